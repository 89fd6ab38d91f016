"""Whisper encoders and Qwen2-Audio read into our modules reproduce transformers' outputs (float32,
within 1e-5, absolutely and relative to the largest value); written back they are the same bits.
The fixtures are tiny random models saved by transformers, with its outputs on fixed inputs
(tools/hf_audio_fixtures.py; no torch needed)."""

import json
import pathlib

import numpy as np
import pytest

from mimo_jax import hf, modules, whole
from mimo_jax.config import Config
from mimo_jax.encoders import audio as audio_encoder
from mimo_jax.hf import audio as hf_audio
from mimo_jax.encoders.audio import AudioConfig
from mimo_jax.encoders.vision import VisionConfig
from mimo_jax.validation import validate

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "hf_audio"
WHISPER = ("whisper_a", "whisper_b")
QWEN2_AUDIO = ("qwen2_audio_a", "qwen2_audio_b")


def _config(src: hf.Source) -> Config:
  cfg = Config()
  cfg.add_encoder("vision", VisionConfig())
  cfg.add_encoder("audio", AudioConfig())
  cfg.data.task, cfg.model.vision.max_images, cfg.data.image_probs = "synthetic", 1, "0.5,0.5"
  cfg.model.language.vocab_size = 64  # a lone tower's (unused) language model
  hf.configure(cfg, src)
  validate(cfg)
  return cfg


def _params(src: hf.Source, cfg: Config, module: str) -> dict:
  return hf.load(src, module, cfg, modules.build_modules(cfg)[module].init(0))


def _close(ours, theirs, tol=1e-5):
  """Within `tol` of the reference both absolutely and relative to its scale:
  max |ours - theirs| <= tol and <= tol * max |theirs|."""
  ours, theirs = np.asarray(ours), np.asarray(theirs)
  assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
  err = np.abs(ours - theirs).max()
  assert err <= tol and err <= tol * np.abs(theirs).max(), (err, np.abs(theirs).max())


@pytest.mark.parametrize("name", WHISPER)
def test_whisper_encoders_match_transformers(name):
  src = hf.Source.open(FIXTURES / name)
  ref = np.load(src.path / "reference.npz")
  cfg = _config(src)
  assert src.modules == ("audio",)
  mel = ref["mel"].transpose(0, 2, 1)  # HF's [n, mel_bins, frames] -> ours [n, frames, mel_bins]
  hidden = audio_encoder.hidden_states(cfg, _params(src, cfg, "audio"), mel)
  _close(hidden, ref["last_hidden_state"])


@pytest.mark.parametrize("name", QWEN2_AUDIO)
def test_qwen2_audio_matches_transformers(name):
  src = hf.Source.open(FIXTURES / name)
  ref = np.load(src.path / "reference.npz")
  cfg = _config(src)
  assert src.modules == ("audio", "language")
  assert (cfg.model.audio.pool, cfg.model.audio.mask_padding) == (2, True)
  params = _params(src, cfg, "audio")
  mel, frames = ref["mel"].transpose(0, 2, 1), ref["mel_frames"]
  hidden = np.asarray(audio_encoder.hidden_states(cfg, params, mel, frames))
  kept = [cfg.model.audio.window_tokens(int(f)) for f in frames]
  for i, k in enumerate(kept):  # the tokens the model keeps; padding's differ by design
    _close(hidden[i, :k], ref["audio_hidden"][i, :k])
  tokens = audio_encoder.audio_tokens(cfg, params, mel, frames)
  assert tokens.shape[0] == sum(kept)
  logits = np.asarray(whole.merged_logits(cfg, _params(src, cfg, "language"), ref["input_ids"],
                                          tokens, src.config["audio_token_index"]))
  mask = ref["attention_mask"].astype(bool)  # right padding: compare the real positions
  _close(logits[mask], ref["logits"][mask])


