"""The executor of pipeline schedules with backward tasks (1f1b, interleaved_1f1b), and what it
shares with pipeline.py's forward executor: the layers of a chunk as a scan, and the stages'
branching.

A `Stack` (pipeline.py) whose schedule has backward tasks runs `explicit`: the forward alone where
no gradient is taken; under autodiff, a `custom_vjp` whose backward runs the schedule's forward
and backward tasks (`run_tasks`) with the stack outputs' cotangents. A forward task keeps what its
backward needs (`Residuals`); under remat=full only its input, and the backward task runs the
chunk again. Either way a stage keeps only its microbatches in flight. Given a `Head` (the
language model's loss), `explicit_loss` runs it inside the schedule: the last chunk's forward
task runs it on its output and keeps the cotangent (under remat=full its backward task runs
both), so the stack's forward never runs alone. Stages branch on their task (`lax.switch`); on
XLA's CPU runtime, which cannot hold stages in different branches, every stage runs the step's
kind of task (phased: forwards or backwards) and keeps what its own asks for."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from mimo_jax.schedules import (COT_SLOT, E_LOCAL, E_MICRO, FIRST, IDLE, IN_SLOT, KIND, LAST,
                                RECV_COT, RECV_IN, RES_SLOT, RUN_BACKWARD, RUN_FORWARD, Tasks,
                                lower_explicit)

PP = "pp"
# The executor's task kind after schedules.py's IDLE, RUN_FORWARD and RUN_BACKWARD: the last
# chunk's task that differs from the others'. Under remat=full its backward, which runs its
# forward too (and the loss head); else, with a loss head, its forward, which runs the head and
# keeps the cotangent for the backward.
RUN_LAST = 3


class State(NamedTuple):
  """What a stage's tasks add to and keep, from step to step: the trained leaves' gradients,
  None or the head's (loss, gradients), the residual slots (a list of arrays [slots, ...]) and
  the cotangent slots [slots, ...]."""
  grads: Any
  totals: Any
  slots: list
  cots: jax.Array


class Head(NamedTuple):
  """A loss after the stack, run inside a schedule with backward tasks: `apply(trained, frozen,
  h, *side) -> loss` (a float32 scalar) on one microbatch's stack output h, differentiated with
  respect to `trained` and h; `side_m` are per-microbatch arrays [M, ...] (targets, weights)."""
  apply: Callable
  trained: Any
  frozen: Any
  side_m: tuple

  def on(self, h, m):
    """(loss, the cotangent of h, the trained leaves' gradients) of microbatch `m`'s output."""
    side = tuple(a[m] for a in self.side_m)
    loss, vjp = jax.vjp(lambda t, o: self.apply(t, self.frozen, o, *side), self.trained, h)
    d_trained, dh = vjp(jnp.ones_like(loss))
    return loss, dh, d_trained


def branches_may_diverge(mesh: Mesh) -> bool:
  """Whether the devices of `mesh` may take different branches of a conditional that holds
  collectives within groups of them. Not on XLA's CPU runtime: there a collective permute (which
  the partitioner makes where a layer reshards its activations over tp, say) waits for every
  device of the program at that same instruction, so stages in different branches hang."""
  platform = (mesh.devices.flat[0].platform if isinstance(mesh, Mesh)
              else jax.default_backend())
  return platform != "cpu"


def scan_layers(layer: Callable, params, x: jax.Array, side: tuple, unroll: bool,
                first=None) -> jax.Array:
  """With `first` (the first layer's index), `layer(params_i, x, index, *side)`."""
  if first is None:
    return jax.lax.scan(lambda h, p: (layer(p, h, *side), None), x, params, unroll=unroll)[0]
  ids = first + jnp.arange(jax.tree.leaves(params)[0].shape[0], dtype=jnp.int32)
  return jax.lax.scan(lambda h, pi: (layer(pi[0], h, pi[1], *side), None), x, (params, ids),
                      unroll=unroll)[0]


def at(tree, i):
  return jax.tree.map(lambda a: a[i], tree)


def part(mask, tree, trained: bool):
  """The leaves of `tree` whose `mask` entry is `trained` (None elsewhere: no leaf)."""
  return jax.tree.map(lambda t, x: x if t == trained else None, mask, tree)


def join(mask, trained, frozen):
  return jax.tree.map(lambda t, a, b: a if t else b, mask, trained, frozen)


def _integer_sides(stack, side_m: tuple) -> None:
  """Raises ValueError unless every side input is integer (they get no gradient)."""
  for a in side_m:
    if not jnp.issubdtype(a.dtype, jnp.integer):
      raise ValueError(f"a {stack.schedule.resolved} pipeline takes integer side inputs (its "
                       f"backward gives them no gradient), got {a.dtype}.")


def explicit(stack, params, x_m, side_m: tuple) -> jax.Array:
  """A schedule with backward tasks: the forward alone where no gradient is taken; under
  autodiff, a `custom_vjp` whose forward keeps nothing but its arguments and whose backward
  runs the schedule's forward and backward tasks (`run_tasks`) with the outputs' cotangents."""
  num = x_m.shape[0]

  @jax.custom_vjp
  def run(params, x_m, side_m):
    return stack.forward(params, x_m, side_m, stack.schedule.forward_tasks(num))

  def forward(params, x_m, side_m):
    return run(params, x_m, side_m), (params, x_m, side_m)

  def backward(saved, dy_m):
    params, x_m, side_m = saved
    mask = stack.mask(params)
    specs = jax.tree.map(lambda _: P(*stack.schedule.stage_spec()), params)
    body = lambda *a: run_tasks(stack, *a, tasks=stack.schedule.tasks(num))
    d_trained, dx_m = jax.shard_map(body, mesh=stack.mesh, in_specs=(specs, P(), P(), P()),
                                    out_specs=(part(mask, specs, True), P()),
                                    axis_names={PP})(params, x_m, side_m, dy_m)
    # A frozen leaf's cotangent: zeros that nothing reads (autodiff drops them).
    d_params = join(mask, d_trained, jax.tree.map(jnp.zeros_like, part(mask, params, False)))
    return d_params, dx_m, tuple(np.zeros(a.shape, jax.dtypes.float0) for a in side_m)

  _integer_sides(stack, side_m)
  run.defvjp(forward, backward)
  return run(params, x_m, side_m)


def head_sum(head: Head, trained, frozen, h_m, side_m: tuple) -> jax.Array:
  """The head's loss summed over stacked microbatches, one at a time (`lax.map`) and each
  recomputed in the backward pass: one microbatch's logits (or chunk's) at a time."""
  one = jax.checkpoint(lambda t, h, *side: head.apply(t, frozen, h, *side))
  return jnp.sum(jax.lax.map(lambda a: one(trained, *a), (h_m, *side_m)))


def explicit_loss(stack, params, x_m, side_m: tuple, head: Head) -> jax.Array:
  """`head`'s loss summed over the stack's outputs, under a schedule with backward tasks: where
  no gradient is taken, the forward alone and the head a microbatch at a time; under autodiff, a
  `custom_vjp` whose forward runs the whole schedule with the head in its last chunk's tasks
  (`run_tasks`), keeping the gradients, which its backward scales."""
  num = x_m.shape[0]
  mask = stack.mask(params)
  specs = jax.tree.map(lambda _: P(*stack.schedule.stage_spec()), params)
  zeros = lambda tree: jax.tree.map(
      lambda a: np.zeros(a.shape, jax.dtypes.float0) if jnp.issubdtype(a.dtype, jnp.integer)
      else jnp.zeros(a.shape, a.dtype), tree)
  frozen_params, frozen_head, sides = part(mask, params, False), head.frozen, (side_m, head.side_m)

  @jax.custom_vjp
  def run(params, trained, frozen, x_m, side_m, head_side):
    h_m = stack.forward(params, x_m, side_m, stack.schedule.forward_tasks(num))
    return head_sum(head, trained, frozen, h_m, head_side)

  def forward(params, trained, frozen, x_m, side_m, head_side):
    body = lambda params, trained, frozen, x_m, side_m, head_side: run_tasks(
        stack, params, x_m, side_m, None, stack.schedule.tasks(num),
        head._replace(trained=trained, frozen=frozen, side_m=head_side))
    loss, d_trained, d_head, dx_m = jax.shard_map(
        body, mesh=stack.mesh, in_specs=(specs, P(), P(), P(), P(), P()),
        out_specs=(P(), part(mask, specs, True), P(), P()),
        axis_names={PP})(params, trained, frozen, x_m, side_m, head_side)
    return loss, (d_trained, d_head, dx_m)

  def backward(saved, g):
    scale = lambda tree: jax.tree.map(lambda a: (a * g).astype(a.dtype), tree)
    d_trained, d_head, dx_m = saved
    return (join(mask, scale(d_trained), zeros(frozen_params)), scale(d_head),
            zeros(frozen_head), scale(dx_m), *zeros(sides))

  _integer_sides(stack, side_m)
  run.defvjp(forward, backward)
  return run(params, head.trained, head.frozen, x_m, side_m, head.side_m)


class Residuals:
  """What a forward task keeps for its backward task: the leaves of the chunk's `jax.vjp`
  function (a `Partial`) that depend on the microbatch, in slots. The rest a backward task takes
  from its own chunk and microbatch: the chunk's parameters and side inputs, which `jax.vjp`
  forwards as they are, and constants. `split` records which leaf is which where the forward is
  traced (once, `TaskRunner`), and `join` rebuilds the function from those records."""
  SLOT, CONST, VALUE = range(3)

  def __init__(self):
    self.treedef, self.sources = None, []

  def split(self, vjp, consts: list) -> list:
    """The leaves of `vjp` to keep, recording where the others come from (`consts`: the
    chunk's parameters and side inputs, as `chunk_vjp` gives them)."""
    leaves, self.treedef = jax.tree.flatten(vjp)
    index = {id(c): j for j, c in enumerate(consts)}
    self.sources, kept, slot = [], [], {}
    for leaf in leaves:
      if id(leaf) in index:
        self.sources.append((self.CONST, index[id(leaf)]))
      elif isinstance(leaf, jax.core.Tracer):  # one slot however often the vjp holds it
        if id(leaf) not in slot:
          slot[id(leaf)] = len(kept)
          kept.append(leaf)
        self.sources.append((self.SLOT, slot[id(leaf)]))
      else:  # a constant of the trace
        self.sources.append((self.VALUE, leaf))
    return kept

  def join(self, kept: list, consts: list):
    """The vjp function from kept leaves and this chunk's `consts`."""
    pick = {self.SLOT: lambda k: kept[k], self.CONST: lambda j: consts[j],
            self.VALUE: lambda v: v}
    return self.treedef.unflatten([pick[kind](k) for kind, k in self.sources])


def run_tasks(stack, params, x_m, side_m, dy_m, tasks: Tasks, head: Head | None = None):
  """One stage's part of a schedule with backward tasks (inside shard_map over `pp`): a scan
  over `lower_explicit`'s table. A forward runs its chunk under `jax.vjp`, keeps the residuals
  in a slot (`Residuals`) and sends the output on; a backward applies the cotangent that came
  back from the next chunk through them (the last chunk's: the stack output's, or the one its
  forward took from `head`), adds the parameters' gradients and sends the input's cotangent
  back. Under remat=full a backward runs its chunk again from its input instead, and the last
  chunk's forward runs in its backward (`TaskRunner`). -> (the parameters' gradients in their
  layout, the input's cotangents [M, ...]); with `head` (and no `dy_m`) -> (the loss, the
  parameters' gradients, the head's trained leaves' gradients, the input's cotangents)."""
  p = stack.schedule.stages
  residual = stack.remat_policy != "full"
  table, n_in, n_cot, n_res = lower_explicit(tasks, residuals=residual)
  stage = jax.lax.axis_index(PP)
  mask = stack.mask(params)
  chunks = stack.chunks(params)
  if head is not None:  # varying over pp: their gradients are the stage's own, not summed
    head = head._replace(trained=jax.lax.pcast(head.trained, (PP,), to="varying"))
  run_task = TaskRunner(stack, chunks, mask, side_m, stage, x_m[0], head)
  kept_shapes = run_task.kept_shapes
  ahead = [(i, (i + 1) % p) for i in range(p)]
  back = [((i + 1) % p, i) for i in range(p)]

  def tick(carry, row):
    got_in, got_cot, inputs, state, dx = carry
    task = row[stage]
    recv_in, recv_cot = task[RECV_IN], task[RECV_COT]
    i = jnp.maximum(recv_in, 0)
    inputs = inputs.at[i].set(jnp.where(recv_in >= 0, got_in, inputs[i]))
    i, cots = jnp.maximum(recv_cot, 0), state.cots
    state = state._replace(cots=cots.at[i].set(jnp.where(recv_cot >= 0, got_cot, cots[i])))
    m, local, first, last, kind = (task[E_MICRO], task[E_LOCAL], task[FIRST], task[LAST],
                                   task[KIND])
    h = jnp.where(first == 1, x_m[m], inputs[jnp.maximum(task[IN_SLOT], 0)])
    cot_slot = jnp.maximum(task[COT_SLOT], 0)
    dy = state.cots[cot_slot]
    if head is None:
      dy = jnp.where(last == 1, dy_m[m], dy)
    if not residual:
      kind = jnp.where((kind == RUN_BACKWARD) & (last == 1), RUN_LAST, kind)
    elif head is not None:
      kind = jnp.where((kind == RUN_FORWARD) & (last == 1), RUN_LAST, kind)
    # Phased: a step runs forwards alone or backwards alone (or nothing), on every stage.
    step = jnp.where(jnp.any(row[:, KIND] == RUN_FORWARD), RUN_FORWARD,
                     jnp.where(jnp.any(row[:, KIND] == RUN_BACKWARD), RUN_BACKWARD, IDLE))
    out, d_in, state = run_task(kind, step, h, dy, m, local, jnp.maximum(task[RES_SLOT], 0),
                                cot_slot, state)
    # The first chunk's backward gives the stack input's cotangent.
    back_task = (kind == RUN_BACKWARD) | ((kind == RUN_LAST) & (not residual))
    dx = dx.at[m].add(jnp.where((first == 1) & back_task, d_in, 0))
    return (jax.lax.ppermute(out, PP, ahead), jax.lax.ppermute(d_in, PP, back), inputs, state,
            dx), None

  zero = jnp.zeros_like(x_m[0])
  varying = lambda tree: jax.lax.pcast(tree, (PP,), to="varying")
  grads = jax.tree.map(jnp.zeros_like, part(mask, chunks, True))  # chunks vary already
  totals = None if head is None else varying(  # the loss and the head's gradients
      (jnp.zeros((), jnp.float32), jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32),
                                                head.trained)))
  slots = varying([jnp.zeros((max(n_res, 1),) + a.shape, a.dtype) for a in kept_shapes])
  state = State(grads, totals, slots, varying(jnp.zeros((n_cot,) + zero.shape, zero.dtype)))
  init = varying((zero, zero, jnp.zeros((n_in,) + zero.shape, zero.dtype))) + (
      state, varying(jnp.zeros_like(x_m)))
  (_, _, _, state, dx), _ = jax.lax.scan(tick, init, jnp.asarray(table))
  grads = state.grads
  if stack.schedule.virtual == 1:
    grads = jax.tree.map(lambda g: g[0], grads)
  dx = jax.lax.psum(dx, PP)  # only stage 0 wrote: a broadcast
  if head is None:
    return grads, dx
  loss, d_head = jax.lax.psum(state.totals, PP)  # only the last stage added
  return loss, grads, jax.tree.map(lambda d, a: d.astype(a.dtype), d_head, head.trained), dx


