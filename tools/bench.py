"""Training-step benchmark: one table of speed figures per layout, on synthetic data.

  python -m tools.bench --config=configs/vlm.py:encoder_heavy \\
      --layouts="vision=0/4/1,language=0/4/1;vision=0/2/1,language=2/2/1" [--steps=8] [--record]

Each layout (`;`-separated; `module=offset/dp/tp[/pp[/virtual]]` as in tests/configs/tiny.py)
trains `--warmup` steps (compilation), and one more step for each shape the measured steps will
bring (slot and row buckets make microbatches differ in shape), then:

* **step time, tokens/s, MFU** over `--steps` steps dispatched as in training (the loader, host
  placement and both meshes overlapping). Tokens are the real text and image-placeholder positions;
  MFU = model FLOPs (mimo_jax/flops.py: 6·N per token plus attention, useful tokens only) / step
  time / (GPUs used · 989 TFLOP/s). The step time is the window's mean, which includes the first
  step's start on an idle device; **median s/step** is the steady step: the median interval
  between consecutive steps' ends, stamped by a thread that waits for each step's metrics while
  the loop dispatches on (as a per-step median of a PyTorch loop measures it; needs `--steps` ≥ 2).
* **busy time per module**, from `--profile_steps` steps run phase by phase with the host waiting
  after each phase: how long each module's own work takes, unoverlapped. Encoders on the language
  model's own mesh run with it as one program a microbatch in training (`GradMode.fused`); the
  profile runs them as separate calls, the way the other layouts do.
* **bridge time**: every transfer of one step (image tokens, slot owners, gradients) replayed back
  to back through the bridge as the step calls it (a fan-out's pieces cut by the program that
  made the array, a fan-in's left for the program that takes it to join), timed with one wait at
  the end; the bridge GB/s are the bytes that change device over that time, against **raw
  device_put GB/s**: the same pieces, pre-cut on their source devices, copied with
  `jax.device_put` and timed the same way. The bridge time bounds the **exposed** bridge time
  from above (a transfer cannot hold a step up longer than it takes).
* **decoupled step**: the step time of the same loop with every bridge transfer replaced by an array
  already in place, so the language model no longer waits for the encoder: step time minus this is
  what the dependency between the modules costs (pipeline fill and drain, and the bridge).
* **loader wait**: time the loop waited for the next batch.
* **time to first step**: from the layout's start (building its step, initialising its state) to
  its first step's end, every compile it waits for included; **compile s/shape**: how long each
  batch shape's step program took to compile (`fused_step` or `language_step`; with the
  persistent compilation cache warm, the time to load it). On a layout where every module shares
  one dp-only mesh the step programs of the measured steps' shapes compile ahead in background
  threads (mimo_jax/precompile.py, as training does), the first step's shapes first.
* **peak GiB** (the most any device held) beside **estimate GiB**, mimo_jax/memory.py's lower
  bound for the busiest device; a layout over the device's memory is refused before compiling.

`--json` writes every figure for tools/plan.py; `--record` appends the table to docs/benchmarks.md.
`--set field=value` overrides config fields (repeatable), e.g. `--set data.global_batch=48`. On a
CPU backend JAX makes `run.cpu_devices` devices, as `mimo_jax.launch` does (`--set
run.cpu_devices=N` for N); a layout past them says so. Every flag, the config and each layout are
checked before anything compiles: a bad one is one line `bench: error: ...`, exit status 2.
`--bridge private` runs the bridge on JAX's private copy and assembly paths (mimo_jax/compat.py)
instead of the public ones, to measure what they save inside the step.
"""

from __future__ import annotations

import argparse
import collections
import functools
import queue
import threading
import time

import jax
import numpy as np

from mimo_jax import bridge, compat, compile_cache, memory, precompile
from mimo_jax.batch import total
from mimo_jax.config import Config, ConfigError, set_layout
from mimo_jax.data import loader
from mimo_jax.flops import H100_H200_BF16_PEAK, FlopModel
from mimo_jax.step import Probe, Step
from mimo_jax.validation import validate, validate_backend
from tools.common import (Parser, config, fail, figures_file, load_config, median_times, number,
                          record, write_figures)


def moved_bytes(x, dst) -> int:
  """Bytes the bridge copies between devices for `x` (an array or `bridge.Parts`; pieces already
  in place excluded)."""
  if x.sharding == dst:
    return 0
  plan = bridge.plan(x.sharding, tuple(x.shape), dst)
  row = x.nbytes // x.shape[0] if x.ndim else x.nbytes
  return sum((p.hi - p.lo) * row for pieces in plan.values() for p in pieces if p.src != p.dst)


