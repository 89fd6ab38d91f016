"""How much of the FP8 step is the abs-max passes: `tools.bench` with every FP8 operand cast at a
constant power-of-two scale instead of one taken from its abs-max at the call.

  python -m tools.fp8_scale_bound [tools.bench flags, with model.<module>.fp8=true]

A timing experiment, not a way to train: the constant scales (1 for inputs and kernels, 2^-20 for
gradients) do not fit the values, so the losses mean nothing. With no reduction to wait for, XLA
fuses each cast into the kernel that produces its operand, as it could with scales known before the
call (delayed scaling, from an abs-max history): the step time here bounds what that would save.
"""

from __future__ import annotations

import sys

import jax.numpy as jnp

from mimo_jax.models import fp8


def constant_quantize(x, dtype):
  top = float(jnp.finfo(dtype).max)
  scale = jnp.float32(1.0 if dtype == fp8.FORWARD else 2.0 ** -20)
  return jnp.clip(x.astype(jnp.float32) / scale, -top, top).astype(dtype), scale


def main(argv: list[str] | None = None) -> None:
  fp8.quantize = constant_quantize  # _forward and _backward look it up at each call
  from tools import bench
  bench.main(argv)


if __name__ == "__main__":
  main(sys.argv[1:])
