"""Gradient accumulators held layer by layer, so that the matmuls fold them in (`train.fold_grads`).

A step adds each microbatch's gradients to float32 accumulators. For a stacked kernel [L, k, n]
that is a pass of its own after the backward: every layer's gradient, stacked, cast and added,
about 10 bytes a parameter a microbatch. Where a module's layers run unrolled, the trained stacked
kernels are differentiated as their L slices instead (`unstack`, restacked inside the loss:
XLA's simplifier takes a slice of that stack back to the slice itself), each layer's gradient comes
out of its matmul in float32 (`kernel_grads.float32_kernel_grads`), and its accumulator is a
buffer of its own, donated: XLA's GEMM rewriter then takes the accumulator into the cuBLAS call as
its C operand (beta = 1), and no pass follows. The programs after the microbatches (the norm, the
update) take the stack of the slices (`restack`), which XLA fuses into them.
tools.accumulate_bench measures the forms; docs/benchmarks.md has the figures.

Held so: an accumulator leaf is a `Layers` (a pytree node of L arrays); everything else in the
tree is as before.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mimo_jax import optim, trees
from mimo_jax.config import Config, lora_of
from mimo_jax.sharding import BLOCKS, ModulePlan


@jax.tree_util.register_pytree_node_class
class Layers:
  """A stacked leaf [L, ...] held as its L slices [...]."""

  def __init__(self, items):
    self.items = tuple(items)

  def tree_flatten(self):
    return self.items, None

  @classmethod
  def tree_unflatten(cls, _, items):
    return cls(items)

  def __repr__(self):
    return f"Layers({len(self.items)})"


def is_layers(x) -> bool:
  return isinstance(x, Layers)


def eligible(cfg: Config, p: ModulePlan, name: str, per_rank: bool) -> bool:
  """Whether module `name`'s trained stacked kernels accumulate layer by layer: `train.fold_grads`,
  a compute dtype below the float32 parameters, the layers unrolled and not pipelined, each
  layer keeping all it computes (remat none: the matmuls' own backward keeps its inputs), no FSDP
  gather, gradients summed over ranks inside the microbatch's program (not kept per rank), no
  FP8 matmuls and no LoRA adapters (their kernels are frozen)."""
  top = cfg.topology.module(name)
  model = cfg.model.module(name)
  return (cfg.train.fold_grads and jnp.dtype(cfg.model.dtype) != jnp.float32
          and not p.schedule.pipelined and top.unroll and top.remat == "none"
          and p.gather is None and not per_rank and not getattr(model, "fp8", False)
          and lora_of(cfg, name) is None and p.trainable and any(jax.tree.leaves(mask(p))))


def mask(p: ModulePlan):
  """Over the trained leaves of module `p` (`ModulePlan.trained`): True for a stacked block
  kernel [L, k, n] that trains (a linear layer's `kernel` under `blocks`)."""
  labels = p.trained(p.labels)
  shapes = p.trained(p.abstract_params)

  def one(path, label, shape):
    key = trees.path_str(path)  # as trees.kernel_params names a kernel
    return (key.startswith(f"{BLOCKS}/") and key.endswith("/kernel") and len(shape.shape) == 3
            and optim.trains(label))
  return jax.tree_util.tree_map_with_path(one, labels, shapes)


def unstack(tree, folds):
  """`tree` with each leaf that `folds` marks as a `Layers` of its slices."""
  return jax.tree.map(lambda a, f: Layers(list(a)) if f else a, tree, folds)


def restack(tree):
  """`tree` with each `Layers` stacked back [L, ...] (other leaves as they are)."""
  return jax.tree.map(lambda a: jnp.stack(a.items) if is_layers(a) else a, tree,
                      is_leaf=is_layers)


def shardings(p: ModulePlan, folds):
  """Module `p`'s trained leaves' shardings (`ModulePlan.trained_sh`) with each leaf that `folds`
  marks as a `Layers` of its slices' (the stacked spec without its layer axis, which is never
  split where layers fold)."""
  def one(sh, shape, f):
    if not f:
      return sh
    return Layers([NamedSharding(sh.mesh, P(*tuple(sh.spec)[1:]))] * shape.shape[0])
  return jax.tree.map(one, p.trained_sh, p.trained(p.abstract_params), folds)
