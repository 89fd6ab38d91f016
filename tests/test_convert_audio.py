"""Conversations with audio: `tools.convert` stores each clip's Whisper features beside the images
(a clip's `<audio>` becoming Qwen2-Audio's markers), bad clips are skipped with their reasons or
refused, the loader reads the features back, and a run's model.audio must match the conversion."""

import json
import pathlib
import shutil

import numpy as np
import pytest
import soundfile
from tokenizers import Tokenizer

from mimo_jax.config import ConfigError
from mimo_jax.data import audio, audio_records, conversations, records
from tests.configs import tiny_audio
from tools import convert

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
MARKERS = ["<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>"]


def _rec(rid, text, image=None, **clips):
  r = {"id": rid, "conversations": [{"from": "human", "value": text},
                                    {"from": "gpt", "value": "Heard it."}]}
  if image:
    r["image"] = image
  return {**r, **clips}


GOOD = [
    _rec("text", "Hello there."),
    _rec("one", "<audio>\nWhat is said?", audio="one_second.flac"),
    _rec("both", "<image> and <audio>: the same?", image="portrait.png", audios=["speech.flac"]),
    _rec("two", "<audio> then <audio>", audios=["one_second.flac", "long_45s.flac"]),
]
BAD = {
    "missing audio": _rec("gone", "<audio>?", audio="nowhere.flac"),
    "corrupt audio": _rec("broken", "<audio>?", audio="broken.flac"),
    "unsupported audio": _rec("odd", "<audio>?", audio="clip.xyz"),
    "empty audio": _rec("empty", "<audio>?", audio="empty.wav"),
    "short audio": _rec("short", "<audio>?", audio="twenty_ms.wav"),
    "outside audio folder": _rec("out", "<audio>?", audio="../images/portrait.png"),
    "audio count": _rec("count", "<audio> <audio>?", audio="one_second.flac"),
    "bad audio field": _rec("field", "<audio>?", audio=3),
}


def media_source(root: pathlib.Path, clips: tuple[str, ...]) -> pathlib.Path:
  """`root` with tokenizer/ (the Llama-3 chat fixture with Qwen2-Audio's audio tokens),
  images/portrait.png and audio/ holding the fixtures' `clips`."""
  tok_dir = root / "tokenizer"
  shutil.copytree(FIXTURES / "chat" / "llama3", tok_dir)
  tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
  tok.add_special_tokens(MARKERS)
  tok.save(str(tok_dir / "tokenizer.json"))
  (root / "images").mkdir()
  shutil.copy(FIXTURES / "images" / "portrait.png", root / "images")
  (root / "audio").mkdir()
  for f in clips:
    shutil.copy(FIXTURES / "audio" / f, root / "audio")
  return root


@pytest.fixture(scope="module")
def source(tmp_path_factory):
  """A tokenizer with Qwen2-Audio's audio tokens, images/, audio/ and records good and bad."""
  root = media_source(tmp_path_factory.mktemp("avlm"),
                      ("one_second.flac", "speech.flac", "long_45s.flac"))
  (root / "audio" / "broken.flac").write_bytes(b"fLaC not really")
  (root / "audio" / "clip.xyz").write_bytes(b"??")
  soundfile.write(root / "audio" / "empty.wav", np.zeros(0, np.float32), audio.SAMPLE_RATE)
  # 20 ms: 2 mel frames, one position, no token after Qwen2-Audio's pooling by 2 (--audio_pool 2)
  soundfile.write(root / "audio" / "twenty_ms.wav", np.full(320, 0.1, np.float32),
                  audio.SAMPLE_RATE)
  good = [dict(r, id=f"{r['id']}-{k}") for k in range(3) for r in GOOD]
  (root / "good.json").write_text(json.dumps(good))
  (root / "bad.json").write_text(json.dumps(good + list(BAD.values())))
  return root


def _args(root, out, data="good.json", *extra):
  return ["--json", str(root / data), "--images", str(root / "images"), "--audio",
          str(root / "audio"), "--tokenizer", str(root / "tokenizer"), "--processor",
          str(FIXTURES / "images" / "siglip"), "--out", str(out), "--image_tokens", "4",
          "--eval", "4", "--workers", "1", "--mel_bins", "80", "--max_skipped_fraction", "1",
          *extra]  # files of bad clips beside a few good ones


