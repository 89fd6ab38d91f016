"""Each module's training state on its mesh: initialisation, and the conversion between a pipeline
schedule's layout of stacked blocks (`Schedule.to_layout`) and the topology-independent one that
checkpoints hold. Where everything is placed is the plan's (sharding.py)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

from mimo_jax import optim
from mimo_jax.config import ConfigError
from mimo_jax.sharding import Plan, optimizer_shardings, with_shardings, REPLICATED
from mimo_jax.trees import paths


@dataclasses.dataclass
class ModuleState:
  params: Any
  opt_state: Any


@dataclasses.dataclass(frozen=True)
class HFStart:
  """A module starting from an HF directory: its tensors as `(path, read)` leaves
  (mimo_jax/hf's `Leaf`s; an encoder's `load()`, or the language model's mapping)."""
  path: str  # the directory, for errors
  leaves: list


def init_state(plan: Plan, modules: dict, seed: int, optimizer: bool = True,
               starts: dict | None = None) -> dict[str, ModuleState]:
  """Parameters born sharded on their module's mesh; values depend only on the seed, except for
  a module in `starts` (init_from.starts: what the config names to start from): canonical
  parameters of a mimo_jax run (a leaf left abstract, a fresh adapter, is the seed's), or an
  `HFStart`. The optimizer state is fresh (step 0); without `optimizer` it is None (a checkpoint
  of parameters only)."""
  starts = dict(starts or {})
  state = {}
  for name, module in modules.items():
    p, start = plan[name], starts.pop(name, None)
    # Every leaf in its stored dtype (optim.stored: a frozen one in the compute dtype).
    stored = lambda tree, p=p: optim.cast(p.layout(tree), p.abstract_params)
    if isinstance(start, HFStart):
      params = _from_hf(p, module, seed, start, name)
    elif start is not None:
      params = jax.jit(stored, out_shardings=p.param_sh,
                       donate_argnums=0)(_seed_abstract(p, module, seed, start))
    else:
      init = lambda seed, module=module, stored=stored: stored(module.init(seed))
      params = jax.jit(init, static_argnums=0, out_shardings=p.param_sh)(seed)
    opt_state = (jax.jit(lambda params, p=p: p.tx.init(p.trained(params)),
                         out_shardings=p.opt_sh)(params) if optimizer else None)
    state[name] = ModuleState(params, opt_state)
  return state


def _seed_abstract(p, module, seed: int, start):
  """Canonical parameters `start` with each leaf it leaves abstract drawn from the seed, as a
  fresh start draws it (only those leaves are computed)."""
  leaves, treedef = jax.tree.flatten(start)
  missing = [i for i, x in enumerate(leaves) if isinstance(x, jax.ShapeDtypeStruct)]
  if not missing:
    return start
  target = jax.tree.leaves(p.canonical_params)
  init = lambda seed: [jax.tree.leaves(optim.cast(module.init(seed), p.canonical_params))[i]
                       for i in missing]
  drawn = jax.jit(init, static_argnums=0,
                  out_shardings=[target[i].sharding for i in missing])(seed)
  for i, x in zip(missing, drawn):
    leaves[i] = x
  return jax.tree.unflatten(treedef, leaves)


def _from_hf(p, module, seed: int, start: HFStart, name: str):
  """The seed's parameters with every leaf the HF directory has replaced, each read on the host
  and placed straight into its sharding: one tensor in host memory at a time (a stacked leaf is
  written into its device array layer by layer). On a terminal a bar counts the tensors, with
  the host memory."""
  canonical_sh = jax.tree.map(lambda a: a.sharding, p.canonical_params)
  init = lambda seed: optim.cast(module.init(seed), p.canonical_params)
  params = jax.jit(init, static_argnums=0, out_shardings=canonical_sh)(seed)
  bar = tqdm(total=sum(max(read.layers, 1) for _, read in start.leaves), unit="tensor",
             desc=f"model.{name}", leave=False,
             disable=None if jax.process_index() == 0 else True)  # None: on a terminal only
  with bar:
    for path, read in start.leaves:
      _read_leaf(params, p, path, read, bar, start.path, name)
  return jax.jit(lambda t: optim.cast(p.layout(t), p.abstract_params), out_shardings=p.param_sh,
                 donate_argnums=0)(params)


def _read_leaf(params, p, path, read, bar, directory: str, name: str):
  """Places one leaf the HF directory holds into `params` (the canonical layout)."""
  node, target = params, p.canonical_params
  for k in path[:-1]:
    node, target = node[k], target[k]
  target = target[path[-1]]
  shape = ((read.layers,) if read.layers else ()) + tuple(read.layer_shape)
  if shape != tuple(target.shape):
    raise ConfigError(f"{directory}: {'/'.join(path)} has shape {shape} where model.{name} has "
                     f"{target.shape}.")
  node[path[-1]] = (_place_layers(read, target, bar) if read.layers else
                    _place(read.layer(0), target.sharding).astype(target.dtype))
  bar.update(0 if read.layers else 1)
  if not bar.disable:
    bar.set_postfix_str(f"host {host_gib():.1f} GiB", refresh=False)


def host_gib(field: str = "VmRSS") -> float:
  """This process's host memory from /proc/self/status, GiB: resident now (VmRSS) or its peak
  (VmHWM); 0 where /proc is not there."""
  try:
    with open("/proc/self/status", encoding="utf-8") as f:
      return next(int(ln.split()[1]) for ln in f if ln.startswith(field + ":")) / 1024**2
  except (OSError, StopIteration):
    return 0.0


def _place(x, sharding):
  return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def _place_layers(read, target, bar=None):
  """A stacked leaf [L, ...] built on its devices from one layer on the host at a time."""
  sharding = target.sharding
  layer_sh = NamedSharding(sharding.mesh, P(*tuple(sharding.spec)[1:]))
  out = jnp.zeros(target.shape, target.dtype, device=sharding)
  for i in range(read.layers):
    out = _set_layer(out, _place(read.layer(i), layer_sh), i)
    if bar is not None:
      bar.update(1)
  return out


@functools.partial(jax.jit, donate_argnums=0)
def _set_layer(stacked, x, i):
  return jax.lax.dynamic_update_index_in_dim(stacked, x.astype(stacked.dtype), i, 0)


def frozen_paths(plan: Plan, lora: bool) -> dict[str, set]:
  """Module -> `params/<path>` of its frozen leaves, for a run with LoRA adapters (`lora`;
  empty sets otherwise): what its checkpoints leave to their base (checkpoint_steps.Base)."""
  return {n: {f"params/{k}" for k, label in paths(p.labels).items()
              if lora and label == optim.FROZEN} for n, p in plan.modules.items()}


def abstract_state(plan: Plan, canonical: bool = False) -> dict[str, dict]:
  """Shapes, dtypes and this topology's shardings of every module's state; with `canonical`, in
  the layout checkpoints hold (restore targets)."""
  out = {}
  for name, p in plan.modules.items():
    out[name] = {"params": p.abstract_params,
                 "opt_state": with_shardings(p.opt_shapes, p.opt_sh)}
    if canonical and p.schedule.virtual > 1:
      shapes = jax.eval_shape(p.unlayout, p.opt_shapes)
      opt_sh = optimizer_shardings(p.tx, shapes, p.canonical_grad_sh, p.sharding(REPLICATED))
      out[name] = {"params": p.canonical_params, "opt_state": with_shardings(shapes, opt_sh)}
  return out


def canonical(plan: Plan, state: dict[str, ModuleState]) -> dict[str, ModuleState]:
  """State in the topology-independent layout (stacked layers [L, ...]) for checkpoints."""
  return _convert(plan, state, to_canonical=True)


def from_canonical(plan: Plan, state: dict[str, ModuleState]) -> dict[str, ModuleState]:
  return _convert(plan, state, to_canonical=False)


def _convert(plan: Plan, state: dict[str, ModuleState], to_canonical: bool):
  out = {}
  target = abstract_state(plan, canonical=to_canonical)
  for name, s in state.items():
    p = plan[name]
    if p.schedule.virtual == 1:
      out[name] = s
      continue
    fn = p.unlayout if to_canonical else p.layout
    tree = {"params": s.params, "opt_state": s.opt_state}
    if s.opt_state is None:  # parameters only
      tree = {"params": s.params}
    shardings = jax.tree.map(lambda a: a.sharding, {k: target[name][k] for k in tree})
    moved = jax.jit(fn, out_shardings=shardings)(tree)
    out[name] = ModuleState(moved["params"], moved.get("opt_state"))
  return out
