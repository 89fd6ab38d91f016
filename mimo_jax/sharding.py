"""The parallel plan, in one place: mesh axes, tensor-parallel rules, and for every module the
shardings of its parameters, optimizer state and per-rank gradients.

Each module has a mesh of axes (pp, dp, tp) (topology.py). What is split where:

* **Activations and batches** are split on their first axis over `dp` (`BATCH`); scalars and
  whatever every rank needs whole are replicated (`REPLICATED`).
* **Parameters** follow `TP_RULES` (Megatron's column/row split over `tp`; a parameter no rule
  matches is replicated), with the stacked layer axes of `blocks` split over `pp` as the pipeline
  schedule lays them out (`Schedule.stage_spec`).
* **Optimizer state**: every leaf that mirrors a parameter (Adam's moments) takes that parameter's
  sharding, found by optax from the transform's own structure (`optax.tree_utils.tree_map_params`,
  an `eval_shape` of its init); the rest (step counts) is replicated.
* **Per-rank gradients** (`per_rank`): a parameter's gradient with a leading [dp] axis split over
  `dp`, for the steps that keep each rank's gradients apart and sum them once a step.
* **State sharded over dp** (`topology.<module>.shard`): `optimizer` (ZeRO-1) splits the optimizer
  state and the summed gradients over `dp`, `full` (FSDP) the parameters too. Each leaf is split
  on its largest dimension that dp divides and nothing else splits (`dp_specs`; never a stacked
  layer axis); a leaf with none stays replicated. Under `full` each layer's parameters are
  gathered in the compute dtype just before the layer runs and their gradients reduce-scattered
  right after (`layer_gather`); the backward gathers again rather than keeping them.

Models never see a mesh: they name their parameters, and these rules place them.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax
import optax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mimo_jax import optim, words
from mimo_jax.config import Config, parse_freeze
from mimo_jax.models import fp8
from mimo_jax.pipeline import GATHERED, Schedule
from mimo_jax.trees import path_str

AXES = ("pp", "dp", "tp")
BATCH = P("dp")  # arrays split on their first axis over data-parallel ranks
REPLICATED = P()

COLUMN = P(None, "tp")  # kernel [in, out]: out split
ROW = P("tp", None)  # kernel [in, out]: in split
COLUMN_BIAS = P("tp")

# (path regex, spec) pairs; the first match wins, unmatched parameters are replicated. The first
# matmul of attention and of an MLP is split on its output features (heads, hidden units), the
# second on its input features, so each block needs one reduction.
TP_RULES = (
    (r".*attn/(q|k|v)/kernel$", COLUMN),
    (r".*attn/(q|k|v)/bias$", COLUMN_BIAS),
    (r".*attn/o/kernel$", ROW),
    (r"(.*/)?(mlp|projector)/(gate|up)/kernel$", COLUMN),
    (r"(.*/)?(mlp|projector)/(gate|up)/bias$", COLUMN_BIAS),
    (r"(.*/)?(mlp|projector)/down/kernel$", ROW),
    # LoRA adapters (models/lora.py) follow their kernel: B [rank, out] of a column-split kernel
    # split on its output, A [in, rank] of a row-split one on its input; the other replicated.
    (r".*attn/(q|k|v)/lora_b$", COLUMN),
    (r".*attn/o/lora_a$", ROW),
    (r"(.*/)?(mlp|projector)/(gate|up)/lora_b$", COLUMN),
    (r"(.*/)?(mlp|projector)/down/lora_a$", ROW),
)
BLOCKS = "blocks"  # the stacked repeated layers of a module (models/layers.stacked)


def param_specs(params, stage_spec: tuple = ("pp",)):
  """PartitionSpec per parameter from `TP_RULES`; the stacked layer axes of `blocks` are split as
  `stage_spec` says (pipeline stages)."""
  def spec(path, _):
    p = path_str(path)
    lead = stage_spec if p.startswith(BLOCKS + "/") else ()
    for pattern, s in TP_RULES:
      if re.fullmatch(pattern, p):
        return P(*lead, *s)
    return P(*lead)
  return jax.tree_util.tree_map_with_path(spec, params)


def dp_specs(shapes, specs, dp: int, stage_dims: int):
  """`specs` with each leaf also split over `dp` on its largest dimension that dp divides and no
  other axis splits; the first `stage_dims` axes of stacked blocks (layers, pipeline chunks) are
  never chosen. A leaf with no such dimension is left as it was (replicated over dp)."""
  def one(path, a, s):
    if fp8.is_history(path_str(path)):  # a few floats every rank reads whole
      return s
    lead = stage_dims if path_str(path).startswith(BLOCKS + "/") else 0
    entries = list(s) + [None] * (a.ndim - len(s))
    free = [d for d in range(lead, a.ndim) if entries[d] is None and a.shape[d] % dp == 0]
    if dp == 1 or not free:
      return s
    entries[max(free, key=lambda d: (a.shape[d], -d))] = "dp"
    return P(*entries)
  return jax.tree_util.tree_map_with_path(one, shapes, specs)


def layer_gather(mesh: Mesh, canonical_shapes, gathered_specs, sharded_specs, dtype):
  """FSDP's gather of one layer's parameters (a slice of `blocks`, under jit): the matmul kernels
  cast to the compute `dtype` on their shards first, as the layers would cast them (exact, and
  half the bytes in bfloat16), then constrained to their specs without dp, so XLA all-gathers
  them just before the layer and reduce-scatters their gradients right after it. The gathered
  values are named GATHERED: no remat policy keeps them for the backward, which gathers again."""
  layer = lambda tree: jax.tree.map(lambda s: P(*s[1:]), tree[BLOCKS])
  full = jax.tree.map(lambda s: NamedSharding(mesh, s), layer(gathered_specs))
  split = jax.tree.map(lambda s: NamedSharding(mesh, s), layer(sharded_specs))
  kernels = jax.tree_util.tree_map_with_path(
      lambda path, _: path_str(path).endswith("kernel"), canonical_shapes[BLOCKS])

  def one(x, kernel, split, full):
    if kernel:
      x = jax.lax.with_sharding_constraint(x.astype(dtype), split)
    return checkpoint_name(jax.lax.with_sharding_constraint(x, full), GATHERED)
  return lambda params: jax.tree.map(one, params, kernels, split, full)


def on_blocks(tree, fn):
  """`fn` applied to the leaves of stacked blocks (parameters and the optimizer moments that
  mirror them), identity elsewhere."""
  key = f"[{BLOCKS!r}]"
  return jax.tree_util.tree_map_with_path(
      lambda path, x: fn(x) if key in jax.tree_util.keystr(path) else x, tree)


def with_shardings(shapes, shardings):
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes,
                      shardings)


def optimizer_shardings(tx: optax.GradientTransformation, opt_shapes, param_shardings,
                        replicated: NamedSharding):
  """The sharding of every optimizer-state leaf: a parameter's where the leaf mirrors one."""
  masked = lambda x: isinstance(x, optax.MaskedNode)
  return optax.tree_utils.tree_map_params(
      tx, lambda leaf, s: leaf if masked(leaf) else s, opt_shapes, param_shardings,
      transform_non_params=lambda _: replicated, is_leaf=masked)