@pytest.mark.parametrize("name", WHISPER + QWEN2_AUDIO)
def test_import_then_export_is_bitwise(name):
  """Every tensor of the encoder (and of Qwen2-Audio's projector and language model) written back
  under the names transformers' classes use, with the bits it was read with; a Whisper's decoder
  is not ours and is not written."""
  from safetensors.numpy import load_file  # pylint: disable=import-outside-toplevel
  src = hf.Source.open(FIXTURES / name)
  cfg = _config(src)
  params = {m: _params(src, cfg, m) for m in src.modules}
  ours = dict(hf.export.export_tensors(src.modules, cfg, params))
  theirs = load_file(src.path / "model.safetensors")
  theirs = {k.removeprefix("model."): v for k, v in theirs.items()
            if "decoder." not in k and not k.startswith("proj_out")}
  assert sorted(ours) == sorted(theirs)
  for k, x in ours.items():
    assert x.dtype == theirs[k].dtype == np.float32, k
    np.testing.assert_array_equal(x.view(np.uint32), theirs[k].view(np.uint32), err_msg=k)


def test_tools_hf_imports_qwen2_audio_into_a_run(tmp_path, capsys):
  """tools.hf import of a Qwen2-Audio directory fills model.audio and model.language from its
  config.json and writes their tensors as the step-0 checkpoint (the vision encoder from the
  seed); a config without model.audio is one error naming it, with nothing written."""
  from tools import hf as hf_tool  # pylint: disable=import-outside-toplevel
  from tools import hf_export  # pylint: disable=import-outside-toplevel
  src = hf.Source.open(FIXTURES / "qwen2_audio_a")
  run = ["--config.data.task=synthetic", "--config.model.vision.max_images=1",
         "--config.data.image_probs=0.25,0.75", "--config.data.text_len=8",
         "--config.eval.samples=16"]
  hf_tool.main(["import", "--hf", str(src.path), "--out", str(tmp_path / "run"),
                "--config=tests/configs/tiny_audio.py", *run])
  cfg, params, _, _ = hf_export._read_checkpoint(str(tmp_path / "run"), 0)  # pylint: disable=protected-access
  assert (cfg.model.audio.pool, cfg.model.audio.projector) == (2, "linear")
  assert cfg.model.audio.audio_token == src.config["audio_token_index"]
  assert cfg.model.audio.init_from == str(src.path.resolve())
  for module in ("audio", "language"):
    want = _params(src, cfg, module)
    got = hf.nest(dict(hf.flatten(params[module])))
    for path, x in hf.flatten(want):
      node = got
      for k in path:
        node = node[k]
      np.testing.assert_array_equal(np.asarray(node), x, err_msg="/".join(path))
  with pytest.raises(SystemExit):
    hf_tool.main(["import", "--hf", str(src.path), "--out", str(tmp_path / "bad"),
                  "--config=tests/configs/tiny.py", *run])
  err = capsys.readouterr().err
  assert "holds the audio encoder" in err and "model.audio" in err, err
  assert not (tmp_path / "bad").exists()


def test_tools_hf_exports_a_whisper_encoder_bit_for_bit(tmp_path):
  """A Whisper import exported with --module audio: WhisperModel's config.json and feature
  extractor, and the encoder's tensors with the fixture's names and bits."""
  from safetensors.numpy import load_file  # pylint: disable=import-outside-toplevel
  from tools import hf as hf_tool  # pylint: disable=import-outside-toplevel
  src = hf.Source.open(FIXTURES / "whisper_b")  # WhisperForConditionalGeneration: model.encoder.
  run = ["--config.data.task=synthetic", "--config.model.vision.max_images=1",
         "--config.data.image_probs=0.25,0.75", "--config.data.text_len=8",
         "--config.eval.samples=16", "--config.model.language.vocab_size=64"]
  hf_tool.main(["import", "--hf", str(src.path), "--out", str(tmp_path / "run"),
                "--config=tests/configs/tiny_audio.py", *run])
  hf_tool.main(["export", str(tmp_path / "run"), "--module", "audio", "--out",
                str(tmp_path / "hf")])
  config = json.loads((tmp_path / "hf" / "config.json").read_text())
  assert config["architectures"] == ["WhisperModel"]
  for key in ("num_mel_bins", "max_source_positions", "d_model", "encoder_layers",
              "encoder_attention_heads", "encoder_ffn_dim"):
    assert config[key] == src.config[key], key
  # 12-frame windows are no whole number of seconds: no feature extractor (a 30 s window has one).
  assert not (tmp_path / "hf" / "preprocessor_config.json").exists()
  pre = hf_audio.feature_extractor_json(audio_encoder.AudioConfig(mel_bins=128, positions=1500))
  assert (pre["feature_size"], pre["chunk_length"], pre["nb_max_frames"]) == (128, 30, 3000)
  ours = load_file(tmp_path / "hf" / "model.safetensors")
  theirs = {k.removeprefix("model."): v for k, v in load_file(src.path / "model.safetensors").items()
            if k.startswith("model.encoder.")}
  assert sorted(ours) == sorted(theirs)
  for k, x in ours.items():
    np.testing.assert_array_equal(x.view(np.uint32), theirs[k].view(np.uint32), err_msg=k)


