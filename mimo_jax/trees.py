"""Small utilities over pytrees of arrays (parameters, gradients, optimizer state)."""

import jax


def path_str(path: tuple) -> str:
  """A leaf's key path as `a/b/c` (the form parameter rules and groups match)."""
  return jax.tree_util.keystr(path, simple=True, separator="/")


def add(a, b):
  """Leafwise sum of two trees of the same structure."""
  return jax.tree.map(lambda x, y: x + y, a, b)
