"""The audio-visual digits demo (configs/av_digits.py): a digit's image and a dialled digit's DTMF
clip, both converted by the conversation path (a WAV through tools.convert's audio features),
are named on held-out images and clips far above chance, with the demo's layout (vision 4 -> 2
fan-in, audio 1 -> 2 fan-out, three disjoint meshes), and the README's question about an image
and a clip together gets its answer from tools.generate; the converter's short feature windows
that its toy tower reads, and its shards of highly compressible features."""

import json
import pathlib
import shlex
import shutil

import numpy as np
import pytest
import soundfile

from configs import av_digits as av_config
from mimo_jax import train
from mimo_jax.data import audio, av_digits, conversations, conversion_files, records
from tests.helpers import run_main
from tools import convert, generate

FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures" / "audio"
README = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")


def _config(data_dir, workdir):
  """The demo's config, shortened: fewer samples and steps, the same model and layout."""
  cfg = av_config.get_config()
  d = cfg.data
  d.dir, d.train_samples, d.eval_samples = str(data_dir), 1280, 100
  cfg.train.steps, cfg.optim.warmup_steps = 200, 20
  cfg.eval.samples, cfg.eval.batch = 100, 100
  cfg.run.workdir, cfg.run.log_every = str(workdir), 40
  return cfg


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """The shortened demo, trained once for this module: its config and last metrics."""
  root = tmp_path_factory.mktemp("av_demo")
  cfg = _config(root / "data", root / "run")
  return cfg, train.run(cfg)[-1]


def test_both_digits_are_named_on_held_out_images_and_clips(trained):
  cfg, final = trained
  built = av_digits.directory(cfg.data.dir, cfg.data.train_samples, cfg.data.eval_samples)
  # Each answer names two digits, one from each bridge; a model blind to either modality names at
  # most half of them plus a tenth of the other half (55%).
  assert final["step"] == 200 and final["eval_digits"] == 200, final
  assert final["eval_accuracy"] >= 0.9, final

  # The clips are real files at 8 kHz whose dominant tones are their keys', converted as such.
  source = built / "source"
  first = json.loads((source / "conversations.jsonl").read_text().splitlines()[0])
  wave, rate = soundfile.read(source / "audio" / first["audio"])
  assert rate == av_digits.RATE and 0.2 * rate <= len(wave) <= 0.6 * rate
  key = av_digits.DIGIT_WORDS.index(first["conversations"][1]["value"].split()[1])
  spectrum = np.abs(np.fft.rfft(wave))
  hz = np.fft.rfftfreq(len(wave), 1 / rate)
  low, high = (hz[(hz > a) & (hz < b)][spectrum[(hz > a) & (hz < b)].argmax()]
               for a, b in ((650, 1000), (1150, 1550)))
  row, col = av_digits.KEYS[key]
  assert abs(low - av_digits.ROWS[row]) < 30 and abs(high - av_digits.COLS[col]) < 40
  m = conversations.manifest(str(built))
  assert (m["audios"], m["audio_window_frames"], m["mel_bins"]) == (1380, 100, 80)
  from array_record.python import array_record_module  # pylint: disable=import-outside-toplevel
  reader = array_record_module.ArrayRecordReader(str(built / "train.array_record"))
  header, _, clips = records.unpack_all(reader.read([0])[0])
  feats, frames = audio.file_features(source / "audio" / first["audio"], 80, window_s=1)
  np.testing.assert_array_equal(clips[0], feats)
  assert header["audio_frames"] == frames


