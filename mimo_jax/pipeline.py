"""A stack of identical layers, run in one piece or pipelined over a module mesh's `pp` axis.

Models keep the parameters of their repeated blocks stacked on a leading layer axis (see
`models/layers.stacked`), and hand the stack to a `Stack`: the model code is the same for every
pipeline size. With `pp == 1` the layers run as one `lax.scan`. With `pp > 1` the stack runs
inside a `jax.shard_map` that is manual over `pp` only (dp and tp stay automatic, so tensor
parallelism inside a layer is unchanged), and activations move from stage to stage with
`lax.ppermute`.

A schedule is a value (`schedules.Tasks`, built by a function in `schedules.SCHEDULES`): for
each stage, what it does at each time step. `Stack` builds the schedule's tasks for its microbatch
count, checks and lowers them, and scans over the table. Forward tasks alone (gpipe, circular)
run in `_pipeline`, and autodiff makes their backward: the transpose of the loop (ppermute's
transpose sends the other way), all forwards then all backwards, every microbatch's activations
kept. A schedule with backward tasks (1f1b, interleaved_1f1b) runs them itself (pipeline_tasks.py,
under a `custom_vjp`): a backward recomputes its chunk from the input kept for it and applies
the cotangent from the next stage, so a stage keeps only its microbatches in flight.
Bubble steps repeat a real task with their output masked out (forward schedules) or idle
(`lax.switch`; on XLA's CPU runtime, which cannot hold stages in different branches, every stage
runs a forward and a backward each step and keeps what its task asks for). Inputs and outputs
are replicated over `pp`: every stage receives the microbatches and the last stage's outputs are
broadcast by one `psum`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from mimo_jax import pipeline_tasks
from mimo_jax.models import fp8, manual
from mimo_jax.pipeline_tasks import PP, Head, at, scan_layers  # noqa: F401 (pipeline.Head)
from mimo_jax.schedules import (  # noqa: F401  (the schedule values, as pipeline.X too)
    BACKWARD, COT_SLOT, DONE, E_LOCAL, E_MICRO, FIRST, FORWARD, FROM_INPUT, FROM_PARKED,
    FROM_PREVIOUS, IN_SLOT, KIND, LAST, LOCAL, MICRO, PARK, RECV_COT, RECV_IN, RUN_BACKWARD,
    RUN_FORWARD, SCHEDULES, SOURCE, Task, Tasks, check, circular, gpipe, has_backward, lower,
    Lowered, lower_explicit, one_f_one_b, interleaved_1f1b)

GATHERED = "fsdp_gathered"  # checkpoint name of a layer's gathered parameters (never saved)

_fp8_operands = jax.checkpoint_policies.save_only_these_names(fp8.OPERAND)


def _dots(prim, *args, **params) -> bool:
  """Matmul outputs, and an FP8 matmul's quantized input (models/fp8.py), which its backward
  reads: without it the backward pass would quantize the input again."""
  return (jax.checkpoint_policies.dots_with_no_batch_dims_saveable(prim, *args, **params) or
          _fp8_operands(prim, *args, **params))


_manual_attention = jax.checkpoint_policies.save_only_these_names(manual.OUTPUT)


def _dots_and_attention(prim, *args, **params) -> bool:
  """As `_dots`, and fused attention's outputs (cuDNN's: the output and its softmax statistics,
  which its backward reads; inside a stage, `manual.whole_manual`'s output, whose backward runs
  the forward again); elsewhere (XLA's attention) as `dots`."""
  return (prim.name.startswith("dot_product_attention_fwd") or _dots(prim, *args, **params) or
          _manual_attention(prim, *args, **params))


# Activation rematerialisation per layer: what the backward pass keeps from the forward.
REMAT_POLICIES = {
    "none": None,  # keep everything (no recomputation)
    "full": jax.checkpoint_policies.nothing_saveable,  # keep only each layer's input
    "dots": _dots,  # keep matmul outputs
    "dots_attention": _dots_and_attention,  # and fused attention's outputs
}


@dataclasses.dataclass(frozen=True)
class Schedule:
  """A pipeline: its layout (stages, chunks a stage) and the schedule that runs it."""
  stages: int = 1  # p: the size of the mesh's pp axis
  virtual: int = 1  # v: chunks per stage
  name: str = ""  # a key of SCHEDULES; "" is gpipe for virtual 1, circular otherwise

  def __post_init__(self):
    if self.name and self.name not in SCHEDULES:
      raise ValueError(f"unknown pipeline schedule {self.name!r}; one of {', '.join(SCHEDULES)}.")

  @property
  def resolved(self) -> str:
    """The schedule's name, the default ("") resolved: gpipe for virtual 1, circular otherwise."""
    return self.name or ("gpipe" if self.virtual == 1 else "circular")

  def tasks(self, microbatches: int) -> Tasks:
    """The schedule's tasks for `microbatches`, checked (`check`)."""
    tasks = SCHEDULES[self.resolved](self.stages, microbatches, self.virtual)
    check(tasks, self.stages, microbatches, self.virtual)
    return tasks

  def forward_tasks(self, microbatches: int) -> Tasks:
    """The forward alone, as the layout's autodiff schedule runs it (gpipe, circular): what a
    schedule with backward tasks runs where no gradient is taken, and ahead of its backward."""
    build = gpipe if self.virtual == 1 else circular
    tasks = build(self.stages, microbatches, self.virtual)
    check(tasks, self.stages, microbatches, self.virtual)
    return tasks

  def explicit(self, microbatches: int) -> bool:
    """Whether the schedule runs its own backward tasks (1f1b, interleaved_1f1b)."""
    return has_backward(self.tasks(microbatches))

  def held(self, microbatches: int, remat_policy: str = "none") -> int:
    """The most chunk inputs a stage keeps for its backward at once: every microbatch's every
    chunk where autodiff makes the backward (M·v); with backward tasks the input slots of
    `lower_explicit` (its microbatches in flight, at most 2(p − s) − 1 for 1F1B, until their
    forward, or under remat=full their backward, runs)."""
    if not self.explicit(microbatches):
      return microbatches * self.virtual
    return self.lowered(microbatches, remat_policy).inputs

  def kept(self, microbatches: int, remat_policy: str = "none") -> int:
    """The most forward tasks whose residuals (a chunk's layer internals under the remat
    policy) a stage keeps at once for their backward: none where autodiff makes the backward or
    under remat=full (a backward task runs its chunk again)."""
    if not self.explicit(microbatches):
      return 0
    return self.lowered(microbatches, remat_policy).residuals

  def lowered(self, microbatches: int, remat_policy: str = "none") -> Lowered:
    """The schedule's tasks as the executor with backward tasks scans them."""
    return lower_explicit(self.tasks(microbatches), residuals=remat_policy != "full")

  def compute(self, microbatches: int, remat_policy: str = "none", head: bool = False) -> float:
    """A stage's FLOPs a microbatch against the same layers' unpipelined (a forward F, its
    backward 2F, and F again to recompute under remat=full): 1 where autodiff makes the backward,
    and with backward tasks where the loss `head` runs inside the schedule (the language model's,
    `Stack.loss`): a forward task keeps its residuals for the backward task, or under remat=full
    the backward task runs the chunk again (the last chunk's forward runs in its backward). An
    encoder's stack runs its forward alone first (its outputs' cotangents come from the language
    model after it): 4F against 3F, 5F against 4F under remat=full."""
    if not self.explicit(microbatches) or head:
      return 1.0
    return 5 / 4 if remat_policy == "full" else 4 / 3

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

  def bubble(self, microbatches: int, remat_policy: str = "none") -> float:
    """The share of a stage's time its schedule leaves it idle, the stages running their steps
    in lockstep (a step takes as long as its slowest task). Forward schedules (gpipe, circular;
    autodiff's backward mirrors them): the idle share of a stage's steps, (p − 1) / (M·v + p −
    1). With backward tasks, a step weighs its slowest task, a forward 1 and a backward 2, or
    under remat=full 3 (it runs its chunk again; the last chunk's forward is its backward's, 0),
    and a stage is idle for what its own tasks leave of the steps' weight (`schedules._as_soon`
    phases the steps)."""
    tasks = self.tasks(microbatches)
    if not has_backward(tasks):
      slots = [task for row in tasks for task in row]
      return slots.count(None) / len(slots)
    last = self.stages * self.virtual - 1 if remat_policy == "full" else -1
    weight = lambda x: (0 if x is None or x.chunk == last and x.kind == FORWARD else  # noqa
                        (3 if last >= 0 else 2) if x.kind == BACKWARD else 1)
    steps = sum(max(weight(row[t]) for row in tasks) for t in range(len(tasks[0])))
    return 1 - max(sum(weight(x) for x in row) for row in tasks) / steps


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


def _filled(a: jax.Array, pad: int) -> jax.Array:
  """`a` [M, ...] with `pad` microbatches of zeros after it."""
  return jnp.concatenate([a, jnp.zeros((pad,) + a.shape[1:], a.dtype)]) if pad else a


class Stack:
  """Runs `layer(params_i, x, *side) -> x` over stacked parameters for M microbatches at once.

  `params` leaves are [L, ...] (virtual 1) or [v, L/v, ...] (`Schedule.to_layout`), split over
  `pp` by `Schedule.stage_spec`, and run in the order of the schedule's tasks; `x_m` is [M, ...]
  and each of `side_m` is [M, ...] (per-microbatch inputs every layer sees, such as positions)."""

  def __init__(self, layer: Callable, mesh: Mesh, schedule: Schedule, remat_policy: str = "none",
               unroll: bool = True, gather: Callable | None = None, branch: bool | None = None,
               trained=None, indexed: bool = False, dtype=None):
    """`gather(params_i) -> params_i` runs first in every layer (FSDP: sharding.layer_gather).
    `branch`: whether the stages of a schedule with backward tasks branch on their task
    (`pipeline_tasks.TaskRunner`); None: everywhere but on XLA's CPU runtime
    (`pipeline_tasks.branches_may_diverge`).
    `trained`: a tree of bools over the stacked parameters (None: all trained); the backward
    tasks differentiate the trained leaves alone (a frozen one gets no gradient, nor zeros).
    `indexed`: each layer is called `layer(params_i, x, index, *side)`, `index` its place in the
    whole stack (int32) whichever stage and chunk runs it (LoRA dropout draws its masks by it).
    `dtype`: the layers' compute dtype, to which a schedule with backward tasks casts a chunk's
    kernels before its forward tasks keep their residuals (pipeline_tasks.py; None: as they
    are)."""
    self.trained, self.indexed, self.dtype = trained, indexed, dtype
    if gather is not None:
      inner = layer
      layer = lambda params, x, *side: inner(gather(params), x, *side)
    self.layer = remat(layer, remat_policy, gathered=gather is not None)
    # Under a schedule with backward tasks and remat=full, a backward task runs its chunk again
    # from the chunk's input, each layer keeping all it needs (pipeline_tasks.py).
    self.bare_layer = remat(layer, "none", gathered=gather is not None)
    self.remat_policy = remat_policy
    self.mesh, self.schedule, self.unroll, self.branch = mesh, schedule, unroll, branch

  def __call__(self, params, x_m: jax.Array, side_m: tuple = ()) -> jax.Array:
    if not self.schedule.pipelined:
      if x_m.shape[0] == 1:  # one microbatch (the usual chunk): no vmap around the kernels
        return scan_layers(self.layer, params, x_m[0], tuple(a[0] for a in side_m),
                            self.unroll, self.first())[None]
      return jax.vmap(lambda x, *side: scan_layers(self.layer, params, x, side, self.unroll,
                                                    self.first()))(x_m, *side_m)
    num, pad = x_m.shape[0], self._pad(x_m.shape[0])
    x_m, side_m = _filled(x_m, pad), tuple(_filled(a, pad) for a in side_m)
    if self.schedule.explicit(num + pad):
      return pipeline_tasks.explicit(self, params, x_m, tuple(side_m))[:num]
    return self.forward(params, x_m, tuple(side_m), self.schedule.tasks(num + pad))[:num]

  def loss(self, params, x_m: jax.Array, side_m: tuple, head: pipeline_tasks.Head) -> jax.Array:
    """`head`'s loss summed over the stack's outputs for M microbatches (pipelined): under a
    schedule with backward tasks the head runs inside it (`pipeline_tasks.explicit_loss`), else
    after the stack, a microbatch at a time (`pipeline_tasks.head_sum`)."""
    num, pad = x_m.shape[0], self._pad(x_m.shape[0])
    x_m, side_m = _filled(x_m, pad), tuple(_filled(a, pad) for a in side_m)
    # The padded microbatches' loss weights are 0, and so is their loss.
    head = head._replace(side_m=tuple(_filled(a, pad) for a in head.side_m))
    if self.schedule.explicit(num + pad):
      return pipeline_tasks.explicit_loss(self, params, x_m, tuple(side_m), head)
    h_m = self.forward(params, x_m, tuple(side_m), self.schedule.tasks(num + pad))
    return pipeline_tasks.head_sum(head, head.trained, head.frozen, h_m, head.side_m)

  def _pad(self, num: int) -> int:
    """Microbatches of zeros after `num` (pipelined): fewer than the stages (evaluation), or not
    a whole group of the interleaved schedule's. Their outputs are dropped (their cotangents are
    zero)."""
    p = self.schedule.stages
    return max(p - num, 0) if self.schedule.resolved != "interleaved_1f1b" else -num % p

  def forward(self, params, x_m, side_m: tuple, tasks: Tasks) -> jax.Array:
    """The forward `tasks` over `pp` (autodiff makes their backward)."""
    specs = jax.tree.map(lambda _: P(*self.schedule.stage_spec()), params)
    run = jax.shard_map(functools.partial(self._pipeline, table=lower(tasks)), mesh=self.mesh,
                        in_specs=(specs, P(), P()), out_specs=P(), axis_names={PP})
    return run(params, x_m, side_m)

  def _pipeline(self, params, x_m, side_m, table: np.ndarray):
    """One stage's part of a forward schedule (inside shard_map over `pp`): a scan over the
    lowered schedule's steps, each running this stage's task and sending its output on."""
    p, num = self.schedule.stages, x_m.shape[0]
    parks = bool((table[..., PARK] >= 0).any())  # no buffer where every input arrives in time
    stage = jax.lax.axis_index(PP)
    chunks = self.chunks(params)
    ring = [(i, (i + 1) % p) for i in range(p)]

    def tick(carry, row):
      incoming, parked, outs = carry
      task = row[stage]
      m, source, park = task[MICRO], task[SOURCE], task[PARK]
      h = x_m[m]
      if parks:
        h = jnp.where(source == FROM_PARKED, parked[m], h)
      h = jnp.where(source == FROM_PREVIOUS, incoming, h)
      h = scan_layers(self.layer, at(chunks, task[LOCAL]), h, tuple(a[m] for a in side_m),
                       self.unroll, self.first(chunks, task[LOCAL], stage))
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

  def first(self, chunks=None, local=0, stage=0):
    """The index in the stack of the first layer of this stage's chunk `local` (None unless
    `indexed`): chunk local·p + stage, of L/(p·v) layers (`_chunks`)."""
    if not self.indexed or chunks is None:
      return 0 if self.indexed else None
    return (local * self.schedule.stages + stage) * jax.tree.leaves(chunks)[0].shape[1]

  def mask(self, params):
    return self.trained if self.trained is not None else jax.tree.map(lambda _: True, params)

  def chunks(self, params):
    """This stage's chunks as [v, L/(p·v), ...] whichever layout they arrived in."""
    return params if self.schedule.virtual > 1 else jax.tree.map(lambda a: a[None], params)
