"""Per-record metadata beside every shard: what the layout needs without reading the record.

Scalable data parallelism (loader.py) reads only the records whose rows or image slots live on this
process's devices, yet the layout of a microbatch (which row and which slots each sample takes), the
cost-balanced reorder and the loss scale (1 / target tokens of the global batch) depend on every
sample of the step. They need three numbers a sample, kept in `<shard>.meta.npy` (int32 [records, 3]):

  images        images of the sample
  text_tokens   its tokens other than image placeholders, bos and eos included
  loss_tokens   its target tokens that carry loss

Shards are built with their sidecar; a shard without one gets it on first use (one full scan).
"""

from __future__ import annotations

import os

import numpy as np

from mimo_jax.data.layout import sample_tokens, text_length
from mimo_jax.data.tokenizer import Tokenizer

IMAGES, TEXT_TOKENS, LOSS_TOKENS = range(3)


def row(sample: dict, tok: Tokenizer) -> tuple[int, int, int]:
  seq, start = sample_tokens(tok, sample, 1)
  return len(sample["images"]), text_length(sample, tok), len(seq) - 1 - start


def path_of(shard: str) -> str:
  return shard + ".meta.npy"


def write(shard: str, samples) -> None:
  """Writes the sidecar of `shard` from its samples (in record order), atomically."""
  tok = Tokenizer()
  save(shard, [row(s, tok) for s in samples])


def save(shard: str, rows: list) -> None:
  tmp = path_of(shard) + ".tmp.npy"
  np.save(tmp, np.asarray(rows, np.int32).reshape(-1, 3))
  os.replace(tmp, path_of(shard))


def load(shard: str, count: int, read) -> np.ndarray:
  """The sidecar of `shard` ([count, 3]); built by scanning with `read(i)` if missing or stale."""
  path = path_of(shard)
  if os.path.exists(path):
    table = np.load(path)
    if table.shape == (count, 3):
      return table
  write(shard, (read(i) for i in range(count)))
  return np.load(path)
