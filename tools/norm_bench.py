"""A pre-norm block's LayerNorm, forward and backward, at a tower's shapes on a GPU: XLA's fusions
of it (`layers.LayerNorm`) and the Pallas kernels of `mimo_jax/models/norm_kernels.py`
(`model.layer_norm=pallas`) at each of a range of block sizes, in bfloat16, with each result's
distance from XLA's in float32.

  python -m tools.norm_bench [--shapes 48x576x1024] [--rows 4,8,16] [--warps 2,4,8] [--repeat 20]

A shape is images x positions x width (the default: 48 images of CLIP ViT-L/14 at 336 px, a
microbatch of configs/vlm.py's dense step). The work timed is a block's norm as training runs it:
its output from the residual stream, then the gradients of the stream, the scale and the bias from
the output's gradient and the stream's own gradient (the kernels add the latter in their backward
pass). Times are the median over 5 runs of one compiled program that takes `--repeat` such
gradients in turn (each pass's input gradient is the next one's input), divided by `--repeat`;
the bandwidth counts the six passes over [images x positions x width] that one read or write
of each array needs (x and y forward; x, the two incoming gradients and dx backward). The kernels' rows and warps a kernel instance takes are `norm_kernels.ROWS` and
`WARPS`: the rows whose figures are lowest are the ones to set there.
"""

from __future__ import annotations

import argparse
import itertools

import jax
import jax.numpy as jnp

from mimo_jax.models import layers, norm_kernels
from tools.common import Parser, gpu_timing, median_time

EPS = 1e-6


def xla(x, scale, bias):
  norm = layers.LayerNorm(x.shape[-1], EPS)
  norm.scale[...], norm.bias[...] = scale, bias
  return norm.with_residual(x)


def kernels(x, scale, bias):
  return norm_kernels.residual_layer_norm(x, scale, bias, EPS)


def gradients(fn, x, scale, bias, dres, dy):
  _, vjp = jax.vjp(fn, x, scale, bias)
  return vjp((dres, dy))


def seconds(fn, x, scale, bias, dres, dy, repeat: int) -> float:
  """fn's forward and backward, one of `repeat` in one program. The passes are unrolled (a loop
  on the GPU would add its own per-pass wait) and each takes the last one's gradients as its
  input, scale and bias, so that every element of every output is computed."""
  def run(x, scale, bias, dres, dy):
    for _ in range(repeat):
      dx, dscale, dbias = gradients(fn, x, scale, bias, dres, dy)
      x, scale, bias = dx, scale + 1e-9 * dscale, bias + 1e-9 * dbias
    return x, scale, bias

  run = jax.jit(run)
  return median_time(lambda: run(x, scale, bias, dres, dy)) / repeat


def distance(fn, x, scale, bias, dres, dy) -> float:
  """The largest relative distance of fn's output and gradients in bfloat16 from XLA's in
  float32."""
  f32 = lambda *a: [v.astype(jnp.float32) for v in a]
  want = (xla(*f32(x, scale, bias))[1], *gradients(xla, *f32(x, scale, bias, dres, dy)))
  got = (fn(x, scale, bias)[1], *gradients(fn, x, scale, bias, dres, dy))
  return max(float(jnp.linalg.norm(g.astype(jnp.float32) - w) / jnp.linalg.norm(w))
             for g, w in zip(got, want))


def _ints(text: str, flag: str) -> list[int]:
  try:
    values = [int(v) for v in text.split(",")]
  except ValueError:
    values = []
  if not values or min(values) < 1 or any(v & (v - 1) for v in values):
    raise SystemExit(f"tools.norm_bench: {flag} {text!r}: give powers of two, comma-separated "
                     "(e.g. 4,8,16).")
  return values


def main(argv: list[str] | None = None) -> None:
  parser = Parser("norm_bench", description=__doc__,
                  formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--shapes", default="48x576x1024",
                      help="images x positions x width, comma-separated")
  parser.add_argument("--rows", default="4,8,16", help="rows a kernel instance normalises")
  parser.add_argument("--warps", default="2,4,8", help="warps a kernel instance runs")
  parser.add_argument("--repeat", type=int, default=20, help="gradients a timed program takes")
  args = parser.parse_args(argv)
  rows, warps = _ints(args.rows, "--rows"), _ints(args.warps, "--warps")
  try:
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
  except ValueError:
    shapes = []
  if not shapes or any(len(s) != 3 or min(s) < 1 for s in shapes):
    raise SystemExit(f"tools.norm_bench: --shapes {args.shapes!r}: give images x positions x "
                     "width, comma-separated (e.g. 48x576x1024).")
  gpu_timing("tools.norm_bench", args.repeat, "Triton kernels")
  chosen = norm_kernels.ROWS, norm_kernels.WARPS
  try:
    _table(shapes, rows, warps, args.repeat)
  finally:
    norm_kernels.ROWS, norm_kernels.WARPS = chosen


def _table(shapes: list[tuple[int, ...]], rows: list[int], warps: list[int], repeat: int) -> None:
  print("| images x positions x width | norm | fwd+bwd ms | TB/s | relative distance |")
  print("|---|---|---:|---:|---:|")
  for shape in shapes:
    if not norm_kernels.supported(shape[-1]):
      print(f"| {'x'.join(map(str, shape))} | kernels | – | – | width {shape[-1]} is not a "
            "power of two from 16 to 8192 |")
    k = jax.random.split(jax.random.key(0), 5)
    x = (2 * jax.random.normal(k[0], shape) + 0.5).astype(jnp.bfloat16)
    dres, dy = (jax.random.normal(key, shape, jnp.bfloat16) for key in k[1:3])
    scale = 1 + 0.1 * jax.random.normal(k[3], shape[-1:])
    bias = 0.1 * jax.random.normal(k[4], shape[-1:])
    inputs = (x, scale, bias, dres, dy)
    passes = 6 * x.size * x.dtype.itemsize
    kinds = [("xla", xla, None)]
    if norm_kernels.supported(shape[-1]):
      kinds += [(f"kernels, {r} rows, {w} warps", kernels, (r, w))
                for r, w in itertools.product(rows, warps)]
    for name, fn, blocks in kinds:
      if blocks is not None:
        norm_kernels.ROWS, norm_kernels.WARPS = blocks
      try:
        s = seconds(fn, *inputs, repeat)
        row = f"{s * 1e3:.3f} | {passes / s / 1e12:.2f} | {distance(fn, *inputs):.2e}"
      except jax.errors.JaxRuntimeError as e:
        row = f"– | – | {type(e).__name__}: {str(e).splitlines()[0][:80]}"
      print(f"| {'x'.join(map(str, shape))} | {name} | {row} |", flush=True)


if __name__ == "__main__":
  main()
