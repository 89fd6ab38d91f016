"""Synthetic VLM-shaped samples in ArrayRecord shards, for benchmarks (`data.task=synthetic`).

A sample is k images (k drawn from `data.image_probs`, so 0..max_images with any skew) of random
uint8 pixels, each of a size drawn uniformly from `data.image_sizes` (default the image tower's
image_size, square; images.synthetic_shapes) with its channels, followed by a text of n random
token ids (n log-normal around `data.text_len` with spread `data.text_len_sigma`, clipped so that
the sample fits `data.seq_len` with its image tokens). The loss covers the text. Real files, real
decoding and real grain workers, shaped like LLaVA training data; the content is noise, so only
speed means anything.

With an audio encoder (`model.audio`) each sample also has `max_audios` clips, each of a length
drawn uniformly from a quarter window to `max_windows` windows of log-mel frames, their
placeholders after the images' (`SyntheticAudio`); a clip's features are standard normal noise
made again from its seed when the record is read, so the shards stay the size of the images.

Record format: a 4-byte little-endian header length, a JSON header {"shapes": [[h, w, c], ...],
"tokens"} (with clips, also "audio_frames" and "audio_seeds"), then the k images' raw bytes one
after another.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import tempfile

import numpy as np
from array_record.python import array_record_module

from mimo_jax import encoders, run_paths
from mimo_jax.config import Config
from mimo_jax.data import images, meta, records
from mimo_jax.data.text import TokenIds
from mimo_jax.data.tokenizer import BOS, EOS, IMG, PAD, SPECIALS

FORMAT_VERSION = 2
FIRST_TEXT_ID = len(SPECIALS)  # text ids are drawn from [FIRST_TEXT_ID, vocab_size)
# The built-in tasks' special ids (data/tokenizer.py): <img> marks an image, bos and eos go around
# a sample (its text carries the loss).
VOCABULARY = TokenIds(pad=PAD, bos=BOS, eos=EOS)


@dataclasses.dataclass(frozen=True)
class SyntheticAudio:
  """The clips of each synthetic sample: `clips` of up to `windows` windows of `frames` frames of
  `mel_bins`, each marked by `token` and taking `tokens(frames)` language tokens."""
  clips: int
  frames: int
  windows: int
  mel_bins: int
  token: int
  tokens: object  # (audio frames) -> tokens

  def key(self) -> str:
    return f"-a{self.clips}_{self.frames}_{self.windows}_{self.mel_bins}_{self.token}"


def _taking(cfg: Config, sample_key: str) -> str | None:
  """The run's encoder whose items are a sample's `sample_key` field, or None."""
  return next((n for n in cfg.model.encoders if encoders.get(n).sample_key == sample_key), None)


def audio_of(cfg: Config) -> SyntheticAudio | None:
  """The run's synthetic clips, or None without an encoder of clips (a sample's "audios")."""
  name = _taking(cfg, "audios")
  if name is None:
    return None
  a = cfg.model.module(name)
  tokens = lambda f: sum(a.window_tokens(min(a.frames, f - s)) for s in range(0, f, a.frames))
  return SyntheticAudio(a.max_audios, a.frames, a.max_windows, a.mel_bins, a.audio_token, tokens)


def clip_features(frames: int, window: int, mel_bins: int, seed: int) -> np.ndarray:
  """A clip's noise features [whole windows · window, mel_bins] (float32), from its seed."""
  windows = -(-frames // window)
  rng = np.random.default_rng(seed)
  return rng.standard_normal((windows * window, mel_bins), dtype=np.float32)


def text_lengths(rng: np.random.Generator, n: int, mean: int, sigma: float,
                 limit: np.ndarray) -> np.ndarray:
  """n text lengths, log-normal with median `mean`, each in [1, limit]."""
  lengths = np.round(mean * np.exp(sigma * rng.standard_normal(n))).astype(np.int64)
  return np.clip(lengths, 1, np.maximum(limit, 1))


def make_samples(n: int, seed: int, probs: list[float], sizes: list[tuple[int, int]],
                 channels: int, image_tokens, seq_len: int, text_len: int, text_sigma: float,
                 vocab_size: int, audio: SyntheticAudio | None = None):
  """Yields n samples: {"images": [uint8 [h, w, c] each], "tokens": int32 [k + n_text]}, sizes
  drawn from `sizes`; `image_tokens(h, w)` is what an image takes in the language sequence.
  With `audio`, also its clips' "audio_frames" and "audio_seeds" (features made on reading)."""
  rng = np.random.default_rng(seed)
  ks = rng.choice(len(probs), size=n, p=probs)
  drawn = [rng.integers(len(sizes), size=int(k)) for k in ks]
  clips = ([[int(f) for f in rng.integers(max(audio.frames // 4, 1),
                                          audio.windows * audio.frames + 1, size=audio.clips)]
            for _ in range(n)] if audio else [[] for _ in range(n)])
  first_text = max(FIRST_TEXT_ID, audio.token + 1) if audio else FIRST_TEXT_ID
  if first_text >= vocab_size:
    raise ValueError(f"model.language.vocab_size={vocab_size} leaves no text ids above the "
                     f"placeholders (< {first_text}); raise it.")
  # bos + image and audio tokens + text + eos must fit seq_len + 1 (inputs and shifted targets).
  room = seq_len - 1 - np.asarray([sum(image_tokens(*sizes[i]) for i in d) +
                                   sum(audio.tokens(f) for f in c)
                                   for d, c in zip(drawn, clips)], np.int64)
  if np.any(room < 1):
    worst = int(np.argmin(room))
    raise ValueError(f"{ks[worst]} images of {seq_len - 1 - room[worst]} tokens leave no room for "
                     f"text in data.seq_len={seq_len}; raise data.seq_len or lower the most "
                     "images a sample has (data.image_probs).")
  lengths = text_lengths(rng, n, text_len, text_sigma, room)
  for k, which, length, frames in zip(ks, drawn, lengths, clips):
    pixels = [rng.integers(0, 256, size=sizes[i] + (channels,), dtype=np.uint8) for i in which]
    text = rng.integers(first_text, vocab_size, size=int(length), dtype=np.int32)
    marks = [np.full(k, IMG, np.int32)]
    sample = {"images": pixels}
    if audio:
      seeds = [int(x) for x in rng.integers(0, 2**31, size=len(frames))]
      sample.update(audios=[None] * len(frames), audio_frames=frames, audio_seeds=seeds,
                    audio_shape=[audio.frames, audio.mel_bins])
      marks.append(np.full(len(frames), audio.token, np.int32))
    yield {**sample, "tokens": np.concatenate(marks + [text])}


AUDIO_FIELDS = ("audio_frames", "audio_seeds", "audio_shape")


def encode(sample: dict) -> bytes:
  extra = {k: sample[k] for k in AUDIO_FIELDS if k in sample}
  return records.pack({"tokens": np.asarray(sample["tokens"]).tolist(), **extra},
                      sample["images"])


def decode(record: bytes, source: str, index: int) -> dict:
  """Record -> {"images": [uint8 [h, w, c] each], "tokens": int32 [...]}; a bad record names the
  file and index."""
  try:
    header, pixels = records.unpack(record)
    out = {"images": pixels, "tokens": np.asarray(header["tokens"], np.int32)}
    if "audio_frames" in header:
      window, mels = header["audio_shape"]
      out.update(audio_frames=header["audio_frames"],
                 audios=[clip_features(f, window, mels, s)
                         for f, s in zip(header["audio_frames"], header["audio_seeds"])])
    return out
  except (ValueError, KeyError, TypeError) as e:
    raise ValueError(f"{source}: record {index} is not a valid synthetic sample ({e}).") from None


def paths(cfg: Config, progress=None) -> dict[str, str]:
  """The run's train and eval shards (`build` with its data fields and image shapes)."""
  d = cfg.data
  tower = _taking(cfg, "images")
  if tower is not None:
    sizes, channels, token_pixels = images.synthetic_shapes(cfg, cfg.model.module(tower))
    probs = d.probs()
  else:  # no image encoder: every sample has no images
    sizes, channels, token_pixels, probs = [(1, 1)], 1, 1, [1.0]
  return build(d.dir, d.train_samples, d.eval_samples, probs, sizes, channels, token_pixels,
               d.seq_len, d.text_len, d.text_len_sigma, cfg.model.language.vocab_size, progress,
               audio_of(cfg))


def build(root: str, samples: int, eval_samples: int, probs: list[float],
          sizes: list[tuple[int, int]], channels: int, token_pixels: int, seq_len: int,
          text_len: int, text_sigma: float, vocab_size: int, progress=None,
          audio: SyntheticAudio | None = None) -> dict[str, str]:
  """Builds (once) train and eval shards under `root`; returns split -> path. An image token
  covers `token_pixels` x `token_pixels` pixels (patch size * downsample). The file name encodes
  every parameter; files are written under a temporary name and renamed when complete."""
  unit = token_pixels
  image_tokens = lambda h, w: (h // unit) * (w // unit)
  shapes = "_".join(f"{h}x{w}" for h, w in sizes)
  key = (f"v{FORMAT_VERSION}-n{samples}-e{eval_samples}-p{'_'.join(f'{p:g}' for p in probs)}"
         f"-i{shapes}x{channels}-u{unit}-l{seq_len}-x{text_len}_{text_sigma:g}"
         f"-v{vocab_size}{audio.key() if audio else ''}")
  out_dir = pathlib.Path(root or run_paths.cache_dir("synthetic"))
  paths = {s: out_dir / f"synthetic-{key}-{s}.array_record" for s in ("train", "eval")}
  if all(p.exists() for p in paths.values()):
    return {k: str(v) for k, v in paths.items()}
  out_dir.mkdir(parents=True, exist_ok=True)
  for seed, (split, path) in enumerate(paths.items(), start=1):
    n = samples if split == "train" else eval_samples
    fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".tmp")
    os.close(fd)
    try:  # a failure or a signal midway (train.run stops a build at once) leaves no .tmp file
      writer = array_record_module.ArrayRecordWriter(tmp, "group_size:1")
      rows = []
      for i, sample in enumerate(make_samples(n, seed, probs, sizes, channels, image_tokens,
                                              seq_len, text_len, text_sigma, vocab_size, audio)):
        writer.write(encode(sample))
        rows.append(meta.row(sample, VOCABULARY))
        if progress and (i + 1) % 1000 == 0:
          progress(f"{path.name}: {i + 1}/{n} samples")
      writer.close()
      meta.save(str(path), rows)  # before the shard appears under its name
      os.replace(tmp, path)
    finally:
      if os.path.exists(tmp):
        os.remove(tmp)
  return {k: str(v) for k, v in paths.items()}
