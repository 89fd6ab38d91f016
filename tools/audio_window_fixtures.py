"""transformers' WhisperFeatureExtractor features of a clip in windows shorter than Whisper's
30 s (its `chunk_length`), for the test of `tools.convert --audio_window`
(tests/test_av_demo.py).

  python -m tools.audio_window_fixtures [--out tests/fixtures/audio/window_1s.npz]

Needs transformers, soundfile and soxr (`pip install -e '.[hf]'`). The clip is the feature tests'
3 s speech-like clip (tools/audio_fixtures.py, tests/fixtures/audio/speech.flac, 16 kHz), cut
into consecutive 1 s windows, each featurised as one example by an extractor with chunk_length=1
and 80 mel bins (its NumPy path, as tools/audio_fixtures.py uses); the npz holds the features
[windows · 100, 80] (float32) and each window's audio frames.
"""

from __future__ import annotations

import argparse
import pathlib

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
CLIP = ROOT / "tests" / "fixtures" / "audio" / "speech.flac"
SECONDS, MEL_BINS = 1, 80


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(prog="python -m tools.audio_window_fixtures",
                                   description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=str(ROOT / "tests" / "fixtures" / "audio" / "window_1s.npz"))
  args = parser.parse_args(argv)
  import soundfile  # pylint: disable=import-outside-toplevel
  from transformers import WhisperFeatureExtractor  # pylint: disable=import-outside-toplevel
  wave, rate = soundfile.read(CLIP, dtype="float32")
  assert rate == 16000 and wave.ndim == 1, (rate, wave.shape)
  fe = WhisperFeatureExtractor(feature_size=MEL_BINS, chunk_length=SECONDS)
  step = SECONDS * rate
  feats, frames = [], []
  for start in range(0, len(wave), step):
    window = wave[start:start + step]
    out = fe(window, sampling_rate=rate, return_tensors="np", return_attention_mask=True)
    feats.append(out["input_features"][0].T.astype(np.float32))
    frames.append(int(out["attention_mask"][0].sum()))
  np.savez_compressed(args.out, features=np.concatenate(feats), frames=np.asarray(frames))
  print(f"wrote {args.out}: {len(frames)} windows of {SECONDS} s, audio frames {frames}")


if __name__ == "__main__":
  main()
