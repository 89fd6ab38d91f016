"""FP8 against bfloat16 training: does `model.<module>.fp8` stay within bfloat16's seed-to-seed spread?

  python -m tools.fp8_check [--config configs/digits.py:single] [--seeds 0,1,2,3,4]
      [--scaling current|delayed] [--set field=value ...] [--out /tmp/fp8_check]

Trains the config once per seed (`train.seed` and `data.seed` both set to it) in bfloat16 and once
with both modules' matmuls in FP8 (`--scaling`: their `fp8_scaling`, current or delayed), each a
`python -m mimo_jax.launch` run in its own workdir under `--out`, and prints a table of the last
training loss and the final eval figures of every run, with each column's mean and standard
deviation over the seeds, and the FP8 mean's distance from the bfloat16 one in bfloat16 standard
deviations. The default, the digits task on one device, is a learnable task (unlike the synthetic
benchmark data): about 40 s a run on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import time

from tools.common import Parser, fail, load_config, new_folder, own_fields, run_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
COLUMNS = ("loss", "eval_loss", "eval_accuracy")


def last_metrics(workdir: pathlib.Path) -> dict:
  """The last value of each column in the run's metrics.jsonl."""
  out = {}
  with open(workdir / "metrics.jsonl", encoding="utf-8") as f:
    for line in f:
      row = json.loads(line)
      out.update({k: row[k] for k in COLUMNS if k in row})
  return out


def run_sets(seed: int, fp8: bool, sets: list[str], workdir: pathlib.Path,
             scaling: str = "current") -> list[str]:
  """A run's fields (`a.b=value`) in the order its launch line sets them: the precision, the
  seeds, the workdir, then the `--set` ones."""
  flag = "true" if fp8 else "false"
  scale = [f"model.{m}.fp8_scaling={scaling}" for m in ("vision", "language")]
  return ["model.dtype=bfloat16", f"model.vision.fp8={flag}", f"model.language.fp8={flag}",
          *(scale if fp8 else []), f"train.seed={seed}", f"data.seed={seed}",
          f"run.workdir={workdir}", "run.progress=lines", *sets]


# The fields each run's launch line sets (run_sets), which a --set may not change.
OWN = ("model.dtype", "model.vision.fp8", "model.language.fp8", "model.vision.fp8_scaling",
       "model.language.fp8_scaling", "train.seed", "data.seed", "run.workdir", "run.progress")


def train(config: str, seed: int, fp8: bool, sets: list[str], workdir: pathlib.Path,
          scaling: str = "current") -> dict:
  cmd = [sys.executable, "-m", "mimo_jax.launch", f"--config={config}",
         *[f"--config.{s}" for s in run_sets(seed, fp8, sets, workdir, scaling)]]
  log = workdir.with_suffix(".log")
  with open(log, "w", encoding="utf-8") as f:
    rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, check=False).returncode
  if rc:
    raise SystemExit(f"fp8_check: {' '.join(cmd)} exited {rc}; its output is in {log}")
  return last_metrics(workdir)


def summary(rows: dict[str, list[tuple[int, dict]]]) -> str:
  """`rows`: per precision, (seed, last metrics) of each run."""
  lines = ["| run | seed | " + " | ".join(COLUMNS) + " |", "|---|---:|" + "---:|" * len(COLUMNS)]
  stats = {}
  for name, runs in rows.items():
    for seed, m in runs:
      lines.append(f"| {name} | {seed} | " + " | ".join(f"{m.get(c, float('nan')):.4f}"
                                                       for c in COLUMNS) + " |")
    for c in COLUMNS:
      vals = [m[c] for _, m in runs if c in m]
      stats[name, c] = (statistics.mean(vals), statistics.stdev(vals) if len(vals) > 1 else 0.0)
    lines.append(f"| {name} | mean ± sd | " + " | ".join(
        f"{stats[name, c][0]:.4f} ± {stats[name, c][1]:.4f}" for c in COLUMNS) + " |")
  gaps = []
  for c in COLUMNS:
    (fm, _), (bm, bs) = stats["fp8", c], stats["bfloat16", c]
    gaps.append(f"{(fm - bm) / bs:+.2f}" if bs > 0 else "–")
  lines.append("| fp8 − bfloat16 | in bfloat16 sd | " + " | ".join(gaps) + " |")
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
  parser = Parser("fp8_check", description=__doc__,
                  formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", default="configs/digits.py:single", help="config file[:variant]")
  parser.add_argument("--seeds", default="0,1,2,3,4",
                      help="comma-separated seeds (two or more, different, each >= 0)")
  parser.add_argument("--set", action="append", default=[],
                      help="field=value override for every run, e.g. train.steps=300")
  parser.add_argument("--scaling", choices=("current", "delayed"), default="current",
                      help="the FP8 runs' model.<module>.fp8_scaling")
  parser.add_argument("--out", default="/tmp/fp8_check", help="where the runs' workdirs go")
  args = parser.parse_args(argv)
  try:
    seeds = [int(s) for s in args.seeds.split(",")]
  except ValueError:
    fail("fp8_check", f"--seeds={args.seeds}: not comma-separated integers such as 0,1,2.")
  if len(seeds) < 2 or len(set(seeds)) < len(seeds) or not 0 <= min(seeds) <= max(seeds) < 2**32:
    fail("fp8_check", f"--seeds={args.seeds}: two or more different seeds for a spread (a seed "
         "names its runs' workdirs), each from 0 to 2**32 - 1 (data.seed's range).")
  own_fields("fp8_check", args.set, OWN, "--seeds for the seeds, --scaling for FP8's, --out for "
             "the workdirs; the runs compare bfloat16 with FP8 in both modules")
  load_config("fp8_check", args.config, args.set)  # the --set flags as typed: one line, status 2
  out = pathlib.Path(args.out)
  for name in ("bfloat16", "fp8"):  # each run's config as launch reads it, before any run
    run_config("fp8_check", args.config,
               run_sets(seeds[0], name == "fp8", args.set, out / f"{name}_{seeds[0]}",
                        args.scaling), runs=f"the {name} runs")
  new_folder("fp8_check", "--out", str(out), "runs would resume from what it holds")
  rows: dict[str, list] = {"bfloat16": [], "fp8": []}
  total, start = 2 * len(seeds), time.time()
  for seed in seeds:
    for name in rows:
      m = train(args.config, seed, name == "fp8", args.set, out / f"{name}_{seed}", args.scaling)
      rows[name].append((seed, m))
      done = sum(map(len, rows.values()))
      print(f"[{time.time() - start:7.1f}s] {done}/{total} {name} seed {seed}: " +
            ", ".join(f"{k} {v:.4f}" for k, v in m.items()), flush=True)
  print(f"FP8 runs with {args.scaling} scaling")
  print(summary(rows))


if __name__ == "__main__":
  main()
