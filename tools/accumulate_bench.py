"""The gradient accumulation of a microbatch's weight gradients on a GPU, in two forms, beside the
weight-gradient matmuls alone, in bfloat16 with float32 accumulators.

  python -m tools.accumulate_bench [--shape 16384x2048x8192] [--layers 24] [--repeat 5]

A shape is positions x rows x columns: each of `--layers` weight gradients is the product of a
[positions, rows] input and a [positions, columns] output gradient over positions (the
defaults: a microbatch of configs/vlm.py's dense step at half its 32768 positions, and the
language model's 2048 x 8192 MLP kernels). Programs timed, each over all the layers:

* the matmuls alone, bfloat16 out (what the others add to);
* stacked (the step's form, programs.py): each layer's gradient in bfloat16 as the matmul's
  transpose gives it, the layers stacked [layers, rows, columns], cast to float32 and added to the
  stacked accumulator (donated): one pass of 10 bytes a parameter after the matmuls;
* folded: each layer's gradient made in float32 by its matmul and added to an accumulator of its
  own (donated), which XLA takes into the cuBLAS call as its C operand (beta = 1), so no pass
  follows; the tool counts the matmuls that XLA so folded in the compiled program.

Each time is the median over `--repeat` runs taken in turns (tools.common.median_times); the
last column is each form's time over the matmuls', per billion parameters accumulated.
"""

from __future__ import annotations

import argparse
import re

import jax
import jax.numpy as jnp

from tools.common import Parser, dims, gpu_timing, median_times

_T = (((0,), (0,)), ((), ()))  # contract the positions: x [p, r], dy [p, c] -> [r, c]


def inputs(i: int, x, dy):
  """Layer i's input: distinct for each layer, so that XLA makes one matmul a layer."""
  return x * jnp.asarray(1 + i / 64, x.dtype), dy


def matmuls(x, dy, layers: int):
  return [jax.lax.dot_general(*inputs(i, x, dy), _T) for i in range(layers)]


def stacked(x, dy, acc):
  """acc [layers, r, c] float32 plus the layers' bfloat16 gradients, stacked and cast."""
  g = jnp.stack(matmuls(x, dy, acc.shape[0]))
  return acc + g.astype(jnp.float32)


def folded(x, dy, acc: list):
  """Each acc[i] [r, c] float32 plus layer i's gradient, made in float32 by its matmul."""
  return [a + jax.lax.dot_general(*inputs(i, x, dy), _T, preferred_element_type=jnp.float32)
          for i, a in enumerate(acc)]


def in_place(x, dy, acc):
  """acc [layers, r, c] float32 with each layer's float32 gradient added to its slice in place
  (`lax.dynamic_update_index_in_dim`): XLA may fold the add into the matmul with the slice as its
  C operand, and with `--xla_gpu_enable_dynamic_slice_fusion` read and write the slice where it
  lies."""
  for i in range(acc.shape[0]):
    g = jax.lax.dot_general(*inputs(i, x, dy), _T, preferred_element_type=jnp.float32)
    acc = jax.lax.dynamic_update_index_in_dim(acc, acc[i] + g, i, 0)
  return acc


def folded_matmuls(compiled_text: str) -> int:
  """The matmuls of a compiled GPU program that take their C operand with beta = 1."""
  return len(re.findall(r'"beta":1(?:\.0)?[,}]', compiled_text))


def distance(x, dy, layers: int) -> float:
  """The largest relative distance between the two forms' sums (after two accumulations each)."""
  acc_s = jnp.zeros((layers,) + (x.shape[1], dy.shape[1]), jnp.float32)
  acc_f = list(acc_s)
  for _ in range(2):
    acc_s, acc_f = stacked(x, dy, acc_s), folded(x, dy, acc_f)
  return max(float(jnp.linalg.norm(f - s) / jnp.linalg.norm(f))
             for f, s in zip(acc_f, acc_s))


def main(argv: list[str] | None = None) -> None:
  parser = Parser("accumulate_bench", description=__doc__,
                  formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--shape", default="16384x2048x8192", help="positions x rows x columns")
  parser.add_argument("--layers", type=int, default=24, help="weight gradients a program makes")
  parser.add_argument("--repeat", type=int, default=5, help="timed runs of each program")
  args = parser.parse_args(argv)
  p, r, c = dims("accumulate_bench", "--shape", args.shape, "positions x rows x columns",
                 "16384x2048x8192")
  if args.layers < 1:
    raise SystemExit(f"tools.accumulate_bench: --layers {args.layers}: give 1 or more.")
  gpu_timing("tools.accumulate_bench", args.repeat, "its figures are the GPU's")
  k = jax.random.split(jax.random.key(0))
  x = (0.1 * jax.random.normal(k[0], (p, r))).astype(jnp.bfloat16)
  dy = (0.1 * jax.random.normal(k[1], (p, c))).astype(jnp.bfloat16)
  n = args.layers
  run_m = jax.jit(lambda x, dy: matmuls(x, dy, n))
  run_s = jax.jit(stacked, donate_argnums=2)
  run_f = jax.jit(folded, donate_argnums=2)
  run_i = jax.jit(in_place, donate_argnums=2)
  acc = {"s": jnp.zeros((n, r, c), jnp.float32), "i": jnp.zeros((n, r, c), jnp.float32),
         "f": [jnp.zeros((r, c), jnp.float32) for _ in range(n)]}
  beta = folded_matmuls(run_f.lower(x, dy, acc["f"]).compile().as_text())
  text_i = run_i.lower(x, dy, acc["i"]).compile().as_text()
  beta_i, sliced = folded_matmuls(text_i), text_i.count("address_computation")

  def step(key, run):
    def fn():
      acc[key] = run(x, dy, acc[key])
      return acc[key]
    return fn

  t = median_times({"matmuls": lambda: run_m(x, dy), "stacked": step("s", run_s),
                    "folded": step("f", run_f), "in place": step("i", run_i)}, args.repeat)
  params = n * r * c
  print(f"{n} weight gradients of {r} x {c} over {p} positions ({params / 1e9:.3f} billion "
        f"parameters); matmuls with beta = 1: folded {beta} of {n}, in place {beta_i} of {n} "
        f"({sliced} in dynamic-slice fusions); relative "
        f"distance of the two sums: {distance(x, dy, n):.1e}")
  print("| program | ms | over the matmuls, ms a billion parameters |")
  print("|---|---:|---:|")
  for name in ("matmuls", "stacked", "folded", "in place"):
    extra = (t[name] - t["matmuls"]) / params * 1e9 * 1e3
    print(f"| {name} | {t[name] * 1e3:.3f} | {extra:.2f} |", flush=True)


if __name__ == "__main__":
  main()
