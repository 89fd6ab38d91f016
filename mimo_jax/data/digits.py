"""The digits-captioning task (README), stored as ArrayRecord shards of JSON samples.

A sample is 0..k images of scikit-learn's 8x8 handwritten digits plus text. With images the text is
`<img> <img> : seven two` (name the digits in order); without, it is a question such as
`after seven : eight`. Train and eval samples draw from disjoint image sets, so eval accuracy
measures recognition of digits never seen in training.
"""

from __future__ import annotations

import json
import os
import pathlib
import tempfile

import numpy as np
from array_record.python import array_record_module

from mimo_jax.data import meta
from mimo_jax.data.tokenizer import DIGIT_WORDS

FORMAT_VERSION = 1
EVAL_IMAGES = 297  # held out from the 1,797 images, split once with a fixed seed
SPLIT_SEED = 20240815


def default_dir() -> str:
  return os.path.join(os.path.expanduser("~"), ".cache", "mimo_jax", "digits")


def _images() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
  from sklearn.datasets import load_digits  # pylint: disable=import-outside-toplevel
  digits = load_digits()
  images = digits.images.astype(np.uint8)  # values 0..16
  order = np.random.default_rng(SPLIT_SEED).permutation(len(images))
  ev, tr = order[:EVAL_IMAGES], order[EVAL_IMAGES:]
  return images[tr], digits.target[tr], images[ev], digits.target[ev]


def make_samples(images: np.ndarray, labels: np.ndarray, n: int, probs: list[float],
                 seed: int) -> list[dict]:
  """Draws n samples; sample i has k ~ probs images drawn from `images`."""
  rng = np.random.default_rng(seed)
  out = []
  for i in range(n):
    k = int(rng.choice(len(probs), p=probs))
    if k == 0:
      d = int(rng.integers(10))
      if rng.random() < 0.5:
        text = f"after {DIGIT_WORDS[d]} : {DIGIT_WORDS[(d + 1) % 10]}"
      else:
        text = f"before {DIGIT_WORDS[d]} : {DIGIT_WORDS[(d - 1) % 10]}"
      out.append({"id": i, "images": [], "text": text})
      continue
    idx = rng.integers(len(images), size=k)
    answer = " ".join(DIGIT_WORDS[int(labels[j])] for j in idx)
    text = " ".join(["<img>"] * k) + " : " + answer
    out.append({"id": i, "images": [images[j].reshape(-1).tolist() for j in idx],
                "text": text})
  return out


def _write(path: pathlib.Path, samples: list[dict]) -> None:
  writer = array_record_module.ArrayRecordWriter(str(path), "group_size:1")
  for s in samples:
    writer.write(json.dumps(s, separators=(",", ":")).encode())
  writer.close()


def build(root: str, train_samples: int, eval_samples: int, probs: list[float]) -> dict[str, str]:
  """Builds (once) the train and eval shards under `root`; returns split -> file path.

  The shard name encodes every parameter, so a changed config never reads a stale file.
  Files are written to a temporary name and renamed, so a crash never leaves a partial shard.
  """
  key = f"v{FORMAT_VERSION}-n{train_samples}-e{eval_samples}-p{'_'.join(f'{p:g}' for p in probs)}"
  out_dir = pathlib.Path(root or default_dir())
  paths = {split: out_dir / f"digits-{key}-{split}.array_record" for split in ("train", "eval")}
  if all(p.exists() for p in paths.values()):
    return {k: str(v) for k, v in paths.items()}
  out_dir.mkdir(parents=True, exist_ok=True)
  tr_x, tr_y, ev_x, ev_y = _images()
  sets = {"train": make_samples(tr_x, tr_y, train_samples, probs, seed=1),
          "eval": make_samples(ev_x, ev_y, eval_samples, probs, seed=2)}
  for split, path in paths.items():
    fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".tmp")
    os.close(fd)
    _write(pathlib.Path(tmp), sets[split])
    # Before the shard appears under its name.
    meta.write(str(path), (_sample(s) for s in sets[split]))
    os.replace(tmp, path)
  return {k: str(v) for k, v in paths.items()}


def _sample(s: dict) -> dict:
  """A stored sample (flat pixel lists) as the loader sees it."""
  return {"images": np.asarray(s["images"], np.uint8).reshape(len(s["images"]), 8, 8),
          "text": s["text"]}


def decode(record: bytes, source: str, index: int) -> dict:
  """JSON record -> sample dict with images as uint8 [k, 8, 8]; bad records name file and index."""
  try:
    return _sample(json.loads(record))
  except (ValueError, KeyError, TypeError) as e:
    raise ValueError(f"{source}: record {index} is not a valid digits sample ({e}).") from None
