"""A LLaVA-format JSON or JSONL file's records, and the eval split a conversion draws from them:
every record of one id on the same side."""

from __future__ import annotations

import json
import os
import pathlib

import numpy as np

from mimo_jax.config import ConfigError
from mimo_jax.words import json_kind

# A default eval split: 1% of the records, at least 10 and at most 1000, at most a tenth of them.
EVAL_FRACTION, EVAL_MIN, EVAL_MAX = 0.01, 10, 1000


def read_records(path: pathlib.Path) -> list[dict]:
  """The records of a LLaVA-format JSON list or JSONL file (UTF-8)."""
  try:
    data = pathlib.Path(path).read_bytes()
  except OSError as e:
    raise ConfigError(f"--json {path}: unreadable ({os.strerror(e.errno) if e.errno else e}).") \
        from None
  try:
    text = data.decode("utf-8-sig")
  except UnicodeDecodeError as e:
    raise ConfigError(f"--json {path}: not UTF-8 (byte {data[e.start]:#04x} at offset {e.start}); "
                      "JSON is UTF-8: save the file as UTF-8.") from None
  if text.lstrip().startswith("["):
    try:
      out = json.loads(text)
    except ValueError as e:
      raise ConfigError(f"--json {path}: not JSON ({e}).") from None
  else:
    out = []
    for k, line in enumerate(text.splitlines()):
      if line.strip():
        try:
          out.append(json.loads(line))
        except ValueError as e:
          raise ConfigError(f"--json {path}: line {k + 1} is not JSON ({e}); JSONL holds one "
                            "record a line.") from None
  if not isinstance(out, list):
    raise ConfigError(f"--json {path}: {json_kind(out)}, not a list of records.")
  bad = next((i for i, r in enumerate(out) if not isinstance(r, dict)), None)
  if bad is not None:
    raise ConfigError(f"--json {path}: record {bad} is {json_kind(out[bad])}, not an object "
                      "with an id and conversations.")
  if not out:
    raise ConfigError(f"--json {path}: no records.")
  return out


def default_eval(records: int) -> int:
  """The eval split's size when none is given (EVAL_FRACTION, EVAL_MIN, EVAL_MAX)."""
  return max(1, min(EVAL_MAX, max(EVAL_MIN, round(records * EVAL_FRACTION)), records // 10))


def eval_split(records: list[dict], count: int, seed: int) -> tuple[set[int], list]:
  """The indices of about `count` records drawn for eval with `seed`, every record of one id on
  the same side (records without an id stand alone), and the ids several records share."""
  n = len(records)
  if n < 2:
    raise ConfigError(f"--json holds {n} record; a conversion needs at least 2 (one to train on, "
                      "one to evaluate).")
  if count < 1:
    raise ConfigError(f"--eval {count}: a run evaluates on the eval split (eval.samples > 0); "
                      f"hold out at least 1 record (without --eval: {default_eval(n)}).")
  if count >= n:
    raise ConfigError(f"--eval {count}: --json holds {n} records, and training needs some; hold "
                      f"out fewer (without --eval: {default_eval(n)}).")
  groups: dict[str, list[int]] = {}
  for i, r in enumerate(records):
    key = r.get("id")
    groups.setdefault(f"i{i}" if key is None else "k" + json.dumps(key, sort_keys=True),
                      []).append(i)
  members = list(groups.values())
  chosen: set[int] = set()
  for g in np.random.default_rng(seed).permutation(len(members)):
    if len(chosen) >= count:
      break
    chosen.update(members[g])
  if len(chosen) >= n:
    raise ConfigError(f"--eval {count}: the records share ids so that none would be left to "
                      "train on (each id's records stay on one side); hold out fewer.")
  shared = [records[g[0]].get("id") for g in members if len(g) > 1]
  return chosen, shared