@pytest.fixture(scope="module")
def converted(source, tmp_path_factory):
  out = tmp_path_factory.mktemp("conv") / "data"
  assert convert.main(_args(source, out)) == 0
  return out


def _samples(out):
  from array_record.python import array_record_module  # pylint: disable=import-outside-toplevel
  got = []
  for split in conversations.SPLITS:
    path = out / f"{split}.array_record"
    reader = array_record_module.ArrayRecordReader(str(path))
    got += [conversations.decode(reader.read([i])[0], str(path), i)
            for i in range(reader.num_records())]
  return got


def test_clips_are_stored_as_their_features_and_read_back(source, converted):
  m = conversations.manifest(str(converted))
  tok = Tokenizer.from_file(str(source / "tokenizer" / "tokenizer.json"))
  audio_id, bos, eos = (tok.token_to_id(t) for t in ("<|AUDIO|>", MARKERS[0], MARKERS[2]))
  assert (m["audio_token"], m["mel_bins"], m["audios"], m["max_audios"], m["max_windows"]) == \
      (audio_id, 80, 12, 2, 2)
  want = {f: audio.file_features(source / "audio" / f, 80)
          for f in ("one_second.flac", "speech.flac", "long_45s.flac")}
  samples = _samples(converted)
  assert len(samples) == 12
  seen = set()
  for s in samples:
    clips = s.get("audios", [])
    at = np.flatnonzero(s["tokens"] == audio_id)
    assert len(at) == len(clips) and "audio_frames" in s or not clips
    assert all(s["tokens"][a - 1] == bos and s["tokens"][a + 1] == eos for a in at)
    for mel, frames in zip(clips, s.get("audio_frames", [])):
      name = next(f for f, (w, _) in want.items() if w.shape == mel.shape and
                  np.array_equal(w, mel))
      assert mel.dtype == np.float32 and frames == sum(want[name][1])
      seen.add(name)
    if len(clips) == 1 and s["images"]:
      assert s["images"][0].shape[:2] == (20, 20)
  assert seen == set(want)
  # the longest sample counts each clip's tokens after pooling by 2
  assert m["longest"] == max(audio_records.positions(
      len(s["tokens"]) + 3 * len(s["images"]),
      [audio.clip_tokens(int(f), 2) for f in s.get("audio_frames", [])]) for s in samples)


def test_records_without_audio_read_as_before():
  old = records.pack({"tokens": [1, 2], "loss_mask": [0, 1]}, [np.ones((2, 2, 3), np.uint8)])
  s = conversations.decode(old, "old", 0)
  assert "audios" not in s and s["images"][0].shape == (2, 2, 3)
  assert records.unpack(old)[0]["tokens"] == [1, 2]
  with pytest.raises(ValueError, match="record 0"):
    conversations.decode(old + b"x", "old", 0)


def test_bad_clips_are_skipped_with_their_reasons(source, tmp_path, capsys):
  assert convert.main(_args(source, tmp_path / "out", "bad.json")) == 0
  m = conversations.manifest(str(tmp_path / "out"))
  assert m["skipped"] == {reason: 1 for reason in BAD}
  assert sum(m["samples"].values()) == 12


@pytest.mark.parametrize("reason", ["corrupt audio", "audio count", "short audio"])
def test_a_bad_clip_under_fail_is_one_line_and_writes_nothing(source, tmp_path, capsys, reason):
  data = f"fail-{BAD[reason]['id']}.json"
  (source / data).write_text(json.dumps([GOOD[1], BAD[reason], GOOD[0]]))
  out = tmp_path / "out"
  assert convert.main(_args(source, out, data, "--on_error", "fail", "--eval", "1")) == 2
  err = capsys.readouterr().err
  last = err.strip().splitlines()[-1]
  assert last.startswith("tools.convert: error: ") and "Traceback" not in err, err
  assert f"(id {BAD[reason]['id']!r})" in last and "--on_error skip" in last
  assert not out.exists()


