"""Where a training step's GPU time goes: per-kernel time shares from a profiler trace.

  python -m tools.kernels --config=configs/vlm.py --layout=vision=0/1/1,language=0/1/1 \\
      --set data.text_len=2000 --set data.text_len_sigma=0 --set data.image_probs=0,0,0,1 \\
      [--steps 2] [--top 25] [--out DIR] [--json FILE]

Trains `--warmup` steps (compilation), then `--steps` steps as training dispatches them under
`jax.profiler.trace` (the trace is kept in `--out`), and sums the device's kernel time:

* by **category** of kernel: `matmul` (cuBLAS/cuBLASLt/CUTLASS kernels and XLA's Triton GEMM
  fusions), `attention` (cuDNN's fused attention), `fusion` (XLA's elementwise and reduction
  fusions: norms, activations, bias and residual adds, casts, the loss; and the vision tower's
  LayerNorm kernels, models/norm_kernels.py; memory-bound), `copy`
  (memcpy, memset, dynamic-update-slice and copy kernels), `collective` (NCCL), `other`;
* by **program** (the compiled XLA module a kernel belongs to, e.g. the vision encoder's or the
  language model's step) and category;
* the `--top` kernels by total time, with their counts.

Shares are of the summed kernel time on the device (busy time; idle gaps are not kernels), which
is also printed beside the wall time of the traced steps, with the device's **idle** time: the
gaps between its kernels (any stream) from the first traced kernel to the last, a step (summed
over the devices, each on its own), and the program before and after each gap, summed by that
pair (e.g. `jit_fused_step -> jit_fused_step`: within a program, where it waits for the host, or
between two runs of it; `jit_fused_step -> jit_update`: between two programs), and the longest
gaps.
The trace records the device's kernels and the host's annotations, not the Python interpreter's
calls (which would slow the host's dispatch, and with it the gaps' measure). While traced, XLA
runs a program kernel by kernel instead of through its command buffers (CUDA graphs), which
moves the gaps; `--command_buffers` keeps them (`--xla_enable_command_buffers_during_profiling`),
but the profiler does not see the kernels of a loop recorded into a command buffer
(`run.device_loops`): their time shows as gaps after `set_while_condition`.

With `--hlo DIR` (a new or empty directory) XLA writes each program's optimized HLO there as
text, and each kernel that XLA emitted (its fusions; library kernels such as cuBLAS's and cuDNN's
are named by the library, not by an instruction) is traced to the source line that made it,
through the HLO's stack frames: the time by **part** (the model file it belongs to, e.g.
models/vit.py or models/llm.py, else the innermost source file outside installed packages) and
category, and the `--top` source lines by time, each with an instruction's shape and operation,
and the bytes its kernels read and write a step (each instruction's operands and results once,
from their shapes in the HLO) with the bandwidth that makes: a memory-bound kernel far below the
GPU's memory bandwidth moves its bytes badly, one near it can only gain by moving fewer.
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

from tools.bench import Run
from tools.common import Parser, figures_file, load_config, number, write_figures
from tools.hlo_dump import (UNTRACED, Instruction, add_xla_flags, dump_hlo, instruction, part,
                            read_hlo, source)

CATEGORIES = (
    ("collective", re.compile(r"nccl|all_?reduce|all_?gather|reduce_?scatter|collective", re.I)),
    ("attention", re.compile(r"fmha|flash|sdpa|cudnn|attention|fprop_|bprop_", re.I)),
    ("matmul", re.compile(r"gemm|cutlass|xmma|nvjet|cublas|sm\d+_.*(hmma|gmma)|triton_gemm|"
                          r"__triton_gemm|dot", re.I)),
    ("copy", re.compile(r"memcpy|memset|copy|dynamic_update_slice|dynamic-update-slice|"
                        r"concatenate|transpose", re.I)),
    ("fusion", re.compile(r"fusion|loop_|input_|reduce|convert|multiply|add|broadcast|select|"
                          r"triton|layer_norm", re.I)),
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


def summarize(events: list[dict], procs: dict[int, str],
              hlo: dict[str, dict[str, Instruction]] | None = None) -> dict:
  """Kernel time by category, by program and category, and by kernel, on the device tracks;
  with `hlo` (read_hlo), also by part and category and by source line."""
  device = {pid for pid, name in procs.items() if "/device:" in name}
  by_cat, by_prog, by_kernel, counts = (collections.Counter(), collections.Counter(),
                                        collections.Counter(), collections.Counter())
  by_part, by_source = collections.Counter(), collections.Counter()
  source_bytes, kernel_bytes = collections.Counter(), collections.Counter()
  examples: dict[str, str] = {}
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
    if hlo is not None:
      found = instruction(hlo, prog, name, op)
      where = source(found.frames) if found else UNTRACED
      by_part[(part(found.frames) if found else "(library kernels)", cat)] += dur
      by_source[where] += dur
      if found:
        source_bytes[where] += found.bytes
        kernel_bytes[key] += found.bytes
        examples.setdefault(where, f"{found.shape} {found.op.rsplit('/', 1)[-1]}"[:80])
  hlo_figures = {} if hlo is None else {
      "parts": {f"{p} / {c}": v for (p, c), v in by_part.items()},
      "sources": [{"source": k, "s": v, "example": examples.get(k, ""), "bytes": source_bytes[k]}
                  for k, v in by_source.most_common()]}
  return {"total_s": total, "categories": dict(by_cat), **hlo_figures, "idle": idle(events, device),
          "programs": {f"{p} / {c}": v for (p, c), v in by_prog.items()},
          "kernels": [{"name": n, "category": c, "s": v, "count": counts[(n, c)],
                       "ops": [[o, t] for o, t in ops[(n, c)].most_common(3)],
                       **({"bytes": kernel_bytes[(n, c)]} if hlo is not None else {})}
                      for (n, c), v in by_kernel.most_common()],
          "device_tracks": sorted(procs[p] for p in device)}


def idle(events: list[dict], device: set, longest: int = 8) -> dict:
  """The devices' gaps between kernels, each device from its first kernel to its last (its
  streams as one: a gap is time when none of them runs): their sum and the spans' over the
  devices, the sum by the pair of programs around each gap, and the `longest` gaps with the
  kernels around them."""
  spans = collections.defaultdict(list)
  for e in events:
    if e.get("ph") == "X" and e.get("pid") in device and "ts" in e:
      spans[e["pid"]].append((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)),
                              e.get("name", "")[:60],
                              str(e.get("args", {}).get("hlo_module", "") or "?")))
  gaps, by_programs, span_s = [], collections.Counter(), 0.0
  for track in spans.values():
    track.sort()
    end, last = track[0][1], track[0]
    for span in track[1:]:
      if span[0] > end:
        gap = (span[0] - end) / 1e6
        by_programs[f"{last[3]} -> {span[3]}"] += gap
        gaps.append((gap, f"{last[2]} ({last[3]})", f"{span[2]} ({span[3]})"))
      if span[1] > end:
        end, last = span[1], span
    span_s += (end - track[0][0]) / 1e6
  gaps.sort(reverse=True)
  return {"idle_s": sum((g for g, _, _ in gaps), 0.0), "span_s": span_s,
          "by_programs": dict(by_programs.most_common()),
          "longest": [{"s": g, "after": a, "before": b} for g, a, b in gaps[:longest]]}


def report(summary: dict, steps: int, wall_s: float, top: int) -> str:
  total = summary["total_s"] or 1.0
  lines = [f"traced {steps} steps: {wall_s / steps:.3f} s/step wall, "
           f"{summary['total_s'] / steps:.3f} s/step of kernels "
           f"({', '.join(summary['device_tracks']) or 'no device tracks'})", "",
           "| category | s/step | share |", "|---|---:|---:|"]
  for cat, v in sorted(summary["categories"].items(), key=lambda kv: -kv[1]):
    lines.append(f"| {cat} | {v / steps:.4f} | {v / total:.1%} |")
  gaps = summary["idle"]
  if gaps["span_s"]:  # a trace of timed kernels
    lines += ["", f"idle between kernels: {gaps['idle_s'] / steps:.4f} s/step "
              f"({gaps['idle_s'] / gaps['span_s']:.1%} of the traced span)", "",
              "| programs around the gap | s/step |", "|---|---:|"]
    lines += [f"| {k} | {v / steps:.4f} |" for k, v in list(gaps["by_programs"].items())[:8]]
    lines += ["", "| longest gaps: ms | after | before |", "|---:|---|---|"]
    lines += [f"| {g['s'] * 1e3:.3f} | `{g['after']}` | `{g['before']}` |"
              for g in gaps["longest"]]
  lines += ["", "| program / category | s/step | share |", "|---|---:|---:|"]
  for key, v in sorted(summary["programs"].items(), key=lambda kv: -kv[1])[:20]:
    lines.append(f"| {key} | {v / steps:.4f} | {v / total:.1%} |")
  traced = "parts" in summary  # with the HLO: each kernel's bytes and bandwidth too
  lines += ["", "| kernel | category | calls/step | s/step | share |" +
            (" GB/step | TB/s |" if traced else ""),
            "|---|---|---:|---:|---:|" + ("---:|---:|" if traced else "")]
  for k in summary["kernels"][:top]:
    lines.append(f"| `{k['name']}` | {k['category']} | {k['count'] / steps:g} | "
                 f"{k['s'] / steps:.4f} | {k['s'] / total:.1%} |" +
                 (_traffic(k.get("bytes", 0), k["s"], steps) if traced else ""))
  if "parts" in summary:
    lines += ["", "| part / category | s/step | share |", "|---|---:|---:|"]
    for key, v in sorted(summary["parts"].items(), key=lambda kv: -kv[1]):
      lines.append(f"| {key} | {v / steps:.4f} | {v / total:.1%} |")
    lines += ["", "| source line | an instruction of it | s/step | share | GB/step | TB/s |",
              "|---|---|---:|---:|---:|---:|"]
    for k in summary["sources"][:top]:
      lines.append(f"| `{k['source']}` | `{k['example']}` | {k['s'] / steps:.4f} | "
                   f"{k['s'] / total:.1%} |" + _traffic(k.get("bytes", 0), k["s"], steps))
  return "\n".join(lines)


def _traffic(moved: int, seconds: float, steps: int) -> str:
  """Table cells: GB a step and TB/s, or dashes for a kernel of no traced instruction."""
  if not moved or not seconds:
    return " – | – |"
  return f" {moved / 1e9 / steps:.2f} | {moved / seconds / 1e12:.2f} |"


def keep_command_buffers() -> None:
  """Has XLA run programs through their command buffers while traced, as untraced runs do;
  before JAX's backend starts."""
  add_xla_flags("--xla_enable_command_buffers_during_profiling=true")


