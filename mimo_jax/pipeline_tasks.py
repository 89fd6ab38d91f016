"""The executor of pipeline schedules with backward tasks (1f1b, interleaved_1f1b), and what it
shares with pipeline.py's forward executor: the layers of a chunk as a scan, and the stages'
branching.

A `Stack` (pipeline.py) whose schedule has backward tasks runs `explicit`: the forward alone where
no gradient is taken; under autodiff, a `custom_vjp` whose backward runs the schedule's forward
and backward tasks (`run_tasks`) with the stack outputs' cotangents. A backward task recomputes
its chunk from the input kept for it and applies the cotangent from the next stage, so a stage
keeps only its microbatches in flight. Given a `Head` (the language model's loss), `explicit_loss`
runs it inside the schedule instead: the last chunk's backward task runs the head on its output
and takes the cotangent from it, so the stack's forward never runs alone. Stages branch on their
task (`lax.switch`); on XLA's CPU runtime, which cannot hold stages in different branches, every
stage runs a forward and a backward each step and keeps what its task asks for.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from mimo_jax.schedules import (COT_SLOT, E_LOCAL, E_MICRO, FIRST, IN_SLOT, KIND, LAST, RECV_COT,
                                RECV_IN, RUN_BACKWARD, RUN_FORWARD, Tasks, lower_explicit)

PP = "pp"
RUN_HEAD = 3  # the last chunk's backward task with the head in it (a branch after schedules')


class Head(NamedTuple):
  """A loss after the stack, run inside a schedule with backward tasks: `apply(trained, frozen,
  h, *side) -> loss` (a float32 scalar) on one microbatch's stack output h, differentiated with
  respect to `trained` and h; `side_m` are per-microbatch arrays [M, ...] (targets, weights)."""
  apply: Callable
  trained: Any
  frozen: Any
  side_m: tuple

  def on(self, h, m, trained=None):
    """(loss, the cotangent of h, the trained leaves' gradients) of microbatch `m`'s output."""
    side = tuple(a[m] for a in self.side_m)
    trained = self.trained if trained is None else trained
    loss, vjp = jax.vjp(lambda t, o: self.apply(t, self.frozen, o, *side), trained, h)
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

  for a in side_m:
    if not jnp.issubdtype(a.dtype, jnp.integer):
      raise ValueError(f"a {stack.schedule.resolved} pipeline takes integer side inputs (its "
                       f"backward gives them no gradient), got {a.dtype}.")
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
  `custom_vjp` whose forward runs the whole schedule with the head in its last chunk's backward
  tasks (`run_tasks`), keeping the gradients, which its backward scales."""
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

  for a in side_m:
    if not jnp.issubdtype(a.dtype, jnp.integer):
      raise ValueError(f"a {stack.schedule.resolved} pipeline takes integer side inputs (its "
                       f"backward gives them no gradient), got {a.dtype}.")
  run.defvjp(forward, backward)
  return run(params, head.trained, head.frozen, x_m, side_m, head.side_m)


def run_tasks(stack, params, x_m, side_m, dy_m, tasks: Tasks, head: Head | None = None):
  """One stage's part of a schedule with backward tasks (inside shard_map over `pp`): a scan
  over `lower_explicit`'s table. A forward runs its chunk and sends the output on; a backward
  recomputes its chunk from the input kept in its slot (`jax.vjp`), applies the cotangent that
  came back from the next chunk (the stack output's for the last), adds the parameters'
  gradients and sends the input's cotangent back. -> (the parameters' gradients in their
  layout, the input's cotangents [M, ...]). With `head` (and no `dy_m`), the last chunk's
  backward runs the head on its output for its cotangent -> (the loss, the parameters'
  gradients, the head's trained leaves' gradients, the input's cotangents)."""
  p = stack.schedule.stages
  table, n_in, n_cot = lower_explicit(tasks)
  stage = jax.lax.axis_index(PP)
  mask = stack.mask(params)
  chunks = stack.chunks(params)
  if head is not None:  # varying over pp: their gradients are the stage's own, not summed
    head = head._replace(trained=jax.lax.pcast(head.trained, (PP,), to="varying"))
  run_task = task_runner(stack, chunks, mask, side_m, stage, head)
  ahead = [(i, (i + 1) % p) for i in range(p)]
  back = [((i + 1) % p, i) for i in range(p)]

  def tick(carry, row):
    got_in, got_cot, inputs, cots, acc, dx = carry
    task = row[stage]
    recv_in, recv_cot = task[RECV_IN], task[RECV_COT]
    i = jnp.maximum(recv_in, 0)
    inputs = inputs.at[i].set(jnp.where(recv_in >= 0, got_in, inputs[i]))
    i = jnp.maximum(recv_cot, 0)
    cots = cots.at[i].set(jnp.where(recv_cot >= 0, got_cot, cots[i]))
    m, local, first, last = task[E_MICRO], task[E_LOCAL], task[FIRST], task[LAST]
    h = jnp.where(first == 1, x_m[m], inputs[jnp.maximum(task[IN_SLOT], 0)])
    dy = cots[jnp.maximum(task[COT_SLOT], 0)]
    kind = task[KIND]
    if head is None:
      dy = jnp.where(last == 1, dy_m[m], dy)
    else:
      kind = jnp.where((kind == RUN_BACKWARD) & (last == 1), RUN_HEAD, kind)
    out, d_in, acc = run_task(kind, h, dy, m, local, acc)
    # The first chunk's backward gives the stack input's cotangent.
    dx = dx.at[m].add(jnp.where((first == 1) & (kind >= RUN_BACKWARD), d_in, 0))
    return (jax.lax.ppermute(out, PP, ahead), jax.lax.ppermute(d_in, PP, back), inputs, cots,
            acc, dx), None

  zero = jnp.zeros_like(x_m[0])
  init = jax.lax.pcast((zero, zero, jnp.zeros((n_in,) + zero.shape, zero.dtype),
                        jnp.zeros((n_cot,) + zero.shape, zero.dtype), jnp.zeros_like(x_m)),
                       (PP,), to="varying")
  grads0 = jax.tree.map(jnp.zeros_like, part(mask, chunks, True))  # chunks vary already
  totals = None if head is None else jax.lax.pcast(  # the loss and the head's gradients
      (jnp.zeros((), jnp.float32), jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32),
                                                head.trained)), (PP,), to="varying")
  init = init[:4] + ((grads0, totals),) + init[4:]
  (_, _, _, _, (grads, totals), dx), _ = jax.lax.scan(tick, init, jnp.asarray(table))
  if stack.schedule.virtual == 1:
    grads = jax.tree.map(lambda g: g[0], grads)
  dx = jax.lax.psum(dx, PP)  # only stage 0 wrote: a broadcast
  if head is None:
    return grads, dx
  loss, d_head = jax.lax.psum(totals, PP)  # only the last stage added
  return loss, grads, jax.tree.map(lambda d, a: d.astype(a.dtype), d_head, head.trained), dx