def raw_pieces(x, dst) -> list[tuple[jax.Array, jax.Device]]:
  """The pieces the bridge copies for `x`, pre-cut on their source devices (the parts themselves
  for `bridge.Parts`)."""
  if x.sharding == dst:
    return []
  plan = bridge.plan(x.sharding, tuple(x.shape), dst)
  moving = [p for pieces in plan.values() for p in pieces if p.src != p.dst]
  cut = bridge.cuts(x, moving)
  return [(jax.block_until_ready(cut[p]), p.dst) for p in moving]


STEP_PROGRAMS = ("fused_step", "language_step")  # the programs that take a batch's shape


class Compiles:
  """Every XLA compile of the process (or load from the persistent cache), by program name."""

  def __init__(self):
    self.seen: list[tuple[str, float]] = []
    self._listener = lambda event, seconds, **kw: self.seen.append(
        (kw.get("fun_name", ""), seconds)) if event == BACKEND_COMPILE else None
    jax.monitoring.register_event_duration_secs_listener(self._listener)

  def close(self) -> None:
    jax.monitoring.unregister_event_duration_listener(self._listener)

  def step_programs(self, since: int = 0) -> list[float]:
    """Seconds of each step-program compile after the first `since` compiles: one a shape."""
    return [s for n, s in self.seen[since:] if any(p in n for p in STEP_PROGRAMS)]


BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


