"""Hugging Face checkpoints read into our modules reproduce transformers' outputs (float32, 1e-5
relative). The fixtures are tiny random models saved by transformers, with its outputs on fixed
inputs (tools/hf_fixtures.py writes them; no torch needed here)."""

import pathlib

import jax
import numpy as np
import pytest

from mimo_jax import hf
from mimo_jax.config import Config, ConfigError, set_layout
from mimo_jax.encoders.vision import VisionConfig
from mimo_jax.data import loader
from mimo_jax.data.layout import layout_microbatch
from mimo_jax.data.tokenizer import IMG, Tokenizer
from mimo_jax import modules
from mimo_jax import whole
from mimo_jax.encoders import vision as vision_encoder
from mimo_jax.validation import validate
from tests.helpers import run_steps

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "hf"
LANGUAGE = ("llama3", "llama31", "llama32_tied", "qwen2")
VISION = ("siglip", "clip")
LLAVA = ("llava15", "llava_siglip")


def _config(src: hf.Source) -> Config:
  cfg = Config()
  cfg.add_encoder("vision", VisionConfig())
  cfg.data.task, cfg.model.vision.max_images, cfg.data.image_probs = "synthetic", 1, "0.5,0.5"
  cfg.model.language.vocab_size = 64  # a lone tower's (unused) language model
  hf.configure(cfg, src)
  validate(cfg)
  return cfg


def _params(src: hf.Source, cfg: Config, module: str) -> dict:
  return hf.load(src, module, cfg, modules.build_modules(cfg)[module].init(0))


def _close(ours, theirs, rtol=1e-5):
  """Relative to the reference's scale: max |ours - theirs| <= rtol * max |theirs|."""
  ours, theirs = np.asarray(ours), np.asarray(theirs)
  assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
  err = np.abs(ours - theirs).max() / np.abs(theirs).max()
  assert err <= rtol, err


@pytest.mark.parametrize("name", LANGUAGE)
def test_language_models_match_transformers(name):
  src = hf.Source.open(FIXTURES / name)
  ref = np.load(src.path / "reference.npz")
  cfg = _config(src)
  logits = whole.language_logits(cfg, _params(src, cfg, "language"), ref["input_ids"])
  _close(logits, ref["logits"])


@pytest.mark.parametrize("name", VISION)
def test_vision_towers_match_transformers(name):
  src = hf.Source.open(FIXTURES / name)
  ref = np.load(src.path / "reference.npz")
  cfg = _config(src)
  params = _params(src, cfg, "vision")
  hidden = vision_encoder.hidden_states(cfg, params, ref["pixels"])
  if cfg.model.vision.final_norm:  # SigLIP's last_hidden_state is after post_layernorm
    hidden = modules.build_modules(cfg)["vision"].bind(params).norm(hidden)
  _close(hidden, ref["last_hidden_state"])


@pytest.mark.parametrize("name", VISION)
def test_vision_towers_off_the_grid_match_transformers_interpolation(name):
  """Images of another patch grid than the position table's (smaller and not square, larger):
  position_resize=bicubic (set by the import) equals interpolate_pos_encoding=True."""
  src = hf.Source.open(FIXTURES / name)
  ref = np.load(src.path / "reference.npz")
  cfg = _config(src)
  assert cfg.model.vision.position_resize == "bicubic"
  params = _params(src, cfg, "vision")
  model = modules.build_modules(cfg)["vision"].bind(params)
  sizes = sorted(k[len("pixels_"):] for k in ref.files if k.startswith("pixels_"))
  assert sizes == ["24x20", "8x12"]
  for size in sizes:
    hidden = vision_encoder.hidden_states(cfg, params, ref[f"pixels_{size}"])
    if cfg.model.vision.final_norm:
      hidden = model.norm(hidden)
    _close(hidden, ref[f"last_hidden_state_{size}"])


@pytest.mark.parametrize("name", LLAVA)
def test_llava_matches_transformers(name):
  src = hf.Source.open(FIXTURES / name)
  ref = np.load(src.path / "reference.npz")
  cfg = _config(src)
  tokens = vision_encoder.image_tokens(cfg, _params(src, cfg, "vision"), ref["pixels"])
  logits = whole.merged_logits(cfg, _params(src, cfg, "language"), ref["input_ids"], tokens,
                               src.config["image_token_index"])
  _close(logits, ref["logits"])
  np.testing.assert_allclose(whole.next_token_loss(logits, ref["labels"]), ref["loss"],
                             rtol=1e-5)


