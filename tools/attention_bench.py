"""Attention's forward and backward at the model's shapes on a GPU: cuDNN's fused kernels as
`jax.nn.dot_product_attention` runs them (jax 0.11.2 refuses odd lengths in training), XLA's
attention, and mimo_jax's (`layers.attention`, which runs rows of an odd length through cuDNN padded
by one position), in bfloat16, with each result's distance from XLA's in float32. Grouped-query
shapes also run cuDNN with the key and value heads repeated to the query's count.

  python -m tools.attention_bench [--shapes 48x577x16x64,48x576x16x64,16x2048x32x64/8c] [--repeat 20]
                                  [--pallas]

A shape is rows x positions x heads x head_dim, then `/kv_heads` for grouped-query heads and `c`
for causal attention: the defaults are CLIP ViT-L/14 at 336 px with its class token (577), without
it (576), SigLIP-so400m at 384 px (729), 48 images a call, and configs/vlm.py's language model
(a microbatch of 16 rows of 2048 tokens, 32 heads of 64, 8 key-value heads). Times are the median
over 5 runs of one compiled program that takes `--repeat` gradients of all three inputs, divided by
`--repeat` (one program, so no dispatch gaps between calls). TFLOP/s counts the forward's two
matmuls (4·rows·positions²·heads·head_dim, half of it when causal) and 2.5 times that for the
backward (which recomputes the scores), as FlashAttention's papers count.

`--pallas` adds jax's own Pallas attention kernels (`jax.experimental.pallas.ops.gpu`): the
Triton one (`attention.mha`, key and value heads repeated for grouped-query shapes; lengths a
multiple of its 64-wide blocks) and the Mosaic GPU one for Hopper (`attention_mgpu.attention`,
non-causal, queries padded to a multiple of 128, each without a scale of its own so the queries
are scaled first). A kernel that refuses a shape or a dtype gets its error in the row.
"""

from __future__ import annotations

import argparse
import math

import jax
import jax.numpy as jnp

from mimo_jax.models import layers
from tools.common import Parser, gpu_timing, median_time


def _repeated(q, k, v, causal):
  groups = q.shape[2] // k.shape[2]
  k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
  return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")


KINDS = {
    "cudnn as jax runs it": lambda q, k, v, causal: jax.nn.dot_product_attention(
        q, k, v, is_causal=causal, implementation="cudnn"),
    "cudnn, key and value heads repeated": _repeated,
    "xla": lambda q, k, v, causal: jax.nn.dot_product_attention(
        q, k, v, is_causal=causal, implementation="xla"),
    "mimo_jax cudnn (layers.attention)": lambda q, k, v, causal: layers.attention(
        q, k, v, None, causal, "cudnn"),
}


def _triton(q, k, v, causal):
  from jax.experimental.pallas.ops.gpu import attention as triton  # deprecated: imported on use
  groups = q.shape[2] // k.shape[2]
  k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
  blocks = triton.BlockSizes(block_q=64, block_k=64, block_q_dkv=64, block_kv_dkv=64,
                             block_q_dq=64, block_kv_dq=64)
  return triton.mha(q, k, v, None, sm_scale=1 / math.sqrt(q.shape[-1]), causal=causal,
                    block_sizes=blocks, num_warps=4, num_stages=2)


def _mosaic(q, k, v, causal):
  from jax.experimental.pallas.ops.gpu import attention_mgpu as mosaic
  config = mosaic.TuningConfig(block_q=64, block_kv=64, max_concurrent_steps=2, causal=causal,
                               block_q_dkv=64, block_kv_dkv=64, block_q_dq=64, block_kv_dq=64)
  l = q.shape[1]
  q = q * jnp.asarray(1 / math.sqrt(q.shape[-1]), q.dtype)
  q = jnp.pad(q, ((0, 0), (0, -l % (2 * config.block_q)), (0, 0), (0, 0)))
  return mosaic.attention(q, k, v, config)[:, :l]


