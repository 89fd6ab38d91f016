"""grain pipelines: the global sample order and the per-step batches in slot layout.

Sample j of step s is element s * global_batch + j of one shuffled, endlessly repeated stream that
depends only on `data.seed`, never on the topology (DESIGN §2.3). The layout (slots per language dp
rank) is the only topology-dependent part, and it moves samples between slots, never between steps.
"""

from __future__ import annotations

import functools
from typing import Iterator

import grain
import numpy as np

from mimo_jax.config import Config, DataConfig
from mimo_jax.data import digits, reorder, synthetic
from mimo_jax.data.layout import Layout, layout_microbatch, stack, text_length
from mimo_jax.data.tokenizer import Tokenizer


DECODERS = {"digits": digits.decode, "synthetic": synthetic.decode}


def build_paths(cfg: Config, progress=None) -> dict[str, str]:
  """The task's train and eval shards, built on first use."""
  d, v = cfg.data, cfg.model.vision
  if d.task == "synthetic":
    return synthetic.build(d.dir, d.train_samples, d.eval_samples, d.probs(),
                           (v.image_size, v.image_size, v.channels), v.tokens_per_image, d.seq_len,
                           d.text_len, d.text_len_sigma, cfg.model.language.vocab_size, progress)
  return digits.build(d.dir, d.train_samples, d.eval_samples, d.probs())


def make_layout(cfg: Config, groups: int, slots: int, pack_rows: int = 0) -> Layout:
  v = cfg.model.vision
  return Layout(seq_len=cfg.data.seq_len, tokens_per_image=v.tokens_per_image, groups=groups,
                slots=slots, image_shape=(v.image_size, v.image_size, v.channels),
                pack_rows=pack_rows)


class _Decode(grain.transforms.Map):

  def __init__(self, path: str, task: str):
    self._path, self._decode = path, DECODERS[task]

  def map(self, element):
    index, record = element
    return index, self._decode(record, self._path, index)


def _source(path: str, task: str = "digits") -> grain.MapDataset:
  src = grain.sources.ArrayRecordDataSource([path])
  if len(src) == 0:
    raise ValueError(f"{path} holds no samples; delete it to rebuild, or check data.dir.")
  ds = grain.MapDataset.source(src)
  return ds.map_with_index(lambda i, r: (i, r)).map(_Decode(path, task))


def _layout_batch(elements, layout: Layout, tok: Tokenizer, id_of,
                  data: DataConfig) -> dict[str, np.ndarray]:
  """Lays out one microbatch, reordering its samples over language dp ranks if configured."""
  costs = [reorder.sample_cost(len(s["images"]), text_length(s, tok),
                               layout.tokens_per_image, data.image_token_cost,
                               data.text_token_cost) for _, s in elements]
  order = list(range(len(elements)))
  if data.reorder == "balance":
    order = reorder.balance(costs, layout.groups)
  elements = [elements[i] for i in order]
  out = layout_microbatch([s for _, s in elements], [id_of(i) for i, _ in elements], layout, tok)
  out["cost_spread"] = np.float32(reorder.spread(costs, order, layout.groups))
  out["cost_spread_in_order"] = np.float32(
      reorder.spread(costs, list(range(len(costs))), layout.groups))
  return out


def train_dataset(cfg: Config, path: str, lang_dp: int) -> grain.MapDataset:
  """Element s = step s's batch: arrays with a leading [microbatches] axis."""
  d = cfg.data
  layout = make_layout(cfg, lang_dp, d.slots(), d.pack_rows)
  tok = Tokenizer()
  ds = _source(path, d.task).shuffle(seed=d.seed).repeat()
  # Stream position = sample id: unique within a step, identical on every topology.
  ds = ds.map_with_index(lambda pos, el: (pos, el[1]))
  batch_fn = functools.partial(_layout_batch, layout=layout, tok=tok,
                               id_of=lambda pos: pos % (2**31 - 1), data=d)
  ds = ds.batch(d.micro_batch, batch_fn=batch_fn)
  return ds.batch(d.microbatches, batch_fn=stack)


def train_iterator(cfg: Config, path: str, lang_dp: int, start_step: int = 0) -> Iterator[dict]:
  ds = train_dataset(cfg, path, lang_dp)[start_step:]
  opts = grain.ReadOptions(num_threads=cfg.data.workers, prefetch_buffer_size=2 * cfg.data.workers)
  return iter(ds.to_iter_dataset(opts) if cfg.data.workers else ds)


def eval_batches(cfg: Config, path: str, lang_dp: int) -> list[dict[str, np.ndarray]]:
  """The first `eval.samples` eval samples in file order, in batches of `eval.batch`.

  The last batch is padded with empty rows (sample id -1, no loss, no accuracy), never truncated.
  """
  n, bsz = cfg.eval.samples, cfg.eval.batch
  layout = make_layout(cfg, lang_dp, bsz * cfg.data.max_images)
  tok = Tokenizer()
  ds = _source(path, cfg.data.task)
  if n > len(ds):
    raise ValueError(f"eval.samples={n} but {path} holds only {len(ds)} samples; lower "
                     "eval.samples or raise data.eval_samples.")
  out = []
  for start in range(0, n, bsz):
    stop = min(start + bsz, n)
    elements = [ds[i] for i in range(start, stop)]
    samples = [s for _, s in elements] + [None] * (bsz - (stop - start))
    ids = list(range(start, stop)) + [-1] * (bsz - (stop - start))
    out.append(layout_microbatch(samples, ids, layout, tok))
  return out
