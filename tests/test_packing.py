"""Sequence packing: several samples a row as segments, with the unpacked loss trajectory."""

import numpy as np
import pytest

from mimo_jax.data import loader
from mimo_jax.data.layout import layout_microbatch
from mimo_jax.data.tokenizer import PAD, Tokenizer
from tests.helpers import assert_close_trajectory, run_steps, tiny_config, image_layout
from tests.test_merge import _sample

SINGLE = {"vision": (0, 1, 1), "language": (0, 1, 1)}


def test_packed_rows_hold_segments_with_restarting_positions():
  samples = [_sample(i, k) for i, k in enumerate([1, 0, 2, 0, 1, 3, 0, 0])]
  layout = image_layout(seq_len=24, tokens_per_image=4, groups=2, slots=24, pack_rows=4)
  mb = layout_microbatch(samples, list(range(10, 18)), layout, Tokenizer())
  plain = layout_microbatch(samples, list(range(10, 18)),
                            image_layout(seq_len=24, tokens_per_image=4, groups=2, slots=24),
                            Tokenizer())
  assert mb.text.tokens_rl.shape == (4, 24)
  for b, sid in enumerate(range(10, 18)):
    r, cols = np.nonzero(mb.text.token_sample_rl == sid)
    assert len(set(r)) == 1 and r[0] // 2 == b // 4  # one row, of the sample's own rank
    n = int((plain.text.tokens_rl[b] != PAD).sum())
    np.testing.assert_array_equal(cols, cols[0] + np.arange(n))  # contiguous
    np.testing.assert_array_equal(mb.text.positions_rl[r[0], cols], np.arange(n))
    np.testing.assert_array_equal(mb.text.tokens_rl[r[0], cols], plain.text.tokens_rl[b, :n])
    np.testing.assert_array_equal(mb.text.loss_mask_rl[r[0], cols], plain.text.loss_mask_rl[b, :n])
    np.testing.assert_array_equal(mb.slots["vision"].pos_rl[r[0], cols],
                                  plain.slots["vision"].pos_rl[b, :n])
  assert mb.text.loss_mask_rl.sum() == plain.text.loss_mask_rl.sum()
  assert (mb.text.segment_ids_rl.max(axis=1) > 1).any()  # some row really holds several samples


def test_overfull_packed_rank_names_the_sample():
  samples = [_sample(i, 3) for i in range(8)]
  layout = image_layout(seq_len=24, tokens_per_image=4, groups=2, slots=24, pack_rows=2)
  with pytest.raises(ValueError, match=r"sample 1\d \(\d+ tokens\) does not fit.*data.pack_rows"):
    layout_microbatch(samples, list(range(10, 18)), layout, Tokenizer())


@pytest.mark.parametrize("topo", [pytest.param(SINGLE, id="single"),
                                  pytest.param({"vision": (0, 4, 1), "language": (4, 2, 2)},
                                               id="fan-in-tp")])
def test_packing_keeps_the_loss_trajectory(data_dir, topo):
  ref = run_steps(tiny_config(data_dir, **SINGLE), 4)[0]
  cfg = tiny_config(data_dir, **topo)
  cfg.data.seq_len, cfg.data.pack_rows = 48, 10  # 16 samples a microbatch in 10 rows
  path = loader.build_paths(cfg)["train"]
  batch = loader.train_dataset(cfg, path, topo["language"][1])[0]
  assert batch.text.tokens_rl.shape[1] == 10
  assert_close_trajectory(ref, run_steps(cfg, 4)[0], rtol=1e-4)