def test_non_finite_samples_and_bad_audio_fields_skip_their_record_alone(source, tmp_path,
                                                                        capsys):
  """A float clip holding NaN or infinity is corrupt audio; an audio field that names no clip
  (empty, a number) is a bad field of its record, and does not make a tokenizer without audio
  tokens refuse the whole conversion."""
  wave = np.full(audio.SAMPLE_RATE, 0.1, np.float32)
  wave[100], wave[200] = np.nan, np.inf
  soundfile.write(source / "audio" / "nan.wav", wave, audio.SAMPLE_RATE, subtype="FLOAT")
  (source / "nan.json").write_text(json.dumps([GOOD[1], _rec("nan", "<audio>?", audio="nan.wav"),
                                               GOOD[0]]))
  assert convert.main(_args(source, tmp_path / "a", "nan.json", "--eval", "1")) == 0
  assert conversations.manifest(str(tmp_path / "a"))["skipped"] == {"corrupt audio": 1}
  (source / "fields.json").write_text(json.dumps(
      [GOOD[0], _rec("none", "Hi.", audio=None), _rec("no list", "Hi.", audios=[]),
       _rec("empty", "Hi.", audio=""), _rec("number", "Hi.", audio=5), GOOD[0]]))
  plain = ["--tokenizer", str(FIXTURES / "chat" / "llama3")]  # no audio tokens
  assert convert.main(_args(source, tmp_path / "b", "fields.json", "--eval", "1") + plain) == 0
  m = conversations.manifest(str(tmp_path / "b"))
  assert m["skipped"] == {"bad audio field": 2} and sum(m["samples"].values()) == 4


def test_an_audio_token_the_tokenizer_lacks_is_one_error(source, tmp_path, capsys):
  assert convert.main(_args(source, tmp_path / "out", "good.json", "--audio_token", "<|A|>",
                            "--audio_markers", "<|A|>")) == 2
  assert "--audio_token '<|A|>'" in capsys.readouterr().err
  assert not (tmp_path / "out").exists()


def _config(m):
  cfg = tiny_audio.get_config("vision=0/1/1,audio=0/1/1,language=0/1/1")
  a = cfg.model.audio
  a.audio_token, a.mel_bins, a.positions, a.pool = m["audio_token"], 80, 1500, 2
  a.max_audios, a.max_windows = 2, 2
  cfg.data.task, cfg.data.image_token = "conversations", m["image_token"]
  cfg.model.vision.image_size, cfg.model.language.vocab_size = 20, m["vocab_size"]
  return cfg


@pytest.mark.parametrize("field, value, named", [
    ("audio_token", 7, "model.audio.audio_token"), ("mel_bins", 128, "model.audio.mel_bins"),
    ("positions", 8, "model.audio.positions"), ("max_windows", 1, "model.audio.max_windows")])
def test_a_config_that_disagrees_with_the_clips_is_one_error(converted, field, value, named):
  m = conversations.manifest(str(converted))
  cfg = _config(m)
  assert set(conversations.paths(cfg, str(converted))) == set(conversations.SPLITS)
  setattr(cfg.model.audio, field, value)
  with pytest.raises(ConfigError, match=named) as e:
    conversations.paths(cfg, str(converted))
  assert str(m.get(field, m["audio_window_frames"] // 2 if field == "positions" else
                   m["max_windows"])) in str(e.value)
  if field == "max_windows":  # the conversion's window length, not always Whisper's 30 s
    assert f"windows of {m['audio_window_frames'] // 100} s;" in str(e.value)


