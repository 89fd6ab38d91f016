"""Small utilities over pytrees of arrays (parameters, gradients, optimizer state)."""

import jax
import jax.numpy as jnp
import numpy as np


def path_str(path: tuple) -> str:
  """A leaf's key path as `a/b/c` (the form parameter rules and groups match)."""
  return jax.tree_util.keystr(path, simple=True, separator="/")


def paths(tree) -> dict[str, object]:
  """Leaves by their path (`params/blocks/0/w`: keys, attributes and indices alike, so a tree read
  back as plain dicts and lists names its leaves as the saved one did), in tree order."""
  return {path_str(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def kernel_params(params, prefix: str = "") -> int:
  """Parameters of matmul kernels under `prefix` (every `kernel` leaf): what a module's FLOP model
  counts (flops.py, each encoder's `flops`)."""
  total = 0
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    key = path_str(path)
    if key.endswith("kernel") and key.startswith(prefix):
      total += int(np.prod(leaf.shape))
  return total


def add(a, b):
  """Leafwise sum of two trees of the same structure."""
  return jax.tree.map(jnp.add, a, b)


def stack(trees: list):
  """Trees (one a microbatch) -> one tree of their arrays stacked on a leading axis [M, ...]."""
  return jax.tree.map(lambda *xs: jnp.stack(xs) if len(xs) > 1 else xs[0][None], *trees)
