"""What identifies a run's data beyond its config fields: a converted data set's manifest, shards
and tokenizer, digested. A checkpoint records it, and a resume on other data is refused unless
`checkpoint.allow_data_change` (checkpoint_config.check_compatible)."""

from __future__ import annotations

import hashlib
import os
import pathlib

from mimo_jax.config import Config, ConfigError
from mimo_jax.data import conversations, meta as data_meta


def sha256(path: pathlib.Path, ends: int | None = None) -> str | None:
  """The SHA-256 of a file (with `ends`: of its size and its first and last `ends` bytes); None
  where it cannot be read."""
  digest = hashlib.sha256()
  try:
    with open(path, "rb") as f:
      if ends is None:
        for chunk in iter(lambda: f.read(1 << 20), b""):
          digest.update(chunk)
      else:
        size = os.fstat(f.fileno()).st_size
        digest.update(str(size).encode() + f.read(ends))
        f.seek(max(size - ends, 0))
        digest.update(f.read(ends))
  except OSError:
    return None
  return digest.hexdigest()


def fingerprint(cfg: Config) -> dict:
  """What identifies converted data (data.task=conversations) beyond the run's fields: digests
  of its manifest, of each shard's sidecar with its size and first and last 64 KiB, and of the
  tokenizer's files; {} for the built-in tasks, which their data fields define."""
  if cfg.data.task != "conversations":
    return {}
  root = pathlib.Path(cfg.data.dir)
  out = {"dir": str(root.resolve()), "manifest": sha256(root / conversations.MANIFEST)}
  for split in conversations.SPLITS:
    shard = root / f"{split}.array_record"
    out[split] = {"bytes": shard.stat().st_size if shard.exists() else None,
                  "digest": sha256(shard, ends=1 << 16),
                  "sidecar": sha256(pathlib.Path(data_meta.path_of(str(shard))))}
  try:
    tokenizer = pathlib.Path(conversations.source_path(
        cfg.data.dir, conversations.manifest(cfg.data.dir)["tokenizer"]))
  except (ConfigError, KeyError):
    tokenizer = None
  out["tokenizer"] = None if tokenizer is None else {
      f: sha256(tokenizer / f) for f in ("tokenizer.json", "tokenizer_config.json")}
  return out


def differences(saved: dict | None, current: dict) -> list[str]:
  """What differs between two data fingerprints (none where the step has none: a built-in task,
  or written before fingerprints were kept)."""
  if not saved or not current:
    return []
  where = f"data.dir={current['dir']!r}" + (
      f" (the step's: {saved['dir']!r})" if saved.get("dir") != current["dir"] else "")
  what = []
  if saved.get("manifest") != current["manifest"]:
    what.append("its manifest")
  for split in ("train", "eval"):
    a, b = saved.get(split, {}), current[split]
    if a.get("bytes") != b["bytes"]:
      what.append(f"its {split} shard ({a.get('bytes')} bytes, now {b['bytes']})")
    elif a != b:
      what.append(f"its {split} shard's records")
  if saved.get("tokenizer") and current["tokenizer"] and any(
      v and saved["tokenizer"].get(k) and v != saved["tokenizer"][k]
      for k, v in current["tokenizer"].items()):
    what.append("its tokenizer")
  return [f"{where}: {', '.join(what)} differ{'s' if len(what) == 1 else ''}"] if what else []