@pytest.mark.parametrize("name", QWEN2_AUDIO)
def test_greedy_generation_with_audio_matches_transformers(name):
  """generate.generate (the key-value-cache decoder tools.generate and eval run) after a prompt
  whose placeholders hold a clip's tokens gives transformers' greedy `generate`, token for token
  (tools/hf_audio_fixtures.py: generate.npz, one prompt a call)."""
  from mimo_jax import generate  # pylint: disable=import-outside-toplevel
  src = hf.Source.open(FIXTURES / name)
  ref, want = np.load(src.path / "reference.npz"), np.load(src.path / "generate.npz")["tokens"]
  cfg = _config(src)
  audio, language = _params(src, cfg, "audio"), _params(src, cfg, "language")
  mel = ref["mel"].transpose(0, 2, 1)
  for i in range(len(want)):
    ids = ref["input_ids"][i][ref["attention_mask"][i].astype(bool)][None]
    tokens = audio_encoder.audio_tokens(cfg, audio, mel[i:i + 1], ref["mel_frames"][i:i + 1])
    embeds = whole.merged_embeddings(cfg, language, ids, tokens, src.config["audio_token_index"])
    got = generate.generate(cfg, language, ids, np.ones_like(ids), want.shape[1],
                            embeds_bld=embeds)
    np.testing.assert_array_equal(got[0], want[i])


@pytest.mark.parametrize("name", ["hf_audio/whisper_a", "hf_audio/qwen2_audio_a", "hf/llava15",
                                  "hf/llama3", "hf/qwen2", "hf/siglip", "hf/clip"])
def test_the_check_tool_agrees_with_transformers(name, capsys):
  """`python -m tools.hf check` on each kind of fixture (where torch and transformers are
  installed): transformers' own class and ours on the same random inputs, float32."""
  pytest.importorskip("torch")
  pytest.importorskip("transformers")
  from tools import hf_check  # pylint: disable=import-outside-toplevel
  err, rel = hf_check.check(str(FIXTURES.parent / name))
  assert rel <= 1e-5, (err, rel)
  assert "max abs difference" in capsys.readouterr().out


def test_a_tower_no_hf_class_holds_names_each_field_and_what_exports():
  """configs/llava_cpu.py:audio's tower (pooled by 2, padding not masked, an MLP projector) fits
  neither Qwen2-Audio nor a WhisperModel: each differing field with the value HF needs, in JSON's
  words, and what can be exported instead."""
  cfg = Config()
  cfg.add_encoder("audio", AudioConfig(pool=2, mask_padding=False, projector="mlp"))
  with pytest.raises(hf.HFError) as e:
    hf_audio.qwen2_audio_config_json(cfg, token=5)
  assert str(e.value) == (
      "model.audio.mask_padding is false, Qwen2AudioForConditionalGeneration needs true; "
      "model.audio.projector is \"mlp\", Qwen2AudioForConditionalGeneration needs \"linear\": no "
      "Qwen2AudioForConditionalGeneration holds this audio tower; --module language exports the "
      "language model alone, --module audio a Whisper-shaped tower (pool 1, mask_padding false) "
      "alone.")
  with pytest.raises(hf.HFError, match=r"^model\.audio\.pool is 2, WhisperModel needs 1: no "):
    hf_audio.whisper_config_json(cfg.model.audio)