@dataclasses.dataclass
class ModulePlan:
  """One module's placement: mesh, pipeline schedule, parameter groups and optax transform, and
  the shardings of its state, in the schedule's layout of stacked blocks and in the
  topology-independent one checkpoints hold (`canonical_*`)."""
  name: str
  mesh: Mesh
  schedule: Schedule
  shard: str  # topology.<module>.shard: none, optimizer (ZeRO-1) or full (FSDP)
  labels: Any  # parameter tree of group labels (optim.FROZEN for frozen groups)
  tx: optax.GradientTransformation  # over the trained part (`trained`)
  trainable: bool
  abstract_params: Any  # ShapeDtypeStructs with shardings, in the schedule's layout; frozen
  # leaves in the compute dtype (optim.stored)
  opt_shapes: Any
  param_sh: Any
  opt_sh: Any
  # Gradients exist for the trained part alone (`trained`): these trees hold nothing else.
  grad_sh: Any  # a step's summed gradients (split over dp under optimizer and full)
  per_rank_sh: Any  # gradients kept per dp rank: [dp, ...] split over dp (not under full)
  canonical_params: Any  # ShapeDtypeStructs with shardings, stacked blocks as [L, ...]
  canonical_grad_sh: Any  # grad_sh in the canonical layout (what optimizer moments follow)
  gather: Any = None  # FSDP's per-layer gather (`layer_gather`), for a `full` unpipelined module

  def sharding(self, spec: P = BATCH) -> NamedSharding:
    return NamedSharding(self.mesh, spec)

  @property
  def dp(self) -> int:
    return self.mesh.shape["dp"]

  @property
  def tp(self) -> int:
    return self.mesh.shape["tp"]

  @property
  def sharded_params(self) -> bool:
    """FSDP: the parameters themselves are split over dp ranks."""
    return self.shard == "full" and self.dp > 1

  def trained(self, tree):
    """The trained leaves of a parameter-shaped tree (optim.trained)."""
    return optim.trained(tree, self.labels)

  def frozen(self, tree):
    return optim.frozen(tree, self.labels)

  def join(self, trained, frozen):
    """A `trained` and a `frozen` part as the whole parameter tree."""
    return optim.join(trained, frozen)

  @property
  def trained_sh(self):
    """The trained leaves' parameter shardings (where unsummed gradients live)."""
    return self.trained(self.param_sh)

  def layout(self, tree):
    """Canonical stacked blocks [L, ...] -> the schedule's layout."""
    return on_blocks(tree, self.schedule.to_layout)

  def unlayout(self, tree):
    return on_blocks(tree, self.schedule.from_layout)


