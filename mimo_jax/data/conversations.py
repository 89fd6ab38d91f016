"""LLaVA-style conversation data: records with a language model's own token ids, a loss mask on
the assistant turns and images prepared by the vision tower's processor (`tools.convert` writes
them; `data.task=conversations` trains on them).

A converted directory (`data.dir`) holds:

  train.array_record, eval.array_record   one record a sample (`encode`)
  <shard>.meta.npz                         the per-record sidecar of scalable reads (meta.py)
  conversations.json                       the manifest: image token id, tokenizer, processor,
                                           image sizes, counts

A record (records.py) is a JSON header (`tokens`, `loss_mask`, the shape of each image) and the
images' uint8 bytes. Each `<image>` of the text is one token, the image token
(`data.image_token`, checked against the manifest), which the layout expands to that image's
tokens; the loss mask is 1 on every assistant token and its end-of-turn token.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np

from mimo_jax.config import Config, ConfigError
from mimo_jax.data import records

MANIFEST = "conversations.json"
SPLITS = ("train", "eval")
FORMAT_VERSION = 1


def encode(sample: dict) -> bytes:
  return records.pack({"tokens": np.asarray(sample["tokens"]).tolist(),
                       "loss_mask": np.asarray(sample["loss_mask"]).tolist()}, sample["images"])


def decode(record: bytes, source: str, index: int) -> dict:
  """Record -> {"images": [uint8 [h, w, c]], "tokens": int32 [n], "loss_mask": int32 [n]}; a bad
  record names the file and index."""
  try:
    header, images = records.unpack(record)
    tokens = np.asarray(header["tokens"], np.int32)
    mask = np.asarray(header["loss_mask"], np.int32)
    if tokens.shape != mask.shape:
      raise ValueError(f"{mask.size} loss mask entries for {tokens.size} tokens")
    return {"images": images, "tokens": tokens, "loss_mask": mask}
  except (ValueError, KeyError, TypeError) as e:
    raise ValueError(f"{source}: record {index} is not a valid conversation sample ({e}).") \
        from None


def manifest(directory: str) -> dict:
  path = pathlib.Path(directory) / MANIFEST
  try:
    out = json.loads(path.read_text())
  except FileNotFoundError:
    raise ConfigError(f"config.data.dir: {path} not found; data.task=conversations reads a "
                      "directory written by `python -m tools.convert`.") from None
  except (OSError, ValueError) as e:
    raise ConfigError(f"config.data.dir: {path} is unreadable ({e}); convert the data again.") \
        from None
  if out.get("format") != FORMAT_VERSION:
    raise ConfigError(f"config.data.dir: {path} has format {out.get('format')!r}, not "
                      f"{FORMAT_VERSION}; convert the data again.")
  return out


def paths(cfg: Config) -> dict[str, str]:
  """The converted train and eval shards of `data.dir`, after checking that the run's fields
  agree with the manifest."""
  d, v = cfg.data, cfg.model.vision
  m = manifest(d.dir)
  if d.image_token != m["image_token"]:
    raise ConfigError(f"config.data.image_token: {d.image_token} where {d.dir} marks images "
                      f"with token {m['image_token']}; set data.image_token={m['image_token']}.")
  h, w = m["image_size"]
  if not d.slot_patches and (h, w) != (v.image_size, v.image_size):
    raise ConfigError(f"config.model.vision.image_size: {v.image_size} where {d.dir} holds "
                      f"{h}x{w} images; set model.vision.image_size={h}, or data.slot_patches.")
  others = [f"{a}x{b}" for a, b in m.get("image_sizes", []) if (a, b) != (h, w)]
  if others and not d.slot_patches:
    raise ConfigError(f"config.data.slot_patches: {d.dir} holds images of several sizes "
                      f"({h}x{w}, {', '.join(others[:3])}), which need dynamic resolution; set "
                      "data.slot_patches, or convert with a processor that crops.")
  vocab = cfg.model.language.vocab_size
  if vocab < m["vocab_size"]:
    raise ConfigError(f"config.model.language.vocab_size: {vocab} is less than the tokenizer's "
                      f"{m['vocab_size']} ({m['tokenizer']}).")
  out = {}
  for split in SPLITS:
    path = pathlib.Path(d.dir) / f"{split}.array_record"
    if not path.exists():
      raise ConfigError(f"config.data.dir: {path} not found; convert the data again.")
    out[split] = str(path)
  return out
