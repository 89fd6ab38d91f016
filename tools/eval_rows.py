"""tools.eval's results file (tools/eval.py says what it holds): where it goes (`default_out`),
the settings that key it, the rows it holds and appends under its lock (`Rows`), and the
summary beside it."""

from __future__ import annotations

import argparse
import itertools
import json
import os
import pathlib

from mimo_jax import output
from mimo_jax import workdir as workdir_lib


def default_out(args: argparse.Namespace, step: int, settings: dict) -> pathlib.Path:
  """WORKDIR/eval/<data name>[.<split>].step<N>.jsonl, or where that holds the rows of an eval
  of other settings, the first of <...>.2.jsonl, .3.jsonl, ... that holds this eval's or
  nothing (so that the same command finds its rows again)."""
  name = pathlib.Path(os.path.normpath(args.data)).name.removesuffix(".jsonl").removesuffix(".json")
  split = f".{args.split}" if os.path.isdir(args.data) else ""
  folder, stem = pathlib.Path(args.workdir) / "eval", f"{name}{split}.step{step}"
  for k in itertools.count(1):
    out = folder / (f"{stem}.jsonl" if k == 1 else f"{stem}.{k}.jsonl")
    if not out.exists() or _as_now(_recorded_settings(out), settings) == settings:
      return out


def _recorded_settings(out: pathlib.Path) -> dict | None:
  """The settings `Rows` recorded beside `out`, or None where there are none to read."""
  try:
    return json.loads(settings_path(out).read_text())
  except (OSError, ValueError):
    return None


def _as_now(recorded: dict | None, settings: dict) -> dict | None:
  """`recorded` (`_recorded_settings`) as these `settings` write them: a JSON's split is null
  (it has none), where settings written before that hold "eval"; the sample count, which older
  settings held, is none of them (`--samples` takes the first N samples, so the rows of a
  smaller N are the first rows of a larger one)."""
  if recorded is None:
    return None
  recorded = {k: v for k, v in recorded.items() if k != "samples"}
  if settings.get("split") is None and recorded.get("split") == "eval":
    recorded["split"] = None
  return recorded


def settings_path(out: pathlib.Path) -> pathlib.Path:
  return out.with_name(out.name + ".settings.json")


def summary_path(out: pathlib.Path) -> pathlib.Path:
  return out.with_name(out.name.removesuffix(".jsonl") + ".summary.json")


def key(row: dict) -> str:
  """What a sample's row is kept by: its position in a converted split (records may share an
  id; rows of older versions, which lack the position, hold it as their id), else its id (a
  JSON's ids are checked to be unique)."""
  return json.dumps(row.get("position", row["id"]))


class Rows:
  """`--out` under its lock: the rows it holds (a torn last line is dropped), and appends. Nothing
  is written before the first append (an eval that stops before answering leaves no file, and an
  earlier eval's file as it was). A failed write (a full disk) is one line naming `--out`
  (output.write_errors); the rows before it stay, and the same command goes on from them."""

  def __init__(self, out: pathlib.Path, settings: dict, flag: str = "--out"):
    """`flag`: how errors name `out` (the default --out is not a flag the user gave)."""
    self.out, self.settings = out, settings
    self.what, self.named = f"{flag}={str(out)!r}", f"{flag} {out}"
    self.made = workdir_lib.Made(str(out.parent))  # the folders the lock makes, if unused
    self.lock = output.lock(out, flag)
    self.done: dict[str, dict] = {}
    self.file, self.keep = None, None
    try:
      with output.write_errors(self.what):
        self._read()
      self.earlier, self.added = len(self.done), 0  # rows in the file: read, and written since
    except BaseException:
      self.close()
      raise

  def _read(self) -> None:
    if not self.out.exists():
      return
    recorded = _as_now(_recorded_settings(self.out), self.settings)
    if recorded is None:  # not an eval's rows: maybe the data itself
      raise output.OutputError(
          f"{self.named} exists and is no eval's rows file (it has no readable "
          f"{settings_path(self.out).name} beside it); give another --out.")
    if recorded != self.settings:
      differ = "; ".join(f"{k} {recorded.get(k)!r} there, {v!r} here"
                         for k, v in self.settings.items() if recorded.get(k) != v)
      raise output.OutputError(f"{self.named} holds rows of another eval ({differ}); give "
                               "another --out or remove it.")
    data = self.out.read_bytes()
    self.keep = data.rfind(b"\n") + 1  # a line cut by a crash is written again
    for n, line in enumerate(data[:self.keep].split(b"\n")[:-1], 1):
      try:
        row = json.loads(line.decode())
        scored = row["score"]  # every metric's, as the summary reads them
        missing = [m for m in self.settings.get("metrics", ()) if m not in scored]
        if missing:
          raise KeyError(f"no score of {', '.join(missing)}")
        self.done[key(row)] = row
      except (UnicodeDecodeError, ValueError, AttributeError, KeyError, TypeError) as e:
        raise output.OutputError(
            f"{self.named}: line {n} is not an eval's row ({type(e).__name__}: {e}); remove "
            "it (the eval answers its sample again) or give another --out.") from None

  def _open(self) -> None:
    """`--out` opened to append: its torn last line cut, or made with its settings beside it."""
    if self.keep is None:
      output.write_whole(settings_path(self.out), self.settings)
    elif self.out.stat().st_size != self.keep:
      with open(self.out, "r+b") as f:
        f.truncate(self.keep)
    self.file = open(self.out, "a", encoding="utf-8")  # pylint: disable=consider-using-with

  def append(self, rows: list[dict]) -> None:
    for row in rows:
      self.done[key(row)] = row
    with output.write_errors(self.what):
      if self.file is None:
        self._open()
      self.file.write("".join(json.dumps(r) + "\n" for r in rows))
      self.added += len(rows)  # written: an interrupt from here on leaves them in the file
      self.file.flush()
      os.fsync(self.file.fileno())

  def close(self) -> None:
    try:
      # Every append was flushed and synced: only a failed one's bytes (reported) can fail again.
      if self.file is not None:
        self.file.close()
    except OSError:
      pass
    finally:
      self.lock.release()
      if self.file is None and self.keep is None:  # nothing written: the folders made, if empty
        self.made.remove_unused(None)


def earlier_speed(out: pathlib.Path) -> float | None:
  """The answering speed `out`'s summary holds (a run that answers nothing keeps it), or None."""
  try:
    return json.loads(summary_path(out).read_text()).get("new_tokens_per_s")
  except (OSError, ValueError):
    return None
