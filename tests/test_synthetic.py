"""Synthetic VLM-shaped data (data/synthetic.py) and the realistic model features it feeds: many
images a sample, a large vocabulary, the pixel-shuffle projector."""

import signal

import numpy as np
import pytest
from array_record.python import array_record_module

from mimo_jax import output, train
from mimo_jax.config import ConfigError
from mimo_jax.data import loader, synthetic
from mimo_jax.data.layout import layout_microbatch
from mimo_jax.data.tokenizer import BOS, EOS, IMG, Tokenizer
from mimo_jax.validation import validate
from tests.configs import tiny_vlm
from tests.helpers import assert_close_trajectory, run_steps, image_layout


def _config(tmp_dir, topo=None, variant="encoder_heavy"):
  cfg = tiny_vlm.get_config(variant)
  cfg.data.dir = str(tmp_dir)
  cfg.data.train_samples, cfg.data.eval_samples = 96, 16
  if topo:
    for name, (o, dp, tp) in topo.items():
      t = getattr(cfg.topology, name)
      t.offset, t.dp, t.tp = o, dp, tp
  return cfg


@pytest.fixture(scope="module")
def synth_dir(tmp_path_factory):
  return tmp_path_factory.mktemp("synthetic")


def test_samples_follow_the_config(synth_dir):
  cfg = _config(synth_dir)
  validate(cfg, 8)
  path = loader.build_paths(cfg)["train"]
  assert loader.build_paths(cfg)["train"] == path  # built once, then reused
  ds = loader._source(path, "synthetic")  # pylint: disable=protected-access
  v, d = cfg.model.vision, cfg.data
  counts = []
  for i in range(len(ds)):
    _, s = ds[i]
    k = len(s["images"])
    counts.append(k)
    assert all(img.dtype == np.uint8 and img.shape == (16, 16, 3) for img in s["images"])
    assert np.sum(s["tokens"] == IMG) == k and np.all(s["tokens"][:k] == IMG)
    text = s["tokens"][k:]
    assert len(text) >= 1 and np.all((text >= synthetic.FIRST_TEXT_ID) &
                                      (text < cfg.model.language.vocab_size))
    assert 2 + k * v.tokens_per_image + len(text) <= d.seq_len + 1  # fits with bos and eos
  assert set(counts) <= set(range(4, 12)) and len(set(counts)) > 3  # 4..11 images, spread


def test_a_bad_record_names_file_and_index(tmp_path):
  path = str(tmp_path / "bad.array_record")
  writer = array_record_module.ArrayRecordWriter(path, "group_size:1")
  writer.write(synthetic.encode({"images": np.zeros((1, 4, 4, 3), np.uint8),
                                 "tokens": np.array([IMG, 9], np.int32)}))
  writer.write(b"\x05\x00\x00\x00{oops")
  writer.close()
  ds = loader._source(path, "synthetic")  # pylint: disable=protected-access
  assert [img.shape for img in ds[0][1]["images"]] == [(4, 4, 3)]
  with pytest.raises(ValueError, match=r"bad\.array_record: record 1 is not a valid synthetic"):
    ds[1]  # pylint: disable=pointless-statement


def test_a_build_stopped_midway_leaves_no_file(tmp_path, monkeypatch):
  """A signal while the shards are written (train.run stops a build at once) leaves no partial
  shard; the next run builds them whole."""
  made = synthetic.make_samples

  def stopped(*args):
    yield next(made(*args))
    raise output.Interrupted(signal.SIGINT)
  monkeypatch.setattr(synthetic, "make_samples", stopped)
  cfg = _config(tmp_path / "data")
  with pytest.raises(output.Interrupted):
    loader.build_paths(cfg)
  assert not list((tmp_path / "data").iterdir())
  monkeypatch.setattr(synthetic, "make_samples", made)
  assert sorted(loader.build_paths(cfg)) == ["eval", "train"]


def test_too_many_image_tokens_for_the_sequence_is_an_error():
  with pytest.raises(ValueError, match="raise data.seq_len"):
    list(synthetic.make_samples(4, 0, [0, 0, 1], [(4, 4)], 3, lambda h, w: 16, 32, 8, 0.5, 64))


def test_layout_of_token_samples_puts_the_loss_on_the_text():
  tpi = 4
  sample = {"images": np.full((2, 4, 4, 3), 7, np.uint8),
            "tokens": np.array([IMG, IMG, 20, 21, 22], np.int32)}
  layout = image_layout(seq_len=16, tokens_per_image=tpi, groups=1, slots=2, image_shape=(4, 4, 3))
  mb = layout_microbatch([sample], [5], layout, Tokenizer())
  n = 1 + 2 * tpi + 3  # bos, placeholders, text (eos is the last target)
  np.testing.assert_array_equal(mb.text.tokens_rl[0, :n], [BOS] + [IMG] * 8 + [20, 21, 22])
  np.testing.assert_array_equal(mb.text.targets_rl[0, :n], [IMG] * 8 + [20, 21, 22, EOS])
  # Targets from the last placeholder on: the three text tokens and eos.
  np.testing.assert_array_equal(np.flatnonzero(mb.text.loss_mask_rl[0]), np.arange(8, 12))
  images = mb.slots["vision"].inputs["images_nhwc"]
  assert images.dtype == np.uint8 and np.all(images == 7)


def test_synthetic_task_needs_a_vocabulary(synth_dir):
  cfg = _config(synth_dir)
  cfg.model.language.vocab_size = 0
  with pytest.raises(ConfigError, match=r"config\.model\.language\.vocab_size"):
    validate(cfg, 8)


def test_fan_in_with_pixel_shuffle_matches_single_device(synth_dir):
  """4-11 images a sample, 2x2 pixel shuffle, vocabulary 64: fan-in 4 -> dp2*tp2 against one
  device (float32)."""
  ref = run_steps(_config(synth_dir), 3)[0]
  assert ref[-1]["loss"] < ref[0]["loss"]
  got = run_steps(_config(synth_dir, {"vision": (0, 4, 1), "language": (4, 2, 2)}), 3)[0]
  assert_close_trajectory(ref, got, rtol=1e-4)


def test_training_run_on_synthetic_data_reports_eval_loss(synth_dir, tmp_path):
  cfg = _config(synth_dir, variant="default")
  cfg.run.workdir = str(tmp_path / "run")
  cfg.train.steps, cfg.run.log_every = 2, 1
  records = train.run(cfg)
  final = records[-1]
  assert np.isfinite(final["eval_loss"]) and "eval_accuracy" not in final
  assert all(np.isfinite(r["loss"]) for r in records if "loss" in r)
