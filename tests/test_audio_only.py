"""Models of an audio encoder and a language model alone (no vision encoder): converted
conversations with clips train, converted data with images is one error naming the fix, and
`tools.hf import` reads a Qwen2-Audio directory into such a model. A truncated clip (a WAV whose
data chunk declares more frames than the file holds, which libsndfile reads without a word) is a
bad clip: skipped by tools.convert with its reason, refused by tools.generate --audio."""

import json
import pathlib
import shutil

import numpy as np
import pytest
import soundfile
from tokenizers import Tokenizer

from mimo_jax import validation
from mimo_jax.config import Config, ConfigError
from mimo_jax.data import audio, conversations
from tests.configs import tiny_audio
from tools import convert

FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures"
MARKERS = ["<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>"]
WINDOW_S = 1  # 1 s windows (50 positions): a tower that compiles in seconds


def _rec(rid: str, text: str, **fields) -> dict:
  return {"id": rid, "conversations": [{"from": "human", "value": text},
                                       {"from": "gpt", "value": "Heard it."}], **fields}


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> pathlib.Path:
  """A tokenizer with Qwen2-Audio's audio tokens, a clip and an image."""
  root = tmp_path_factory.mktemp("audio_only")
  shutil.copytree(FIXTURES / "chat" / "llama3", root / "tokenizer")
  tok = Tokenizer.from_file(str(root / "tokenizer" / "tokenizer.json"))
  tok.add_special_tokens(MARKERS)
  tok.save(str(root / "tokenizer" / "tokenizer.json"))
  (root / "audio").mkdir()
  shutil.copy(FIXTURES / "audio" / "one_second.flac", root / "audio")
  (root / "images").mkdir()
  shutil.copy(FIXTURES / "images" / "portrait.png", root / "images")
  return root


def _convert(root: pathlib.Path, name: str, records: list[dict]) -> pathlib.Path:
  """records converted into root/name (the siglip fixture's processor for records with an
  image)."""
  (root / f"{name}.json").write_text(json.dumps(records))
  out = root / name
  assert convert.main(["--json", str(root / f"{name}.json"), "--images", str(root / "images"),
                       "--audio", str(root / "audio"), "--tokenizer", str(root / "tokenizer"),
                       "--processor", str(FIXTURES / "images" / "siglip"), "--out", str(out),
                       "--image_tokens", "4", "--eval", "2", "--workers", "1", "--mel_bins",
                       "80", "--audio_window", str(WINDOW_S), "--on_error", "fail"]) == 0
  return out


def _audio_only(data: pathlib.Path, workdir: pathlib.Path) -> Config:
  """tests/configs/tiny_audio.py without its vision encoder, set for the conversion `data`."""
  m = conversations.manifest(str(data))
  cfg = tiny_audio.get_config("audio=0/1/1,language=0/1/1")
  del cfg.model.encoders["vision"], cfg.topology.encoders["vision"]
  a = cfg.model.audio
  a.audio_token, a.mel_bins, a.pool, a.layers = m["audio_token"], m["mel_bins"], 2, 1
  a.positions, a.max_audios, a.max_windows = WINDOW_S * 50, m["max_audios"], m["max_windows"]
  cfg.data.task, cfg.data.dir, cfg.data.image_token = "conversations", str(data), m["image_token"]
  cfg.data.seq_len = m["longest"]  # as the launch line tools.convert printed
  cfg.model.language.vocab_size = m["vocab_size"]
  cfg.data.global_batch, cfg.data.microbatches = 2, 1
  cfg.eval.samples, cfg.eval.batch = 2, 2
  cfg.train.steps, cfg.run.workdir, cfg.run.log_every = 2, str(workdir), 1
  return cfg