class Run:
  """One layout: its step, state and loader."""

  def __init__(self, cfg: Config, ahead: int = 0):
    """`ahead` > 0: the step programs of the first `ahead` steps' shapes compile in background
    threads (a fused layout; precompile.py)."""
    self.started = time.perf_counter()
    self.first_step_s = None  # set by the first step
    validate(cfg, len(jax.devices()))
    validate_backend(cfg, jax.default_backend(), jax.process_count())
    self.cfg = cfg
    # Refused before compiling where a device cannot hold it (run.device_memory_gb or the
    # device's own); the estimate is a lower bound to set beside the measured peak.
    self.estimate_gib = memory.per_device(cfg, memory.check(cfg, warn=print)) / 2**30
    self.step = Step.build(cfg)
    self.topo = self.step.topo
    self.state = self.step.init_state(cfg.train.seed)
    paths = loader.build_paths(cfg, progress=lambda s: print(s, flush=True))
    where = loader.locality(self.topo, loader.slot_counts(cfg))
    groups = self.step.ctx.groups
    self.batches = loader.train_iterator(cfg, paths["train"], groups, where=where)
    self.dataset = loader.train_dataset(cfg, paths["train"], groups, where)
    self.flops = FlopModel.build(cfg, {n: m.abstract_params()
                                       for n, m in self.step.modules.items()})
    self.devices = {d for mesh in self.topo.meshes.values() for d in mesh.devices.flat}
    self.compiler = precompile.Compiler(self.step, threads=2, say=print)
    self.keys = {}  # step -> its program keys (compiled ahead)
    for s in range(ahead if self.compiler.enabled else 0):  # the first step's shapes first
      self.keys[s] = self.compiler.keys(self.dataset[s % len(self.dataset)])
    self.taken = 0  # steps read from self.batches

  def steps(self, n: int, probe: Probe | None = None) -> dict:
    """n steps as training runs them (or through `probe`); per-step means."""
    totals = collections.Counter()
    metrics = None
    groups = self.step.ctx.groups
    done = _Watch() if probe is None else None
    start = time.perf_counter()
    for _ in range(n):
      t = time.perf_counter()
      batch = next(self.batches)
      totals["loader_wait_s"] += time.perf_counter() - t
      self.compiler.wait(self.keys.pop(self.taken, []))
      self.taken += 1
      totals["tokens"] += total(batch, lambda s: s.tokens)
      totals["records_read"] += total(batch, lambda s: s.records_read)
      for k, v in self.flops.step(batch).items():
        totals[f"flops_{k}"] += v
      for slots in batch.slots.values():  # every encoder's (images', and clips' with audio)
        totals["image_tokens"] += int(np.sum(slots.owner_nt >= 0))
        # Slot tokens the encoder computes: the slots each microbatch sends (data.slot_buckets).
        totals["image_token_capacity"] += (int(slots.sent.sum()) * groups *
                                           slots.owner_nt.shape[-1])
      # Row positions the language model computes: the rows each microbatch sends.
      totals["row_capacity"] += (int(batch.text.rows_sent.sum()) * groups *
                                 batch.text.tokens_rl.shape[-1])
      if probe is None:
        self.state, metrics = self.step.train_step(self.state, batch)
        done.put(metrics)
      else:
        self.state, metrics = self.step.dispatch(self.state, *self.step.place_step(batch), probe)
      if self.first_step_s is None:
        jax.block_until_ready(metrics)
        self.first_step_s = time.perf_counter() - self.started
    jax.block_until_ready((self.state, metrics))
    out = {k: v / n for k, v in totals.items()}
    out["step_s"] = (time.perf_counter() - start) / n
    out["step_median_s"] = done.median_interval() if done is not None else None
    out["loss"] = float(jax.device_get(metrics["loss"]))
    return out

  def compile_ahead(self, start: int, n: int) -> int:
    """With slot or row buckets microbatches differ in shape, and each new shape compiles. Runs
    one step (advancing the state) for every step batch in [start, start + n) that brings a shape
    not seen yet, so that the measured steps, which read those batches next, never compile.
    Returns the number of steps run."""
    seen, ran = set(), 0
    for s in range(start, start + n):
      batch = self.dataset[s % len(self.dataset)]
      shapes = set(zip(*[v.sent.tolist() for v in batch.slots.values()],
                       batch.text.rows_sent.tolist()))
      if shapes <= seen:
        continue
      seen |= shapes
      self.state, metrics = self.step.train_step(self.state, batch)
      jax.block_until_ready((self.state, metrics))
      if self.first_step_s is None:  # no warmup steps: this is the first
        self.first_step_s = time.perf_counter() - self.started
      ran += 1
    return ran

  def profile(self, n: int) -> dict:
    """n steps phase by phase: busy seconds per module and for the bridge, bytes moved."""
    phases = collections.Counter()
    sent = []
    real_send = functools.partial(bridge.send, parts=True)

    def counted_send(x, dst):
      sent.append((x, dst, lambda: real_send(x, dst)()))
      return real_send(x, dst)

    last = [0.0]

    def on_phase(name, tree):
      jax.block_until_ready(tree)
      now = time.perf_counter()
      phases[name] += now - last[0]
      last[0] = now

    # Module by module: a colocated step that runs as one program a microbatch (GradMode.fused)
    # has no per-module phases, so the profile runs the modules' separate calls instead. Those
    # compile on first use: then one untimed pass over the same batches comes first.
    batches = [next(self.batches) for _ in range(n)]
    self.taken += n
    unfused = Probe(fused=False)
    if self.step.ctx.mode.fused:
      for batch in batches:
        self.state, metrics = self.step.dispatch(self.state, *self.step.place_step(batch),
                                                 unfused)
        jax.block_until_ready((self.state, metrics))
    probe = Probe(phase=on_phase, send=counted_send, fused=False)
    for batch in batches:
      inputs, inv = self.step.place_step(batch)
      jax.block_until_ready((inputs, inv))
      last[0] = time.perf_counter()
      sent.clear()  # the last step's transfers are kept for the raw comparison
      self.state, _ = self.step.dispatch(self.state, inputs, inv, probe)
      jax.block_until_ready(self.state)
    out = {f"busy_{k}_s": v / n for k, v in phases.items() if k != "bridge"}
    out["bridge_bytes"] = sum(moved_bytes(x, dst) for x, dst, _ in sent)
    pieces = [p for x, dst, _ in sent for p in raw_pieces(x, dst)]
    out["raw_s"] = out["bridge_s"] = 0.0
    if pieces:  # the bridge as the step calls it (a fan-in's pieces left to its consumer)
      out.update(median_times({"raw_s": lambda: [jax.device_put(a, d) for a, d in pieces],
                               "bridge_s": lambda: [again() for _, _, again in sent]},
                              reps=15))
    out["peak_gib"] = max((d.memory_stats() or {}).get("peak_bytes_in_use", 0)
                          for d in self.devices) / 2**30
    return out

  def without_bridge(self, n: int) -> float:
    """Step time when every bridge transfer returns an array already in place."""
    cache = {}
    delivered = lambda x, dst: bridge.send(x, dst, parts=True)()

    def in_place(x, dst):
      key = (tuple(x.shape), x.dtype, dst)
      if key not in cache:
        cache[key] = jax.block_until_ready(delivered(x, dst))
      return cache[key]

    probe = Probe(send=lambda x, dst: functools.partial(in_place, x, dst))
    self.steps(1, probe)  # fills the cache
    return self.steps(n, probe)["step_s"]


