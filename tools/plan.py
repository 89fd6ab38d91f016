"""Split planner: which GPUs each module should get, from a short profiling run.

  python -m tools.plan --config=configs/vlm.py:encoder_heavy --gpus=4 --profile_layouts
  python -m tools.bench --config=configs/vlm.py:encoder_heavy --layouts="$(that)" --json=prof.json
  python -m tools.plan --profile=prof.json --gpus=4 [--max_tp=1] [--measured=brute.json]

**Modules.** The planner places one encoder, vision, and the language model: a config with
another encoder, or more than one (configs/av_digits.py's vision and audio), is refused before
any work; measure its layouts with tools/bench.py instead. The config and its `--set` overrides
are checked first, `--profile_layouts` too.

**Profiles.** Each row of a tools/bench.py JSON gives, for both modules at that row's dp and tp,
the module's busy seconds a step (`busy_<module>_s`, run phase by phase with the host waiting after
each phase). Divided by the work the module computes under that layout (below) and multiplied by
its GPUs, that is its **cost**: GPU-seconds per computed token at that (dp, tp). The cost grows
with dp where per-GPU batches get small; the profiling run measures it instead of assuming linear
scaling. A colocated dp-only row on g GPUs also gives **f_g** = its step time / (vision busy +
language busy): how much faster a real step runs than the modules one by one, phase by phase (one
program a microbatch, no host wait between phases). `--profile_layouts` prints the profiling run:
both modules colocated, dp-only, on the first g GPUs for each g dividing `--gpus`. Several
`--profile` files may be given.

**Work.** Padding depends on the layout: buckets round each microbatch's image slots and rows up to
what its fullest language rank needs, so the more ranks, the more padding. For the profile rows and
every candidate alike, the planner lays out the same `--data_steps` steps of the config's own data
(metadata only; no record is read) and counts the slot tokens the encoder and the row positions
the language model would compute.

**Prediction.** A module's time a step on its g GPUs is T = f_g · cost(dp, tp) · work / g, with
the cost at the candidate's own (dp, tp) if profiled, else interpolated linearly in dp between the
profiled dps of that tp (the nearest one beyond them), and with no profile of that tp, that of tp 1
at dp · tp (f_g likewise; 1 without any colocated dp-only profile). Then

  colocated (all G GPUs hold both modules):   T_v + T_l
  non-colocated (g_v + g_l = G):              max(T_v, T_l + T_v / M) + bridge
      the encoder runs ahead of the language model over the M microbatches of a step, so the step
      takes the encoder's time unless the language model's, plus one microbatch of the encoder's
      (the first forward before it, the last backward after it), is longer; bridge = a
      microbatch's embeddings and their gradients (bytes from the config) at `--bridge_gbps`, for
      the one microbatch that is not hidden.

**What a split can gain at most.** A non-colocated step takes at least its slower module's time,
and no split of G GPUs runs both modules in less than their GPU-seconds summed over G (each
module's fewest over the candidates' GPU counts). The planner prints that bound and its ratio to
the fastest colocated prediction: where the modules scale almost linearly with their GPUs, it is
close to 1 and no split pays, however the GPUs are divided (`split_bound`).

**Memory.** With `--memory_gb`, every candidate's bytes a GPU are estimated from the config
alone (mimo_jax/memory.py: parameters, optimizer state and gradients exactly from the shardings
that `topology.<module>.shard` gives, activations as a lower bound), and the layouts that cannot
fit are listed and left out; give the shard choice with `--set topology.language.shard=full`.

**Pipelines.** With `--pp=1,2,...`, a module also runs on pp stages of dp·tp GPUs each, under
each of `--schedules` (gpipe and 1f1b by default; circular and interleaved_1f1b with `--virtual`
chunks a stage): the layout `offset/dp/tp/pp/virtual@schedule`. Its time is that of the same
GPUs unpipelined (the cost at the stage's dp and tp), stretched by the schedule's bubble, the
idle share of a stage's steps (`Schedule.bubble`: 1 / (1 − bubble)), and by the FLOPs its
schedule spends a microbatch against the unpipelined step's (`Schedule.compute`: 1 for gpipe and
circular, and for 1f1b and interleaved_1f1b the language model's, whose loss runs inside the
schedule; 4/3 for an encoder's, whose stack runs its forward alone first, 5/4 under remat=full).
Their memory differs the other way: gpipe and circular keep every microbatch's layer internals
for the backward, 1f1b and interleaved_1f1b their microbatches in flight (at most 2p − 1: what
their forwards keep, or under remat=full their chunk inputs, `memory.in_flight`, printed). So
with `--memory_gb` the planner takes a one-forward-one-backward schedule where GPipe's
activations do not fit, and GPipe where both fit and it is faster.

tp is preferred last among layouts with the same prediction. `--layouts_only` prints the
candidates as one `;`-joined string for tools/bench.py (to measure them all), and `--measured` (a
tools/bench.py JSON of such a run; repeatable) adds the measured step times and says how far the
recommended layout is from the best measured.
"""

