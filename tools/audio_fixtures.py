"""Audio clips and transformers' WhisperFeatureExtractor features of them, for the audio feature
tests (tests/test_audio_features.py).

  python -m tools.audio_fixtures [--out tests/fixtures/audio] [--keep_tokens]

Needs transformers, soundfile and soxr (`pip install -e '.[hf]'`), and torch for the token counts
(`--keep_tokens` keeps those of the reference already in --out instead); the tests need no torch.
It writes the clips and reference.npz into --out and leaves the folder's other files.
The clips are synthetic and speech-like (a glottal pulse train with a wandering pitch through
three formant resonators, in syllables; the long ones quiet, to keep them small), stored as 16-bit FLAC: speech (3 s), silence (2 s),
a 1 s clip, 29.9 s and 45 s clips (one window nearly full; two windows), an 8 kHz source, a
44.1 kHz stereo source and a 16 kHz stereo clip.

The extractor is given what the reader makes of each file: soundfile's samples, channels
averaged, resampled to 16 kHz by soxr (HQ) when the source is not, called directly here, cut
into consecutive 30 s windows, each featurised as one example. Its NumPy path
(`_np_extract_fbank_features`, float64 STFT) is used: its torch path computes the STFT in
float32 and differs from the NumPy path itself by up to ~2e-5 in frames of low energy.
`reference.npz` holds, per clip, the features at 80 and at 128 bins at a set of frames (every
frame of the short clips; for the long ones a stride plus the frames around each window's end of
audio) and their frame indices, each window's audio frames (the extractor's attention mask), and
transformers' Qwen2-Audio `_get_feat_extract_output_lengths` of frame counts 1..3000.
"""

from __future__ import annotations

import argparse
import pathlib

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
WINDOW = 480000  # samples of a 30 s window at 16 kHz


def speech(seconds: float, rate: int, seed: int, peak: float = 0.3) -> np.ndarray:
  """A speech-like signal: pulses at 90–160 Hz through formants, in syllables with pauses."""
  rng = np.random.default_rng(seed)
  n = int(round(seconds * rate))
  t = np.arange(n) / rate
  f0 = 120 + 30 * np.sin(2 * np.pi * 0.7 * t + rng.uniform(0, 6))
  phase = np.cumsum(f0 / rate)
  source = (np.diff(np.floor(phase), prepend=0) > 0).astype(np.float64)
  out = np.zeros(n)
  for formant, width in ((rng.uniform(500, 800), 80), (rng.uniform(1100, 1800), 120),
                         (rng.uniform(2300, 3000), 200)):
    if formant >= rate / 2:
      continue
    r, theta = np.exp(-np.pi * width / rate), 2 * np.pi * formant / rate
    a1, a2 = 2 * r * np.cos(theta), -r * r
    y1 = y2 = 0.0
    y = np.empty(n)
    for i in range(n):  # a two-pole resonator
      y0 = source[i] + a1 * y1 + a2 * y2
      y[i], y2, y1 = y0, y1, y0
    out += y / np.abs(y).max()
  syllables = np.clip(np.sin(2 * np.pi * 2.5 * t) * 1.5, 0, 1) ** 2
  out = out * syllables
  return (peak * out / max(np.abs(out).max(), 1e-9)).astype(np.float32)


def clips() -> dict[str, tuple[np.ndarray, int]]:
  """name -> (samples [s] or [s, channels], sample rate)."""
  left, right = speech(2.0, 44100, 5), speech(2.0, 44100, 6)
  stereo16 = np.stack([speech(2.0, 16000, 7), 0.5 * speech(2.0, 16000, 8)], axis=1)
  return {"speech": (speech(3.0, 16000, 0), 16000),
          "silence": (np.zeros(32000, np.float32), 16000),
          "one_second": (speech(1.0, 16000, 1), 16000),
          "long_29_9s": (speech(29.9, 16000, 2, 0.02), 16000),
          "long_45s": (speech(45.0, 16000, 3, 0.02), 16000),
          "source_8k": (speech(2.5, 8000, 4), 8000),
          "stereo_44k": (np.stack([left, right], axis=1), 44100),
          "stereo_16k": (stereo16, 16000)}


