"""Cost-based reordering: samples over ranks (even ranks, same loss, same samples per module) and
a step's microbatches (Johnson's rule, slot buckets)."""

import itertools
import re

import numpy as np
import pytest

from mimo_jax.data import capacity, loader, reorder
from tests.helpers import assert_close_trajectory, run_steps, tiny_config

FAN_IN = {"vision": (0, 4, 1), "language": (4, 2, 2)}


def test_balance_is_a_permutation_with_equal_group_sizes():
  rng = np.random.default_rng(0)
  for groups in (1, 2, 4, 8):
    costs = list(rng.integers(0, 50, size=32).astype(float))
    order = reorder.balance(costs, groups)
    assert sorted(order) == list(range(32))
    assert reorder.spread(costs, order, groups) <= reorder.spread(costs, list(range(32)), groups)


def test_balance_evens_a_skewed_microbatch():
  costs = [40.0] * 8 + [2.0] * 8  # stream order puts every heavy sample on rank 0
  assert reorder.spread(costs, list(range(16)), 2) == pytest.approx(40 * 8 / (21 * 8))
  assert reorder.spread(costs, reorder.balance(costs, 2), 2) == 1.0


@pytest.mark.parametrize("lang_dp", [2, 4])
def test_reorder_keeps_the_samples_and_their_images(data_dir, lang_dp):
  cfg = tiny_config(data_dir, vision=(0, 4, 1), language=(4, lang_dp, 1))
  path = loader.build_paths(cfg)["train"]
  plain = loader.train_dataset(cfg, path, lang_dp)[0]
  cfg.data.reorder = "balance"
  balanced = loader.train_dataset(cfg, path, lang_dp)[0]
  for m in range(cfg.data.microbatches):
    a = {int(s): i for i, s in enumerate(plain.samples.ids_b[m])}
    b = {int(s): i for i, s in enumerate(balanced.samples.ids_b[m])}
    assert set(a) == set(b)
    for sid in a:
      np.testing.assert_array_equal(plain.text.tokens_rl[m][a[sid]],
                                    balanced.text.tokens_rl[m][b[sid]])
      mine = lambda b: (b.slots["vision"].inputs["images_nhwc"][m]
                        [b.slots["vision"].owner_nt[m][:, 0] == sid])
      np.testing.assert_array_equal(mine(plain), mine(balanced))
    assert balanced.stats.cost_spread[m] <= plain.stats.cost_spread[m]
  assert balanced.stats.cost_spread.mean() < plain.stats.cost_spread.mean()


def test_reorder_keeps_the_loss_trajectory(data_dir, single_reference):
  cfg = tiny_config(data_dir, **FAN_IN)
  cfg.data.reorder = "balance"
  assert_close_trajectory(single_reference, run_steps(cfg, 4)[0], rtol=1e-4)


def test_reorder_lets_fewer_slots_fit(data_dir):
  """Balanced ranks need fewer image slots than stream order for the same data."""
  cfg = tiny_config(data_dir, **FAN_IN)
  path = loader.build_paths(cfg)["train"]

  def fits(slots: int, mode: str) -> bool:
    cfg.model.vision.image_slots, cfg.data.reorder = slots, mode
    try:
      ds = loader.train_dataset(cfg, path, 2)
      for s in range(8):
        ds[s]
    except ValueError as e:
      assert "raise model.vision.image_slots" in str(e)
      return False
    return True

  need = {mode: next(s for s in range(4, 16 * 3 + 1, 4) if fits(s, mode))
          for mode in ("none", "balance")}
  assert need["balance"] < need["none"]  # 36 vs 44 of 48 slots with these seeds


def _makespan(order, a, b):
  """Two machines in series: each job on the first, then on the second."""
  t1 = t2 = 0.0
  for i in order:
    t1 += a[i]
    t2 = max(t2, t1) + b[i]
  return t2


def test_pipeline_order_is_the_shortest_two_stage_schedule():
  rng = np.random.default_rng(0)
  for _ in range(50):
    n = int(rng.integers(2, 7))
    a, b = rng.uniform(0.1, 2, n).tolist(), rng.uniform(0.1, 2, n).tolist()
    best = min(_makespan(p, a, b) for p in itertools.permutations(range(n)))
    got = reorder.pipeline_order(a, b)
    assert sorted(got) == list(range(n))
    assert _makespan(got, a, b) == pytest.approx(best)


def test_slot_buckets_hold_the_used_slots_and_split_over_vision_dp():
  for used in range(0, 13):
    for buckets in (1, 2, 3, 4, 12):
      size = reorder.bucket(used, 12, buckets, groups=2, split=4)
      assert max(used, 1) <= size <= 12 and (2 * size) % 4 == 0
  assert [reorder.bucket(u, 12, 4, 1) for u in (0, 3, 4, 7, 12)] == [3, 3, 6, 9, 12]


def test_balance_rejects_groups_that_do_not_divide_the_samples():
  with pytest.raises(ValueError, match="do not split evenly over 3 groups"):
    reorder.balance([1.0] * 8, 3)


