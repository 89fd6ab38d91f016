"""Split planner: which GPUs each module should get, from a short profiling run.

  python -m tools.bench --config=configs/vlm.py:encoder_heavy \\
      --layouts="vision=0/1/1,language=0/1/1" --json=profile.json          # profile, 1 GPU
  python -m tools.plan --profile=profile.json --gpus=4 [--measured=brute.json]

The profile gives each module's busy time per step (`busy_vision_s`, `busy_language_s`) on the GPUs
it used; their products with the GPU counts are the module's work per step in GPU-seconds (W_v,
W_l). For every valid layout on `--gpus` GPUs (checked with the config's own validation), the
predicted step time is

  colocated (all G GPUs hold both modules):   (W_v + W_l) / G
  non-colocated (g_v + g_l = G):              max(T_v, T_l) + min(T_v, T_l) / M + bridge
      T_v = W_v / g_v, T_l = W_l / g_l; the encoder and the language model overlap across the M
      microbatches of a step, except for the first microbatch's encoder forward and the last one's
      encoder backward (the fill and drain term); bridge = the microbatch's embeddings and their
      gradients (bytes from the config) at `--bridge_gbps`, for the one microbatch that is not
      hidden.

Scaling within a module is taken as linear in its GPUs, for dp and tp alike; tp is preferred last
among layouts with the same prediction. `--layouts_only` prints the candidates as one `;`-joined
string for tools/bench.py (to measure them all), and `--measured` (a tools/bench.py JSON of such a
run) adds the measured step times and says how far the recommended layout is from the best measured.
"""

from __future__ import annotations

import argparse
import json
import sys

from mimo_jax.config import ConfigError, set_layout, slot_tokens
from mimo_jax.validation import validate_topology
from tools.bench import load_config


def _divisor_pairs(n: int, max_tp: int = 0) -> list[tuple[int, int]]:
  """(dp, tp) with dp * tp = n and tp <= max_tp (0 = any), dp first descending."""
  return [(n // tp, tp) for tp in range(1, n + 1) if n % tp == 0 and (not max_tp or tp <= max_tp)]


def candidates(cfg_spec: str, sets: list[str], gpus: int, max_tp: int = 0) -> list[dict]:
  """Every layout on `gpus` GPUs the config accepts: colocated and non-colocated splits."""
  from tools.bench import set_field  # pylint: disable=import-outside-toplevel
  out = []

  def valid(layout: str) -> bool:
    cfg = load_config(cfg_spec)
    for s in sets:
      set_field(cfg, s)
    set_layout(cfg, layout)
    try:
      validate_topology(cfg, gpus)
    except ConfigError:
      return False
    return True

  for vdp, vtp in _divisor_pairs(gpus, max_tp):
    for ldp, ltp in _divisor_pairs(gpus, max_tp):
      layout = f"vision=0/{vdp}/{vtp},language=0/{ldp}/{ltp}"
      if valid(layout):
        out.append({"layout": layout, "kind": "colocated", "vision_gpus": gpus,
                    "language_gpus": gpus, "tp": vtp + ltp})
  for gv in range(1, gpus):
    gl = gpus - gv
    for vdp, vtp in _divisor_pairs(gv, max_tp):
      for ldp, ltp in _divisor_pairs(gl, max_tp):
        layout = f"vision=0/{vdp}/{vtp},language={gv}/{ldp}/{ltp}"
        if valid(layout):
          out.append({"layout": layout, "kind": "non-colocated", "vision_gpus": gv,
                      "language_gpus": gl, "tp": vtp + ltp})
  return out


def bridge_bytes(cfg) -> float:
  """Bytes through the bridge for one microbatch: image tokens forward, their gradients back."""
  itemsize = 2 if cfg.model.dtype == "bfloat16" else 4
  return 2.0 * cfg.data.slots() * slot_tokens(cfg) * cfg.model.language.dim * itemsize


def predict(c: dict, work_v: float, work_l: float, microbatches: int, bridge_s: float) -> float:
  if c["kind"] == "colocated":
    return (work_v + work_l) / c["vision_gpus"]
  t_v, t_l = work_v / c["vision_gpus"], work_l / c["language_gpus"]
  return max(t_v, t_l) + min(t_v, t_l) / microbatches + bridge_s


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--profile", help="tools/bench.py JSON with one profiled layout")
  parser.add_argument("--config", default="", help="config[:variant] (default: the profile's)")
  parser.add_argument("--set", action="append", default=None,
                      help="field=value overrides (default: the profile's)")
  parser.add_argument("--gpus", type=int, required=True)
  parser.add_argument("--max_tp", type=int, default=0, help="largest tp considered (0 = any)")
  parser.add_argument("--bridge_gbps", type=float, default=300.0,
                      help="bridge bandwidth for the unhidden microbatch (GB/s)")
  parser.add_argument("--layouts_only", action="store_true",
                      help="print the candidate layouts for tools/bench.py and stop")
  parser.add_argument("--measured", default="", help="tools/bench.py JSON of the candidates")
  args = parser.parse_args(argv)
  profile = json.load(open(args.profile)) if args.profile else {}
  cfg_spec = args.config or profile.get("config")
  sets = args.set if args.set is not None else profile.get("set", [])
  if not cfg_spec:
    raise SystemExit("plan: error: give --config or a --profile that names one")
  cands = candidates(cfg_spec, sets, args.gpus, args.max_tp)
  if args.layouts_only:
    print(";".join(c["layout"] for c in cands))
    return
  if not profile:
    raise SystemExit("plan: error: --profile is needed for predictions")
  row = profile["rows"][0]
  gpus_used = row["gpus"]
  work_v = row["busy_vision_s"] * gpus_used
  work_l = row["busy_language_s"] * gpus_used
  cfg = load_config(cfg_spec)
  from tools.bench import set_field  # pylint: disable=import-outside-toplevel
  for s in sets:
    set_field(cfg, s)
  bridge_s = bridge_bytes(cfg) / (args.bridge_gbps * 1e9)
  for c in cands:
    c["predicted_s"] = predict(c, work_v, work_l, cfg.data.microbatches, bridge_s)
  cands.sort(key=lambda c: (round(c["predicted_s"], 6), c["tp"]))
  measured = {}
  if args.measured:
    measured = {r["layout"]: r["step_s"] for r in json.load(open(args.measured))["rows"]}
  print(f"work per step: vision {work_v:.3f} GPU-s, language {work_l:.3f} GPU-s "
        f"(from {row['layout']} on {gpus_used} GPU); bridge {bridge_s * 1e3:.2f} ms a microbatch")
  print("| layout | kind | predicted s/step | measured s/step |\n|---|---|---:|---:|")
  for c in cands:
    got = measured.get(c["layout"])
    print(f"| {c['layout']} | {c['kind']} | {c['predicted_s']:.3f} | "
          f"{'–' if got is None else format(got, '.3f')} |")
  best = cands[0]
  print(f"recommended: {best['layout']} ({best['kind']}), predicted {best['predicted_s']:.3f} s")
  if measured and best["layout"] in measured:
    fastest = min(measured, key=measured.get)
    gap = measured[best["layout"]] / measured[fastest] - 1
    print(f"measured: recommended {measured[best['layout']]:.3f} s, fastest {fastest} "
          f"{measured[fastest]:.3f} s: the recommendation is {gap:.1%} slower")
  sys.stdout.flush()


if __name__ == "__main__":
  main()
