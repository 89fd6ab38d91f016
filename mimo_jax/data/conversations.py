"""LLaVA-style conversation data: records with a language model's own token ids, a loss mask on
the assistant turns and images prepared by the image tower's processor (`tools.convert` writes
them; `data.task=conversations` trains on them).

A converted directory (`data.dir`) holds:

  train.array_record, eval.array_record   one record a sample (`encode`)
  <shard>.meta.npz                         the per-record sidecar of scalable reads (meta.py)
  conversations.json                       the manifest: image token id, tokenizer, processor,
                                           image sizes, counts

A record (records.py) is a JSON header (`tokens`, `loss_mask`, the shape of each image, the `id`
of the LLaVA record it came from, or its index in the source file where it had none) and the
images' uint8 bytes. Each `<image>` of the text is one token, the image token
(`data.image_token`, checked against the manifest), which the layout expands to that image's
tokens; the loss mask is 1 on every assistant token and its end-of-turn token.

`conversion.convert` writes such a directory from LLaVA-format records (`tools.convert` is its
command line; the digits tasks build their shards with it too). Paths in the manifest (tokenizer,
processor, source) are absolute, or relative to the directory where they lie inside it;
`source_path` resolves them, older relative ones against the directory, then the working directory.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np

from mimo_jax import encoders
from mimo_jax.config import Config, ConfigError
from mimo_jax.data import audio_records, images, records
from mimo_jax.data.text import TokenIds

MANIFEST = "conversations.json"
SPLITS = ("train", "eval")
FORMAT_VERSION = 1
IMAGES = "images"  # the field of a sample that lists its images
# The ids the layout writes around converted samples: only padding, as each sample has its loss
# mask and the chat template's own bos and eos. Padding carries no loss and no sample's token
# attends to it, so any id serves; 0.
VOCABULARY = TokenIds(pad=0)


def encode(sample: dict) -> bytes:
  return records.pack({"tokens": np.asarray(sample["tokens"]).tolist(),
                       "loss_mask": np.asarray(sample["loss_mask"]).tolist(),
                       **({"id": sample["id"]} if "id" in sample else {}),
                       **audio_records.header(sample)}, sample[IMAGES],
                      audio_records.clips(sample))


def record_id(record: bytes, source: str, index: int):
  """The id of the LLaVA record a converted sample came from (its index in the source file where
  it had none, as tools.eval names a JSON's records); None in a conversion written before
  `encode` kept ids."""
  try:
    return records.unpack_all(record)[0].get("id")
  except ValueError as e:
    raise ValueError(f"{source}: record {index} is not a valid conversation sample ({e}).") \
        from None


def decode(record: bytes, source: str, index: int) -> dict:
  """Record -> {"images": [uint8 [h, w, c]], "tokens": int32 [n], "loss_mask": int32 [n]}, with
  "audios" [float32 [windows · 3000, mel_bins]] and "audio_frames" int32 [clips] where it has
  clips (audio_records.py); a bad record names the file and index."""
  try:
    header, pixels, clips = records.unpack_all(record)
    tokens = np.asarray(header["tokens"], np.int32)
    mask = np.asarray(header["loss_mask"], np.int32)
    if tokens.shape != mask.shape:
      raise ValueError(f"{mask.size} loss mask entries for {tokens.size} tokens")
    return {IMAGES: pixels, "tokens": tokens, "loss_mask": mask,
            **audio_records.sample_fields(header, clips)}
  except (ValueError, KeyError, TypeError) as e:
    raise ValueError(f"{source}: record {index} is not a valid conversation sample ({e}).") \
        from None


def manifest(directory: str, field: str = "config.data.dir") -> dict:
  """The manifest of a converted directory; errors name `field`, the setting that gave it (a
  tool's flag: `--data`)."""
  path = pathlib.Path(directory) / MANIFEST
  try:
    out = json.loads(path.read_text())
  except FileNotFoundError:
    reads = ("data.task=conversations reads" if field == "config.data.dir"
             else f"{field} takes a LLaVA-format JSON file or")
    raise ConfigError(f"{field}: {path} not found; {reads} a directory written by "
                      "`python -m tools.convert`.") from None
  except (OSError, ValueError) as e:
    raise ConfigError(f"{field}: {path} is unreadable ({e}); convert the data again.") from None
  if out.get("format") != FORMAT_VERSION:
    raise ConfigError(f"{field}: {path} has format {out.get('format')!r}, not "
                      f"{FORMAT_VERSION}; convert the data again.")
  return out


def placeholders(image_id: int | None, audio_id: int | None) -> dict[str, int]:
  """The registered encoders that read a sample's images or clips, each with the image or audio
  token as its placeholder (a conversion's marks: not the built-in tasks')."""
  ids = {IMAGES: image_id, audio_records.AUDIOS: audio_id}
  return {e.name: ids[e.sample_key] for e in encoders.REGISTRY.values()
          if ids.get(e.sample_key) is not None}


def shard_placeholders(shard: str) -> dict[str, int] | None:
  """The placeholders of a converted shard's samples, from the manifest beside it; None if it
  has none (a shard read on its own)."""
  try:
    m = json.loads((pathlib.Path(shard).parent / MANIFEST).read_text())
  except (OSError, ValueError):
    return None
  return placeholders(m.get("image_token"), m.get("audio_token"))


def paths(cfg: Config, directory: str = "") -> dict[str, str]:
  """The converted train and eval shards of `directory` (default `data.dir`), after checking that
  the run's fields agree with its manifest."""
  d = cfg.data
  directory = directory or d.dir
  m = manifest(directory)
  # Data without images may have no image token (-1: a tokenizer without one, as Qwen2-Audio's);
  # then nothing of the run's reads it.
  if (m.get("image_token") is not None and m["image_token"] >= 0
      and d.placeholder != m["image_token"]):
    raise ConfigError(f"config.data.image_token: {d.image_token} where {directory} marks images "
                      f"with token {m['image_token']}; set data.image_token={m['image_token']}.")
  images.check_sizes(cfg, directory, m["image_size"], m.get("image_sizes", []),
                     m.get("max_images") or 0)
  audio_records.check_config(cfg, directory, m)
  vocab = cfg.model.language.vocab_size or m["vocab_size"]
  if vocab < m["vocab_size"]:
    raise ConfigError(f"config.model.language.vocab_size: {vocab} is less than the tokenizer's "
                      f"{m['vocab_size']} ({source_path(directory, m['tokenizer'])}).")
  out = {}
  for split in SPLITS:
    path = pathlib.Path(directory) / f"{split}.array_record"
    if not path.exists():
      raise ConfigError(f"config.data.dir: {path} not found; convert the data again.")
    out[split] = str(path)
  return out


def source_path(directory: str, path: str) -> str:
  """A manifest's path (tokenizer, processor, source) as a path to open from any working
  directory. Conversions store absolute paths, or paths inside the directory relative to it;
  older ones stored paths relative to where the converter ran, so a relative path that is not in
  the directory is tried against the working directory too."""
  if not path or pathlib.Path(path).is_absolute():
    return path
  inside = pathlib.Path(directory) / path
  if inside.exists() or not pathlib.Path(path).exists():
    return str(inside.absolute())
  return str(pathlib.Path(path).absolute())