def read_16k(path: pathlib.Path) -> np.ndarray:
  """The reader's view of a file, made here directly with soundfile and soxr."""
  import soundfile
  import soxr
  wave_sc, rate = soundfile.read(str(path), dtype="float32", always_2d=True)
  wave_s = wave_sc.mean(axis=1, dtype=np.float32)
  if rate != 16000:
    wave_s = soxr.resample(wave_s, rate, 16000, quality="HQ").astype(np.float32)
  return wave_s


def kept_frames(frames_w: list[int], full: bool) -> np.ndarray:
  """Frame indices (over the clip's windows) whose features are stored."""
  keep = set()
  for w, valid in enumerate(frames_w):
    base = w * 3000
    if full:
      keep |= set(range(base, base + 3000))
      continue
    keep |= set(range(base, base + 3000, 29))
    keep |= set(range(base + max(valid - 12, 0), base + min(valid + 12, 3000)))
    keep |= set(range(base, base + 8)) | set(range(base + 2992, base + 3000))
  return np.array(sorted(keep), np.int64)


def token_counts() -> dict[str, np.ndarray]:
  """transformers' Qwen2-Audio `_get_feat_extract_output_lengths` of frame counts 1..3000."""
  import torch
  from transformers.models.qwen2_audio.modeling_qwen2_audio import Qwen2AudioEncoder
  lengths = torch.arange(1, 3001)
  conv, pooled = Qwen2AudioEncoder._get_feat_extract_output_lengths(None, lengths)
  return {"tokens/frames": lengths.numpy(), "tokens/conv": conv.numpy(),
          "tokens/pooled": pooled.numpy()}


def main() -> None:
  p = argparse.ArgumentParser(prog="python -m tools.audio_fixtures",
                              description=__doc__.splitlines()[0])
  p.add_argument("--out", default=str(ROOT / "tests/fixtures/audio"))
  p.add_argument("--keep_tokens", action="store_true",
                 help="keep the token counts of OUT/reference.npz instead of computing them "
                 "(they need torch; the features do not)")
  args = p.parse_args()
  out = pathlib.Path(args.out)
  if args.keep_tokens:
    if not (out / "reference.npz").is_file():
      p.error(f"--keep_tokens: {out / 'reference.npz'} does not exist; leave out --keep_tokens "
              "(with torch installed) to compute the token counts.")
    with np.load(out / "reference.npz") as z:
      tokens = {k: z[k] for k in z.files if k.startswith("tokens/")}
  else:
    tokens = token_counts()
  import soundfile
  import transformers.models.whisper.feature_extraction_whisper as fw
  from transformers import WhisperFeatureExtractor
  fw.is_torch_available = lambda: False  # the NumPy path (see the docstring)
  out.mkdir(parents=True, exist_ok=True)  # beside other tools' fixtures (window_1s.npz)
  ref: dict[str, np.ndarray] = {}
  short = {"speech", "silence", "one_second", "source_8k", "stereo_44k", "stereo_16k"}
  for name, (wave, rate) in clips().items():
    path = out / f"{name}.flac"
    soundfile.write(str(path), wave, rate, subtype="PCM_16")
    wave_s = read_16k(path)
    windows = [wave_s[i:i + WINDOW] for i in range(0, len(wave_s), WINDOW)]
    mask = WhisperFeatureExtractor()  # its attention mask's frames, as Qwen2-Audio counts them
    frames_w = [int(mask(w, sampling_rate=16000, return_attention_mask=True,
                         return_tensors="np").attention_mask.sum()) for w in windows]
    ref[f"{name}/audio_frames"] = np.array(frames_w, np.int64)
    keep = kept_frames(frames_w, name in short)
    ref[f"{name}/frames"] = keep
    for bins in (80, 128):
      fe = WhisperFeatureExtractor(feature_size=bins)
      mel = np.concatenate([fe(w, sampling_rate=16000, return_tensors="np").input_features[0].T
                            for w in windows])
      ref[f"{name}/mel{bins}"] = mel[keep].astype(np.float32)
  np.savez_compressed(out / "reference.npz", **ref, **tokens)
  names = [f"{n}.flac" for n in clips()] + ["reference.npz"]
  total = sum((out / n).stat().st_size for n in names)
  print(f"wrote {len(names)} files, {total / 1e6:.2f} MB, to {out}")

if __name__ == "__main__":
  main()
