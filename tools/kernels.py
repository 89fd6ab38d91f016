"""Where a training step's GPU time goes: per-kernel time shares from a profiler trace.

  python -m tools.kernels --config=configs/vlm.py --layout=vision=0/1/1,language=0/1/1 \\
      --set data.text_len=2000 --set data.text_len_sigma=0 --set data.image_probs=0,0,0,1 \\
      [--steps 2] [--top 25] [--out DIR] [--json FILE]

Trains `--warmup` steps (compilation), then `--steps` steps as training dispatches them under
`jax.profiler.trace` (the trace is kept in `--out`), and sums the device's kernel time:

* by **category** of kernel: `matmul` (cuBLAS/cuBLASLt/CUTLASS kernels and XLA's Triton GEMM
  fusions), `attention` (cuDNN's fused attention), `fusion` (XLA's elementwise and reduction
  fusions: norms, activations, bias and residual adds, casts, the loss; memory-bound), `copy`
  (memcpy, memset, dynamic-update-slice and copy kernels), `collective` (NCCL), `other`;
* by **program** (the compiled XLA module a kernel belongs to, e.g. the vision encoder's or the
  language model's step) and category;
* the `--top` kernels by total time, with their counts.

Shares are of the summed kernel time on the device (busy time; idle gaps are not kernels), which
is also printed beside the wall time of the traced steps.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import time

import jax

from mimo_jax import configfile
from mimo_jax.config import set_layout
from tools.bench import Run

CATEGORIES = (
    ("collective", re.compile(r"nccl|all_?reduce|all_?gather|reduce_?scatter|collective", re.I)),
    ("attention", re.compile(r"fmha|flash|sdpa|cudnn|attention|fprop_|bprop_", re.I)),
    ("matmul", re.compile(r"gemm|cutlass|xmma|nvjet|cublas|sm\d+_.*(hmma|gmma)|triton_gemm|"
                          r"__triton_gemm|dot", re.I)),
    ("copy", re.compile(r"memcpy|memset|copy|dynamic_update_slice|dynamic-update-slice|"
                        r"concatenate|transpose", re.I)),
    ("fusion", re.compile(r"fusion|loop_|input_|reduce|convert|multiply|add|broadcast|select|"
                          r"triton", re.I)),
)


def category(name: str, op: str) -> str:
  for cat, pattern in CATEGORIES:
    if pattern.search(name) or (op and pattern.search(op)):
      return cat
  return "other"


def read_trace(directory: str) -> tuple[list[dict], dict[int, str]]:
  files = sorted(glob.glob(os.path.join(directory, "**", "*perfetto_trace.json.gz"),
                           recursive=True))
  if not files:
    raise SystemExit(f"kernels: no perfetto trace under {directory}")
  with gzip.open(files[-1]) as f:
    data = json.load(f)
  events = data["traceEvents"] if isinstance(data, dict) else data
  procs = {e["pid"]: e.get("args", {}).get("name", "") for e in events
           if e.get("ph") == "M" and e.get("name") == "process_name"}
  return events, procs


def summarize(events: list[dict], procs: dict[int, str]) -> dict:
  """Kernel time by category, by program and category, and by kernel, on the device tracks."""
  device = {pid for pid, name in procs.items() if "/device:" in name}
  by_cat, by_prog, by_kernel, counts = (collections.Counter(), collections.Counter(),
                                        collections.Counter(), collections.Counter())
  ops: dict[tuple[str, str], collections.Counter] = {}  # kernel -> the HLO ops it ran for
  total = 0.0
  for e in events:
    if e.get("ph") != "X" or e.get("pid") not in device:
      continue
    args = e.get("args", {})
    name = e.get("name", "")
    op = str(args.get("hlo_op", "") or args.get("long_name", ""))
    prog = str(args.get("hlo_module", "") or "?")
    dur = float(e.get("dur", 0.0)) / 1e6  # microseconds -> seconds
    cat = category(name, op)
    total += dur
    by_cat[cat] += dur
    by_prog[(prog, cat)] += dur
    key = (name[:90], cat)
    by_kernel[key] += dur
    counts[key] += 1
    ops.setdefault(key, collections.Counter())[f"{prog}: {op}"[:200]] += dur
  return {"total_s": total, "categories": dict(by_cat),
          "programs": {f"{p} / {c}": v for (p, c), v in by_prog.items()},
          "kernels": [{"name": n, "category": c, "s": v, "count": counts[(n, c)],
                       "ops": [[o, t] for o, t in ops[(n, c)].most_common(3)]}
                      for (n, c), v in by_kernel.most_common()],
          "device_tracks": sorted(procs[p] for p in device)}


def report(summary: dict, steps: int, wall_s: float, top: int) -> str:
  total = summary["total_s"] or 1.0
  lines = [f"traced {steps} steps: {wall_s / steps:.3f} s/step wall, "
           f"{summary['total_s'] / steps:.3f} s/step of kernels "
           f"({', '.join(summary['device_tracks']) or 'no device tracks'})", "",
           "| category | s/step | share |", "|---|---:|---:|"]
  for cat, v in sorted(summary["categories"].items(), key=lambda kv: -kv[1]):
    lines.append(f"| {cat} | {v / steps:.4f} | {v / total:.1%} |")
  lines += ["", "| program / category | s/step | share |", "|---|---:|---:|"]
  for key, v in sorted(summary["programs"].items(), key=lambda kv: -kv[1])[:20]:
    lines.append(f"| {key} | {v / steps:.4f} | {v / total:.1%} |")
  lines += ["", "| kernel | category | calls/step | s/step | share |", "|---|---|---:|---:|---:|"]
  for k in summary["kernels"][:top]:
    lines.append(f"| `{k['name']}` | {k['category']} | {k['count'] / steps:g} | "
                 f"{k['s'] / steps:.4f} | {k['s'] / total:.1%} |")
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(prog="python -m tools.kernels", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", default="configs/vlm.py", help="config file[:variant]")
  parser.add_argument("--layout", default="vision=0/1/1,language=0/1/1",
                      help="module=o/dp/tp[/pp[/v]], comma-separated (as tools.bench)")
  parser.add_argument("--set", action="append", default=[], help="field=value override")
  parser.add_argument("--warmup", type=int, default=2)
  parser.add_argument("--steps", type=int, default=2)
  parser.add_argument("--top", type=int, default=25)
  parser.add_argument("--out", default="/tmp/mimo_jax_trace", help="where the trace is kept")
  parser.add_argument("--json", default="", help="write the summary to this file")
  args = parser.parse_args(argv)
  cfg = configfile.load(args.config, [f"--config.{s}" for s in args.set])
  set_layout(cfg, args.layout)
  run = Run(cfg)
  print(f"{run.topo.describe()}; compiling and warming up", flush=True)
  run.steps(args.warmup)
  run.compile_ahead(args.warmup, args.steps + 1)
  start = time.perf_counter()
  with jax.profiler.trace(args.out, create_perfetto_trace=True):
    run.steps(args.steps)
  wall = time.perf_counter() - start
  summary = summarize(*read_trace(args.out))
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump(dict(summary, steps=args.steps, wall_s=wall), f, indent=1)
  print(report(summary, args.steps, wall, args.top))


if __name__ == "__main__":
  main()
