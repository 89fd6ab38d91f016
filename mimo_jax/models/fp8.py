"""FP8 matmuls for the blocks' linear layers (`model.<module>.fp8`), with current scaling.

Each operand of a matmul is scaled by its own absolute maximum at the call, so that it spans the
FP8 range, and cast: the inputs and the kernel to float8_e4m3fn (3 mantissa bits, up to 448) in the
forward pass, the incoming gradient to float8_e5m2 (2 mantissa bits, up to 57344: the wider range
gradients need) in the backward pass. The products run in FP8 with bfloat16 results, multiplied
back by the two scales. Current scaling keeps no state (no amax history as delayed scaling does):
parameters, optimizer state and checkpoints are those of a bfloat16 run. The matmuls keep their
FP8 operands for the backward pass, half the bytes of bfloat16 ones.

On Hopper GPUs XLA runs a dot of FP8 operands as an FP8 GEMM (twice bfloat16's peak); elsewhere it
computes the same values at higher precision. A matmul's result differs from the bfloat16 one by
the FP8 rounding of its operands: about 4% (relative, over a whole product of random data) with
e4m3 operands, 6% for the gradients with e5m2 ones (tests/test_fp8.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

FORWARD, BACKWARD = jnp.float8_e4m3fn, jnp.float8_e5m2


def quantize(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
  """`x` in `dtype` scaled by its absolute maximum, and the float32 scale that undoes it."""
  amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
  top = float(jnp.finfo(dtype).max)
  scale = jnp.where(amax > 0, amax / top, 1.0)
  # Clipped: a value the scaling rounds past the largest finite one would become NaN.
  q = jnp.clip(x.astype(jnp.float32) / scale, -top, top).astype(dtype)
  return q, scale


def _dot(a, b, dims, out_dtype):
  return jax.lax.dot_general(a, b, dims, preferred_element_type=out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _matmul(x, w, dtypes):
  return _forward(x, w, dtypes)[0]


def _forward(x, w, dtypes):
  """`dtypes`: the names of the result's, x's and w's dtypes (static)."""
  qx, sx = quantize(x, FORWARD)
  qw, sw = quantize(w, FORWARD)
  y = _dot(qx, qw, (((x.ndim - 1,), (0,)), ((), ())), jnp.float32) * (sx * sw)
  return y.astype(dtypes[0]), (qx, sx, qw, sw)


def _backward(dtypes, res, g):
  qx, sx, qw, sw = res
  qg, sg = quantize(g, BACKWARD)
  n = qx.ndim - 1
  # dx [..., k] = g [..., n] · w [k, n]ᵀ;  dw [k, n] = x [..., k]ᵀ · g [..., n]
  dx = _dot(qg, qw, (((n,), (1,)), ((), ())), jnp.float32) * (sg * sw)
  lead = tuple(range(n))
  dw = _dot(qx, qg, ((lead, lead), ((), ())), jnp.float32) * (sx * sg)
  return dx.astype(dtypes[1]), dw.astype(dtypes[2])


_matmul.defvjp(_forward, _backward)


def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
                out_sharding=None):
  """`nnx.Linear`'s matmul (inputs [..., k] · kernel [k, n]) in FP8; any other contraction, or an
  explicit `out_sharding`, is an error. `precision` does not apply to FP8 products."""
  del precision
  if out_sharding is not None:
    raise ValueError(f"fp8.dot_general: out_sharding {out_sharding} is not supported; the result "
                     "takes the sharding its operands imply.")
  (contract_l, contract_r), (batch_l, batch_r) = dimension_numbers
  if (tuple(contract_l) != (lhs.ndim - 1,) or tuple(contract_r) != (0,) or batch_l or batch_r
      or rhs.ndim != 2):
    raise ValueError(f"fp8.dot_general: only inputs [..., k] times a kernel [k, n], got "
                     f"{lhs.shape} and {rhs.shape} with {dimension_numbers}")
  out = jnp.dtype(preferred_element_type or lhs.dtype)
  return _matmul(lhs, rhs, (out.name, lhs.dtype.name, rhs.dtype.name))