def plan_module(cfg: Config, name: str, mesh: Mesh, module, frozen: tuple[str, ...]) -> ModulePlan:
  t = cfg.topology.module(name)
  schedule = Schedule(t.pp, t.virtual, t.schedule)
  built = module.abstract_params()
  # Frozen leaves are stored in the compute dtype (optim.stored); the rest as the model built it.
  canonical = optim.stored(built, optim.labels(module.groups(built), frozen),
                           jax.numpy.dtype(cfg.model.dtype))
  layout = lambda tree: on_blocks(tree, schedule.to_layout)
  abstract = jax.eval_shape(layout, canonical)
  shard = lambda specs: jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
  dp = mesh.shape["dp"]

  def specs(shapes, stage_spec):
    """(parameter specs, specs of summed gradients and optimizer moments) for this module."""
    tp_specs = param_specs(shapes, stage_spec)
    if t.shard == "none":
      return tp_specs, tp_specs
    split = dp_specs(shapes, tp_specs, dp, len(stage_spec))
    return (split if t.shard == "full" else tp_specs), split

  param_specs_, grad_specs = specs(abstract, schedule.stage_spec())
  canonical_specs, canonical_grad_specs = specs(canonical, ("pp",))
  param_sh = shard(param_specs_)
  groups = module.groups(abstract)
  labels = optim.labels(groups, frozen)
  trained = lambda tree: optim.trained(tree, labels)  # what gradients and moments cover
  tx = optim.module_transform(cfg, trained(groups))
  abstract_params = with_shardings(abstract, param_sh)
  opt_shapes = jax.eval_shape(tx.init, trained(abstract_params))
  replicated = NamedSharding(mesh, REPLICATED)
  gather = None
  if t.shard == "full" and dp > 1 and not schedule.pipelined:
    gather = layer_gather(mesh, canonical, param_specs(canonical), canonical_specs,
                          jax.numpy.dtype(cfg.model.dtype))
  return ModulePlan(
      name=name, mesh=mesh, schedule=schedule, shard=t.shard, labels=labels, tx=tx,
      trainable=any(optim.trains(l) for l in jax.tree.leaves(labels)),
      abstract_params=abstract_params, opt_shapes=opt_shapes, param_sh=param_sh,
      opt_sh=optimizer_shardings(tx, opt_shapes, trained(shard(grad_specs)), replicated),
      grad_sh=trained(shard(grad_specs)),
      per_rank_sh=trained(jax.tree.map(lambda s: NamedSharding(mesh, P("dp", *s)),
                                       param_specs(abstract, schedule.stage_spec()))),
      canonical_params=with_shardings(canonical, shard(canonical_specs)),
      canonical_grad_sh=trained(shard(canonical_grad_specs)), gather=gather)


@dataclasses.dataclass
class Plan:
  """Every module's `ModulePlan`, encoders first and `language` last (the dispatch order)."""
  modules: dict[str, ModulePlan]

  @classmethod
  def build(cls, cfg: Config, meshes: dict[str, Mesh], modules: dict) -> "Plan":
    frozen = parse_freeze(cfg)
    return cls({n: plan_module(cfg, n, meshes[n], m, frozen) for n, m in modules.items()})

  def __getitem__(self, name: str) -> ModulePlan:
    return self.modules[name]

  def sharding(self, name: str, spec: P = BATCH) -> NamedSharding:
    return self.modules[name].sharding(spec)

  @property
  def encoders(self) -> list[str]:
    return [n for n in self.modules if n != "language"]

  def parameters(self) -> str:
    """What trains and what does not, counted: `trained: GROUP N, ...; frozen: MODULE N, ...`
    (the optimizer's groups, e.g. `language_lora`; a module's frozen leaves, its LoRA base or a
    group `optim.freeze` names, under the module's name). FP8 abs-max histories are not
    parameters."""
    trained, frozen = {}, {}
    for name, plan in self.modules.items():
      sizes = jax.tree.leaves(jax.tree.map(lambda a: a.size, plan.canonical_params))
      for label, size in zip(jax.tree.leaves(plan.labels), sizes):
        if label == optim.FROZEN:
          frozen[name] = frozen.get(name, 0) + size
        elif optim.trains(label):
          trained[label] = trained.get(label, 0) + size
    said = lambda counts: ", ".join(f"{k} {words.amount(v)}" for k, v in counts.items()) or "none"
    return f"trained: {said(trained)}; frozen: {said(frozen)}"