def measure(cfg: Config, layout: str, args) -> dict:
  set_layout(cfg, layout)
  compiles = Compiles()
  try:
    return _measure(cfg, layout, args, compiles)
  finally:
    compiles.close()


def _measure(cfg: Config, layout: str, args, compiles: Compiles) -> dict:
  horizon = 2 * args.steps + args.profile_steps + 1
  run = Run(cfg, ahead=args.warmup + horizon)
  print(f"[{layout}] {run.topo.describe()}; compiling and warming up", flush=True)
  if args.warmup:
    run.steps(args.warmup)
  ahead = run.compile_ahead(args.warmup, horizon)
  print(f"[{layout}] time to first step {run.first_step_s:.1f} s", flush=True)
  if ahead:
    print(f"[{layout}] {ahead} more steps compiled the shapes of the steps to come", flush=True)
  shapes = compiles.step_programs()
  print(f"[{layout}] step program compiles (one a shape): "
        f"{', '.join(f'{s:.1f}' for s in shapes) or 'none'} s; every compile of the layout: "
        f"{sum(s for _, s in compiles.seen):.1f} s", flush=True)
  timed = run.steps(args.steps)
  gpus = len(run.devices)
  median = timed["step_median_s"]
  print(f"[{layout}] {timed['step_s']:.3f} s/step"
        + (f" (median between steps' ends {median:.3f})" if median is not None else "")
        + f", {timed['tokens'] / timed['step_s']:,.0f} "
        f"tokens/s, MFU {timed['flops_total'] / timed['step_s'] / (gpus * args.peak):.1%}; "
        "the profile next", flush=True)
  prof = run.profile(args.profile_steps)
  decoupled = run.without_bridge(args.steps) if prof["bridge_bytes"] else timed["step_s"]
  run.compiler.close()
  row = {"layout": layout, "gpus": gpus, **timed, **prof, "decoupled_step_s": decoupled,
         "estimate_gib": run.estimate_gib, "time_to_first_step_s": run.first_step_s,
         "compile_s_per_shape": shapes, "compile_s": sum(s for _, s in compiles.seen)}
  row["tokens_per_s"] = timed["tokens"] / timed["step_s"]
  row["mfu"] = timed["flops_total"] / timed["step_s"] / (gpus * args.peak)
  moved = prof["bridge_bytes"]
  row["bridge_gbps"] = moved / prof["bridge_s"] / 1e9 if moved else None
  row["raw_gbps"] = moved / prof["raw_s"] / 1e9 if moved else None
  row["padding_efficiency"] = timed["image_tokens"] / max(timed["image_token_capacity"], 1)
  row["row_fill"] = timed["tokens"] / max(timed["row_capacity"], 1)
  return row


class _Watch:
  """When each dispatched step ends: a thread waits for the steps' metrics in turn and stamps the
  time each is ready, while the loop goes on dispatching (it waits for nothing). The median
  interval between consecutive ends is the steady step time, without the first step's start on
  an idle device that the window's mean shares out over its steps."""

  def __init__(self):
    self.stamps: list[float] = []
    self.pending: queue.Queue = queue.Queue()
    self.thread = threading.Thread(target=self._run, daemon=True)
    self.thread.start()

  def put(self, metrics) -> None:
    self.pending.put(metrics)

  def _run(self) -> None:
    while (metrics := self.pending.get()) is not None:
      jax.block_until_ready(metrics)
      self.stamps.append(time.perf_counter())

  def median_interval(self) -> float | None:
    """The median time between consecutive steps' ends (None for fewer than two steps)."""
    self.pending.put(None)
    self.thread.join()
    gaps = np.diff(self.stamps)
    return float(np.median(gaps)) if len(gaps) else None


