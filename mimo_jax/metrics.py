"""Run outputs: metrics.jsonl, TensorBoard scalars, and a progress bar or plain log lines; the
window of steps whose average a record logs, and lines said before the outputs are open."""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
from typing import Callable

from tqdm import tqdm


class NonFiniteError(FloatingPointError):
  """A logged metric is NaN or Inf."""


def _summary_writer():
  """tensorboardX's `SummaryWriter`, imported without torch. tensorboardX imports torch whenever it
  is installed, only to recognise torch tensors (a run logs Python floats), and that import takes
  seconds on the way to a run's first step; a process that has imported torch already keeps it.
  Called once, as this module is imported (before a run starts threads: while it runs, an
  `import torch` elsewhere in the process would fail)."""
  if "torch" in sys.modules:
    from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel
    return SummaryWriter
  sys.modules["torch"] = None  # `import torch` raises ImportError while this is here
  try:
    from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel
  finally:
    if "torch" in sys.modules and sys.modules["torch"] is None:
      del sys.modules["torch"]
  return SummaryWriter


SummaryWriter = _summary_writer()


def stamped(t0: float, line: str) -> str:
  """A console line stamped with the seconds since `t0` (time.time()), as a run prints them."""
  return f"[{time.time() - t0:7.1f}s] {line}"


class MetricsWriter:
  """Writes one JSON object per logged record; mirrors scalars to TensorBoard and the console."""

  def __init__(self, workdir: str, total_steps: int, progress: str = "auto",
               resume_after: int = 0, enabled: bool = True, started: float | None = None):
    """`resume_after` > 0 keeps the records of steps up to it (those a checkpoint covers).
    `started`: the time (time.time()) the console lines' clock counts from (default: now).

    A disabled writer (processes other than 0) writes and prints nothing but still checks values.
    """
    self.enabled = enabled
    self._t0 = time.time() if started is None else started
    self.evaluated = set()  # steps whose eval record is kept from before
    if not enabled:
      return
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, "metrics.jsonl")
    kept = []
    if os.path.exists(path):
      kept = _records_through(path, resume_after)
    # The kept records are rewritten atomically, then appended to.
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
      f.writelines(kept)
    os.replace(tmp, path)
    self.evaluated = _evaluated(kept)
    self._jsonl = open(path, "a", encoding="utf-8")
    # Events of steps after the checkpoint (from the run that was cut short) are dropped.
    self._tb = SummaryWriter(os.path.join(workdir, "tb"), purge_step=resume_after + 1)
    use_bar = progress == "bar" or (progress == "auto" and sys.stderr.isatty())
    self._bar = tqdm(total=total_steps, initial=min(resume_after, total_steps), unit="step",
                     dynamic_ncols=True) if use_bar else None

  def write(self, record: dict) -> None:
    """Logs a record with a `step`; raises NonFiniteError on NaN/Inf (after writing it)."""
    step = record["step"]
    if self.enabled:
      self._jsonl.write(json.dumps(_strict(record), allow_nan=False) + "\n")
      self._jsonl.flush()
      for k, v in record.items():
        if k != "step" and isinstance(v, (int, float)):
          self._tb.add_scalar(k, v, step)
      self.say(format_record(record))
    bad = [k for k, v in record.items() if isinstance(v, float) and not math.isfinite(v)]
    if bad:
      raise NonFiniteError(f"step {step}: {', '.join(bad)} is not finite; lower optim.lr or "
                           "check the data.")

  def advance(self, steps: int = 1) -> None:
    if self.enabled and self._bar is not None:
      self._bar.update(steps)

  def say(self, line: str) -> None:
    if not self.enabled:
      return
    if self._bar is not None:
      self._bar.write(line)
    else:
      print(stamped(self._t0, line), flush=True)

  def close(self) -> None:
    if not self.enabled:
      return
    if self._bar is not None:
      self._bar.close()
    self._tb.close()
    self._jsonl.close()


def evaluated_through(workdir: str, step: int) -> set[int]:
  """The steps with an eval record among `workdir`'s records up to `step` (those a run resuming
  from a checkpoint of `step` keeps)."""
  path = os.path.join(workdir, "metrics.jsonl")
  return _evaluated(_records_through(path, step)) if os.path.exists(path) else set()


def _evaluated(lines: list[str]) -> set[int]:
  return {json.loads(ln)["step"] for ln in lines if '"eval_' in ln}


def _records_through(path: str, step: int) -> list[str]:
  """The lines of a metrics file up to `step` (a torn last line, from a run that was killed while
  writing, is dropped)."""
  kept = []
  with open(path, encoding="utf-8") as f:
    for ln in f:
      try:
        record = json.loads(ln)
      except ValueError:
        continue
      if isinstance(record, dict) and isinstance(record.get("step"), int) and \
          record["step"] <= step:
        kept.append(ln if ln.endswith("\n") else ln + "\n")
  return kept


def _strict(record: dict) -> dict:
  """Strict JSON has no NaN or Infinity: such values are written as the strings "nan", "inf" and
  "-inf"."""
  return {k: str(v) if isinstance(v, float) and not math.isfinite(v) else v
          for k, v in record.items()}


def format_record(record: dict) -> str:
  parts = [f"step {record['step']}"]
  for k, v in record.items():
    if k == "step":
      continue
    parts.append(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}")
  return " | ".join(parts)


class StepWindow:
  """The steps since the last record, whose average a record logs as its step time.

  The run's first step compiles its programs: it is in no average (the first window starts when
  it completes); logged alone, its whole time is.
  """

  def __init__(self):
    self.start = None  # when the window's first step completed; None before the run's first
    self.steps = 0
    self.tokens = 0

  def completed(self, now: float, tokens: int) -> None:
    """Counts a step whose metrics have just been fetched."""
    if self.start is None:
      self.start = now
    else:
      self.steps += 1
      self.tokens += tokens

  def restart(self, now: float) -> None:
    self.start, self.steps, self.tokens = now, 0, 0

  def timing(self, now: float, dispatched: float, info: dict) -> tuple[float, dict]:
    """A record's step time, and its batch info with tokens averaged like it.

    Averaged over the window: a single interval between completions is noisy when metrics are
    fetched one step late. The last step is timed like the others: from its dispatch it would
    also count its wait behind the step before it, which the loop dispatches it beside.
    """
    if self.steps:
      took = (now - self.start) / self.steps
      info = dict(info, tokens=self.tokens / self.steps)
    else:  # the first step logged alone: from its dispatch, compilation included
      took = now - dispatched
    return took, info


class SaidLater:
  """Lines said (by any thread) before the run's outputs are open, said in order once they are
  (`to`); said at once after."""

  def __init__(self):
    self._lock = threading.Lock()
    self._lines: list[str] = []
    self._say: Callable[[str], None] | None = None

  def __call__(self, line: str) -> None:
    with self._lock:
      if self._say is None:
        self._lines.append(line)
        return
    self._say(line)

  def to(self, say: Callable[[str], None]) -> None:
    with self._lock:
      for line in self._lines:
        say(line)
      self._lines, self._say = [], say
