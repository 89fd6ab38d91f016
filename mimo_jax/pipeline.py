"""A stack of identical layers, run in one piece or pipelined over a module mesh's `pp` axis.

Models keep the parameters of their repeated blocks stacked on a leading layer axis (see
`models/layers.stacked`), and hand the stack to a `Stack`: the model code is the same for every
pipeline size. With `pp == 1` the layers run as one `lax.scan`. With `pp > 1` the stack runs
inside a `jax.shard_map` that is manual over `pp` only (dp and tp stay automatic, so tensor
parallelism inside a layer is unchanged), and activations move from stage to stage with
`lax.ppermute`.

Schedules, for M microbatches, p stages and v virtual stages (chunks) per stage:

* GPipe (v = 1): stage s holds layers [s·L/p, (s+1)·L/p). At time t stage s runs microbatch
  t − s; M + p − 1 steps, a bubble of (p − 1) / (M + p − 1).
* Circular (v > 1): the layers form p·v chunks of L/(p·v); chunk k lives on stage k mod p, so a
  microbatch goes round the ring v times. Stage 0 parks what comes back from the last stage until
  its next round (this needs M ≥ p). M·v + p − 1 steps of 1/v the work each: the bubble shrinks
  by v.

The backward pass is the transpose of the forward loop (ppermute's transpose sends the other way),
so gradients flow through the same ring in reverse: all forwards, then all backwards, as in GPipe.
Bubble steps compute on zeros and are masked out. Inputs and outputs are replicated over `pp`:
every stage receives the microbatches and the last stage's outputs are broadcast by one `psum`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
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


@dataclasses.dataclass(frozen=True)
class Schedule:
  stages: int = 1  # p: the size of the mesh's pp axis
  virtual: int = 1  # v: chunks per stage; > 1 is the circular schedule

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
    """Idle fraction of the ideal schedule: (p − 1) / (M·v + p − 1)."""
    p, v = self.stages, self.virtual
    return (p - 1) / (microbatches * v + p - 1)


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

  `params` leaves are [L, ...] (GPipe) or [v, L/v, ...] (circular, `Schedule.to_layout`), split
  over `pp` by `Schedule.stage_spec`; `x_m` is [M, ...] and each of `side_m` is [M, ...] (per-
  microbatch inputs every layer sees, such as positions).
  """

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
    p, v = self.schedule.stages, self.schedule.virtual
    num = x_m.shape[0]
    items = num * v  # (round, microbatch) pairs each stage works through
    stage = jax.lax.axis_index(PP)
    # This stage's chunks as [v, L/(p·v), ...] whichever layout they arrived in.
    chunks = params if v > 1 else jax.tree.map(lambda a: a[None], params)
    ring = [(i, (i + 1) % p) for i in range(p)]

    def tick(carry, t):
      incoming, parked, outs = carry
      i = t - stage  # the item this stage works on now
      ic = jnp.clip(i, 0, items - 1)
      rnd, m = ic // num, ic % num
      first = jnp.where(rnd == 0, x_m[m], parked[m]) if v > 1 else x_m[m]
      h = jnp.where(stage == 0, first, incoming)
      h = _scan_layers(self.layer, _at(chunks, rnd), h, tuple(a[m] for a in side_m), self.unroll)
      done = (stage == p - 1) & (rnd == v - 1) & (i >= 0) & (i < items)
      outs = outs.at[m].set(jnp.where(done, h, outs[m]))
      incoming = jax.lax.ppermute(h, PP, ring)
      if v > 1:  # stage 0 parks what the last stage finished, until that microbatch's next round
        j = t - (p - 1)
        jc = jnp.clip(j, 0, items - 1)
        keep = (stage == 0) & (j >= 0) & (j < num * (v - 1))
        parked = parked.at[jc % num].set(jnp.where(keep, incoming, parked[jc % num]))
      return (incoming, parked, outs), None

    init = jax.lax.pcast((jnp.zeros_like(x_m[0]), jnp.zeros_like(x_m) if v > 1 else
                          jnp.zeros((num, 0), x_m.dtype), jnp.zeros_like(x_m)), (PP,),
                         to="varying")
    (_, _, outs), _ = jax.lax.scan(tick, init, jnp.arange(items + p - 1))
    return jax.lax.psum(outs, PP)  # only the last stage wrote: a broadcast
