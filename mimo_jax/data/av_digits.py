"""The audio-visual digits task (README): a digit shown as an image and a digit dialled as a
telephone's DTMF tones, named in that order, written as LLaVA-format conversations with WAV
clips and converted by the same path as any conversation data (conversion.py, audio.py).

A sample's user turn is `<img> <audio>` (one 8x8 digit of scikit-learn's set, as the digits task
draws them, and one clip) and the assistant answers `seven two`: the image's digit, then the
dialled one. The two are drawn independently, so neither bridge's tokens tell the other's digit:
a model names both only if each sample's own image and clip reach the language model. Eval
samples use the held-out images (digits.py) and clips synthesised with another seed.

A clip is the key's two DTMF frequencies (a row tone of 697-941 Hz and a column tone of
1209-1477 Hz) at 8 kHz, 16-bit WAV written with soundfile: 0.2-0.5 s of tone after up to 0.1 s
of silence, each tone's frequency off by up to 1.5 % (what DTMF receivers accept), random
phases, levels and twist, and white noise at 5-25 dB SNR, so no two clips are alike and the
converter's resampling to 16 kHz and log-mel features (audio.py) see a real file.

`build` writes, once per parameter set, a directory under `data.dir`:

  source/conversations.jsonl         the samples as LLaVA-format records (train, then eval)
  source/images/{train,eval}/NNNN.png  the digit images (digits.py)
  source/audio/{train,eval}/NNNNN.wav  one clip a sample
  source/tokenizer/                  the digits tokenizer (digits.py) plus `<aud>`, the audio token
  train.array_record, ...            what `conversion.convert` makes of them (manifest included)

Features are Whisper's log-mel features of 80 bins in windows of WINDOW_S = 1 s (the feature
extractor's chunk_length; `tools.convert --audio_window 1`), for a toy tower of 50 positions
that trains in minutes on CPUs; a clip (0.2-0.6 s) gives 5-15 audio tokens after the tower's
pooling by 2.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np

from mimo_jax import run_paths
from mimo_jax.config_run import AV_DIGITS_VOCAB
from mimo_jax.data import audio_records, conversion, conversion_record, digits
from mimo_jax.data.tokenizer import DIGIT_WORDS

FORMAT_VERSION = 1
AUDIO_TOKEN_TEXT = "<aud>"
AUDIO_TOKEN = 17  # `<aud>`: after the digits vocabulary's 17 ids (tokenizer.py)
VOCAB = AV_DIGITS_VOCAB
MEL_BINS = 80
POOL = 2
WINDOW_S = 1  # seconds a window of features: every clip fits one
RATE = 8000  # the clips' sample rate (the converter resamples to 16 kHz)
# DTMF: each key's row and column frequencies (Hz).
ROWS, COLS = (697, 770, 852, 941), (1209, 1336, 1477)
KEYS = {1: (0, 0), 2: (0, 1), 3: (0, 2), 4: (1, 0), 5: (1, 1), 6: (1, 2), 7: (2, 0), 8: (2, 1),
        9: (2, 2), 0: (3, 1)}
PROMPT = f"{digits.IMAGE_TOKEN} {audio_records.MARK}"


def default_dir() -> str:
  return run_paths.cache_dir("av_digits")


def dtmf(key: int, rng: np.random.Generator) -> np.ndarray:
  """A clip [s] (float32, RATE Hz, peak < 1) of `key` dialled: its two tones with random
  frequency error, phases, level and twist, after a random silence, in white noise."""
  row, col = KEYS[key]
  tone = int(rng.uniform(0.2, 0.5) * RATE)
  lead = int(rng.uniform(0.0, 0.1) * RATE)
  t = np.arange(tone) / RATE
  wave = np.zeros(lead + tone)
  for f, level in ((ROWS[row], 1.0), (COLS[col], 10 ** (rng.uniform(-4, 4) / 20))):
    f *= 1 + rng.uniform(-0.015, 0.015)
    wave[lead:] += level * np.sin(2 * np.pi * f * t + rng.uniform(0, 2 * np.pi))
  ramp = min(tone // 2, RATE // 200)  # 5 ms fades: no clicks
  wave[lead:lead + ramp] *= np.linspace(0, 1, ramp)
  wave[lead + tone - ramp:] *= np.linspace(1, 0, ramp)
  signal = np.sqrt(np.mean(wave[lead:] ** 2))
  wave += rng.normal(0, signal * 10 ** (-rng.uniform(5, 25) / 20), len(wave))
  return (wave / np.abs(wave).max() * rng.uniform(0.1, 0.9)).astype(np.float32)


def write_tokenizer(directory: pathlib.Path) -> None:
  """The digits tokenizer (digits.py) with `<aud>` as one more special token (id AUDIO_TOKEN)."""
  digits.write_tokenizer(directory)
  data = json.loads((directory / "tokenizer.json").read_text(encoding="utf-8"))
  data["model"]["vocab"][AUDIO_TOKEN_TEXT] = AUDIO_TOKEN
  data["added_tokens"].append({**data["added_tokens"][-1], "id": AUDIO_TOKEN,
                               "content": AUDIO_TOKEN_TEXT})
  (directory / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")


def _write_source(root: pathlib.Path, train_samples: int, eval_samples: int) -> None:
  """The LLaVA-format source of the task under root/source: train records first, then eval."""
  # pylint: disable-next=import-outside-toplevel
  import soundfile
  # pylint: disable-next=import-outside-toplevel
  from PIL import Image
  src = root / "source"
  write_tokenizer(src / "tokenizer")
  tr_x, tr_y, ev_x, ev_y = digits.split_images()
  records = []
  for split, x, y, n, seed in (("train", tr_x, tr_y, train_samples, 1),
                               ("eval", ev_x, ev_y, eval_samples, 2)):
    images, clips = src / "images" / split, src / "audio" / split
    images.mkdir(parents=True)
    clips.mkdir(parents=True)
    for j, image in enumerate(x):
      Image.fromarray(digits.pixels(image), mode="L").save(images / f"{j:04d}.png")
    rng = np.random.default_rng([seed, FORMAT_VERSION])
    for i in range(n):
      j, key = int(rng.integers(len(y))), int(rng.integers(10))
      soundfile.write(clips / f"{i:05d}.wav", dtmf(key, rng), RATE, subtype="PCM_16")
      answer = f"{DIGIT_WORDS[int(y[j])]} {DIGIT_WORDS[key]}"
      records.append({"id": f"{split}-{len(records)}", "image": f"{split}/{j:04d}.png",
                      "audio": f"{split}/{i:05d}.wav",
                      "conversations": [{"from": "human", "value": PROMPT},
                                        {"from": "gpt", "value": answer}]})
  with open(src / "conversations.jsonl", "w", encoding="utf-8") as f:
    f.writelines(json.dumps(r, separators=(",", ":")) + "\n" for r in records)


def directory(root: str, train_samples: int, eval_samples: int) -> pathlib.Path:
  """The directory of one parameter set: its name encodes every parameter."""
  return pathlib.Path(root or default_dir()) / (
      f"av_digits-v{FORMAT_VERSION}-n{train_samples}-e{eval_samples}")


def build(root: str, train_samples: int, eval_samples: int) -> str:
  """Builds (once) the task's converted directory under `root` and returns it; written under a
  temporary name and renamed when complete, as digits.build does (`digits.built`)."""
  final = directory(root, train_samples, eval_samples)
  if digits.complete(final):
    return str(final)

  def write(tmp: pathlib.Path) -> None:
    _write_source(tmp, train_samples, eval_samples)
    src = tmp / "source"
    opts = conversion_record.Options(
        tokenizer=str(src / "tokenizer"), images=str(src / "images"),
        image_token=digits.IMAGE_TOKEN, on_error="fail", workers=1,
        audio=audio_records.Settings(folder=str(src / "audio"), token=AUDIO_TOKEN_TEXT,
                                     markers=AUDIO_TOKEN_TEXT, mel_bins=MEL_BINS, pool=POOL,
                                     window_s=WINDOW_S))
    evals = range(train_samples, train_samples + eval_samples)
    conversion.convert(src / "conversations.jsonl", tmp, opts, eval_ids=evals, progress=False)
  return digits.built(final, "av_digits: building the task's records in {} (once)", write)
