"""The executor of pipeline schedules with backward tasks (1f1b, interleaved_1f1b), and what it
shares with pipeline.py's forward executor: the layers of a chunk as a scan, and the stages'
branching.

A `Stack` (pipeline.py) whose schedule has backward tasks runs `explicit`: the forward alone where
no gradient is taken; under autodiff, a `custom_vjp` whose backward runs the schedule's forward
and backward tasks (`run_tasks`) with the stack outputs' cotangents. A backward task recomputes
its chunk from the input kept for it and applies the cotangent from the next stage, so a stage
keeps only its microbatches in flight. Stages branch on their task (`lax.switch`); on XLA's CPU
runtime, which cannot hold stages in different branches, every stage runs a forward and a
backward each step and keeps what its task asks for.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from mimo_jax.schedules import (COT_SLOT, E_LOCAL, E_MICRO, FIRST, IN_SLOT, KIND, LAST, RECV_COT,
                                RECV_IN, RUN_BACKWARD, RUN_FORWARD, Tasks, lower_explicit)

PP = "pp"


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


def run_tasks(stack, params, x_m, side_m, dy_m, tasks: Tasks):
  """One stage's part of a schedule with backward tasks (inside shard_map over `pp`): a scan
  over `lower_explicit`'s table. A forward runs its chunk and sends the output on; a backward
  recomputes its chunk from the input kept in its slot (`jax.vjp`), applies the cotangent that
  came back from the next chunk (the stack output's for the last), adds the parameters'
  gradients and sends the input's cotangent back. -> (the parameters' gradients in their
  layout, the input's cotangents [M, ...])."""
  p = stack.schedule.stages
  table, n_in, n_cot = lower_explicit(tasks)
  stage = jax.lax.axis_index(PP)
  mask = stack.mask(params)
  chunks = stack.chunks(params)
  run_task = task_runner(stack, chunks, mask, side_m, stage)
  ahead = [(i, (i + 1) % p) for i in range(p)]
  back = [((i + 1) % p, i) for i in range(p)]

  def tick(carry, row):
    got_in, got_cot, inputs, cots, grads, dx = carry
    task = row[stage]
    recv_in, recv_cot = task[RECV_IN], task[RECV_COT]
    i = jnp.maximum(recv_in, 0)
    inputs = inputs.at[i].set(jnp.where(recv_in >= 0, got_in, inputs[i]))
    i = jnp.maximum(recv_cot, 0)
    cots = cots.at[i].set(jnp.where(recv_cot >= 0, got_cot, cots[i]))
    m, local, first, last = task[E_MICRO], task[E_LOCAL], task[FIRST], task[LAST]
    h = jnp.where(first == 1, x_m[m], inputs[jnp.maximum(task[IN_SLOT], 0)])
    dy = jnp.where(last == 1, dy_m[m], cots[jnp.maximum(task[COT_SLOT], 0)])
    out, d_in, grads = run_task(task[KIND], h, dy, m, local, grads)
    # The first chunk's backward gives the stack input's cotangent.
    dx = dx.at[m].add(jnp.where((first == 1) & (task[KIND] == RUN_BACKWARD), d_in, 0))
    return (jax.lax.ppermute(out, PP, ahead), jax.lax.ppermute(d_in, PP, back), inputs, cots,
            grads, dx), None

  zero = jnp.zeros_like(x_m[0])
  init = jax.lax.pcast((zero, zero, jnp.zeros((n_in,) + zero.shape, zero.dtype),
                        jnp.zeros((n_cot,) + zero.shape, zero.dtype), jnp.zeros_like(x_m)),
                       (PP,), to="varying")
  grads0 = jax.tree.map(jnp.zeros_like, part(mask, chunks, True))  # chunks vary already
  init = init[:4] + (grads0,) + init[4:]
  (_, _, _, _, grads, dx), _ = jax.lax.scan(tick, init, jnp.asarray(table))
  if stack.schedule.virtual == 1:
    grads = jax.tree.map(lambda g: g[0], grads)
  return grads, jax.lax.psum(dx, PP)  # only stage 0 wrote: a broadcast


def task_runner(stack, chunks, mask, side_m: tuple, stage) -> Callable:
  """`(kind, h, dy, m, local, grads) -> (output sent on, input's cotangent sent back, grads)`:
  this stage's task `kind` (idle, forward or backward) on its chunk `local` for microbatch `m`,
  a backward adding the trained leaves' gradients to `grads`.

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

  def idle(h, dy, m, local, grads):
    return jnp.zeros_like(h), jnp.zeros_like(h), grads

  def forward(h, dy, m, local, grads):
    return chunk_fn(m, local)(at(chunks, local), h), jnp.zeros_like(h), grads

  def backward(h, dy, m, local, grads):
    _, vjp = chunk_vjp(m, local, h)
    d_chunk, dh = vjp(dy)
    return jnp.zeros_like(h), dh, jax.tree.map(lambda g, d: g.at[local].add(d), grads, d_chunk)

  def every_task(kind, h, dy, m, local, grads):
    """What `switch` picks, with one forward and one backward whatever the task: every device
    runs the same collectives in the same order."""
    out, vjp = chunk_vjp(m, local, h)
    d_chunk, dh = vjp(dy)
    fwd, bwd = kind == RUN_FORWARD, kind == RUN_BACKWARD
    grads = jax.tree.map(lambda g, d: g.at[local].add(jnp.where(bwd, d, 0)), grads, d_chunk)
    return jnp.where(fwd, out, 0), jnp.where(bwd, dh, 0), grads

  branch = branches_may_diverge(stack.mesh) if stack.branch is None else stack.branch
  if branch:
    return lambda kind, *args: jax.lax.switch(kind, (idle, forward, backward), *args)
  return every_task
