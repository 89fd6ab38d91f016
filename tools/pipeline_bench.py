"""Pipeline schedules against their ideal bubble: step time of a decoder stack for pp 1, 2, 4.

  python -m tools.pipeline_bench [--pp 1,2,4] [--microbatches 4,8,16] [--virtual 1,2] [--record]

Runs forward and backward of `--layers` Llama decoder blocks (the language model's own
`DecoderBlock`, `--dtype` compute, float32 parameters) through `pipeline.Stack` on `pp` GPUs with
dp = tp = 1, for M microbatches of `--micro_batch` rows of `--seq` tokens. The reference is one
microbatch through all layers on one GPU (t_mb). A schedule with p stages and v chunks a stage
runs M·v + p − 1 steps of t_mb / (p·v) each, so

  ideal(p, v, M) = t_mb · (M·v + p − 1) / (p·v),      bubble = (p − 1) / (M·v + p − 1)

and the table prints measured / ideal (1.00 = no cost beyond the bubble). Each time is the median
of `--reps` steps after a warm-up. `--record` appends the table to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mimo_jax import topology
from mimo_jax.config import Config
from mimo_jax.encoders.vision import VisionConfig
from mimo_jax.models.layers import stacked
from mimo_jax.models.llm import DecoderBlock
from mimo_jax.modules import build_modules
from mimo_jax.pipeline import Schedule, Stack
from tools.common import median_time, record



def _ints(s: str) -> list[int]:
  return [int(v) for v in s.split(",") if v]


class Bench:

  def __init__(self, args):
    self.args = args
    cfg = Config()
    cfg.add_encoder("vision", VisionConfig())
    lm = cfg.model.language
    lm.dim, lm.layers, lm.heads, lm.kv_heads, lm.mlp_dim = (
        args.dim, args.layers, args.heads, args.kv_heads, args.mlp_dim)
    cfg.model.dtype = args.dtype
    self.lm, self.dtype = lm, jnp.dtype(args.dtype)
    self.layer = build_modules(cfg)["language"].layer

  def params(self, mesh: Mesh, schedule: Schedule):
    def init():
      blocks = stacked(lambda r: DecoderBlock(r, self.lm, self.dtype), self.lm.layers,
                       nnx.Rngs(params=jax.random.key(0)))
      return jax.tree.map(schedule.to_layout, nnx.to_pure_dict(nnx.split(blocks)[1]))
    shapes = jax.eval_shape(init)
    shardings = jax.tree.map(lambda a: NamedSharding(mesh, P(*schedule.stage_spec())), shapes)
    return jax.jit(init, out_shardings=shardings)()

  def step_time(self, pp: int, virtual: int, micro: int) -> float:
    a = self.args
    devices = np.asarray(jax.devices()[:pp], dtype=object).reshape(pp, 1, 1)
    mesh = Mesh(devices, topology.AXES)
    schedule = Schedule(pp, virtual)
    stack = Stack(self.layer, mesh, schedule, a.remat)
    params = self.params(mesh, schedule)
    rep = NamedSharding(mesh, P())
    x = jax.device_put(jnp.ones((micro, a.micro_batch, a.seq, a.dim), self.dtype) * 0.1, rep)
    pos = jax.device_put(jnp.broadcast_to(jnp.arange(a.seq, dtype=jnp.int32),
                                          (micro, a.micro_batch, a.seq)), rep)

    @jax.jit
    def step(params, x, pos):
      loss = lambda p: jnp.mean(stack(p, x, (pos,)).astype(jnp.float32) ** 2)
      return jax.value_and_grad(loss)(params)

    return median_time(lambda: step(params, x, pos), a.reps)


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(prog="python -m tools.pipeline_bench", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--pp", default="1,2,4", help="pipeline sizes (GPUs) to measure")
  parser.add_argument("--microbatches", default="4,8,16", help="microbatch counts M")
  parser.add_argument("--virtual", default="1,2", help="chunks per stage (1 = GPipe)")
  parser.add_argument("--layers", type=int, default=16, help="decoder blocks in the stack")
  parser.add_argument("--dim", type=int, default=2048, help="a block's width")
  parser.add_argument("--heads", type=int, default=16, help="attention heads")
  parser.add_argument("--kv_heads", type=int, default=8, help="key-value heads")
  parser.add_argument("--mlp_dim", type=int, default=5632, help="SwiGLU hidden width")
  parser.add_argument("--seq", type=int, default=2048, help="tokens a row")
  parser.add_argument("--micro_batch", type=int, default=2, help="rows a microbatch")
  parser.add_argument("--dtype", default="bfloat16",
                      help="compute dtype (XLA's CPU backend cannot all-reduce bfloat16)")
  parser.add_argument("--remat", default="full", help="remat policy: none, full, dots")
  parser.add_argument("--reps", type=int, default=5, help="timed steps: each time their median")
  parser.add_argument("--record", action="store_true", help="append to docs/benchmarks.md")
  args = parser.parse_args(argv)
  bench = Bench(args)
  available = len(jax.devices())
  t_mb = bench.step_time(1, 1, 1)
  print(f"t_mb (one microbatch, {args.layers} layers, 1 GPU): {t_mb * 1e3:.1f} ms", flush=True)
  rows = []
  for pp in _ints(args.pp):
    if pp > available:
      print(f"pp={pp}: skipped, {available} devices", flush=True)
      continue
    for v in _ints(args.virtual) if pp > 1 else [1]:
      if args.layers % (pp * v):
        continue
      for m in _ints(args.microbatches):
        if pp > 1 and m < pp:
          continue
        t = bench.step_time(pp, v, m)
        ideal = t_mb * (m * v + pp - 1) / (pp * v)
        bubble = Schedule(pp, v).bubble(m)
        rows.append((pp, v, m, t, ideal, bubble))
        print(f"pp={pp} v={v} M={m}: {t * 1e3:.1f} ms, ideal {ideal * 1e3:.1f} ms, "
              f"ratio {t / ideal:.3f}", flush=True)
  header = ("| pp | virtual | M | step ms | ideal ms | measured / ideal | bubble | "
            "speed-up vs 1 GPU |\n|---:|---:|---:|---:|---:|---:|---:|---:|")
  lines = [header] + [
      f"| {pp} | {v} | {m} | {t * 1e3:.1f} | {ideal * 1e3:.1f} | {t / ideal:.3f} | "
      f"{bubble:.3f} | {m * t_mb / t:.2f} |" for pp, v, m, t, ideal, bubble in rows]
  table = "\n".join(lines)
  print(table)
  if args.record:
    record("Pipeline schedules vs ideal bubble", "pipeline_bench", argv, table, notes=(
        f"t_mb = {t_mb * 1e3:.1f} ms (one microbatch of {args.micro_batch}x{args.seq} tokens "
        f"through {args.layers} layers of dim {args.dim}, forward and backward, remat "
        f"{args.remat}, 1 GPU)",))


if __name__ == "__main__":
  main()
