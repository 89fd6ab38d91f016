"""Attention's forward and backward at a tower's shapes on a GPU: cuDNN's fused kernels as
`jax.nn.dot_product_attention` runs them (jax 0.11.2 refuses odd lengths in training), XLA's
attention, and mimo_jax's (`layers.attention`, which runs rows of an odd length through cuDNN padded
by one position), in bfloat16, with each result's distance from XLA's in float32.

  python -m tools.attention_bench [--shapes 48x577x16x64,48x576x16x64,48x729x16x72] [--repeat 20]

A shape is images x positions x heads x head_dim: the defaults are CLIP ViT-L/14 at 336 px with
its class token (577), without it (576), and SigLIP-so400m at 384 px (729), 48 images a call.
Times are the median over 5 runs of one compiled program that takes `--repeat` gradients of all
three inputs, divided by `--repeat` (one program, so no dispatch gaps between calls).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from mimo_jax.models import layers
from tools.common import median_time

KINDS = {
    "cudnn as jax runs it": lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, implementation="cudnn"),
    "xla": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="xla"),
    "mimo_jax cudnn (layers.attention)": lambda q, k, v: layers.attention(
        q, k, v, None, False, "cudnn"),
}


def seconds(fn, q, k, v, repeat: int) -> float:
  """fn's forward and backward, one of `repeat` in one program."""
  grads = jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32)) * 1e-3, (0, 1, 2))

  def run(q, k, v):
    def body(_, c):  # each pass reads the last one's result, so none is left out
      dq, _, _ = grads(q + c.astype(q.dtype), k, v)
      return c + dq[0, 0, 0, 0].astype(jnp.float32) * 1e-9
    return jax.lax.fori_loop(0, repeat, body, jnp.zeros((), jnp.float32))

  run = jax.jit(run)
  return median_time(lambda: run(q, k, v)) / repeat


def distance(fn, q, k, v, dout) -> float:
  """The largest relative distance of fn's output and input gradients in bfloat16 from XLA's in
  float32."""
  f32 = [x.astype(jnp.float32) for x in (q, k, v)]
  want, vjp = jax.vjp(KINDS["xla"], *f32)
  want = (want, *vjp(dout.astype(jnp.float32)))
  got, vjp = jax.vjp(fn, q, k, v)
  got = (got, *vjp(dout))
  return max(float(jnp.linalg.norm(g.astype(jnp.float32) - w) / jnp.linalg.norm(w))
             for g, w in zip(got, want))


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(prog="python -m tools.attention_bench", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--shapes", default="48x577x16x64,48x576x16x64,48x729x16x72")
  parser.add_argument("--repeat", type=int, default=20)
  args = parser.parse_args(argv)
  if jax.default_backend() != "gpu":
    raise SystemExit(f"tools.attention_bench: needs a GPU (cuDNN); jax runs on "
                     f"{jax.default_backend()} here.")
  print(f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}")
  print("| images x positions x heads x head_dim | attention | fwd+bwd ms | relative distance |")
  print("|---|---|---:|---:|")
  for shape in args.shapes.split(","):
    b, l, h, d = (int(x) for x in shape.split("x"))
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, dout = (jax.random.normal(key, (b, l, h, d), jnp.bfloat16) for key in keys)
    for name, fn in KINDS.items():
      try:
        ms = seconds(fn, q, k, v, args.repeat) * 1e3
        row = f"{ms:.3f} | {distance(fn, q, k, v, dout):.2e}"
      except (NotImplementedError, jax.errors.JaxRuntimeError) as e:
        row = f"– | {type(e).__name__}: {str(e).splitlines()[0][:80]}"
      print(f"| {shape} | {name} | {row} |", flush=True)


if __name__ == "__main__":
  main()
