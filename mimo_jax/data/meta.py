"""Per-record metadata beside every shard: what the layout needs without reading the record.

Scalable data parallelism (loader.py) reads only the records whose rows or image slots live on this
process's devices, yet the layout of a microbatch (which row and which slots each sample takes), the
cost-balanced reorder and the loss scale (1 / target tokens of the global batch) depend on every
sample of the step. They need three numbers a sample and the size of each image, kept in
`<shard>.meta.npy` (int32 [records, 3 + 2K], K the most images of a sample in the shard):

  images        images of the sample
  text_tokens   its tokens other than image placeholders, bos and eos included
  loss_tokens   its target tokens that carry loss (image placeholders excluded)
  h, w          height and width of image 0, 1, ... (0 past the sample's images)

Shards are built with their sidecar; a shard without one gets it on first use (one full scan).
"""

from __future__ import annotations

import os

import numpy as np

from mimo_jax.data.layout import sample_tokens, text_length
from mimo_jax.data.tokenizer import IMG, Tokenizer
from mimo_jax.encoders.vision import image_sizes

IMAGES, TEXT_TOKENS, LOSS_TOKENS = range(3)


def row(sample: dict, tok: Tokenizer) -> tuple[int, ...]:
  k = len(sample["images"])
  seq, start = sample_tokens(tok, sample, {IMG: [1] * k})
  sizes = [v for hw in image_sizes(sample) for v in hw]
  return (k, text_length(sample, tok, (IMG,)), len(seq) - 1 - start, *sizes)


def path_of(shard: str) -> str:
  return shard + ".meta.npy"


def write(shard: str, samples) -> None:
  """Writes the sidecar of `shard` from its samples (in record order), atomically."""
  tok = Tokenizer()
  save(shard, [row(s, tok) for s in samples])


def save(shard: str, rows: list) -> None:
  width = 3 + 2 * max((r[IMAGES] for r in rows), default=0)
  table = np.zeros((len(rows), width), np.int32)
  for i, r in enumerate(rows):
    table[i, :len(r)] = r
  tmp = path_of(shard) + ".tmp.npy"
  np.save(tmp, table)
  os.replace(tmp, path_of(shard))


def _current(table: np.ndarray, count: int) -> bool:
  """Whether a loaded sidecar has this format (one row a record, every image's size)."""
  return (table.ndim == 2 and table.shape[0] == count and table.shape[1] >= 3 and
          table.shape[1] == 3 + 2 * int(table[:, IMAGES].max(initial=0)))


def load(shard: str, count: int, read) -> np.ndarray:
  """The sidecar of `shard` ([count, 3 + 2K]); built by scanning with `read(i)` if missing or
  stale."""
  path = path_of(shard)
  if os.path.exists(path):
    table = np.load(path)
    if _current(table, count):
      return table
  write(shard, (read(i) for i in range(count)))
  return np.load(path)