def table(rows: list[dict]) -> str:
  """One row a layout; a busy column for each module the rows profiled (vision, any other
  encoder, language), in the rows' order."""
  modules = list(dict.fromkeys(k[len("busy_"):-len("_s")] for r in rows for k in r
                               if k.startswith("busy_") and k.endswith("_s")))
  modules = modules or ["vision", "language"]
  head = ("| layout | GPUs | s/step | median s/step | tokens/s | MFU | "
          + "".join(f"{m} busy s | " for m in modules) +
          "bridge s (% step) | bridge GB/s | raw GB/s | decoupled s/step | loader wait s | "
          "peak GiB | estimate GiB | first step s | compile s/shape |\n"
          "|---|---:|---:|---:|---:|---:|" + "---:|" * len(modules) +
          "---:|---:|---:|---:|---:|---:|---:|---:|---:|")
  fmt = lambda v, f: "–" if v is None else format(v, f)
  lines = [head]
  for r in rows:
    busy = "".join(f"{fmt(r.get(f'busy_{m}_s'), '.3f')} | " for m in modules)
    lines.append(
        f"| {r['layout']} | {r['gpus']} | {r['step_s']:.3f} | "
        f"{fmt(r.get('step_median_s'), '.3f')} | {r['tokens_per_s']:,.0f} | "
        f"{r['mfu']:.1%} | {busy}"
        f"{r['bridge_s']:.4f} ({r['bridge_s'] / r['step_s']:.2%}) | "
        f"{fmt(r['bridge_gbps'], '.0f')} | {fmt(r['raw_gbps'], '.0f')} | "
        f"{r['decoupled_step_s']:.3f} | {r['loader_wait_s']:.4f} | {r['peak_gib']:.1f} | "
        f"{r.get('estimate_gib', 0):.1f} | {fmt(r.get('time_to_first_step_s'), '.1f')} | "
        f"{_per_shape(r.get('compile_s_per_shape'))} |")
  return "\n".join(lines)


def _per_shape(seconds: list[float] | None) -> str:
  """Compile seconds of the step programs, one a shape: their count, mean and most."""
  if not seconds:
    return "–"
  return f"{len(seconds)} × {sum(seconds) / len(seconds):.1f} (max {max(seconds):.1f})"


def _args(argv: list[str] | None) -> argparse.Namespace:
  """The flags, each checked before any work: a bad one is one line `bench: error: ...`, exit
  status 2 (a count below its least, an empty --layouts, a --json that cannot be written)."""
  parser = Parser("bench", description=__doc__,
                  formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", default="configs/vlm.py", help="config file[:variant]")
  parser.add_argument("--layouts", required=True, help="';'-separated module=o/dp/tp[/pp[/v]]")
  parser.add_argument("--set", action="append", default=[], help="field=value override")
  parser.add_argument("--warmup", type=number(int, least=0), default=2,
                      help="untimed steps (compilation; 0: the shapes' own steps only)")
  parser.add_argument("--steps", type=number(int, least=1), default=6, help="timed steps")
  parser.add_argument("--profile_steps", type=number(int, least=0), default=2,
                      help="phase-by-phase steps (0: no busy times, bridge or decoupled step)")
  parser.add_argument("--peak", type=number(float, above=0), default=H100_H200_BF16_PEAK,
                      help="peak FLOP/s of one device for MFU")
  parser.add_argument("--json", default="", help="write every figure to this file")
  parser.add_argument("--bridge", choices=("public", "private"), default="public",
                      help="the bridge's copy and assembly paths (mimo_jax/compat.py)")
  parser.add_argument("--record", action="store_true", help="append to docs/benchmarks.md")
  args = parser.parse_args(argv)
  given, args.layouts = args.layouts, [s.strip() for s in args.layouts.split(";") if s.strip()]
  if not args.layouts:
    fail("bench", f"--layouts={given}: names no layout; give one or more, ';'-separated, each "
         "module=offset/dp/tp[/pp[/virtual]] (e.g. --layouts=vision=0/1/1,language=0/1/1).")
  if args.json:
    figures_file("bench", "--json", args.json)  # written after each layout: checked now
  try:
    compat.use_private_bridge(args.bridge == "private")
  except RuntimeError as e:
    fail("bench", f"--bridge=private: {e}")
  return args


def main(argv: list[str] | None = None) -> None:
  args = _args(argv)
  layouts = args.layouts
  cfg = load_config("bench", args.config, args.set)
  for layout in layouts:  # every layout checked before anything compiles
    try:
      config(args.config, args.set, layout, devices=True)
    except ConfigError as e:
      fail("bench", f"[{layout}] {e}")
  compile_cache.enable(cfg.run.compile_cache)
  print(compile_cache.describe(), flush=True)
  rows = []
  for layout in layouts:
    try:
      rows.append(measure(load_config("bench", args.config, args.set), layout, args))
    except ConfigError as e:
      fail("bench", f"[{layout}] {e}")
    if args.json:
      write_figures("bench", args.json, {"config": args.config, "set": args.set, "rows": rows})
  text = table(rows)
  print(text)
  if args.record:
    record(f"Training step, {args.config}", "bench", argv, text)


if __name__ == "__main__":
  main()
