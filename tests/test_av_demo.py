"""The audio-visual digits demo (configs/av_digits.py): a digit's image and a dialled digit's DTMF
clip, both converted by the conversation path (a WAV through tools.convert's audio features),
are named on held-out images and clips far above chance, with the demo's layout (vision 4 -> 2
fan-in, audio 1 -> 2 fan-out, three disjoint meshes)."""

import json

import numpy as np
import soundfile

from configs import av_digits as av_config
from mimo_jax import train
from mimo_jax.data import audio, av_digits, conversations, records


def _config(data_dir, workdir):
  """The demo's config, shortened: fewer samples and steps, the same model and layout."""
  cfg = av_config.get_config()
  d = cfg.data
  d.dir, d.train_samples, d.eval_samples = str(data_dir), 640, 100
  cfg.train.steps, cfg.optim.warmup_steps = 160, 20
  cfg.eval.samples, cfg.eval.batch = 100, 100
  cfg.run.workdir, cfg.run.log_every = str(workdir), 40
  return cfg


def test_both_digits_are_named_on_held_out_images_and_clips(tmp_path):
  cfg = _config(tmp_path / "data", tmp_path / "run")
  built = av_digits.directory(cfg.data.dir, cfg.data.train_samples, cfg.data.eval_samples)
  final = train.run(cfg)[-1]
  # Each answer names two digits, one from each bridge; a model blind to either modality names at
  # most half of them plus a tenth of the other half (55%).
  assert final["step"] == 160 and final["eval_digits"] == 200, final
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
  assert (m["audios"], m["audio_window_frames"], m["mel_bins"]) == (740, 100, 80)
  from array_record.python import array_record_module  # pylint: disable=import-outside-toplevel
  reader = array_record_module.ArrayRecordReader(str(built / "train.array_record"))
  header, _, clips = records.unpack_all(reader.read([0])[0])
  feats, frames = audio.file_features(source / "audio" / first["audio"], 80, window_s=1)
  np.testing.assert_array_equal(clips[0], feats)
  assert header["audio_frames"] == frames