PALLAS = {"pallas triton (jax.experimental)": _triton,
          "pallas mosaic gpu (jax.experimental)": _mosaic}


def parse_shape(text: str) -> tuple[int, int, int, int, int, bool]:
  """rows, positions, heads, head_dim, kv_heads, causal from `BxLxHxD[/KV][c]`."""
  causal = text.endswith("c")
  body = text[:-1] if causal else text
  body, _, kv = body.partition("/")
  try:
    b, l, h, d = (int(x) for x in body.split("x"))
    kv_heads = int(kv) if kv else h
  except ValueError:
    raise SystemExit(f"tools.attention_bench: --shapes {text!r}: give rows x positions x heads x "
                     f"head_dim[/kv_heads][c], e.g. 16x2048x32x64/8c.") from None
  if min(b, l, h, d, kv_heads) < 1 or h % kv_heads:
    raise SystemExit(f"tools.attention_bench: --shapes {text!r}: give sizes of 1 or more and a "
                     f"head count that the key-value heads divide.")
  return b, l, h, d, kv_heads, causal


def flops(b: int, l: int, h: int, d: int, causal: bool) -> float:
  """Forward and backward FLOPs of one attention call."""
  forward = 4 * b * l * l * h * d / (2 if causal else 1)
  return 3.5 * forward


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


def distance(fn, q, k, v, dout, causal: bool) -> float:
  """The largest relative distance of fn's output and input gradients in bfloat16 from XLA's in
  float32."""
  f32 = [x.astype(jnp.float32) for x in (q, k, v)]
  want, vjp = jax.vjp(lambda q, k, v: KINDS["xla"](q, k, v, causal), *f32)
  want = (want, *vjp(dout.astype(jnp.float32)))
  got, vjp = jax.vjp(fn, q, k, v)
  got = (got, *vjp(dout))
  return max(float(jnp.linalg.norm(g.astype(jnp.float32) - w) / jnp.linalg.norm(w))
             for g, w in zip(got, want))


def main(argv: list[str] | None = None) -> None:
  parser = Parser("attention_bench", description=__doc__,
                  formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--shapes", default="48x577x16x64,48x576x16x64,48x729x16x72,16x2048x32x64/8c",
                      help="comma-separated rows x positions x heads x head_dim[/kv_heads][c]")
  parser.add_argument("--repeat", type=int, default=20,
                      help="forward and backward passes in one timed program")
  parser.add_argument("--pallas", action="store_true",
                      help="also jax's Pallas attention kernels (Triton, Mosaic GPU)")
  args = parser.parse_args(argv)
  kinds = {**KINDS, **(PALLAS if args.pallas else {})}
  shapes = [parse_shape(s) for s in args.shapes.split(",")]
  gpu_timing("tools.attention_bench", args.repeat, "cuDNN")
  print("| shape | attention | fwd+bwd ms | TFLOP/s | relative distance |")
  print("|---|---|---:|---:|---:|")
  for text, (b, l, h, d, kv_heads, causal) in zip(args.shapes.split(","), shapes):
    keys = jax.random.split(jax.random.key(0), 4)
    q, dout = (jax.random.normal(key, (b, l, h, d), jnp.bfloat16) for key in keys[::3])
    k, v = (jax.random.normal(key, (b, l, kv_heads, d), jnp.bfloat16) for key in keys[1:3])
    for name, kind in kinds.items():
      if kind is _repeated and kv_heads == h:
        continue
      fn = lambda q, k, v, kind=kind: kind(q, k, v, causal)
      try:
        ms = seconds(fn, q, k, v, args.repeat) * 1e3
        tflops = flops(b, l, h, d, causal) / ms / 1e9
        row = f"{ms:.3f} | {tflops:.0f} | {distance(fn, q, k, v, dout, causal):.2e}"
      except Exception as e:  # a kernel that refuses the shape or dtype: its row says why
        row = f"– | – | {type(e).__name__}: {str(e).splitlines()[0][:80]}"
      print(f"| {text} | {name} | {row} |", flush=True)


if __name__ == "__main__":
  main()