def main(argv: list[str] | None = None) -> None:
  parser = Parser("kernels", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", default="configs/vlm.py", help="config file[:variant]")
  parser.add_argument("--layout", default="vision=0/1/1,language=0/1/1",
                      help="module=o/dp/tp[/pp[/v]], comma-separated (as tools.bench)")
  parser.add_argument("--set", action="append", default=[], help="field=value override")
  parser.add_argument("--warmup", type=number(int, least=0), default=2)
  parser.add_argument("--steps", type=number(int, least=1), default=2)
  parser.add_argument("--top", type=number(int, least=1), default=25)
  parser.add_argument("--out", default="/tmp/mimo_jax_trace", help="where the trace is kept")
  parser.add_argument("--json", default="", help="write the summary to this file")
  parser.add_argument("--hlo", default="", help="a new or empty directory: XLA writes the "
                      "programs' optimized HLO there and kernels are traced to source lines")
  parser.add_argument("--command_buffers", action="store_true", help="programs run through "
                      "XLA's command buffers while traced, as untraced (a recorded loop's kernels "
                      "are not seen)")
  args = parser.parse_args(argv)
  if args.json:
    figures_file("kernels", "--json", args.json)  # written at the end: checked now
  if args.hlo:
    dump_hlo(args.hlo)
  if args.command_buffers:
    keep_command_buffers()
  cfg = load_config("kernels", args.config, args.set, args.layout, devices=True)
  run = Run(cfg)
  print(f"{run.topo.describe()}; compiling and warming up", flush=True)
  run.steps(args.warmup)
  run.compile_ahead(args.warmup, args.steps + 1)
  start = time.perf_counter()
  # The device's kernels and the host's annotations; not every Python call (jax's default).
  options = jax.profiler.ProfileOptions()
  options.python_tracer_level = 0
  with jax.profiler.trace(args.out, create_perfetto_trace=True, profiler_options=options):
    run.steps(args.steps)
  wall = time.perf_counter() - start
  summary = summarize(*read_trace(args.out), hlo=read_hlo(args.hlo) if args.hlo else None)
  if args.json:
    write_figures("kernels", args.json, dict(summary, steps=args.steps, wall_s=wall))
  print(report(summary, args.steps, wall, args.top))


if __name__ == "__main__":
  main()