def test_an_audio_only_model_trains_on_conversations_with_clips(source, tmp_path, capsys):
  """Two steps and an eval of a model without a vision encoder on a conversion of clips and
  text-only records (no images): the clips reach the audio tower."""
  from mimo_jax import train  # pylint: disable=import-outside-toplevel
  data = _convert(source, "clips", [
      _rec(f"{k}", "<audio>\nWhat is said?", audio="one_second.flac") if k % 2 else
      _rec(f"{k}", "Hello there.") for k in range(6)])
  m = conversations.manifest(str(data))
  assert (m["max_images"], m["audios"]) == (0, 3)
  cfg = _audio_only(data, tmp_path / "run")
  assert set(conversations.paths(cfg)) == set(conversations.SPLITS)
  got = train.run(cfg)
  losses = [r["loss"] for r in got if "loss" in r]
  assert len(losses) == 2 and np.isfinite(losses).all()
  assert sum(r["audios"] for r in got if "loss" in r) > 0
  assert np.isfinite([r["eval_loss"] for r in got if "eval_loss" in r]).all()
  # tools.generate answers a clip from the run (it read the run's history for a vision tower).
  from tools import generate as generate_tool  # pylint: disable=import-outside-toplevel
  assert generate_tool.main([str(tmp_path / "run"), "--prompt", "What is said?", "--audio",
                             str(source / "audio" / "one_second.flac"),
                             "--max_new_tokens", "2"]) == 0
  # A clip too long for the run's positions is named with its tokens (the text was blamed).
  long = tmp_path / "long.wav"
  soundfile.write(str(long), np.sin(np.arange(4 * audio.SAMPLE_RATE) * 0.05), audio.SAMPLE_RATE)
  assert generate_tool.main([str(tmp_path / "run"), "--prompt", "What is said?", "--audio",
                             str(long)]) == 2
  assert "long.wav's 100 tokens, which leaves no room" in capsys.readouterr().err
  # An image for a model without a vision tower is one line, before any processor is looked for.
  assert generate_tool.main([str(tmp_path / "run"), "--prompt", "What is shown?", "--image",
                             str(long)]) == 2
  assert (f"--image {long}: the model has no vision encoder (model.vision); give a model with "
          "one, or no --image.") in capsys.readouterr().err
  # tools.eval of a JSON cuts its clips into the tower's 1 s windows (it cut 30 s ones).
  from tools import eval as eval_tool  # pylint: disable=import-outside-toplevel
  (tmp_path / "eval.json").write_text(json.dumps(
      [_rec("e", "<audio>\nWhat is said?", audio="one_second.flac")]))
  assert eval_tool.main([str(tmp_path / "run"), "--data", str(tmp_path / "eval.json"), "--audio",
                         str(source / "audio"), "--max_new_tokens", "2", "--out",
                         str(tmp_path / "eval.jsonl")]) == 0


def test_data_without_an_image_token_passes_the_manifest_checks(source, tmp_path):
  """Clips converted with Qwen2-Audio's tokenizer, which has no <image>, and no image processor:
  the manifest's image token is -1 and its image size null, and neither a model without a vision
  encoder nor one with it (tiny_audio's) is asked for an image token or size."""
  records = [_rec(f"{k}", "<audio>\nhello", audio="one_second.flac") for k in range(4)]
  (source / "qwen.json").write_text(json.dumps(
      [{**r, "conversations": [r["conversations"][0], {"from": "gpt", "value": "there"}]}
       for r in records]))
  out = source / "qwen"
  assert convert.main(["--json", str(source / "qwen.json"), "--images", str(source / "images"),
                       "--audio", str(source / "audio"), "--tokenizer",
                       str(FIXTURES / "hf_audio" / "qwen2_audio_chat"), "--out", str(out),
                       "--eval", "2", "--workers", "1", "--mel_bins", "80", "--audio_window",
                       str(WINDOW_S), "--on_error", "fail"]) == 0
  m = conversations.manifest(str(out))
  assert (m["image_token"], m["image_size"], m["max_images"]) == (-1, None, 0)
  cfg = _audio_only(out, tmp_path / "run")
  assert cfg.data.image_token == -1
  assert set(conversations.paths(cfg)) == set(conversations.SPLITS)
  with_vision = tiny_audio.get_config()
  with_vision.model.audio = cfg.model.audio
  with_vision.data, with_vision.model.language = cfg.data, cfg.model.language
  assert set(conversations.paths(with_vision)) == set(conversations.SPLITS)
  # The run asks no data.image_token of it, and no token of its text stands for an image (the
  # built-in tasks' id 3 is a word here); a token given is refused, naming the data.
  assert with_vision.data.placeholder == -1
  # tools.eval of a JSON gives such a run's tower an unused placeholder id, which is no
  # data.image_token its data would refuse.
  import argparse  # pylint: disable=import-outside-toplevel
  import copy  # pylint: disable=import-outside-toplevel
  from tools import eval as eval_tool  # pylint: disable=import-outside-toplevel
  evaluated = copy.deepcopy(with_vision)
  eval_tool.build_step(argparse.Namespace(data=str(source / "qwen.json"), layout=""),
                       evaluated, image_id=7)
  assert evaluated.data.image_token == 7
  from mimo_jax import train  # pylint: disable=import-outside-toplevel
  losses = [r["loss"] for r in train.run(cfg) if "loss" in r]
  assert len(losses) == 2 and np.isfinite(losses).all()
  cfg.data.image_token = 5
  with pytest.raises(ConfigError, match=r"config\.data\.image_token: 5, but .*qwen was converted "
                     r"without an image token .*leave data\.image_token out"):
    validation.validate(cfg)


