"""The error of a record that cannot be converted, shared by conversion_record.py and the
modules of its items (audio_records.py), so neither imports the other to raise it."""

import json


class RecordError(ValueError):
  """A record that cannot be converted: the reason (a short key) and the message."""

  def __init__(self, reason: str, message: str):
    super().__init__(message)
    self.reason = reason


def paths(value, key: str, kind: str, where: str) -> list[str]:
  """A record's field `key` that lists files (absent: None): a path or a list of paths; anything
  else is a RecordError of reason "bad `kind` field" naming the record (`where`)."""
  if value is None:
    return []
  if isinstance(value, str) and value:
    return [value]
  if isinstance(value, list) and all(isinstance(f, str) and f for f in value):
    return value
  raise RecordError(f"bad {kind} field", f"{where}: \"{key}\" is {json.dumps(value)[:60]}, not "
                    "a path or a list of paths.")


def record_id(record: dict, where: str):
  """A record's "id": a string or an integer (absent: None); anything else (null, NaN, a float,
  a bool, a list, an object) is a RecordError of reason "bad id field" naming the record
  (`where`): a sample keeps its id, and records of one id stay on one side of the eval split."""
  if "id" not in record:
    return None
  value = record["id"]
  if isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool)):
    return value
  raise RecordError("bad id field", f"{where}: \"id\" is {json.dumps(value)[:60]}, not a string "
                    "or an integer; give the record a string id, or none (its index names it).")
