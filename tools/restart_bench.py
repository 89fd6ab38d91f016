"""Time to first step from a cold start and on restarts, each run a new process:

  python -m tools.restart_bench --config=configs/vlm.py:tuned [--set field=value ...]
      [--restarts 3] [--steps 2] [--log_compiles] [--keep DIR] [--json FILE]

Runs `python -m mimo_jax.launch` with the config in a new workdir and a new compilation cache:
first cold for `--steps` steps (sent SIGTERM once its last step has ended, so that it saves that
step and skips the final eval), then `--restarts` times with more steps, each run resuming from
the saved step with the cache filled and killed at its `time to first step` line (nothing after
it is saved). From each run's own lines it reports the time to first step, the restore (GiB and
seconds) and the first step program's compile or cache load. With `--log_compiles` the restarts
run with `JAX_LOG_COMPILES=1` (every compile and cache load timed in the log); `--keep DIR` keeps
the workdir, the cache and every run's log, each line stamped with the seconds since its spawn.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from tools.common import (Parser, figures_file, load_config, new_folder, number, own_fields,
                          run_config, write_figures)

FIRST = re.compile(r"time to first step: ([\d.]+) s")
RESTORED = re.compile(r"\(([\d.]+) (GiB|MiB) of state restored in ([\d.]+) s\)")
PROGRAM = re.compile(r"compiled step program 1 \(.*\) in ([\d.]+) s")


def run(cmd: list[str], log: str, stop: str, term: bool, env: dict, timeout: float) -> dict:
  """Runs `cmd` in its own process group, its output stamped into `log`; at the first line that
  holds `stop`, sends SIGTERM and reads on to its exit (`term`) or kills the group. Returns the
  figures its lines gave; raises SystemExit if it never printed `stop`, ran past `timeout`, or
  (`term`) did not exit cleanly after the SIGTERM. The group never outlives this call."""
  t0 = time.time()
  proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          start_new_session=True, env=dict(env, PYTHONUNBUFFERED="1"))
  kill = lambda: os.killpg(proc.pid, signal.SIGKILL) if proc.poll() is None else None
  timer = threading.Timer(timeout, kill)  # a run that hangs without a word is killed too
  timer.start()
  out = {"stopped": False}
  tail = []
  try:
    with open(log, "w", encoding="utf-8") as f:
      for line in proc.stdout:
        f.write(f"{time.time() - t0:8.2f} {line}")
        tail = (tail + [line.rstrip()])[-15:]
        for key, pattern in (("first_step_s", FIRST), ("program_1_s", PROGRAM)):
          m = pattern.search(line)
          if m and key not in out:
            out[key] = float(m.group(1))
        m = RESTORED.search(line)
        if m:
          out["restored_gib"] = float(m.group(1)) / (1024 if m.group(2) == "MiB" else 1)
          out["restore_s"] = float(m.group(3))
        if stop in line and not out["stopped"]:
          out["stopped"] = True
          if not term:
            kill()
            break
          os.kill(proc.pid, signal.SIGTERM)
    proc.wait()
  finally:
    timer.cancel()
    kill()  # an exception here (Ctrl-C among them) leaves no run behind
    proc.wait()
    proc.stdout.close()
  out["wall_s"] = time.time() - t0
  what = " ".join(cmd[2:4])
  if out["wall_s"] >= timeout:
    raise SystemExit(f"restart_bench: {what} ran past --timeout {timeout:g} s; its last "
                     "lines:\n" + "\n".join(tail))
  if not out["stopped"] or (term and proc.returncode != 0):
    raise SystemExit(f"restart_bench: {what} ended (status {proc.returncode}) "
                     f"{'after' if out['stopped'] else 'without'} '{stop}'; its last lines:\n"
                     + "\n".join(tail))
  return out


def main(argv: list[str] | None = None) -> None:
  parser = Parser("restart_bench", description=__doc__,
                  formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", default="configs/vlm.py:tuned", help="config file[:variant]")
  parser.add_argument("--set", action="append", default=[], help="field=value override")
  parser.add_argument("--steps", type=number(int, least=1), default=2,
                      help="steps of the cold run (then saved)")
  parser.add_argument("--restarts", type=number(int, least=1), default=3)
  parser.add_argument("--log_compiles", action="store_true",
                      help="run the restarts with JAX_LOG_COMPILES=1")
  parser.add_argument("--keep", default="", help="keep the workdir, cache and logs here")
  parser.add_argument("--timeout", type=number(float, above=0), default=900,
                      help="seconds a run may take")
  parser.add_argument("--json", default="", help="write the figures to this file")
  args = parser.parse_args(argv)
  own_fields("restart_bench", args.set, ("run.workdir", "run.compile_cache", "train.steps",
                                         "run.progress", "run.log_every"),
             "a new workdir and cache, a line a step; --steps for the cold run's steps")
  load_config("restart_bench", args.config, args.set)  # the --set flags as typed: one line
  if args.json:
    figures_file("restart_bench", "--json", args.json)  # written at the end: checked now

  def fields(root: str, steps: int) -> list[str]:
    """A run's fields (`a.b=value`), in its launch line's order: the --set ones, then the tool's."""
    return [*args.set, f"run.workdir={os.path.join(root, 'workdir')}",
            f"run.compile_cache={os.path.join(root, 'cache')}", "run.progress=lines",
            "run.log_every=1", f"train.steps={steps}"]

  # Each run's config as launch reads it, before anything is made or started (the folder the
  # runs get does not change what is checked).
  somewhere = args.keep or tempfile.gettempdir()
  run_config("restart_bench", args.config, fields(somewhere, args.steps), "the cold run")
  run_config("restart_bench", args.config, fields(somewhere, args.steps + 10), "the restarts")
  if args.keep:
    new_folder("restart_bench", "--keep", args.keep, "its runs would resume from what it holds")
  root = args.keep or tempfile.mkdtemp(prefix="restart_bench_")
  launch = [sys.executable, "-m", "mimo_jax.launch", f"--config={args.config}"]
  cold, warm = ([*launch, *[f"--config.{s}" for s in fields(root, n)]]
                for n in (args.steps, args.steps + 10))
  env = {k: v for k, v in os.environ.items() if k != "MIMO_JAX_COMPILE_CACHE"}
  rows = []
  try:
    print(f"cold: {args.steps} steps, saved at the end", flush=True)
    rows.append(dict(run(cold, os.path.join(root, "cold.log"), f"step {args.steps} ended", True,
                         env, args.timeout), run="cold"))
    restart_env = dict(env, JAX_LOG_COMPILES="1") if args.log_compiles else env
    for i in range(1, args.restarts + 1):
      rows.append(dict(run(warm, os.path.join(root, f"restart{i}.log"), "time to first step",
                           False, restart_env, args.timeout), run=f"restart {i}"))
      if "restore_s" not in rows[-1]:
        raise SystemExit(f"restart_bench: restart {i} did not resume from the cold run's step "
                         f"{args.steps} (see {os.path.join(root, f'restart{i}.log')} with --keep)")
      print(f"restart {i}: time to first step {rows[-1].get('first_step_s', float('nan')):.1f} s",
            flush=True)
  finally:
    if not args.keep:
      shutil.rmtree(root, ignore_errors=True)
  fmt = lambda r, k, digits=1: f"{r[k]:.{digits}f}" if k in r else "–"
  print("\n| run | time to first step s | restored GiB | restore s | step program 1 s |\n"
        "|---|---:|---:|---:|---:|")
  for r in rows:
    print(f"| {r['run']} | {fmt(r, 'first_step_s')} | {fmt(r, 'restored_gib', 2)} | "
          f"{fmt(r, 'restore_s')} | {fmt(r, 'program_1_s')} |")
  restarts = sorted(r["first_step_s"] for r in rows[1:] if "first_step_s" in r)
  if restarts:
    print(f"\nrestarts: median {statistics.median(restarts):.1f} s "
          f"(min {restarts[0]:.1f}, max {restarts[-1]:.1f})")
  if args.json:
    write_figures("restart_bench", args.json, {"config": args.config, "set": args.set,
                                                "runs": rows})


if __name__ == "__main__":
  main()