from __future__ import annotations

import argparse
import sys

from mimo_jax import memory, workdir
from mimo_jax.config import ConfigError
from mimo_jax.data import loader
from mimo_jax.pipeline import Schedule
from mimo_jax.validation_topology import validate_topology
from tools.common import Parser, fail, number, read_json, run_config
from tools.plan_costs import (MODULES, Costs, bridge_bytes, layout_config, module_time, predict,
                              shape, split_bound)


def _divisor_pairs(n: int, max_tp: int = 0) -> list[tuple[int, int]]:
  """(dp, tp) with dp * tp = n and tp <= max_tp (0 = any), dp first descending."""
  return [(n // tp, tp) for tp in range(1, n + 1) if n % tp == 0 and (not max_tp or tp <= max_tp)]


SCHEDULES = ("gpipe", "1f1b")  # the schedules weighed by default (with --virtual: the others)
VIRTUAL = ("circular", "interleaved_1f1b")  # schedules of several chunks a stage
MAX_GPUS = 1024  # --gpus: the layouts weighed grow faster than it (1024: 43 s on 2 cores)


def module_layouts(g: int, max_tp: int = 0, pps: tuple[int, ...] = (1,),
                   schedules: tuple[str, ...] = SCHEDULES, virtual: int = 1) -> list[str]:
  """A module's `dp/tp` on `g` GPUs, and with pp > 1 in `pps` its `dp/tp/pp/virtual@schedule`
  for each of `schedules` (circular and interleaved_1f1b with `virtual` > 1 chunks a stage)."""
  out = []
  for pp in pps:
    if g % pp:
      continue
    for dp, tp in _divisor_pairs(g // pp, max_tp):
      if pp == 1:
        out.append(f"{dp}/{tp}")
        continue
      for name in schedules:
        v = virtual if name in VIRTUAL else 1
        if (v > 1) == (name in VIRTUAL):
          out.append(f"{dp}/{tp}/{pp}/{v}@{name}")
  return out


def stretch(cfg, module: str) -> dict:
  """The module's schedule under cfg's layout (none without stages), its bubble, its FLOPs a
  microbatch against the unpipelined step's, and (microbatches' internals, chunk inputs) a stage
  keeps for the backward (`memory.in_flight`)."""
  t, micro = getattr(cfg.topology, module), cfg.data.microbatches
  if t.pp == 1:
    return {"schedule": "none", "bubble": 0.0, "compute": 1.0, "in_flight": (1, 0)}
  schedule = Schedule(t.pp, t.virtual, t.schedule)
  return {"schedule": f"pp{t.pp} {schedule.resolved}", "bubble": schedule.bubble(micro, t.remat),
          "compute": schedule.compute(micro, t.remat, head=module == "language"),
          "in_flight": memory.in_flight(cfg, module)}


def candidates(cfg_spec: str, sets: list[str], gpus: int, max_tp: int = 0,
               memory_gb: float = 0.0, refused: list | None = None, pps: tuple[int, ...] = (1,),
               schedules: tuple[str, ...] = SCHEDULES, virtual: int = 1,
               invalid: list | None = None) -> list[dict]:
  """Every layout on `gpus` GPUs the config accepts: colocated and non-colocated splits, each
  module on pp stages of `pps` under each of `schedules` too (`module_layouts`). With
  `memory_gb`, a layout whose devices cannot hold what it needs (mimo_jax/memory.py's lower
  bound, from the config's shard and remat choices and the layout's schedules) is left out and
  added to `refused`; a layout the config does not accept, with why, to `invalid`."""
  out = []
  options = lambda g: module_layouts(g, max_tp, pps, schedules, virtual)  # noqa: E731

  def add(layout: str, kind: str, gv: int, gl: int) -> None:
    cfg = layout_config(cfg_spec, sets, layout)
    try:
      validate_topology(cfg, gpus)
    except ConfigError as e:
      if invalid is not None:
        invalid.append((layout, str(e)))
      return
    c = {"layout": layout, "kind": kind, "vision_gpus": gv, "language_gpus": gl,
         "tp": cfg.topology.vision.tp + cfg.topology.language.tp}
    c.update({m: stretch(cfg, m) for m in MODULES})
    if memory_gb:
      c["gib"] = memory.per_device(cfg, memory.module_bytes(cfg)) / memory.GiB
      if c["gib"] > memory_gb:
        if refused is not None:
          refused.append(c)
        return
    out.append(c)

  for v in options(gpus):
    for lang in options(gpus):
      add(f"vision=0/{v},language=0/{lang}", "colocated", gpus, gpus)
  for gv in range(1, gpus):
    gl = gpus - gv
    for v in options(gv):
      for lang in options(gl):
        add(f"vision=0/{v},language={gv}/{lang}", "non-colocated", gv, gl)
  return out


def profile_layouts(gpus: int) -> list[str]:
  """The profiling run: both modules colocated, dp-only, on g GPUs for every g dividing `gpus`."""
  return [f"vision=0/{g}/1,language=0/{g}/1" for g in range(1, gpus + 1) if gpus % g == 0]


def work(cfg, path: str, steps: int) -> dict[str, float]:
  """Per step, the slot tokens the encoder computes and the row positions the language model
  computes under cfg's layout (padding included), from the records' metadata alone."""
  ds = loader.train_dataset(cfg, path, cfg.topology.language.dp,
                            loader.Locality(groups=frozenset(), slots={}))
  groups = cfg.topology.language.dp
  images = rows = 0
  for s in range(steps):
    b = ds[s]
    vision = b.slots["vision"]
    images += int(vision.sent.sum()) * groups * vision.owner_nt.shape[-1]
    rows += int(b.text.rows_sent.sum()) * groups * b.text.tokens_rl.shape[-1]
  return {"vision": images / steps, "language": rows / steps}


def _pipelines(c: dict) -> str:
  """The candidate's pipelined modules: schedule, bubble, FLOPs factor, and what a stage keeps
  for the backward: microbatches' layer internals (mb) and chunk inputs (`memory.in_flight`)."""
  parts = [f"{m[0]} {c[m]['schedule']} bubble {c[m]['bubble']:.2f} x{c[m]['compute']:.2f} "
           f"keeps {c[m]['in_flight'][0]} mb + {c[m]['in_flight'][1]} inputs"
           for m in MODULES if c[m]["schedule"] != "none"]
  return "; ".join(parts) or "–"


def _args(argv: list[str] | None) -> argparse.Namespace:
  """The flags, each checked: a bad one is one line `plan: error: ...`, exit status 2."""
  parser = Parser("plan", description=__doc__,
                  formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--profile", action="append", default=[],
                      help="tools/bench.py JSON of the profiling run (repeatable)")
  parser.add_argument("--config", default="", help="config[:variant] (default: the profile's)")
  parser.add_argument("--set", action="append", default=None,
                      help="field=value overrides (default: the profile's)")
  parser.add_argument("--gpus", type=number(int, least=1, most=MAX_GPUS), required=True)
  parser.add_argument("--max_tp", type=number(int, least=0), default=0,
                      help="largest tp considered (0 = any)")
  parser.add_argument("--bridge_gbps", type=number(float, above=0), default=300.0,
                      help="bridge bandwidth for the unhidden microbatch (GB/s)")
  parser.add_argument("--data_steps", type=number(int, least=1), default=16,
                      help="steps of data laid out to count each candidate's computed work")
  parser.add_argument("--layouts_only", action="store_true",
                      help="print the candidate layouts for tools/bench.py and stop")
  parser.add_argument("--profile_layouts", action="store_true",
                      help="print the profiling run's layouts for tools/bench.py and stop")
  parser.add_argument("--measured", action="append", default=[],
                      help="tools/bench.py JSON of the candidates (repeatable)")
  parser.add_argument("--pp", default="1",
                      help="pipeline stage counts weighed for each module, e.g. 1,2,4")
  parser.add_argument("--schedules", default=",".join(SCHEDULES),
                      help="pipeline schedules weighed where pp > 1 (gpipe, 1f1b, circular, "
                      "interleaved_1f1b; the last two need --virtual > 1)")
  parser.add_argument("--virtual", type=number(int, least=1), default=1,
                      help="chunks a stage for circular and interleaved_1f1b")
  parser.add_argument("--memory_gb", type=number(float, least=0), default=0.0,
                      help="memory of one GPU (GiB): layouts that cannot fit are left out "
                      "(0 = not checked)")
  args = parser.parse_args(argv)
  try:
    args.pp = tuple(int(p) for p in args.pp.split(","))
  except ValueError:
    fail("plan", f"--pp={args.pp}: not stage counts such as 1,2,4.")
  if min(args.pp) < 1:
    fail("plan", f"--pp={','.join(map(str, args.pp))}: stage counts are at least 1.")
  args.schedules = tuple(s for s in args.schedules.split(",") if s)
  unknown = [s for s in args.schedules if s not in SCHEDULES + VIRTUAL]
  if unknown or not args.schedules:
    fail("plan", f"--schedules={','.join(args.schedules)}: schedules are "
         f"{', '.join(SCHEDULES + VIRTUAL)}, comma-separated.")
  chunked = [s for s in args.schedules if s in VIRTUAL]
  if chunked and args.virtual == 1:
    fail("plan", f"--schedules={','.join(args.schedules)}: {' and '.join(chunked)} "
         f"{'chunk' if len(chunked) > 1 else 'chunks'} each stage into --virtual chunks; give "
         "--virtual 2 or more.")
  return args


def planned_config(cfg_spec: str, sets: list[str], named: str) -> None:
  """Checks the config being planned (`named`: how the user gave it) before anything else: the
  file and its `--set` overrides, every field as launch checks them (tools.common.run_config:
  the data directory, then `validate` without a device count, as the planner chooses the
  layout), and its modules, which must be the ones the planner places (`MODULES`: one encoder,
  vision, and the language model). Else one line and exit status 2."""
  cfg = run_config("plan", cfg_spec, sets)
  encoders = cfg.topology.names()
  if encoders != [m for m in MODULES if m != "language"]:
    fail("plan", f"{named} has {'encoders ' + ', '.join(encoders) if encoders else 'no encoder'};"
         f" tools.plan places one encoder (vision) and the language model, so it cannot plan "
         "this config: measure its layouts with python -m tools.bench --layouts=... instead.")


def main(argv: list[str] | None = None) -> None:
  args = _args(argv)
  # Every input file read before any work: a bad one is one line.
  profiles = [read_json("plan", "--profile", p, rows=("layout", "step_s")) for p in args.profile]
  measured_rows = [r for m in args.measured
                   for r in read_json("plan", "--measured", m, rows=("layout", "step_s"))["rows"]]
  cfg_spec = args.config or (profiles[0].get("config") if profiles else "")
  sets = args.set if args.set is not None else (profiles[0].get("set", []) if profiles else [])
  if cfg_spec:  # the config and its overrides, before anything else
    planned_config(cfg_spec, sets, f"--config={cfg_spec}" if args.config else
                   f"{args.profile[0]}'s config {cfg_spec}")
  if args.profile_layouts:
    print(";".join(profile_layouts(args.gpus)))
    return
  if not cfg_spec:
    fail("plan", "give --config or a --profile that names one.")
  for p, prof in zip(args.profile, profiles):
    if (prof.get("config"), prof.get("set", [])) != (cfg_spec, sets):
      fail("plan", f"{p} profiles {prof.get('config')} with {prof.get('set')}, not {cfg_spec} "
           f"with {sets}; profile the config being planned.")
  if not profiles and not args.layouts_only:
    fail("plan", "--profile is needed for predictions (--layouts_only lists the candidates).")
  try:
    _plan(args, cfg_spec, sets, profiles, measured_rows)
  except ConfigError as e:  # the data (a damaged shard, say)
    fail("plan", str(e))
  except OSError as e:
    fail("plan", workdir.describe_os_error(e, e.filename or "data.dir"))


def _plan(args: argparse.Namespace, cfg_spec: str, sets: list[str], profiles: list[dict],
          measured_rows: list[dict]) -> None:
  """The candidates, then (with profiles) their predictions, printed as a table."""
  refused, invalid = [], []
  cands = candidates(cfg_spec, sets, args.gpus, args.max_tp, args.memory_gb, refused, args.pp,
                     args.schedules, args.virtual, invalid)
  gib = lambda n: memory.size(n * memory.GiB)  # MiB below a GiB: 0.002 is not "0.0 GiB"
  for c in refused:
    print(f"does not fit: {c['layout']} needs at least {gib(c['gib'])} a GPU of "
          f"{gib(args.memory_gb)}", file=sys.stderr)
  if not cands and refused:
    fail("plan", f"no layout of {args.gpus} GPUs fits {gib(args.memory_gb)} a GPU; shard the "
         "state (--set topology.<module>.shard=full), set topology.<module>.remat=full, or use "
         "more GPUs.")
  if not cands and invalid:
    layout, why = invalid[0]
    fail("plan", f"no layout of {args.gpus} GPUs suits the config ({layout}: {why.rstrip('.')});"
         " try another --gpus, --max_tp or --pp.")
  if not cands:
    fail("plan", f"--pp={','.join(map(str, args.pp))}: no module's share of {args.gpus} GPUs "
         "splits into that many stages; add 1 to --pp or give more --gpus.")
  if args.layouts_only:
    print(";".join(c["layout"] for c in cands))
    return
  cfg = layout_config(cfg_spec, sets)
  path = loader.build_paths(cfg, progress=lambda s: print(s, flush=True))["train"]
  work_of = lambda c: work(c, path, args.data_steps)
  costs = Costs([r for prof in profiles for r in prof["rows"]], cfg_spec, sets, work_of)
  bridge_s = bridge_bytes(cfg) / (args.bridge_gbps * 1e9)
  for c in cands:
    ccfg = layout_config(cfg_spec, sets, c["layout"])
    w = work_of(ccfg)
    times, notes = {}, []
    for m in MODULES:
      dp, tp = shape(ccfg, m)
      cost, note = costs(m, dp, tp)
      # A real step runs a module faster than the profile's phase by phase (f_g, measured where
      # both modules share g GPUs): on a module's own GPUs, that of its GPU count.
      times[m] = module_time(cost * w[m] / c[f"{m}_gpus"] * costs.factor(c[f"{m}_gpus"]), c[m])
      notes.append(f"{m[0]} dp{dp}" + (f"tp{tp}" if tp > 1 else "") + f" {note}")
    c.update(t_vision=times["vision"], t_language=times["language"], cost_from="; ".join(notes))
    c["predicted_s"] = predict(c, times["vision"], times["language"], cfg.data.microbatches,
                               bridge_s)
  cands.sort(key=lambda c: (round(c["predicted_s"], 6), c["tp"]))
  layouts = {c["layout"] for c in cands}  # rows of other GPU counts (a profile's) are not
  measured = {r["layout"]: r["step_s"] for r in measured_rows if r["layout"] in layouts}
  print(f"profiled (module dp/tp): {', '.join(f'{m} {d}/{t}' for m, d, t in sorted(costs.table))}"
        f"; f_g (colocated step / busy sum): "
        f"{', '.join(f'{g} GPUs {f:.3f}' for g, f in sorted(costs.factors.items())) or 'none (1)'}"
        f"; bridge {bridge_s * 1e3:.2f} ms a microbatch")
  print("| layout | kind | vision s | language s | cost from | pipelines | memory a GPU "
        "| predicted s/step | measured s/step |\n|---|---|---:|---:|---|---|---:|---:|---:|")
  for c in cands:
    got = measured.get(c["layout"])
    need = memory.size(c["gib"] * memory.GiB) if "gib" in c else "–"
    print(f"| {c['layout']} | {c['kind']} | {c['t_vision']:.3f} | {c['t_language']:.3f} | "
          f"{c['cost_from']} | {_pipelines(c)} | {need} | {c['predicted_s']:.3f} | "
          f"{'–' if got is None else format(got, '.3f')} |")
  best = cands[0]
  bound = split_bound(cands, args.gpus)
  colocated = [c for c in cands if c["kind"] == "colocated"]
  if bound and colocated:
    fewest = ", ".join(f"{m} {bound[m][0]:.3f} on {bound[m][1]}" for m in MODULES)
    print(f"no split of the {args.gpus} GPUs between the modules can take less than "
          f"{bound['step_s']:.3f} s a step (each module's fewest GPU-seconds a step, {fewest} "
          f"GPUs, over {args.gpus}): at most {colocated[0]['predicted_s'] / bound['step_s']:.2f}x "
          f"the fastest colocated layout's predicted tokens/s")
  print(f"recommended: {best['layout']} ({best['kind']}), predicted {best['predicted_s']:.3f} s")
  if measured and best["layout"] in measured:
    fastest = min(measured, key=measured.get)
    gap = measured[best["layout"]] / measured[fastest] - 1
    print(f"measured: recommended {measured[best['layout']]:.3f} s, fastest {fastest} "
          f"{measured[fastest]:.3f} s: the recommendation is {gap:.1%} slower")
  sys.stdout.flush()


if __name__ == "__main__":
  main()
