"""Scalable data parallelism (data/loader.py): a process reads only the records of its devices,
and every module still sees the same samples in the same places."""

import numpy as np
import pytest

from mimo_jax import topology
from mimo_jax.data import loader, meta
from tests.helpers import tiny_config

TOPO = {"vision": (0, 4, 1), "language": (4, 2, 2)}  # 16 samples a microbatch, 48 image slots


@pytest.fixture(scope="module")
def setup(data_dir):
  cfg = tiny_config(data_dir, **TOPO)
  path = loader.build_paths(cfg)["train"]
  full = loader.train_dataset(cfg, path, 2)
  return cfg, path, [full[s] for s in range(3)]


def _scalable(cfg, path, where):
  ds = loader.train_dataset(cfg, path, 2, where)
  return [ds[s] for s in range(3)]


def _same(a, b, keys, rows=slice(None)):
  for k in keys:
    x, y = FIELDS[k](a), FIELDS[k](b)
    pick = (lambda x: x[:, rows]) if x.ndim > 1 else (lambda x: x)  # [M, ...] or [M]
    np.testing.assert_array_equal(pick(x), pick(y), err_msg=k)


FIELDS = {
    "ids_b": lambda b: b.samples.ids_b, "items_b": lambda b: b.samples.items_b,
    "answer_b": lambda b: b.samples.answer_b, "tokens_b": lambda b: b.samples.tokens_b,
    "tokens": lambda b: b.stats.tokens, "target_tokens": lambda b: b.stats.target_tokens,
    "images": lambda b: b.stats.items["vision"], "cost_spread": lambda b: b.stats.cost_spread,
    "tokens_rl": lambda b: b.text.tokens_rl, "targets_rl": lambda b: b.text.targets_rl,
    "loss_mask_rl": lambda b: b.text.loss_mask_rl, "positions_rl": lambda b: b.text.positions_rl,
    "pos_rl": lambda b: b.slots["vision"].pos_rl,
    "token_sample_rl": lambda b: b.text.token_sample_rl,
    "images_nhwc": lambda b: b.slots["vision"].inputs["images_nhwc"],
    "owner_nt": lambda b: b.slots["vision"].owner_nt,
}
GLOBAL = ("ids_b", "items_b", "answer_b", "tokens_b", "tokens", "target_tokens", "images",
          "cost_spread")
ROWS = ("tokens_rl", "targets_rl", "loss_mask_rl", "positions_rl", "pos_rl", "token_sample_rl")


def test_a_language_rank_reads_its_samples_only(setup):
  cfg, path, full = setup
  where = loader.Locality(groups=frozenset({1}), slots={})  # language dp rank 1 alone
  for want, got in zip(full, _scalable(cfg, path, where)):
    per_rank = cfg.data.micro_batch // 2
    np.testing.assert_array_equal(got.stats.records_read, per_rank)  # its share, not the batch
    _same(want, got, GLOBAL)
    _same(want, got, ROWS, rows=slice(per_rank, None))  # the rows of rank 1 are complete


def test_a_vision_rank_reads_the_samples_of_its_slots(setup):
  cfg, path, full = setup
  # vision dp rank 2 of 4
  where = loader.Locality(groups=frozenset(), slots={"vision": ((24, 36),)})
  for want, got in zip(full, _scalable(cfg, path, where)):
    owners = [len({int(i) for i in ids.ravel() if i >= 0})
              for ids in want.slots["vision"].owner_nt[:, 24:36]]
    np.testing.assert_array_equal(got.stats.records_read, owners)
    assert all(0 < n < cfg.data.micro_batch for n in owners)
    _same(want, got, GLOBAL)
    _same(want, got, ("images_nhwc", "owner_nt"), rows=slice(24, 36))


def test_a_process_holding_every_vision_slot_skips_text_only_samples(setup):
  cfg, path, full = setup
  where = loader.Locality(groups=frozenset(), slots=None)
  for want, got in zip(full, _scalable(cfg, path, where)):
    np.testing.assert_array_equal(got.stats.records_read, np.sum(want.samples.items_b > 0, axis=1))
    _same(want, got, ("images_nhwc", "owner_nt") + GLOBAL)


def test_locality_follows_the_topology(data_dir):
  cfg = tiny_config(data_dir, **TOPO)
  where = loader.locality(topology.build(cfg), loader.slot_counts(cfg))
  assert where.everything  # one process holds every device: it reads everything
  assert loader.Locality().needs(0, {})


def test_metadata_sidecar_matches_the_records(setup):
  cfg, path, _ = setup
  records = loader.Records(path, "digits")
  from mimo_jax.data.tokenizer import Tokenizer
  tok = Tokenizer()
  for i in range(0, len(records), 97):
    assert records.meta[i] == meta.row(records.read(i), tok)
