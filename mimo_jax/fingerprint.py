"""Fingerprints of saved arrays: two 32-bit sums of each array's bits, the same on any layout.

For the bits b_i of element i (row-major index, 32-bit words; 16- and 8-bit types widened, 64-bit
types as two words), the fingerprint is (Σ b_i, Σ b_i·(2i + 1)) modulo 2³². Integer sums do not
depend on the order of addition, so a sharded array gives the same pair as its host copy, on every
topology; the second sum also catches values that moved. A save computes them on the devices (one
read of each array) and stores them with the step; a restore and `tools.ckpt check` recompute them
from what they read.
"""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np

from mimo_jax import distributed, trees


def _words(x):
  """The bits of `x` as uint32 words (jnp or np, by `x`'s kind; 64-bit types as [..., 2])."""
  xp = np if isinstance(x, np.ndarray) else jnp
  x = xp.asarray(x)
  if x.dtype == bool:
    return x.astype(xp.uint32)
  size = x.dtype.itemsize
  if size == 8:
    return _bitcast(xp, x, np.uint32)  # [..., 2]
  kind = {4: np.uint32, 2: np.uint16, 1: np.uint8}[size]
  return _bitcast(xp, x, kind).astype(xp.uint32)


def _bitcast(xp, x, dtype):
  if xp is jnp:
    return jax.lax.bitcast_convert_type(x, dtype)
  out = np.ascontiguousarray(x)[..., None].view(dtype)  # [..., 1] or, for 64 bits, [..., 2]
  return out if x.dtype.itemsize == 8 else out[..., 0]


def _index(xp, shape):
  """Row-major element index of every position, as uint32 (wrapping)."""
  index = xp.zeros(shape, xp.uint32)
  stride = 1
  for axis in reversed(range(len(shape))):
    iota = (jax.lax.broadcasted_iota(jnp.uint32, shape, axis) if xp is jnp else
            np.broadcast_to(np.arange(shape[axis], dtype=np.uint32).reshape(
                [-1 if a == axis else 1 for a in range(len(shape))]), shape))
    index = index + iota * xp.uint32(stride % 2**32)
    stride *= shape[axis]
  return index


def of(x) -> tuple:
  """(Σ b_i, Σ b_i·(2i + 1)) mod 2³² of one array (jnp inside a jit, or numpy on the host)."""
  xp = np if isinstance(x, np.ndarray) or np.isscalar(x) else jnp
  words = _words(x)
  index = _index(xp, words.shape)
  weighted = words * (index * xp.uint32(2) + xp.uint32(1))
  with np.errstate(over="ignore"):
    return (xp.sum(words, dtype=xp.uint32), xp.sum(weighted, dtype=xp.uint32))


paths = trees.paths  # leaves by their path, as checkpoints name them


@jax.jit
def _device(leaves):
  return [jnp.stack(of(x)) for x in leaves]


def on_device(tree) -> dict[str, list[int]]:
  """Fingerprints of every leaf of a tree of device arrays, computed on their devices."""
  named = paths(tree)
  fps = distributed.fetch(_device(list(named.values())))
  return {k: [int(v[0]), int(v[1])] for k, v in zip(named, fps)}


def compile_ahead(trees: list[dict]) -> threading.Thread:
  """Compiles, in a thread, the programs `on_device` will run on each of `trees` (path ->
  ShapeDtypeStruct with its sharding, as the arrays will be when read): a restore starts it
  before its read and joins it after, so that the compiles take none of the restore's time. A
  compile that fails here is left to `on_device`, which compiles again and raises."""
  def compile_all():
    for tree in trees:
      try:
        _device.lower(list(paths(tree).values())).compile()
      except Exception:  # pylint: disable=broad-except
        pass
  thread = threading.Thread(target=compile_all, name="fingerprint-compile", daemon=True)
  thread.start()
  return thread


def on_host(tree) -> dict[str, list[int]]:
  """The same fingerprints of a tree of host arrays."""
  return {k: [int(v) for v in of(np.asarray(x))] for k, x in paths(tree).items()}
