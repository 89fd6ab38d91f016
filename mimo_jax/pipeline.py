"""A stack of identical layers, run in one piece or pipelined over a module mesh's `pp` axis.

Models keep the parameters of their repeated blocks stacked on a leading layer axis (see
`models/layers.stacked`), and hand the stack to a `Stack`: the model code is the same for every
pipeline size. With `pp == 1` the layers run as one `lax.scan`. With `pp > 1` the stack runs
inside a `jax.shard_map` that is manual over `pp` only (dp and tp stay automatic, so tensor
parallelism inside a layer is unchanged), and activations move from stage to stage with
`lax.ppermute`.

A schedule is a value (`Tasks`): for each stage, what it does at each time step, a `Task` (kind,
microbatch, chunk) or None (idle). The layers form p·v chunks of L/(p·v) in model order; chunk c
lives on stage c mod p (v chunks a stage). `Stack` builds the schedule's tasks for its
microbatch count, checks them (`check`), lowers them to a table (`lower`) and scans over it; a new
schedule is a new function building `Tasks`, entered in `SCHEDULES`. For M microbatches:

* `gpipe` (v = 1): at step t stage s runs microbatch t − s; M + p − 1 steps, a bubble of
  (p − 1) / (M + p − 1).
* `circular` (v > 1): a microbatch goes round the ring v times, round r at step r·M + m + s;
  stage 0 parks what comes back from the last stage until that microbatch's next round (this
  needs M ≥ p). M·v + p − 1 steps of 1/v the work each: the bubble shrinks by v.

The backward pass is the transpose of the forward loop (ppermute's transpose sends the other way),
so gradients flow through the same ring in reverse: all forwards, then all backwards, as in GPipe.
Bubble steps repeat a real task with their output masked out. Inputs and outputs are replicated
over `pp`: every stage receives the microbatches and the last stage's outputs are broadcast by one
`psum`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from mimo_jax.models import fp8

PP = "pp"
GATHERED = "fsdp_gathered"  # checkpoint name of a layer's gathered parameters (never saved)

_fp8_operands = jax.checkpoint_policies.save_only_these_names(fp8.OPERAND)


def _dots(prim, *args, **params) -> bool:
  """Matmul outputs, and an FP8 matmul's quantized input (models/fp8.py), which its backward
  reads: without it the backward pass would quantize the input again."""
  return (jax.checkpoint_policies.dots_with_no_batch_dims_saveable(prim, *args, **params) or
          _fp8_operands(prim, *args, **params))


def _dots_and_attention(prim, *args, **params) -> bool:
  """As `_dots`, and fused attention's outputs (cuDNN's: the output and its softmax statistics,
  which its backward reads); elsewhere (XLA's attention) as `dots`."""
  return prim.name.startswith("dot_product_attention_fwd") or _dots(prim, *args, **params)


# Activation rematerialisation per layer: what the backward pass keeps from the forward.
REMAT_POLICIES = {
    "none": None,  # keep everything (no recomputation)
    "full": jax.checkpoint_policies.nothing_saveable,  # keep only each layer's input
    "dots": _dots,  # keep matmul outputs
    "dots_attention": _dots_and_attention,  # and fused attention's outputs
}


# ---- schedules as values ----------------------------------------------------------------------

FORWARD = "forward"  # run a chunk's layers on a microbatch's activations
KINDS = (FORWARD,)  # the task kinds the executor runs


class Task(NamedTuple):
  """One stage's work in one time step: `kind` on chunk `chunk` of microbatch `microbatch`.

  Chunk c is layers [c·L/(p·v), (c+1)·L/(p·v)) and lives on stage c mod p, so the stage a task
  runs on is implied by its chunk."""
  kind: str
  microbatch: int
  chunk: int


Tasks = tuple[tuple[Task | None, ...], ...]  # [stage][step]: a stage's work a step, None idle


def gpipe(stages: int, microbatches: int, virtual: int = 1) -> Tasks:
  """GPipe: stage s runs microbatch m at step m + s; M + p − 1 steps."""
  if virtual != 1:
    raise ValueError(f"gpipe runs one chunk a stage, got virtual={virtual}; use circular.")
  steps = microbatches + stages - 1
  return tuple(tuple(Task(FORWARD, t - s, s) if 0 <= t - s < microbatches else None
                     for t in range(steps)) for s in range(stages))


def circular(stages: int, microbatches: int, virtual: int) -> Tasks:
  """Circular: microbatch m goes round the ring v times, round r (chunk r·p + s) on stage s at
  step r·M + m + s. Round r + 1 starts M steps after round r on stage 0, and the microbatch comes
  back from the last stage after p steps: M ≥ p."""
  if virtual > 1 and microbatches < stages:
    raise ValueError(f"the circular schedule needs at least as many microbatches as stages, got "
                     f"{microbatches} for {stages} stages: a microbatch would start its next "
                     f"round before it comes back; use at least {stages} microbatches.")
  items = microbatches * virtual  # (round, microbatch) pairs, in the order every stage runs them

  def task(s: int, i: int) -> Task | None:
    if not 0 <= i < items:
      return None
    rnd, m = divmod(i, microbatches)
    return Task(FORWARD, m, rnd * stages + s)
  return tuple(tuple(task(s, t - s) for t in range(items + stages - 1)) for s in range(stages))


# A schedule's name -> the function building its tasks from (stages, microbatches, virtual).
SCHEDULES: dict[str, Callable[[int, int, int], Tasks]] = {"gpipe": gpipe, "circular": circular}


def _steps(tasks: Tasks) -> dict[tuple[int, int], int]:
  """(microbatch, chunk) -> the step its task runs at."""
  return {(x.microbatch, x.chunk): t for row in tasks for t, x in enumerate(row) if x is not None}


def _check_task(task: Task, s: int, t: int, stages: int, microbatches: int, chunks: int) -> None:
  """Raises ValueError unless `task`, found at stage `s`, step `t`, is one the executor runs."""
  where = f"the task at stage {s}, step {t} ({task})"
  if task.kind not in KINDS:
    raise ValueError(f"{where}: the pipeline runs only {', '.join(KINDS)} tasks.")
  if not (0 <= task.microbatch < microbatches and 0 <= task.chunk < chunks):
    raise ValueError(f"{where}: microbatches are 0..{microbatches - 1} and chunks "
                     f"0..{chunks - 1}.")
  if task.chunk % stages != s:
    raise ValueError(f"{where}: chunk {task.chunk} lives on stage {task.chunk % stages}.")


def check(tasks: Tasks, stages: int, microbatches: int, virtual: int) -> None:
  """Raises ValueError unless `tasks` runs every chunk of every microbatch once, on the chunk's
  stage, after the chunk before it: what the executor (`lower`, `Stack`) relies on."""
  if min(stages, microbatches, virtual) < 1:
    raise ValueError(f"a schedule needs stages, microbatches and virtual >= 1, got {stages}, "
                     f"{microbatches} and {virtual}.")
  if len(tasks) != stages or len({len(row) for row in tasks}) != 1:
    raise ValueError(f"a schedule has one row of tasks per stage, all as long: got rows of "
                     f"{[len(row) for row in tasks]} steps for {stages} stages.")
  chunks = stages * virtual
  for s, row in enumerate(tasks):
    for t, task in enumerate(row):
      if task is not None:
        _check_task(task, s, t, stages, microbatches, chunks)
  when = _steps(tasks)
  if len(when) != sum(task is not None for row in tasks for task in row):
    raise ValueError("the schedule runs a chunk of a microbatch twice; each runs once.")
  for m in range(microbatches):
    for c in range(chunks):
      if (m, c) not in when:
        raise ValueError(f"the schedule never runs chunk {c} of microbatch {m}; each runs once.")
      if c and when[m, c] <= when[m, c - 1]:
        raise ValueError(f"chunk {c} of microbatch {m} runs at step {when[m, c]}, before chunk "
                         f"{c - 1}'s output reaches stage {c % stages} (step "
                         f"{when[m, c - 1] + 1}).")


# Columns of a lowered schedule (`lower`), and where a task's input comes from (SOURCE).
MICRO, LOCAL, SOURCE, DONE, PARK = range(5)
FROM_INPUT, FROM_PREVIOUS, FROM_PARKED = range(3)


def lower(tasks: Tasks) -> np.ndarray:
  """Checked `tasks` as the int32 table [steps, stages, 5] the executor scans over: each task's
  MICRO (its microbatch), LOCAL (its chunk's index among the stage's chunks), SOURCE, DONE (its
  output is the stack's) and PARK.

  What a stage sends at step t arrives at the next stage for step t + 1. A task that runs then
  reads it there (FROM_PREVIOUS); one that runs later reads it from the stage's buffer, one slot a
  microbatch, where the arriving stage stored it at step t (PARK: the slot, -1 for none). The
  first chunk reads the stack's input (FROM_INPUT). An idle step repeats the stage's nearest task
  (its last, else its first) with DONE 0, so that it computes on real values and is masked out."""
  stages, steps = len(tasks), len(tasks[0])
  when = _steps(tasks)
  last = max(c for _, c in when)
  table = np.zeros((steps, stages, 5), np.int32)
  table[:, :, PARK] = -1
  for s, row in enumerate(tasks):
    entries = {}
    for t, task in enumerate(row):
      if task is None:
        continue
      m, c = task.microbatch, task.chunk
      source = (FROM_INPUT if c == 0 else
                FROM_PREVIOUS if when[m, c - 1] == t - 1 else FROM_PARKED)
      entries[t] = (m, c // stages, source, int(c == last))
      if c < last and when[m, c + 1] > t + 1:
        table[t, (s + 1) % stages, PARK] = m
    for t in range(steps):
      near = max((u for u in entries if u <= t), default=min(entries))
      table[t, s, :PARK] = entries[near] if near == t else entries[near][:DONE] + (0,)
  return table


@dataclasses.dataclass(frozen=True)
class Schedule:
  """A pipeline: its layout (stages, chunks a stage) and the schedule that runs it."""
  stages: int = 1  # p: the size of the mesh's pp axis
  virtual: int = 1  # v: chunks per stage
  name: str = ""  # a key of SCHEDULES; "" is gpipe for virtual 1, circular otherwise

  def __post_init__(self):
    if self.name and self.name not in SCHEDULES:
      raise ValueError(f"unknown pipeline schedule {self.name!r}; one of {', '.join(SCHEDULES)}.")

  def tasks(self, microbatches: int) -> Tasks:
    """The schedule's tasks for `microbatches`, checked (`check`)."""
    build = SCHEDULES[self.name or ("gpipe" if self.virtual == 1 else "circular")]
    tasks = build(self.stages, microbatches, self.virtual)
    check(tasks, self.stages, microbatches, self.virtual)
    return tasks

  @property
  def pipelined(self) -> bool:
    return self.stages > 1

  def stage_spec(self) -> tuple:
    """Leading axes of a stacked parameter in this schedule's layout, as PartitionSpec entries."""
    return (PP,) if self.virtual == 1 else (None, PP)

  def to_layout(self, x: jax.Array) -> jax.Array:
    """[L, ...] -> the layout whose `stage_spec` split gives each stage its chunks: [v, L/v, ...]
    for the circular schedule (row r of chunk column s is chunk r·p + s), unchanged otherwise."""
    if self.virtual == 1:
      return x
    return x.reshape((self.virtual, x.shape[0] // self.virtual) + x.shape[1:])

  def from_layout(self, x: jax.Array) -> jax.Array:
    if self.virtual == 1:
      return x
    return x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:])

  def bubble(self, microbatches: int) -> float:
    """Idle fraction of the schedule's stage-steps: (p − 1) / (M·v + p − 1) for gpipe and
    circular."""
    slots = [task for row in self.tasks(microbatches) for task in row]
    return slots.count(None) / len(slots)


def _all_but_gathered(prim, *_, **params) -> bool:
  """The remat policy `none` where a layer gathers its parameters (FSDP): keeps every value but
  the gathered parameters, which are sharding constraints named GATHERED (the only sharding
  constraints inside a layer)."""
  return prim.name != "sharding_constraint" and params.get("name") != GATHERED


def remat(layer: Callable, policy: str, gathered: bool = False) -> Callable:
  """`layer` under the remat `policy`; with `gathered` (its parameters are gathered inside it,
  named GATHERED), the backward gathers them again rather than keeping them, whatever the policy
  (none keeps everything else)."""
  if policy not in REMAT_POLICIES:
    raise ValueError(f"unknown remat policy {policy!r}; one of {', '.join(REMAT_POLICIES)}")
  if policy == "none":
    if not gathered:
      return layer
    return jax.checkpoint(layer, policy=_all_but_gathered)
  return jax.checkpoint(layer, policy=REMAT_POLICIES[policy])


def _scan_layers(layer: Callable, params, x: jax.Array, side: tuple, unroll: bool) -> jax.Array:
  return jax.lax.scan(lambda h, p: (layer(p, h, *side), None), x, params, unroll=unroll)[0]


def _at(tree, i):
  return jax.tree.map(lambda a: a[i], tree)


class Stack:
  """Runs `layer(params_i, x, *side) -> x` over stacked parameters for M microbatches at once.

  `params` leaves are [L, ...] (virtual 1) or [v, L/v, ...] (`Schedule.to_layout`), split over
  `pp` by `Schedule.stage_spec`, and run in the order of the schedule's tasks; `x_m` is [M, ...]
  and each of `side_m` is [M, ...] (per-microbatch inputs every layer sees, such as positions)."""

  def __init__(self, layer: Callable, mesh: Mesh, schedule: Schedule, remat_policy: str = "none",
               unroll: bool = True, gather: Callable | None = None):
    """`gather(params_i) -> params_i` runs first in every layer (FSDP: sharding.layer_gather)."""
    if gather is not None:
      inner = layer
      layer = lambda params, x, *side: inner(gather(params), x, *side)
    self.layer = remat(layer, remat_policy, gathered=gather is not None)
    self.mesh, self.schedule, self.unroll = mesh, schedule, unroll

  def __call__(self, params, x_m: jax.Array, side_m: tuple = ()) -> jax.Array:
    if not self.schedule.pipelined:
      if x_m.shape[0] == 1:  # one microbatch (the usual chunk): no vmap around the kernels
        return _scan_layers(self.layer, params, x_m[0], tuple(a[0] for a in side_m),
                            self.unroll)[None]
      return jax.vmap(lambda x, *side: _scan_layers(self.layer, params, x, side, self.unroll))(
          x_m, *side_m)
    num = x_m.shape[0]
    pad = max(self.schedule.stages - num, 0)  # fewer microbatches than stages (evaluation)
    if pad:
      fill = lambda a: jnp.concatenate([a, jnp.zeros((pad,) + a.shape[1:], a.dtype)])
      x_m, side_m = fill(x_m), tuple(fill(a) for a in side_m)
    specs = jax.tree.map(lambda _: P(*self.schedule.stage_spec()), params)
    run = jax.shard_map(self._pipeline, mesh=self.mesh, in_specs=(specs, P(), P()),
                        out_specs=P(), axis_names={PP})
    return run(params, x_m, tuple(side_m))[:num]

  def _pipeline(self, params, x_m, side_m):
    """One stage's part of the schedule (inside shard_map over `pp`): a scan over the lowered
    schedule's steps, each running this stage's task and sending its output to the next stage."""
    p, num = self.schedule.stages, x_m.shape[0]
    table = lower(self.schedule.tasks(num))
    parks = bool((table[..., PARK] >= 0).any())  # no buffer where every input arrives in time
    stage = jax.lax.axis_index(PP)
    # This stage's chunks as [v, L/(p·v), ...] whichever layout they arrived in.
    chunks = params if self.schedule.virtual > 1 else jax.tree.map(lambda a: a[None], params)
    ring = [(i, (i + 1) % p) for i in range(p)]

    def tick(carry, row):
      incoming, parked, outs = carry
      task = row[stage]
      m, source, park = task[MICRO], task[SOURCE], task[PARK]
      h = x_m[m]
      if parks:
        h = jnp.where(source == FROM_PARKED, parked[m], h)
      h = jnp.where(source == FROM_PREVIOUS, incoming, h)
      h = _scan_layers(self.layer, _at(chunks, task[LOCAL]), h, tuple(a[m] for a in side_m),
                       self.unroll)
      outs = outs.at[m].set(jnp.where(task[DONE] == 1, h, outs[m]))
      incoming = jax.lax.ppermute(h, PP, ring)
      if parks:  # keep what arrived for a task that runs later than the next step
        slot = jnp.maximum(park, 0)
        parked = parked.at[slot].set(jnp.where(park >= 0, incoming, parked[slot]))
      return (incoming, parked, outs), None

    init = jax.lax.pcast((jnp.zeros_like(x_m[0]), jnp.zeros_like(x_m) if parks else
                          jnp.zeros((num, 0), x_m.dtype), jnp.zeros_like(x_m)), (PP,),
                         to="varying")
    (_, _, outs), _ = jax.lax.scan(tick, init, jnp.asarray(table))
    return jax.lax.psum(outs, PP)  # only the last stage wrote: a broadcast
