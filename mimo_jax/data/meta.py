"""Per-record metadata beside every shard: what the layout needs without reading the record.

Scalable data parallelism (loader.py) reads only the records whose rows or slots live on this
process's devices, yet the layout of a microbatch (which row and which slots each sample takes), the
cost-balanced reorder and the loss scale (1 / target tokens of the global batch) depend on every
sample of the step. They need two numbers a sample and the size of each of its items, for every
registered encoder (`encoders.Encoder.item_sizes`; images: (h, w)). `<shard>.meta.npz` holds, for R
records:

  text_tokens     int32 [R]           tokens other than placeholders, bos and eos included
  loss_tokens     int32 [R]           target tokens that carry loss (placeholders excluded)
  max_token       int32 [R]           the largest token id of the record, placeholders included
                                      (-1: none); absent from sidecars written before it
  <name>.count    int32 [R]           items of encoder <name> (0 where a sample has none)
  <name>.sizes    int32 [R, K, F]     their sizes (K: the most items of a sample; F: the
                                      encoder's size fields)

Shards are built with their sidecar; a shard without one, or with one that lacks an encoder the run
uses, gets it on first use (one full scan). `max_token` lets validation check the data's token ids
against the model's vocabulary without reading a record; an older sidecar without it stays valid
(no rescan of a large dataset), and then only the manifest's vocabulary is checked.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from mimo_jax import encoders
from mimo_jax.data.text import Vocabulary, sample_tokens, text_length

FORMAT = 2


@dataclasses.dataclass(frozen=True)
class Meta:
  """One record's metadata: a stub `{"meta": Meta}` takes the record's row and slots."""
  text_tokens: int
  loss_tokens: int
  sizes: dict[str, tuple[tuple[int, ...], ...]]  # encoder -> each item's size
  max_token: int = -1  # the largest token id (-1: none, or a sidecar without the column)


def row(sample: dict, tok: Vocabulary | None,
        placeholders: dict[str, int] | None = None) -> Meta:
  """The metadata of a full sample, for every registered encoder whose items it lists (each
  marked by its placeholder, or by `placeholders[name]`). `tok` is the task's vocabulary (None
  for a sample with its own loss mask, which needs none)."""
  present = [e for e in encoders.REGISTRY.values() if e.sample_key in sample]
  mark = {e.name: (placeholders or {}).get(e.name, e.placeholder) for e in present}
  # Every registered encoder has its entry, () where the sample lists none, as the sidecar stores.
  sizes = {e.name: tuple(tuple(int(v) for v in s) for s in e.item_sizes(sample))
           if e in present else () for e in encoders.REGISTRY.values()}
  _, loss = sample_tokens(tok, sample, {mark[e.name]: [1] * len(sizes[e.name])
                                        for e in present})
  ids = tok.encode(sample["text"]) if "text" in sample else sample["tokens"]
  return Meta(text_length(sample, tok, tuple(mark.values())), int(loss.sum()), sizes,
              int(np.max(ids, initial=-1)))


def path_of(shard: str) -> str:
  return shard + ".meta.npz"


def write(shard: str, samples, tok: Vocabulary | None,
          placeholders: dict[str, int] | None = None) -> None:
  """Writes the sidecar of `shard` from its samples (in record order, of the task whose
  vocabulary is `tok`, items marked as `row` says), atomically."""
  save(shard, [row(s, tok, placeholders) for s in samples])


def save(shard: str, rows: list[Meta]) -> None:
  arrays = {"format": np.int32(FORMAT),
            "text_tokens": np.asarray([r.text_tokens for r in rows], np.int32).reshape(-1),
            "loss_tokens": np.asarray([r.loss_tokens for r in rows], np.int32).reshape(-1),
            "max_token": np.asarray([r.max_token for r in rows], np.int32).reshape(-1)}
  for e in encoders.REGISTRY.values():
    sizes = [r.sizes.get(e.name, ()) for r in rows]
    k = max((len(s) for s in sizes), default=0)
    table = np.zeros((len(rows), k, e.size_fields), np.int32)
    for i, s in enumerate(sizes):
      if s:
        table[i, :len(s)] = s
    arrays[f"{e.name}.count"] = np.asarray([len(s) for s in sizes], np.int32).reshape(-1)
    arrays[f"{e.name}.sizes"] = table
  tmp = path_of(shard) + ".tmp.npz"
  with open(tmp, "wb") as f:
    np.savez(f, **arrays)
  os.replace(tmp, path_of(shard))


class Table:
  """A loaded sidecar: `table[i]` is record i's `Meta`."""

  def __init__(self, arrays: dict[str, np.ndarray]):
    self.text_tokens, self.loss_tokens = arrays["text_tokens"], arrays["loss_tokens"]
    self.max_token = arrays.get("max_token")  # None in a sidecar written before the column
    self.names = tuple(k[:-len(".count")] for k in arrays if k.endswith(".count"))
    self.count = {n: arrays[f"{n}.count"] for n in self.names}
    self.sizes = {n: arrays[f"{n}.sizes"] for n in self.names}

  def __len__(self) -> int:
    return len(self.text_tokens)

  def __getitem__(self, i: int) -> Meta:
    return Meta(int(self.text_tokens[i]), int(self.loss_tokens[i]),
                {n: tuple(tuple(int(v) for v in s) for s in self.sizes[n][i, :self.count[n][i]])
                 for n in self.names},
                -1 if self.max_token is None else int(self.max_token[i]))


def _read(path: str, count: int, names) -> Table | None:
  """The sidecar at `path` if it has this format, one row a record and every encoder in `names`."""
  try:
    with np.load(path) as z:
      arrays = {k: z[k] for k in z.files}
  except (OSError, ValueError, EOFError):
    return None
  if int(arrays.get("format", -1)) != FORMAT or "text_tokens" not in arrays:
    return None
  table = Table(arrays)
  if len(table) != count or any(n not in table.names for n in names):
    return None
  return table


def load(shard: str, count: int, read, names=(), tok: Vocabulary | None = None,
         placeholders: dict[str, int] | None = None) -> Table:
  """The sidecar of `shard` (`count` records, items of the encoders in `names`); built by scanning
  with `read(i)` if missing, stale or of another format (`tok`: the task's vocabulary, which
  samples without their own loss mask need; `placeholders`: the ids that mark items, as `row`
  takes them, for converted data)."""
  path = path_of(shard)
  if os.path.exists(path):
    table = _read(path, count, names)
    if table is not None:
      return table
  write(shard, (read(i) for i in range(count)), tok, placeholders)
  table = _read(path, count, names)
  if table is None:
    missing = [n for n in names if n not in encoders.REGISTRY]
    raise ValueError(f"{path}: could not build the metadata of {shard} for encoders "
                     f"{', '.join(names)}" + (f" ({', '.join(missing)} not registered)"
                                              if missing else "") + ".")
  return table
