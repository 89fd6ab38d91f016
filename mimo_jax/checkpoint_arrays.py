"""A step's arrays beside this run's: fingerprints checked, shapes compared, trees filled from
arrays by path or stripped of some, the dtypes a save stores and a read gives back, and the note
of optimizer state mapped onto other trained groups."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from mimo_jax import fingerprint
from mimo_jax.config import Config
from mimo_jax.trees import path_str


def mismatches(saved: dict, tree: dict, module: str) -> list[str]:
  """The arrays of `tree` (what was read of one module: params and opt_state, or some of them)
  whose fingerprints differ from `saved`, as `module path`. A bfloat16 array read as stored
  may hold float32 values that a `compact` save fingerprinted as float32: widened, it matches."""
  got = fingerprint.on_device(tree)
  named = fingerprint.paths(tree)
  wide = {k: named[k].astype(jnp.float32) for k in got
          if saved.get(k) != got[k] and named[k].dtype == jnp.bfloat16}
  got.update(fingerprint.on_device(wide) if wide else {})
  return [f"{module} {k}" for k in sorted(got) if saved.get(k) != got[k]]


def fill(tree, arrays: dict, keep_others: bool = False):
  """`tree` with each leaf replaced by `arrays[path]` (fingerprint.paths names); with
  `keep_others` a leaf `arrays` lacks stays as it is."""
  leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
  named = [path_str(p) for p, _ in leaves]
  return jax.tree_util.tree_unflatten(
      treedef, [arrays.get(k, x) if keep_others else arrays[k]
                for k, (_, x) in zip(named, leaves)])


def shape_differences(saved: dict, wanted: dict, module: str) -> list[str]:
  """`module path: saved shape (this run: shape)` for each array of `wanted` the step holds with
  another shape or dtype kind, or not at all."""
  out = []
  for k, a in wanted.items():
    if k not in saved:
      out.append(f"{module} {k}: not in the step")
    elif tuple(saved[k].shape) != tuple(a.shape):
      out.append(f"{module} {k}: {tuple(saved[k].shape)} (this run: {tuple(a.shape)})")
  return out


def without(tree: dict, paths: set, prefix: str = "") -> dict:
  """The nested dicts of `tree` without the leaves whose paths (`a/b/c`) are in `paths`."""
  out = {}
  for k, v in tree.items():
    path = f"{prefix}{k}"
    if isinstance(v, dict):
      kept = without(v, paths, path + "/")
      if kept:
        out[k] = kept
    elif path not in paths:
      out[k] = v
  return out


def as_saved(target: jax.ShapeDtypeStruct, saved) -> jax.ShapeDtypeStruct:
  """`target` in the dtype `saved` (orbax's metadata of the stored array) was written in."""
  dtype = getattr(saved, "dtype", None) or target.dtype
  return jax.ShapeDtypeStruct(target.shape, dtype, sharding=target.sharding)


def bfloat16_if_exact(x: jax.Array) -> jax.Array:
  """`x` as bfloat16 where that holds its float32 values exactly, else `x`."""
  if x.dtype != jnp.float32:
    return x
  y = x.astype(jnp.bfloat16)
  return y if bool(jnp.all(y.astype(jnp.float32) == x)) else x


def compact_nbytes(x: jax.Array) -> int:
  """The bytes a `compact` save stores of `x`."""
  return bfloat16_if_exact(x).nbytes


def params_restore_dtype(stored_dtype):
  """The dtype a stored parameter is read back as: parameters are float32, and one stored as
  bfloat16 (a `compact` save) holds float32 values exactly."""
  return np.float32 if np.dtype(stored_dtype) == jnp.bfloat16 else None


def _group(path: str) -> str:
  """The parameter group of an optimizer-state path (`opt_state/inner_states/<group>/...`)."""
  parts = path.split("/")
  return parts[2] if len(parts) > 2 and parts[1] == "inner_states" else parts[-1]


def regrouped(meta: dict, cfg: Config, step: int, saved: dict, fresh: dict, opt: dict) -> list:
  """The note of a restore that mapped the optimizer state onto other trained groups."""
  new = sorted({_group(k) for keys in fresh.values() for k in keys})
  dropped = sorted({_group(k) for n, arrays in saved.items() for k in arrays
                    if k.startswith("opt_state/") and k not in opt[n]} - set(new))
  if not new and not dropped:
    return []
  was = meta["config"].get("optim", {})
  parts = []
  if new:
    parts.append(f"{', '.join(new)} start{'s' * (len(new) == 1)} with fresh optimizer state")
  if dropped:
    parts.append(f"{', '.join(dropped)} (now frozen) "
                 f"{'drops its' if len(dropped) == 1 else 'drop theirs'}")
  return [f"step {step} was trained with optim.freeze={was.get('freeze', '')!r}, this run has "
          f"{cfg.optim.freeze!r}: {'; '.join(parts)}; the step and the data position carry on."]