def test_data_with_images_under_an_audio_only_model_is_one_error(source, tmp_path):
  """A conversion holding an image, read by a model without a vision encoder: one ConfigError
  naming model.vision, the directory and the fix."""
  data = _convert(source, "mixed", [
      _rec("pic", "<image>\nWhat is this?", image="portrait.png"),
      *[_rec(f"{k}", "<audio>\nWhat is said?", audio="one_second.flac") for k in range(3)]])
  assert conversations.manifest(str(data))["max_images"] == 1
  with pytest.raises(ConfigError) as e:
    conversations.paths(_audio_only(data, tmp_path / "run"))
  message = str(e.value)
  assert message.startswith("config.model.vision: ") and "\n" not in message
  assert str(data) in message and "no vision encoder" in message
  assert "use a config with a vision encoder" in message


def test_an_audio_source_under_a_config_without_audio_names_an_audio_config(tmp_path, capsys):
  """tools.hf import of a Qwen2-Audio directory under the default config (no audio encoder) is
  one line naming configs/avlm.py:audio and configs/llava_cpu.py:audio, whose modules are the
  source's: configs/avlm.py would add a vision tower no source fills (an untrained ViT-L). Nothing
  is written."""
  from tools import hf as hf_tool  # pylint: disable=import-outside-toplevel
  src = FIXTURES / "hf_audio" / "qwen2_audio_chat"
  with pytest.raises(SystemExit) as e:
    hf_tool.main(["import", "--hf", str(src), "--out", str(tmp_path / "run")])
  assert e.value.code == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].endswith(
      "has no model.audio for; use a config that adds it (e.g. --config=configs/avlm.py:audio "
      "(GPU-sized) or configs/llava_cpu.py:audio)."), err
  assert not (tmp_path / "run").exists()


def test_tools_hf_imports_qwen2_audio_into_an_audio_only_model(tmp_path, capsys):
  """tools.hf import of a Qwen2-Audio directory under a config of an audio encoder and a language
  model alone (configs/llava_cpu.py:audio, the CPU-sized one): both modules' tensors become step
  0, with Qwen2-Audio's own tower layout (no LLaVA reading of a vision tower)."""
  from mimo_jax import hf, modules  # pylint: disable=import-outside-toplevel
  from tools import hf as hf_tool  # pylint: disable=import-outside-toplevel
  from tools import hf_export  # pylint: disable=import-outside-toplevel
  src = hf.Source.open(FIXTURES / "hf_audio" / "qwen2_audio_chat")
  assert (hf_tool.main(["import", "--hf", str(src.path), "--out", str(tmp_path / "run"),
                       f"--config={FIXTURES.parent.parent / 'configs' / 'llava_cpu.py'}:audio"])
          in (0, None))
  out = capsys.readouterr().out
  assert "model.vision" not in out and "--config.data.dir=DATA" in out, out
  assert "image_token" not in out, out  # the model reads no image: its data has no image token
  cfg, params, _, _ = hf_export._read_checkpoint(str(tmp_path / "run"), 0)  # pylint: disable=protected-access
  assert set(cfg.model.encoders) == {"audio"} and set(params) == {"audio", "language"}
  assert (cfg.model.audio.pool, cfg.model.audio.projector) == (2, "linear")
  assert cfg.model.audio.audio_token == src.config["audio_token_index"]
  seed = modules.build_modules(cfg)
  for module in ("audio", "language"):
    want = dict(hf.flatten(hf.load(src, module, cfg, seed[module].init(0))))
    got = dict(hf.flatten(params[module]))
    assert sorted(got) == sorted(want), module
    for path, x in want.items():
      np.testing.assert_array_equal(np.asarray(got[path]), x, err_msg="/".join(path))


