"""Synthetic VLM-shaped samples in ArrayRecord shards, for benchmarks (`data.task=synthetic`).

A sample is k images (k drawn from `data.image_probs`, so 0..max_images with any skew) of random
uint8 pixels, each of a size drawn uniformly from `data.image_sizes` (default the image tower's
image_size, square; images.synthetic_shapes) with its channels, followed by a text of n random
token ids (n log-normal around `data.text_len` with spread `data.text_len_sigma`, clipped so that
the sample fits `data.seq_len` with its image tokens). The loss covers the text. Real files, real
decoding and real grain workers, shaped like LLaVA training data; the content is noise, so only
speed means anything.

Record format: a 4-byte little-endian header length, a JSON header {"shapes": [[h, w, c], ...],
"tokens"}, then the k images' raw bytes one after another.
"""

from __future__ import annotations

import os
import pathlib
import tempfile

import numpy as np
from array_record.python import array_record_module

from mimo_jax.config import Config
from mimo_jax.data import images, meta, records
from mimo_jax.data.text import TokenIds
from mimo_jax.data.tokenizer import BOS, EOS, IMG, PAD, SPECIALS

FORMAT_VERSION = 2
FIRST_TEXT_ID = len(SPECIALS)  # text ids are drawn from [FIRST_TEXT_ID, vocab_size)
# The built-in tasks' special ids (data/tokenizer.py): <img> marks an image, bos and eos go around
# a sample (its text carries the loss).
VOCABULARY = TokenIds(pad=PAD, bos=BOS, eos=EOS)


def text_lengths(rng: np.random.Generator, n: int, mean: int, sigma: float,
                 limit: np.ndarray) -> np.ndarray:
  """n text lengths, log-normal with median `mean`, each in [1, limit]."""
  lengths = np.round(mean * np.exp(sigma * rng.standard_normal(n))).astype(np.int64)
  return np.clip(lengths, 1, np.maximum(limit, 1))


def make_samples(n: int, seed: int, probs: list[float], sizes: list[tuple[int, int]],
                 channels: int, image_tokens, seq_len: int, text_len: int, text_sigma: float,
                 vocab_size: int):
  """Yields n samples: {"images": [uint8 [h, w, c] each], "tokens": int32 [k + n_text]}, sizes
  drawn from `sizes`; `image_tokens(h, w)` is what an image takes in the language sequence."""
  rng = np.random.default_rng(seed)
  ks = rng.choice(len(probs), size=n, p=probs)
  drawn = [rng.integers(len(sizes), size=int(k)) for k in ks]
  # bos + image tokens + text + eos must fit seq_len + 1 (inputs and shifted targets).
  room = seq_len - 1 - np.asarray([sum(image_tokens(*sizes[i]) for i in d) for d in drawn],
                                  np.int64)
  if np.any(room < 1):
    worst = int(np.argmin(room))
    raise ValueError(f"{ks[worst]} images of {seq_len - 1 - room[worst]} tokens leave no room for "
                     f"text in data.seq_len={seq_len}; raise data.seq_len or lower the most "
                     "images a sample has (data.image_probs).")
  lengths = text_lengths(rng, n, text_len, text_sigma, room)
  for k, which, length in zip(ks, drawn, lengths):
    pixels = [rng.integers(0, 256, size=sizes[i] + (channels,), dtype=np.uint8) for i in which]
    text = rng.integers(FIRST_TEXT_ID, vocab_size, size=int(length), dtype=np.int32)
    yield {"images": pixels, "tokens": np.concatenate([np.full(k, IMG, np.int32), text])}


def encode(sample: dict) -> bytes:
  return records.pack({"tokens": np.asarray(sample["tokens"]).tolist()}, sample["images"])


def decode(record: bytes, source: str, index: int) -> dict:
  """Record -> {"images": [uint8 [h, w, c] each], "tokens": int32 [...]}; a bad record names the
  file and index."""
  try:
    header, pixels = records.unpack(record)
    return {"images": pixels, "tokens": np.asarray(header["tokens"], np.int32)}
  except (ValueError, KeyError, TypeError) as e:
    raise ValueError(f"{source}: record {index} is not a valid synthetic sample ({e}).") from None


def paths(cfg: Config, progress=None) -> dict[str, str]:
  """The run's train and eval shards (`build` with its data fields and image shapes)."""
  d = cfg.data
  sizes, channels, token_pixels = images.synthetic_shapes(cfg)
  return build(d.dir, d.train_samples, d.eval_samples, d.probs(), sizes, channels, token_pixels,
               d.seq_len, d.text_len, d.text_len_sigma, cfg.model.language.vocab_size, progress)


def build(root: str, samples: int, eval_samples: int, probs: list[float],
          sizes: list[tuple[int, int]], channels: int, token_pixels: int, seq_len: int,
          text_len: int, text_sigma: float, vocab_size: int, progress=None) -> dict[str, str]:
  """Builds (once) train and eval shards under `root`; returns split -> path. An image token
  covers `token_pixels` x `token_pixels` pixels (patch size * downsample). The file name encodes
  every parameter; files are written under a temporary name and renamed when complete."""
  unit = token_pixels
  image_tokens = lambda h, w: (h // unit) * (w // unit)
  shapes = "_".join(f"{h}x{w}" for h, w in sizes)
  key = (f"v{FORMAT_VERSION}-n{samples}-e{eval_samples}-p{'_'.join(f'{p:g}' for p in probs)}"
         f"-i{shapes}x{channels}-u{unit}-l{seq_len}-x{text_len}_{text_sigma:g}"
         f"-v{vocab_size}")
  out_dir = pathlib.Path(root or os.path.join(os.path.expanduser("~"), ".cache", "mimo_jax",
                                              "synthetic"))
  paths = {s: out_dir / f"synthetic-{key}-{s}.array_record" for s in ("train", "eval")}
  if all(p.exists() for p in paths.values()):
    return {k: str(v) for k, v in paths.items()}
  out_dir.mkdir(parents=True, exist_ok=True)
  for seed, (split, path) in enumerate(paths.items(), start=1):
    n = samples if split == "train" else eval_samples
    fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".tmp")
    os.close(fd)
    writer = array_record_module.ArrayRecordWriter(tmp, "group_size:1")
    rows = []
    for i, sample in enumerate(make_samples(n, seed, probs, sizes, channels, image_tokens,
                                            seq_len, text_len, text_sigma, vocab_size)):
      writer.write(encode(sample))
      rows.append(meta.row(sample, VOCABULARY))
      if progress and (i + 1) % 1000 == 0:
        progress(f"{path.name}: {i + 1}/{n} samples")
    writer.close()
    meta.save(str(path), rows)  # before the shard appears under its name
    os.replace(tmp, path)
  return {k: str(v) for k, v in paths.items()}