def test_pack_keeps_microbatch_sizes_and_lowers_the_cost():
  """Samples of lengths that stream order packs badly: pack swaps them into fuller microbatches,
  each still of n / m samples, never breaking `fits`."""
  rng = np.random.default_rng(0)
  for trial in range(20):
    lengths = list(rng.integers(5, 40, size=16))

    def evaluate(members, lengths=lengths):
      rows = loader.first_fit(sorted((lengths[i] for i in members), reverse=True), 48)
      return float(rows), rows <= 3

    stream = [tuple(range(k * 4, (k + 1) * 4)) for k in range(4)]
    if not all(evaluate(g)[1] for g in stream):
      continue
    perm = reorder.pack(16, 4, evaluate)
    assert sorted(perm) == list(range(16)), trial
    groups = [tuple(perm[k * 4:(k + 1) * 4]) for k in range(4)]
    assert all(evaluate(g)[1] for g in groups), trial
    assert sum(evaluate(g)[0] for g in groups) <= sum(evaluate(g)[0] for g in stream), trial
  lengths = [40, 40, 8, 8, 40, 40, 8, 8]  # stream: 3 + 3 rows; best: 2 + 2 (a 40 and an 8 a row)
  evaluate = lambda g: (float(loader.first_fit(sorted((lengths[i] for i in g), reverse=True),
                                               48)), True)
  perm = reorder.pack(8, 2, evaluate)
  assert sum(evaluate(tuple(perm[k * 4:(k + 1) * 4]))[0] for k in range(2)) == 4


def _packed_config(data_dir, fill, **topo):
  cfg = tiny_config(data_dir, **topo)
  cfg.data.seq_len, cfg.data.pack_rows, cfg.data.row_buckets = 48, 10, 10
  cfg.data.slot_buckets, cfg.data.microbatches = 4, 4
  cfg.data.microbatch_fill = fill
  return cfg


@pytest.mark.parametrize("topo", [pytest.param({"vision": (0, 1, 1), "language": (0, 1, 1)},
                                               id="single"),
                                  pytest.param(FAN_IN, id="fan-in-tp")])
def test_microbatch_fill_pack_sends_less_padding_with_the_same_samples(data_dir, topo):
  """Each step holds the same samples (each with the same tokens and images) in stream and pack
  order; pack fits in the fewest rows and slots that check_capacity accepts for it, and sends
  less padded work (rows and slots, the cost model's tokens) over the run."""
  G, steps, least = topo["language"][1], 6, {}
  for fill in ("stream", "pack"):
    cfg = _packed_config(data_dir, fill, **topo)
    path = loader.build_paths(cfg)["train"]
    cfg.data.pack_rows = cfg.model.vision.image_slots = G  # then the fewest check_capacity accepts
    for _ in range(2):
      try:
        capacity.check_capacity(cfg, path, G, 0, steps)
      except capacity.CapacityError as e:
        section, field, value = re.search(r"set (data|model\.vision)\.(\w+)=(\d+)",
                                          str(e)).groups()
        setattr(cfg.data if section == "data" else cfg.model.vision, field, int(value))
    assert cfg.data.pack_rows > G and cfg.model.vision.image_slots > G
    assert capacity.check_capacity(cfg, path, G, 0, steps)
    least[fill] = (cfg.data.pack_rows, cfg.model.vision.image_slots)
    cfg.data.pack_rows -= G
    with pytest.raises(capacity.CapacityError, match="data.pack_rows"):
      capacity.check_capacity(cfg, path, G, 0, steps)
  batches, work = {}, {}
  for fill in ("stream", "pack"):
    cfg = _packed_config(data_dir, fill, **topo)
    cfg.data.pack_rows, cfg.model.vision.image_slots = least[fill]
    ds = loader.train_dataset(cfg, loader.build_paths(cfg)["train"], G)
    batches[fill] = [ds[s] for s in range(steps)]  # a rank whose rows or slots overflow raises
    # The same capacity for both, to compare the padding they send.
    cfg.data.pack_rows, cfg.model.vision.image_slots = (max(v) for v in zip(*least.values()))
    ds = loader.train_dataset(cfg, loader.build_paths(cfg)["train"], G)
    slot_tokens = loader.make_layout(cfg, G).encoder("vision").slot_tokens
    work[fill] = sum(int(b.text.rows_sent.sum()) * cfg.data.seq_len +
                     int(b.slots["vision"].sent.sum()) * slot_tokens
                     for b in (ds[s] for s in range(steps)))
  for a, b in zip(batches["stream"], batches["pack"]):
    ids = lambda x: sorted(int(s) for s in x.samples.ids_b.ravel() if s >= 0)
    assert ids(a) == ids(b)
    tokens = lambda x: {int(s): x.samples.tokens_b[m][i] for m in range(x.microbatches)
                        for i, s in enumerate(x.samples.ids_b[m]) if s >= 0}
    assert tokens(a) == tokens(b)
  assert work["pack"] < work["stream"], work


@pytest.fixture(scope="module")
def packed_stream_reference(data_dir) -> list[dict]:
  return run_steps(_packed_config(data_dir, "stream", vision=(0, 1, 1), language=(0, 1, 1)),
                   4)[0]


@pytest.mark.parametrize("topo", [pytest.param({"vision": (0, 1, 1), "language": (0, 1, 1)},
                                               id="single"),
                                  pytest.param(FAN_IN, id="fan-in-tp")])
def test_microbatch_fill_pack_keeps_the_loss_trajectory(data_dir, packed_stream_reference, topo):
  assert_close_trajectory(packed_stream_reference,
                          run_steps(_packed_config(data_dir, "pack", **topo), 4)[0], rtol=1e-4)