def test_the_readme_asks_about_an_image_and_a_clip_at_once_and_gets_its_answer(trained):
  """tools.generate --image --audio (the image's tokens merged, then the clip's over them): the
  README's question, put to the shortened run, gets the README's answer, which names the first
  eval record's image and the second's clip, a pair no sample holds."""
  cfg, _ = trained
  block = README[README.index("D=~/.cache/mimo_jax/av_digits/"):]
  folder, line = block.split("\n")[:2]
  full = av_config.get_config().data
  assert folder == "D=~/" + str(pathlib.Path(av_digits.directory(
      av_digits.default_dir(), full.train_samples, full.eval_samples), "source").relative_to(
          pathlib.Path.home()))
  command = shlex.split(line)
  assert command[:4] == ["python", "-m", "tools.generate", "runs/av_digits"]
  shown = block[block.index("```\n>") + 4:]
  shown = shown[:shown.index("```")].strip()
  source = av_digits.directory(cfg.data.dir, cfg.data.train_samples,
                               cfg.data.eval_samples) / "source"
  args = [a.replace("$D", str(source)) for a in command[4:]]
  proc = run_main(generate.main, cfg.run.workdir, *args)
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.strip() == shown

  # The eval records the README names (its full run's numbers; the eval records are drawn alike
  # whatever the train count): the first's image, the second's clip, and their digits.
  lines = (source / "conversations.jsonl").read_text().splitlines()
  first, second = (json.loads(x) for x in lines[cfg.data.train_samples:][:2])
  assert f"eval record {full.train_samples}'s" in README
  assert f"record {full.train_samples + 1}'s" in README
  assert args[args.index("--image") + 1].endswith("/images/" + first["image"])
  assert args[args.index("--audio") + 1].endswith("/audio/" + second["audio"])
  answers = [r["conversations"][1]["value"].split() for r in (first, second)]
  assert shown.splitlines()[-1] == f"{answers[0][0]} {answers[1][1]}"


def test_short_windows_equal_the_extractors_and_convert_for_a_tower_of_their_positions(tmp_path):
  """`--audio_window 1`: transformers' extractor with chunk_length=1
  (tools/audio_window_fixtures.py) gives the same features; the manifest and launch line carry the window to model.audio."""
  clip = FIXTURES / "speech.flac"
  ref = np.load(FIXTURES / "window_1s.npz")
  feats, frames = audio.file_features(clip, 80, window_s=1)
  assert feats.shape == ref["features"].shape == (300, 80) and frames == ref["frames"].tolist()
  np.testing.assert_allclose(feats, ref["features"], rtol=0, atol=1e-5)

  av_digits.write_tokenizer(tmp_path / "tok")
  (tmp_path / "clips").mkdir()
  shutil.copy(clip, tmp_path / "clips")
  rec = {"audio": "speech.flac", "conversations": [{"from": "human", "value": "<audio>"},
                                                   {"from": "gpt", "value": "one two"}]}
  (tmp_path / "data.json").write_text(json.dumps([dict(rec, id=str(i)) for i in range(3)]))
  out = tmp_path / "out"
  proc = run_main(convert.main, "--json", tmp_path / "data.json", "--audio", tmp_path / "clips",
                  "--images", tmp_path, "--tokenizer", tmp_path / "tok", "--out", out,
                  "--eval", "1",
                  "--image_token", "<img>", "--audio_token", "<aud>", "--audio_markers", "<aud>",
                  "--mel_bins", "80", "--audio_window", "1")
  assert proc.returncode == 0, proc.stderr
  m = conversations.manifest(str(out))
  assert (m["audio_window_frames"], m["max_windows"]) == (100, 3)
  assert "--config.model.audio.positions=50" in proc.stdout
  assert "--config.model.audio.max_windows=3" in proc.stdout
  bad = run_main(convert.main, "--json", tmp_path / "data.json", "--images", tmp_path,
                 "--tokenizer", tmp_path / "tok", "--out", tmp_path / "never",
                 "--audio_window", "0")
  assert bad.returncode == 2 and "--audio_window" in bad.stderr
  assert not (tmp_path / "never").exists()


def test_a_shard_of_compressible_clips_is_not_taken_for_a_failed_write(tmp_path):
  """Whole 30 s windows of a short clip are mostly padding, which the writer compresses a
  hundredfold: its file stays empty for far more than WRITE_LAG bytes of records, and must not
  read as a write that failed."""
  mel_fm, _ = audio.clip_features(np.sin(np.arange(8000, dtype=np.float32) * 0.3), 80)
  record = mel_fm.tobytes()
  count = conversion_files.WRITE_LAG // len(record) + 8
  shard = conversion_files._Shard(tmp_path / "x.array_record")  # pylint: disable=protected-access
  for _ in range(count):
    shard.write(record)
  shard.close()
  from array_record.python import array_record_module  # pylint: disable=import-outside-toplevel
  reader = array_record_module.ArrayRecordReader(str(tmp_path / "x.array_record"))
  assert reader.num_records() == count and reader.read([count - 1])[0] == record
