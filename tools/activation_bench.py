"""The MLPs' activations on a GPU, forward and backward, as XLA fuses each form of them: the
ViT's bias add and GELU (tanh approximation) and the decoder's SwiGLU product, at a dense
microbatch's shapes, in bfloat16, with each form's distance from the first one's in float32.

  python -m tools.activation_bench [--gelu 48x576x4096] [--swiglu 16x2048x8192] [--repeat 20]

Forms timed:

* GELU, `h + b` then the activation, as `layers.GeluMLP` runs it (the bias added by the up
  projection): `activations.ACTIVATIONS["gelu_tanh"]` (the code's: jax.nn.gelu's tanh form), and
  the same written as x · sigmoid(2u), the sigmoid as 1 / (1 + exp(-2u)), in float32, each with
  the backward pass that keeps only the input (`activations.from_input`);
* SwiGLU, `silu(gate) · up` as `layers.SwiGLU` runs it: jax.nn.silu (the code's), and the same
  written as gate / (1 + exp(-gate)) in float32.

A shape is images x positions x width (the defaults: 48 images of CLIP ViT-L/14 at 336 px with
its hidden width 4096, and 16 rows of 2048 tokens with configs/vlm.py's SwiGLU width 8192: a
microbatch of its dense step). Two times a form: its forward pass alone and its backward pass
(the inputs' gradients from the output's, as training runs it after the forward pass), each the
median over 5 runs of one compiled program that takes `--repeat` passes in turn (each pass's
result is the next one's input, behind an optimization barrier, so that XLA fuses no two passes
into one kernel, as it would a chain of elementwise passes: each pass reads and writes memory, as
in the step), divided by `--repeat`; the bandwidth counts one read or write of each [images x
positions x width] array a pass needs (GELU: h, y forward; h, dy, dh backward;
SwiGLU: gate, up, y forward; gate, up, dy, dgate, dup backward).
"""

from __future__ import annotations

import argparse
import math

import jax
import jax.numpy as jnp

from mimo_jax.models.activations import ACTIVATIONS, DERIVATIVES, from_input
from tools.common import Parser, dims, gpu_timing, median_time


_C = math.sqrt(2 / math.pi)


def _sigmoid_gelu_tanh(x):
  x32 = x.astype(jnp.float32)
  return (x32 * (1 / (1 + jnp.exp(-2 * _C * (x32 + 0.044715 * x32**3))))).astype(x.dtype)


def code_gelu_tanh(bias):
  return lambda h: ACTIVATIONS["gelu_tanh"](h + bias.astype(h.dtype))


def sigmoid_gelu_tanh(bias):
  act = from_input(_sigmoid_gelu_tanh, DERIVATIVES["gelu_tanh"])
  return lambda h: act(h + bias.astype(h.dtype))


def code_swiglu(gate, up):
  return jax.nn.silu(gate) * up


def exp_swiglu(gate, up):
  g = gate.astype(jnp.float32)
  return (g / (1 + jnp.exp(-g)) * up.astype(jnp.float32)).astype(gate.dtype)


def forward_seconds(fn, xs: tuple, repeat: int) -> float:
  def run(*xs):
    for _ in range(repeat):
      xs = jax.lax.optimization_barrier((fn(*xs),) + xs[1:])
    return xs

  run = jax.jit(run)
  return median_time(lambda: run(*xs)) / repeat


def gradients(fn, xs: tuple, dy):
  _, vjp = jax.vjp(fn, *xs)
  return vjp(dy)


def backward_seconds(fn, xs: tuple, dy, repeat: int) -> float:
  def run(xs, dy):
    for _ in range(repeat):
      xs = jax.lax.optimization_barrier(gradients(fn, xs, dy))
    return xs

  run = jax.jit(run)
  return median_time(lambda: run(xs, dy)) / repeat


def distance(fn, reference, xs: tuple, dy) -> float:
  """The largest relative distance of fn's output and gradients in bfloat16 from the reference
  form's in float32."""
  f32 = lambda *a: tuple(v.astype(jnp.float32) for v in a)
  want = (reference(*f32(*xs)), *gradients(reference, f32(*xs), f32(dy)[0]))
  got = (fn(*xs), *gradients(fn, xs, dy))
  return max(float(jnp.linalg.norm(x.astype(jnp.float32) - w) / jnp.linalg.norm(w))
             for x, w in zip(got, want))


def _shape(text: str, flag: str) -> tuple[int, ...]:
  return dims("activation_bench", flag, text, "images x positions x width", "48x576x4096")


def main(argv: list[str] | None = None) -> None:
  parser = Parser("activation_bench", description=__doc__,
                  formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--gelu", default="48x576x4096", help="the GELU's shape")
  parser.add_argument("--swiglu", default="16x2048x8192", help="the SwiGLU's shape")
  parser.add_argument("--repeat", type=int, default=20, help="passes a timed program takes")
  args = parser.parse_args(argv)
  gelu, swiglu = _shape(args.gelu, "--gelu"), _shape(args.swiglu, "--swiglu")
  gpu_timing("tools.activation_bench", args.repeat, "its figures are the GPU's")
  print("| activation | shape | form | fwd ms | TB/s | bwd ms | TB/s | relative distance |")
  print("|---|---|---|---:|---:|---:|---:|---:|")
  k = jax.random.split(jax.random.key(0), 4)
  h, dy = (jax.random.normal(key, gelu, jnp.bfloat16) for key in k[:2])
  bias = 0.1 * jax.random.normal(k[2], gelu[-1:])
  forms = [("jax.nn.gelu's tanh (the code's)", code_gelu_tanh(bias)),
           ("x · sigmoid(2u) in float32", sigmoid_gelu_tanh(bias))]
  _rows("GELU, bias added", gelu, forms, (h,), dy, (2, 3), args.repeat)
  gate, up, dy = (jax.random.normal(key, swiglu, jnp.bfloat16) for key in k[1:])
  forms = [("jax.nn.silu (the code's)", code_swiglu), ("gate / (1 + exp(-gate))", exp_swiglu)]
  _rows("SwiGLU", swiglu, forms, (gate, up), dy, (3, 5), args.repeat)


def _rows(what: str, shape, forms, xs: tuple, dy, passes: tuple[int, int], repeat: int) -> None:
  one = math.prod(shape) * 2
  reference = forms[0][1]
  for name, fn in forms:
    try:
      f = forward_seconds(fn, xs, repeat)
      b = backward_seconds(fn, xs, dy, repeat)
      row = (f"{f * 1e3:.3f} | {passes[0] * one / f / 1e12:.2f} | {b * 1e3:.3f} | "
             f"{passes[1] * one / b / 1e12:.2f} | {distance(fn, reference, xs, dy):.2e}")
    except jax.errors.JaxRuntimeError as e:
      row = f"– | – | – | – | {type(e).__name__}: {str(e).splitlines()[0][:80]}"
    print(f"| {what} | {'x'.join(map(str, shape))} | {name} | {row} |", flush=True)


if __name__ == "__main__":
  main()
