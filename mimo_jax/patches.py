"""Images as rows of patches, in the order the pixel shuffle needs.

The ViT sees an image of gh x gw patches as a sequence. With a pixel shuffle of s
(vision.downsample) each s x s block of neighbouring patches becomes one image token, so the
sequence lists the patches block by block: block (bi, bj) in row-major order, inside it (dy, dx) in
row-major order. Attention does not care about the order (positions are added explicitly), and the
shuffle is then a plain reshape of s*s consecutive patches, which also holds for several images
packed into one row (dynamic resolution, data/layout.py). Works on numpy and jax arrays alike.
"""

from __future__ import annotations

import numpy as np


def patchify(images_nhwc, patch: int, shuffle: int):
  """[n, h, w, c] -> [n, (h/p)*(w/p), p*p*c] in block order (see the module docstring)."""
  n, h, w, c = images_nhwc.shape
  p, s = patch, shuffle
  x = images_nhwc.reshape(n, h // (p * s), s, p, w // (p * s), s, p, c)
  x = x.transpose(0, 1, 4, 2, 5, 3, 6, 7)  # [n, bi, bj, dy, dx, py, px, c]
  return x.reshape(n, (h // p) * (w // p), p * p * c)


def grid_positions(rows: int, cols: int, shuffle: int, grid_cols: int) -> np.ndarray:
  """Position ids (row * grid_cols + col) of a rows x cols patch grid's patches in block order:
  an image smaller than the largest uses the top-left part of the position table."""
  r, c = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
  ids = (r * grid_cols + c).reshape(1, rows, cols, 1)
  return patchify(ids, 1, shuffle).reshape(-1).astype(np.int32)