def task_runner(stack, chunks, mask, side_m: tuple, stage, head: Head | None = None) -> Callable:
  """`(kind, h, dy, m, local, acc) -> (output sent on, input's cotangent sent back, acc)`:
  this stage's task `kind` (idle, forward, backward or RUN_HEAD) on its chunk `local` for
  microbatch `m`; acc is (the trained leaves' gradients, None or the head's (loss, gradients)),
  to which a backward adds. RUN_HEAD is the last chunk's backward with `head`: it runs the head
  on the chunk's output and takes the cotangent from it.

  Stages take different branches: a collective inside a chunk must stay within the stage (tp's
  and dp's do), and where the runtime cannot hold that (`branches_may_diverge`), every stage
  runs both a forward and a backward and keeps the one its task asks for."""
  frozen = part(mask, chunks, False)  # a constant of every backward: no gradient of it

  def chunk_fn(m, local):
    side = tuple(a[m] for a in side_m)
    first = stack.first(chunks, local, stage)
    return lambda c, h: scan_layers(stack.layer, c, h, side, stack.unroll, first)

  def chunk_vjp(m, local, h):
    """A chunk's output and its vjp with respect to (its trained leaves, its input)."""
    run = lambda t, h: chunk_fn(m, local)(join(mask, t, at(frozen, local)), h)
    return jax.vjp(run, at(part(mask, chunks, True), local), h)

  def add(acc, local, d_chunk, keep=True, took=None, took_keep=True):
    """`acc` with a chunk's gradients (where `keep`) and the head's `took` (loss, gradients;
    where `took_keep`)."""
    grads, totals = acc
    grads = jax.tree.map(lambda g, d: g.at[local].add(jnp.where(keep, d, 0)), grads, d_chunk)
    if took is not None:
      totals = jax.tree.map(lambda a, b: a + jnp.where(took_keep, b, 0).astype(a.dtype), totals,
                            took)
    return grads, totals

  def idle(h, dy, m, local, acc):
    return jnp.zeros_like(h), jnp.zeros_like(h), acc

  def forward(h, dy, m, local, acc):
    return chunk_fn(m, local)(at(chunks, local), h), jnp.zeros_like(h), acc

  def backward(h, dy, m, local, acc):
    _, vjp = chunk_vjp(m, local, h)
    d_chunk, dh = vjp(dy)
    return jnp.zeros_like(h), dh, add(acc, local, d_chunk)

  def backward_head(h, dy, m, local, acc):
    out, vjp = chunk_vjp(m, local, h)
    loss, dy, d_head = head.on(out, m)
    d_chunk, dh = vjp(dy)
    return jnp.zeros_like(h), dh, add(acc, local, d_chunk, took=(loss, d_head))

  def every_task(kind, h, dy, m, local, acc):
    """What `switch` picks, with one forward and one backward whatever the task: every device
    runs the same collectives in the same order."""
    out, vjp = chunk_vjp(m, local, h)
    took, with_head = None, kind == RUN_HEAD
    if head is not None:
      loss, dy_head, d_head = head.on(out, m)
      dy, took = jnp.where(with_head, dy_head, dy), (loss, d_head)
    d_chunk, dh = vjp(dy)
    fwd, bwd = kind == RUN_FORWARD, (kind == RUN_BACKWARD) | with_head
    acc = add(acc, local, d_chunk, bwd, took, with_head)
    return jnp.where(fwd, out, 0), jnp.where(bwd, dh, 0), acc

  branch = branches_may_diverge(stack.mesh) if stack.branch is None else stack.branch
  if branch:
    tasks = (idle, forward, backward) + (() if head is None else (backward_head,))
    return lambda kind, *args: jax.lax.switch(kind, tasks, *args)
  return every_task