def test_a_run_trains_on_converted_images_and_audio(source, tmp_path):
  """Two steps of a tiny tower taking real 30 s windows (1500 positions) on a conversion of
  one-window clips, with and without an image."""
  from mimo_jax import train  # pylint: disable=import-outside-toplevel
  (source / "short.json").write_text(json.dumps([dict(r, id=f"{r['id']}-{k}") for k in range(2)
                                                 for r in GOOD[:3]]))
  out = tmp_path / "data"
  assert convert.main(_args(source, out, "short.json", "--eval", "2")) == 0
  m = conversations.manifest(str(out))
  cfg = _config(m)
  a = cfg.model.audio
  a.max_audios, a.max_windows, a.layers = m["max_audios"], m["max_windows"], 1
  # validation asks room for the worst case: a clip of max_windows whole windows
  cfg.data.dir, cfg.data.seq_len = str(out), m["longest"] + a.max_windows * a.tokens_per_window
  cfg.model.vision.max_images, cfg.model.vision.channels = 1, m["channels"]
  cfg.data.image_probs = "0.5,0.5"
  cfg.data.global_batch, cfg.data.microbatches = 2, 1
  cfg.eval.samples, cfg.eval.batch = 2, 2
  cfg.train.steps, cfg.run.workdir, cfg.run.log_every = 2, str(tmp_path / "run"), 1
  got = train.run(cfg)
  losses = [r["loss"] for r in got if "loss" in r]
  assert len(losses) == 2 and np.isfinite(losses).all()
  assert sum(r["audios"] for r in got if "loss" in r) > 0  # the clips reached the tower
  assert np.isfinite([r["eval_loss"] for r in got if "eval_loss" in r]).all()


def test_the_free_space_check_counts_a_window_a_clip(source):
  records = json.loads((source / "good.json").read_text())
  clips = 3 * (1 + 1 + 2)  # three copies of GOOD's records, of 0, 1, 1 and 2 clips
  assert audio_records.estimate_bytes(records, 80) == clips * audio.WINDOW_FRAMES * 80 * 4


def test_the_sidecar_and_launch_line_name_the_clips(converted):
  from mimo_jax.data import meta  # pylint: disable=import-outside-toplevel
  m = conversations.manifest(str(converted))
  shard = converted / "train.array_record"
  samples = _samples(converted)[:m["samples"]["train"]]
  table = meta.load(str(shard), len(samples), lambda i: None, ("audio",))
  for i, s in enumerate(samples):
    assert table[i].sizes["audio"] == tuple((int(f),) for f in s.get("audio_frames", ()))
  flags = dict(f.removeprefix("--config.").split("=", 1)
               for f in convert.launch_flags(converted, m))
  assert (flags["model.audio.audio_token"], flags["model.audio.mel_bins"],
          flags["model.audio.max_audios"], flags["model.audio.max_windows"],
          flags["model.audio.positions"], flags["model.audio.pool"]) == (
              str(m["audio_token"]), "80", "2", "2", "1500", str(m["audio_pool"]))
  # The line works as printed on a model config of other audio fields (a toy tower of 1 s
  # windows: positions 8 and 16 frames a window, as the brief's failing run had; a Whisper
  # tower's pooling, under which a clip takes other tokens than the conversion counted).
  cfg = _config(m)
  a = cfg.model.audio
  a.audio_token, a.mel_bins, a.positions, a.max_audios, a.max_windows = 0, 128, 8, 1, 1
  a.pool = 3 - m["audio_pool"]
  with pytest.raises(ConfigError, match=rf"^config\.model\.audio\.pool: {a.pool} where "):
    a.audio_token, a.mel_bins, a.positions, a.max_audios, a.max_windows = (
        m["audio_token"], 80, 1500, 2, 2)
    conversations.paths(cfg, str(converted))
  a.audio_token, a.mel_bins, a.positions, a.max_audios, a.max_windows = 0, 128, 8, 1, 1
  for key, value in flags.items():
    if key.startswith("model.audio."):
      setattr(a, key.rsplit(".", 1)[1], int(value))
  assert set(conversations.paths(cfg, str(converted))) == set(conversations.SPLITS)


CHAT = FIXTURES / "hf_audio" / "qwen2_audio_chat"  # Qwen2-Audio's tokens, no <image>, no processor


def _audio_only(rid, image=None):
  r = _rec(rid, "<audio>\nwhat is in the audio", audio="one_second.flac")
  r["conversations"][1]["value"] = "hello there"
  return dict(r, image=image, conversations=[
      {"from": "human", "value": "<image> " * bool(image) + r["conversations"][0]["value"]},
      r["conversations"][1]]) if image else r