class TaskRunner:
  """`(kind, step, h, dy, m, local, res_slot, cot_slot, state) -> (output sent on, input's
  cotangent sent back, state)`: a stage's task `kind` (idle, forward, backward or RUN_LAST) on
  its chunk `local` for microbatch `m` (h like `h_like`; `step`: the kind of the step's tasks,
  the same on every stage); a backward adds to the `State`'s gradients. A forward keeps what its
  backward needs (`Residuals`; `kept_shapes`) in slot `res_slot`, and the last chunk's, given
  `head` (RUN_LAST), runs the head on its output and keeps the cotangent in slot `cot_slot`.
  Under remat=full a backward runs its chunk again from its input (each layer keeping all it
  needs), and the last chunk's (RUN_LAST) runs its forward and the head there.

  Stages take different branches: a collective inside a chunk must stay within the stage (tp's
  and dp's do); where the runtime cannot hold that (`branches_may_diverge`), every stage runs
  the step's kind of task and keeps what its own asks for (`every_forward`, `every_backward`)."""

  def __init__(self, stack, chunks, mask, side_m: tuple, stage, h_like, head: Head | None = None):
    self.stack, self.chunks, self.mask, self.side_m = stack, chunks, mask, side_m
    self.stage, self.head = stage, head
    self.frozen = part(mask, chunks, False)  # a constant of every backward: no gradient of it
    self.trained = part(mask, chunks, True)
    self.residuals = Residuals()
    self.residual = stack.remat_policy != "full"
    self.again = stack.layer if self.residual else stack.bare_layer  # a backward's chunk runs
    self.kept_shapes, self.closed = [], None
    if self.residual:
      # A forward task's vjp traced once, which every forward runs: the leaves one trace holds
      # can differ from another's (jax caches traced functions), and a backward rebuilds the
      # vjp from this trace's records (`residuals`).
      varying = lambda a: jax.lax.pcast(a, (PP,), to="varying")
      self.closed = jax.make_jaxpr(lambda m, local, h: (lambda out, vjp, c: (
          out, self.residuals.split(vjp, c)))(*self.chunk_vjp(m, local, h, stack.layer)))(
              varying(jnp.int32(0)), varying(jnp.int32(0)), varying(jnp.zeros_like(h_like)))
      self.kept_shapes = self.closed.out_avals[1:]

  def __call__(self, kind, step, *args):
    """`step`: the kind of the step's tasks, the same on every stage (the schedules are phased:
    IDLE, RUN_FORWARD or RUN_BACKWARD)."""
    stack = self.stack
    if not (branches_may_diverge(stack.mesh) if stack.branch is None else stack.branch):
      idle = lambda kind, *a: self.idle(*a)
      return jax.lax.switch(step, (idle, self.every_forward, self.every_backward), kind, *args)
    last = self.backward_last if not self.residual else (
        lambda *a: self.forward(*a, with_head=self.head is not None))
    return jax.lax.switch(kind, (self.idle, self.forward, self.backward, last), *args)

  def compute(self, tree):
    """The kernels of `tree` ([layers, in, out] floats) in the compute dtype, as the layers
    read them."""
    if self.stack.dtype is None:
      return tree
    kernel = lambda a: a.ndim >= 3 and jnp.issubdtype(a.dtype, jnp.floating)
    return jax.tree.map(lambda a: a.astype(self.stack.dtype) if kernel(a) else a, tree)

  def consts(self, m, local) -> tuple:
    """A chunk's parameters as its layers read them (`compute`), trained and frozen, and its
    side inputs and first layer's index for microbatch `m`."""
    return (self.compute(at(self.trained, local)), self.compute(at(self.frozen, local)),
            tuple(a[m] for a in self.side_m), self.stack.first(self.chunks, local, self.stage))

  def chunk_vjp(self, m, local, h, layer):
    """A chunk's output, its vjp with respect to (its trained leaves, its input), and the
    leaves a backward takes from its own chunk and microbatch (`Residuals`). The kernels are
    cast before `jax.vjp`, so that the vjp forwards the casts (which a backward makes again)
    instead of keeping them among the residuals; their gradients are the casts' (the layers'
    matmuls give them in the compute dtype either way)."""
    t, fz, side, first = c = self.consts(m, local)
    run = lambda t, h: scan_layers(layer, join(self.mask, t, fz), h, side, self.stack.unroll,
                                   first)
    out, vjp = jax.vjp(run, t, h)
    return out, vjp, jax.tree.leaves(c)

  def run_forward(self, m, local, h):  # (a forward's output, what it keeps), from the one trace
    out, *kept = jax.core.eval_jaxpr(self.closed.jaxpr, self.closed.consts, m, local, h)
    return out, kept

  @staticmethod
  def add(state: State, local, d_chunk, keep=True, took=None, took_keep=True) -> State:
    """`state` with a chunk's gradients (where `keep`) and the head's `took` (loss, gradients;
    where `took_keep`)."""
    grads, totals = state.grads, state.totals
    if d_chunk is not None:
      grads = jax.tree.map(lambda g, d: g.at[local].add(jnp.where(keep, d, 0).astype(g.dtype)),
                           grads, d_chunk)
    if took is not None:
      totals = jax.tree.map(lambda a, b: a + jnp.where(took_keep, b, 0).astype(a.dtype), totals,
                            took)
    return state._replace(grads=grads, totals=totals)

  def idle(self, h, dy, m, local, slot, cot_slot, state):
    return jnp.zeros_like(h), jnp.zeros_like(h), state

  def forward(self, h, dy, m, local, slot, cot_slot, state, with_head=False):
    if not self.residual:
      t, fz, side, first = self.consts(m, local)
      out = scan_layers(self.stack.layer, join(self.mask, t, fz), h, side, self.stack.unroll,
                        first)
      return out, jnp.zeros_like(h), state
    out, kept = self.run_forward(m, local, h)
    state = state._replace(slots=[s.at[slot].set(k) for s, k in zip(state.slots, kept)])
    if with_head:  # the last chunk: its output goes nowhere, the cotangent waits for its backward
      loss, dy, d_head = self.head.on(out, m)
      state = self.add(state, local, None, took=(loss, d_head))
      state = state._replace(cots=state.cots.at[cot_slot].set(dy.astype(h.dtype)))
    return out, jnp.zeros_like(h), state


  def kept_vjp(self, slots, slot, m, local):
    """The vjp a forward kept in `slot`."""
    return self.residuals.join([s[slot] for s in slots], jax.tree.leaves(self.consts(m, local)))

  def backward(self, h, dy, m, local, slot, cot_slot, state):
    vjp = (self.kept_vjp(state.slots, slot, m, local) if self.residual else
           self.chunk_vjp(m, local, h, self.again)[1])
    d_chunk, dh = vjp(dy)
    return jnp.zeros_like(h), dh, self.add(state, local, d_chunk)

  def backward_last(self, h, dy, m, local, slot, cot_slot, state):
    """The last chunk's backward under remat=full: its forward runs here (its forward task was
    idle)."""
    out, vjp, _ = self.chunk_vjp(m, local, h, self.again)
    took = None
    if self.head is not None:
      loss, dy, d_head = self.head.on(out, m)
      took = (loss, d_head)
    d_chunk, dh = vjp(dy)
    return jnp.zeros_like(h), dh, self.add(state, local, d_chunk, took=took)

  def every_forward(self, kind, h, dy, m, local, slot, cot_slot, state):
    """A step of forwards where stages cannot branch apart: every stage runs a forward (and the
    head, if any, unless remat=full) and keeps what its task asks for."""
    fwd = (kind == RUN_FORWARD) | ((kind == RUN_LAST) & self.residual)
    if not self.residual:
      out = self.forward(h, dy, m, local, slot, cot_slot, state)[0]
      return jnp.where(fwd, out, 0), jnp.zeros_like(h), state
    out, new = self.run_forward(m, local, h)
    state = state._replace(slots=[s.at[slot].set(jnp.where(fwd, k, s[slot]))
                                  for s, k in zip(state.slots, new)])
    if self.head is not None:  # the head's cotangent waits in its slot for the backward
      with_head = kind == RUN_LAST
      loss, dy_head, d_head = self.head.on(out, m)
      state = self.add(state, local, None, took=(loss, d_head), took_keep=with_head)
      state = state._replace(cots=state.cots.at[cot_slot].set(
          jnp.where(with_head, dy_head.astype(h.dtype), state.cots[cot_slot])))
    return jnp.where(fwd, out, 0), jnp.zeros_like(h), state

  def every_backward(self, kind, h, dy, m, local, slot, cot_slot, state):
    """A step of backwards where stages cannot branch apart: every stage runs a backward (under
    remat=full its chunk again, and the head) and keeps what its task asks for."""
    bwd = (kind == RUN_BACKWARD) | ((kind == RUN_LAST) & (not self.residual))
    took, with_head = None, kind == RUN_LAST
    if self.residual:
      vjp = self.kept_vjp(state.slots, slot, m, local)
    else:
      out, vjp, _ = self.chunk_vjp(m, local, h, self.again)
      if self.head is not None:
        loss, dy_head, d_head = self.head.on(out, m)
        dy, took = jnp.where(with_head, dy_head, dy), (loss, d_head)
    d_chunk, dh = vjp(dy)
    state = self.add(state, local, d_chunk, bwd, took, with_head)
    return jnp.zeros_like(h), jnp.where(bwd, dh, 0), state
