"""Sequence packing: several samples a row as segments, with the unpacked loss trajectory."""

import numpy as np
import pytest

from mimo_jax.data import loader, meta
from mimo_jax.data.layout import layout_microbatch
from mimo_jax.data.tokenizer import IMG, PAD, Tokenizer
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
def test_packing_keeps_the_loss_trajectory(data_dir, single_reference, topo):
  cfg = tiny_config(data_dir, **topo)
  cfg.data.seq_len, cfg.data.pack_rows = 48, 10  # 16 samples a microbatch in 10 rows
  path = loader.build_paths(cfg)["train"]
  batch = loader.train_dataset(cfg, path, topo["language"][1])[0]
  assert batch.text.tokens_rl.shape[1] == 10
  assert_close_trajectory(single_reference, run_steps(cfg, 4)[0], rtol=1e-4)


def test_samples_with_their_own_loss_mask():
  """Token ids with a 0/1 loss mask (a conversation's assistant turns): no bos or eos is added,
  the loss falls on exactly the marked targets (never on image tokens), packed or not, and the
  per-record metadata that stubs are laid out with agrees with the full sample."""
  tokens = np.array([1, 9, IMG, 5, 6, 7, 8, 2], np.int32)
  mask = np.array([0, 0, 0, 0, 1, 1, 0, 1], np.int32)
  samples = [{"images": np.full((1, 8, 8), 3, np.uint8), "tokens": tokens, "loss_mask": mask}] * 2
  want = [9] + [IMG] * 4 + [5, 6, 7, 8, 2]  # the placeholder expanded to its 4 tokens
  want_loss = [0, 0, 0, 0, 0, 0, 1, 1, 0, 1]  # of each target (the tokens after the first)
  for pack_rows in (0, 2):
    layout = image_layout(seq_len=24, tokens_per_image=4, groups=2, slots=4, pack_rows=pack_rows)
    mb = layout_microbatch(samples, [10, 11], layout, Tokenizer())
    r, cols = np.nonzero(mb.text.token_sample_rl == 11)
    np.testing.assert_array_equal(mb.text.tokens_rl[r, cols], [1] + want[:-1])
    np.testing.assert_array_equal(mb.text.targets_rl[r, cols], want)
    np.testing.assert_array_equal(mb.text.loss_mask_rl[r, cols], want_loss)
    assert int(mb.stats.target_tokens) == 2 * sum(want_loss)
    stubs = layout_microbatch([{"meta": meta.row(s, Tokenizer())} for s in samples], [10, 11],
                              layout, Tokenizer())
    assert int(stubs.stats.tokens) == int(mb.stats.tokens) == 2 * len(want)
    assert int(stubs.stats.target_tokens) == int(mb.stats.target_tokens)
    np.testing.assert_array_equal(stubs.samples.answer_b, mb.samples.answer_b)
  bad = [dict(samples[0], loss_mask=mask[:-1])] * 2
  with pytest.raises(ValueError, match=r"sample 10: its loss_mask has 7 entries for 8 tokens"):
    layout_microbatch(bad, [10, 11], layout, Tokenizer())