def _truncated(folder: pathlib.Path) -> tuple[pathlib.Path, int, int]:
  """A WAV written by soundfile, then cut to half its bytes: its path, the frames its header
  declares and those libsndfile reads of it."""
  wave = np.sin(np.arange(15798, dtype=np.float32) / 7) * 0.1
  whole, cut = folder / "whole.wav", folder / "half.wav"
  soundfile.write(whole, wave, audio.SAMPLE_RATE)
  data = whole.read_bytes()
  cut.write_bytes(data[:len(data) // 2])
  return cut, len(wave), soundfile.info(cut).frames


def test_a_truncated_wav_is_a_bad_clip(source, tmp_path, capsys):
  """libsndfile reads the half of a cut WAV there is (soundfile.info says so too) without an error;
  the header's data chunk declares all of it: loading names both counts, and tools.convert skips
  the record as `truncated audio`, or under --on_error fail stops with one line, writing nothing."""
  cut, declared, read = _truncated(source / "audio")
  assert 0 < read < declared and len(soundfile.read(cut)[0]) == read
  assert len(audio.load(source / "audio" / "whole.wav")) == declared
  with pytest.raises(audio.AudioError, match=f"truncated: {read} of {declared} frames"):
    audio.load(cut)
  good = [_rec(f"{k}", "<audio>\nWhat is said?", audio="one_second.flac") for k in range(4)]
  bad = _rec("cut", "<audio>\nWhat is said?", audio=cut.name)
  (source / "cut.json").write_text(json.dumps(good + [bad]))
  args = ["--json", str(source / "cut.json"), "--images", str(source / "images"), "--audio",
          str(source / "audio"), "--tokenizer", str(source / "tokenizer"), "--eval", "1",
          "--workers", "1", "--mel_bins", "80", "--audio_window", str(WINDOW_S),
          "--max_skipped_fraction", "1"]
  assert convert.main([*args, "--out", str(tmp_path / "skip")]) == 0
  assert conversations.manifest(str(tmp_path / "skip"))["skipped"] == {"truncated audio": 1}
  capsys.readouterr()
  assert convert.main([*args, "--out", str(tmp_path / "fail"), "--on_error", "fail"]) == 2
  err = capsys.readouterr().err
  last = err.strip().splitlines()[-1]
  assert last.startswith("tools.convert: error: ") and "Traceback" not in err, err
  assert f"{cut}: truncated: {read} of {declared} frames" in last and "(id 'cut')" in last
  assert not (tmp_path / "fail").exists()


def test_tools_generate_refuses_a_truncated_clip(tmp_path):
  """tools.generate --audio reads its clips with tools.prompts.load_audios: a cut WAV is one line
  naming the file and both counts (the ConfigError tools.generate prints, status 2)."""
  from tools import prompts  # pylint: disable=import-outside-toplevel
  cut, declared, read = _truncated(tmp_path)
  cfg = tiny_audio.get_config()
  cfg.model.audio.positions, cfg.model.audio.mel_bins, cfg.model.audio.pool = 1500, 80, 2
  assert len(prompts.load_audios([str(tmp_path / "whole.wav")], cfg)) == 1
  with pytest.raises(ConfigError) as e:
    prompts.load_audios([str(cut)], cfg)
  assert str(e.value).startswith(f"--audio: audio file {cut}: truncated: {read} of {declared} "
                                 "frames") and "\n" not in str(e.value)
