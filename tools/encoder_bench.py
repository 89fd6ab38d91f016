"""The vision encoder's forward and backward on one device: remat policies, rolled or unrolled
layers, and split or fused forward and backward.

  python -m tools.encoder_bench [--config=configs/vlm.py] [--images=24] [--remat=none,dots,full]
                                [--unroll=false,true] [--reps=8] [--record]

A training step runs the encoder's forward and backward as two jitted calls (the language model
runs between them, on other devices or not): the forward returns the vjp with its residuals, the
backward takes the image tokens' gradient. "split" times that pair; "fused" times one jit doing
both, which is what the encoder would cost inside a single program. The cotangent is random and an
argument (a constant one lets XLA simplify the backward). TFLOP/s counts useful FLOPs
(mimo_jax/flops.py): every slot holds a full-size image here. Prints one row per policy and loop.
"""

from __future__ import annotations

import argparse
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from mimo_jax.config import ConfigError
from mimo_jax.flops import FlopModel
from mimo_jax.step import Step
from mimo_jax.validation import validate
from tools.common import fail, load_config, median_time, record


def measure(cfg, images: int, reps: int) -> dict:
  step = Step.build(cfg)
  params = step.init_state(cfg.train.seed)["vision"].params
  v = cfg.model.vision
  rng = np.random.default_rng(0)
  x = {"images_nhwc": jnp.asarray(rng.integers(0, 256, (1, images, v.image_size, v.image_size,
                                                         v.channels), np.uint8))}

  def forward(p, x):
    return step.ctx.encode("vision", p, x)

  out = jax.eval_shape(forward, params, x)
  ct = (0.01 * jax.random.normal(jax.random.key(1), out.shape)).astype(out.dtype)
  fwd = jax.jit(forward)
  fwd_vjp = jax.jit(lambda p, x: jax.vjp(lambda p: forward(p, x), p))
  bwd = jax.jit(lambda vjp, ct: vjp(ct)[0])
  fused = jax.jit(lambda p, x, ct: jax.vjp(lambda p: forward(p, x), p)[1](ct)[0])
  patches = (v.image_size // v.patch_size) ** 2
  flops = FlopModel.build(cfg, {n: m.abstract_params() for n, m in step.modules.items()})
  total = flops.encoder("vision", {"patches": images * patches,  # forward and backward
                                  "patches_sq": images * patches**2})
  row = {"forward_s": median_time(lambda: fwd(params, x), reps),
         "split_s": median_time(lambda: bwd(fwd_vjp(params, x)[1], ct), reps),
         "fused_s": median_time(lambda: fused(params, x, ct), reps)}
  split, one = bwd(fwd_vjp(params, x)[1], ct), fused(params, x, ct)
  scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(one))
  # The two ways compute the same gradients (up to the order of float sums).
  row["split_vs_fused"] = max(float(jnp.max(jnp.abs(a - b))) for a, b in
                              zip(jax.tree.leaves(split), jax.tree.leaves(one))) / scale
  row["forward_tflops"] = total / 3 / row["forward_s"] / 1e12
  row["split_tflops"] = total / row["split_s"] / 1e12
  row["fused_tflops"] = total / row["fused_s"] / 1e12
  return row


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(prog="python -m tools.encoder_bench", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", default="configs/vlm.py", help="config file[:variant]")
  parser.add_argument("--images", type=int, default=24, help="images a call (full size)")
  parser.add_argument("--remat", default="none,dots,full",
                      help="comma-separated topology.vision.remat policies")
  parser.add_argument("--unroll", default="false,true",
                      help="comma-separated topology.vision.unroll values")
  parser.add_argument("--reps", type=int, default=8, help="timed calls per figure (median)")
  parser.add_argument("--set", action="append", default=[], help="field=value override")
  parser.add_argument("--record", action="store_true", help="append to docs/benchmarks.md")
  args = parser.parse_args(argv)
  unrolls = [u.strip().lower() for u in args.unroll.split(",") if u.strip()]
  if not set(unrolls) <= {"true", "false"}:
    fail("encoder_bench", f"--unroll takes true/false values, got {args.unroll}")
  lines = ["| remat | layers | forward s | TFLOP/s | split fwd+bwd s | TFLOP/s | fused fwd+bwd s "
           "| TFLOP/s |", "|---|---|---:|---:|---:|---:|---:|---:|"]
  for remat, unroll in itertools.product([r.strip() for r in args.remat.split(",")], unrolls):
    cfg = load_config("encoder_bench", args.config, args.set, check=False)
    cfg.topology.vision.remat, cfg.topology.vision.unroll = remat, unroll == "true"
    try:
      validate(cfg, len(jax.devices()))
    except ConfigError as e:
      fail("encoder_bench", str(e))
    r = measure(cfg, args.images, args.reps)
    loop = "unrolled" if unroll == "true" else "rolled"
    lines.append(f"| {remat} | {loop} | {r['forward_s']:.4f} | {r['forward_tflops']:.0f} | "
                 f"{r['split_s']:.4f} | {r['split_tflops']:.0f} | {r['fused_s']:.4f} | "
                 f"{r['fused_tflops']:.0f} |")
    print(lines[-1], flush=True)
  text = "\n".join(lines)
  print(text)
  if args.record:
    record(f"Vision encoder forward and backward, {args.config}, {args.images} images",
           "encoder_bench", argv, text)


if __name__ == "__main__":
  main()
