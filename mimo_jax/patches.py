"""Images as rows of patches, in the order the pixel shuffle needs.

The ViT sees an image of gh x gw patches as a sequence. With a pixel shuffle of s
(the tower's downsample) each s x s block of neighbouring patches becomes one image token, so the
sequence lists the patches block by block: block (bi, bj) in row-major order, inside it (dy, dx) in
row-major order. Attention does not care about the order (positions are added explicitly), and the
shuffle is then a plain reshape of s*s consecutive patches, which also holds for several images
packed into one row (dynamic resolution, data/layout.py). Works on numpy and jax arrays alike.

An image whose patch grid differs from the position table's (the tower's position_resize) takes
its positions either from the table's top-left part (`grid_positions`: ids into the table) or,
as Hugging Face's towers do with `interpolate_pos_encoding`, from the table resized bicubically
(`bicubic_taps`: 16 ids and weights a patch, torch's `interpolate(mode="bicubic",
align_corners=False)` as a weighted sum of table rows).
"""

from __future__ import annotations

import functools

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


def _cubic_taps(out: int, size: int) -> tuple[np.ndarray, np.ndarray]:
  """Source indices and weights [out, 4] of torch's bicubic resize of `size` samples to `out`
  (align_corners=False, Keys' kernel with a = -0.75, indices clamped to the edges)."""
  a = -0.75
  real = (np.arange(out) + 0.5) * (size / out) - 0.5
  first = np.minimum(np.floor(real), size - 1).astype(np.int64)
  t = np.clip(real - first, 0.0, 1.0)

  def near(x):  # |x| <= 1
    return ((a + 2) * x - (a + 3)) * x * x + 1

  def far(x):  # 1 < |x| < 2
    return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a

  weights = np.stack([far(t + 1), near(t), near(1 - t), far(2 - t)], axis=1)
  index = np.clip(first[:, None] + np.arange(-1, 3)[None], 0, size - 1)
  return index, weights


@functools.lru_cache(maxsize=256)
def bicubic_taps(rows: int, cols: int, grid: int, shuffle: int) -> tuple[np.ndarray, np.ndarray]:
  """Position ids [rows * cols, 16] into a grid x grid table and their weights (float32) for a
  rows x cols patch grid in block order: the table resized bicubically to rows x cols. At the
  table's own size the weights pick each row exactly once. Cached (the loader asks once an
  image): the arrays are read-only."""
  ri, rw = _cubic_taps(rows, grid)
  ci, cw = _cubic_taps(cols, grid)
  ids = ri[:, None, :, None] * grid + ci[None, :, None, :]  # [rows, cols, 4, 4]
  weights = rw[:, None, :, None] * cw[None, :, None, :]
  ids = patchify(ids.reshape(1, rows, cols, 16), 1, shuffle).reshape(-1, 16)
  weights = patchify(weights.reshape(1, rows, cols, 16), 1, shuffle).reshape(-1, 16)
  ids, weights = ids.astype(np.int32), weights.astype(np.float32)
  ids.flags.writeable = weights.flags.writeable = False
  return ids, weights