def _llava_run_config(tmp_path) -> Config:
  """A training run on synthetic data that starts both modules from the LLaVA-1.5 fixture."""
  src = hf.Source.open(FIXTURES / "llava15")
  cfg = _config(src)
  cfg.model.vision.init_from = cfg.model.language.init_from = str(src.path)
  d = cfg.data
  d.dir, d.train_samples, d.eval_samples, d.global_batch, d.microbatches = str(tmp_path), 64, 8, 8, 2
  d.seq_len, d.text_len, d.image_probs = 40, 12, "0.25,0.75"
  cfg.model.vision.max_images = 1
  cfg.optim.warmup_steps, cfg.eval.samples, cfg.eval.batch = 1, 8, 8
  validate(cfg, len(jax.devices()))
  return cfg


@pytest.mark.parametrize("layout,shard", [
    pytest.param("", "none", id="one-device"),
    pytest.param("vision=0/2/1,language=2/2/1", "full", id="fsdp-split"),  # each tensor split
    # Stacked layers written layer by layer into arrays split over tp and pp.
    pytest.param("vision=0/1/2,language=2/1/2/2", "none", id="tp-pp"),
])
def test_a_run_starts_from_hf_weights_and_freeze_trains_only_the_projector(tmp_path, layout,
                                                                           shard):
  cfg = _llava_run_config(tmp_path)
  cfg.optim.freeze = "vision,language"  # LLaVA's stage 1: the projector alone
  if layout:
    set_layout(cfg, layout)
    cfg.topology.vision.shard = cfg.topology.language.shard = shard
  src = hf.Source.open(cfg.model.vision.init_from)
  _, _, state, init = run_steps(cfg, 2)
  for module in ("vision", "language"):
    split = [a for a in jax.tree.leaves(state[module].params) if "dp" in a.sharding.spec]
    assert bool(split) == (shard == "full"), module
    want = dict(hf.flatten(_params(src, cfg, module)))
    got = dict(hf.flatten(init[module]))
    assert set(got) == set(want)
    for path, x in want.items():  # the run started from the checkpoint's weights exactly
      np.testing.assert_array_equal(got[path], x, err_msg="/".join(path))
    after = dict(hf.flatten(jax.device_get(state[module].params)))
    for path, x in got.items():
      moved = not np.array_equal(after[path], x)
      assert moved == (path[0] == "projector"), ("/".join(path), moved)


@pytest.mark.parametrize("name", LLAVA)
def test_the_first_training_step_has_transformers_loss(tmp_path, name):
  """The reference batch laid out as training samples (each run of image tokens one placeholder,
  the labels as a loss mask, the pixels as bytes): the run's first loss, through the layout, the
  slots, the bridge and the step, is transformers' loss."""
  src = hf.Source.open(FIXTURES / name)
  ref = np.load(src.path / "reference.npz")
  cfg = _llava_run_config(tmp_path)
  cfg.model.vision.init_from = cfg.model.language.init_from = str(src.path)
  hf.configure(cfg, src)
  cfg.data.global_batch, cfg.data.microbatches = len(ref["input_ids"]), 1
  cfg.data.seq_len, cfg.eval.samples, cfg.eval.batch = ref["input_ids"].shape[1], 2, 2
  image = src.config["image_token_index"]
  samples = []
  for ids, labels, pixels in zip(ref["input_ids"], ref["labels"], ref["pixels"]):
    first = ids != image
    first[1:] |= ids[1:] != ids[:-1]  # the first token of each run of image tokens stays
    samples.append({"tokens": np.where(ids == image, IMG, ids)[first].astype(np.int32),
                    "loss_mask": (labels != -100)[first].astype(np.int32),
                    "images": [np.rint(pixels * 255).astype(np.uint8)]})
    assert list(samples[-1]["tokens"]).count(IMG) == 1

  def batches(groups):
    layout = loader.make_layout(cfg, groups)
    mb = layout_microbatch(samples, list(range(len(samples))), layout, Tokenizer())
    return [loader._step_batch([mb], cfg, layout)]  # pylint: disable=protected-access

  metrics = run_steps(cfg, 1, batches)[0]
  np.testing.assert_allclose(float(metrics[0]["loss"]), float(ref["loss"]), rtol=1e-5)


def test_init_from_that_contradicts_the_config_is_one_error(tmp_path):
  cfg = _llava_run_config(tmp_path)
  cfg.model.language.norm_eps = 1e-6
  with pytest.raises(ConfigError, match=r"model\.language\.norm_eps=1e-06 \(the checkpoint has "
                     r"1e-05\)"):
    validate(cfg)
  cfg = _llava_run_config(tmp_path)
  cfg.model.vision.init_from = str(FIXTURES / "qwen2")
  with pytest.raises(ConfigError, match="holds a qwen2 model, which has no vision module"):
    validate(cfg)
