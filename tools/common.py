"""Shared helpers of the benchmark tools: timing and recording results in docs/benchmarks.md."""

from __future__ import annotations

import datetime
import pathlib
import subprocess
import sys
import time

import jax
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "docs" / "benchmarks.md"


def median_time(fn, reps: int = 5) -> float:
  """Median seconds of `fn()` (waited for) over `reps` calls, after one untimed call that
  compiles and allocates."""
  return median_times({"fn": fn}, reps)["fn"]


def median_times(fns: dict, reps: int = 5) -> dict:
  """`median_time` of several functions measured in turns (a, b, a, b, ...), so that a drift in
  the machine's speed during the measurement reaches every one of them alike."""
  for fn in fns.values():
    jax.block_until_ready(fn())
  times = {k: [] for k in fns}
  for _ in range(reps):
    for k, fn in fns.items():
      t = time.perf_counter()
      jax.block_until_ready(fn())
      times[k].append(time.perf_counter() - t)
  return {k: float(np.median(v)) for k, v in times.items()}


def record(title: str, tool: str, argv: list[str] | None, body: str, notes: tuple = (),
           device: bool = True) -> None:
  """Appends a section to docs/benchmarks.md: title, device (jax's devices), date, the commit
  measured, the command that produced it (`python -m tools.<tool>` with its arguments), `notes`
  lines, then `body`. The file keeps current figures only: remove the section this one replaces."""
  cmd = f"python -m tools.{tool} " + " ".join(sys.argv[1:] if argv is None else argv)
  lines = [f"## {title}", ""]
  if device:
    lines.append(f"- device: {len(jax.devices())} x {jax.devices()[0].device_kind}; "
                 f"jax {jax.__version__}")
  lines += [f"- date: {datetime.date.today().isoformat()}", f"- commit: {_commit()}",
            f"- command: `{cmd}`"]
  lines += [f"- {n}" for n in notes]
  if not BENCHMARKS.exists():
    BENCHMARKS.write_text("# Benchmarks\n\nCurrent figures, measured with the scripts in "
                          "`tools/`.\n")
  with open(BENCHMARKS, "a", encoding="utf-8") as f:
    f.write("\n" + "\n".join(lines) + f"\n\n{body}\n")
  print(f"appended to {BENCHMARKS}")


def _commit() -> str:
  """The checkout's commit (with "+ changes" if its tracked files differ), or "unknown"."""
  try:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout.strip()
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=ROOT).returncode != 0
  except (OSError, subprocess.CalledProcessError):
    return "unknown (not a git checkout)"
  return head + (" + uncommitted changes" if dirty else "")