@pytest.mark.parametrize("image, extra, said", [
    (None, [], None),  # neither an image token nor an image processor is needed
    ("portrait.png", [], "--image_token '<image>': "),
    ("portrait.png", ["--image_token", "w63"], "preprocessor_config.json: not found; a vision "
     "tower's directory holds its image processor's preprocessor_config.json. --processor was not "
     "given, so it is --tokenizer's directory: give --processor DIR"),
])
def test_audio_only_records_need_no_image_token_nor_processor(source, tmp_path, capsys, image,
                                                              extra, said):
  """Records of clips alone convert with a tokenizer that has no image token and a directory
  without an image processor (the manifest's image token -1, no image size); records that list
  an image need both, as before. A word outside the vocabulary (which the tokenizer would encode
  as [UNK]) skips its record as an unknown token."""
  zebra = _audio_only("z")
  zebra["conversations"][1]["value"] = "zebra"
  (tmp_path / "aud.json").write_text(json.dumps(
      [_audio_only(f"a{k}", image if k == 0 else None) for k in range(4)] + [zebra]))
  out = tmp_path / "data"
  args = ["--json", str(tmp_path / "aud.json"), "--images", str(source / "images"), "--audio",
          str(source / "audio"), "--tokenizer", str(CHAT), "--out", str(out), "--eval", "1",
          "--workers", "1", "--mel_bins", "80", "--max_skipped_fraction", "1", *extra]
  rc = convert.main(args)
  got = capsys.readouterr()
  if said:
    last = got.err.strip().splitlines()[-1]
    assert rc == 2 and last.startswith("tools.convert: error: ") and said in last, got.err
    assert "e.g. <image>" not in last and not out.exists()
    return
  assert rc == 0, got.err
  m = conversations.manifest(str(out))
  assert (m["image_token"], m["images"], m["max_images"], m["image_size"], m["processor"]) == \
      (-1, 0, 0, None, "")
  assert m["audios"] == 4 and "an image counts as" not in got.err
  assert m["skipped"] == {"unknown token": 1} and \
      "record 4 (id 'z'): the word 'zebra' is not in the vocabulary of " in got.err, got.err
  flags = dict(f.removeprefix("--config.").split("=", 1)
               for f in got.out.strip().splitlines()[-1].split()[4:])
  assert "data.image_token" not in flags and "model.vision.image_size" not in flags, flags
  assert flags["model.audio.audio_token"] == str(m["audio_token"])


def test_the_cpu_audio_config_trains_on_the_launch_line_of_audio_records(source, tmp_path, capsys):
  """configs/llava_cpu.py:audio (speech and text, no vision) with the launch line tools.convert
  prints for records of clips alone, as a user runs it: two steps and an eval, finite."""
  from mimo_jax import configfile, train  # pylint: disable=import-outside-toplevel
  (tmp_path / "aud.json").write_text(json.dumps([_audio_only(f"a{k}") for k in range(6)]))
  out = tmp_path / "data"
  assert convert.main(["--json", str(tmp_path / "aud.json"), "--audio", str(source / "audio"),
                       "--tokenizer", str(CHAT), "--out", str(out), "--eval", "2",
                       "--workers", "1", "--mel_bins", "80", "--audio_window", "1"]) == 0
  line = capsys.readouterr().out.strip().splitlines()[-1].split()
  assert line[:4] == ["python", "-m", "mimo_jax.launch", "--config=MODEL_CONFIG"], line
  _, overrides, _ = configfile.split_args(
      ["launch", "--config=configs/llava_cpu.py:audio", *line[4:],
       f"--config.run.workdir={tmp_path / 'run'}", "--config.train.steps=2",
       "--config.data.global_batch=2", "--config.eval.samples=2", "--config.eval.batch=2"])
  cfg = configfile.load("configs/llava_cpu.py:audio", overrides)
  assert set(cfg.model.encoders) == {"audio"} and cfg.run.cpu_devices == 1
  got = train.run(cfg)
  losses = [r["loss"] for r in got if "loss" in r]
  assert len(losses) == 2 and np.isfinite(losses).all()
  assert sum(r["audios"] for r in got if "loss" in r) > 0  # the clips reached the tower
  assert np.isfinite([r["eval_loss"] for r in got if "eval_loss" in r]).all()
