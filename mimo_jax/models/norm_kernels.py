"""LayerNorm as Pallas (Triton) kernels for GPUs: one pass over the rows each way.

XLA makes a pre-norm block's LayerNorm backward pass of three kernels: the input's gradient (with
the residual stream's gradient added), a float32 product for the scale's gradient, written whole,
and the column sums of that product. Here it is one kernel: it reads the input, the output's
gradient and the residual stream's, and writes the input's gradient and each block of rows'
partial sums of the scale's and bias's gradients (summed over the blocks after: a small array).
The forward kernel reads each row once and writes its output; the backward kernel recomputes the
rows' statistics from the input it reads anyway, so nothing but the input is kept for it.

`supported` says where the kernels run: a GPU and a feature width that is a power of two
(Triton's blocks). A `pallas_call` sees whole arrays: under XLA's partitioner it would gather
them, so a module uses the kernels only where its program runs on one device a replica
(`mimo.layer_norm_kernel`). On CPU, tests run them through Pallas' interpreter (`INTERPRET`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

# Rows a kernel instance normalises at a time, and its warps: chosen on an H200 for rows of 1024
# (docs/benchmarks.md). Fewer rows where they do not divide the rows.
ROWS = 8
WARPS = 4
INTERPRET = False  # tests: run the kernels through Pallas' interpreter (any backend)


def supported(width: int, backend: str | None = None) -> bool:
  """Whether the kernels normalise rows of `width` features on `backend` (jax's default)."""
  return (INTERPRET or (backend or jax.default_backend()) == "gpu") and (
      16 <= width <= 8192 and width & (width - 1) == 0)


def _rows(n: int) -> int:
  """The largest power of two up to ROWS that divides n."""
  rows = ROWS
  while n % rows:
    rows //= 2
  return rows


def _normalised(x, eps: float):
  """x [rows, d] in float32 -> (x normalised, 1 / its standard deviation [rows, 1])."""
  mean = jnp.mean(x, axis=-1, keepdims=True)
  xc = x - mean
  rstd = jax.lax.rsqrt(jnp.mean(xc * xc, axis=-1, keepdims=True) + eps)
  return xc * rstd, rstd


def _forward_kernel(x_ref, scale_ref, bias_ref, y_ref, *, eps: float):
  xhat, _ = _normalised(x_ref[...].astype(jnp.float32), eps)
  y_ref[...] = (xhat * scale_ref[...][None, :] + bias_ref[...][None, :]).astype(y_ref.dtype)


def _backward_kernel(*refs, eps: float, residual: bool):
  if residual:
    x_ref, dy_ref, dres_ref, scale_ref, dx_ref, dscale_ref, dbias_ref = refs
  else:
    x_ref, dy_ref, scale_ref, dx_ref, dscale_ref, dbias_ref = refs
  xhat, rstd = _normalised(x_ref[...].astype(jnp.float32), eps)
  dy = dy_ref[...].astype(jnp.float32)
  g = dy * scale_ref[...][None, :]
  dx = (g - xhat * jnp.mean(g * xhat, axis=-1, keepdims=True)
        - jnp.mean(g, axis=-1, keepdims=True)) * rstd
  if residual:
    dx = dx + dres_ref[...].astype(jnp.float32)
  dx_ref[...] = dx.astype(dx_ref.dtype)
  dscale_ref[...] = jnp.sum(dy * xhat, axis=0)[None, :]
  dbias_ref[...] = jnp.sum(dy, axis=0)[None, :]


def _call(kernel, name: str, x, ins: list, vectors: list, outs):
  """`kernel` over x's rows [n, d], a block of rows at a time: `ins` [n, d] and `vectors` [d] in,
  `outs` out ([n, d], or one row a block for per-block sums)."""
  n, d = x.shape
  rows = _rows(n)
  block = pl.BlockSpec((rows, d), lambda i: (i, 0))
  vector = pl.BlockSpec((d,), lambda i: (0,))
  per_block = pl.BlockSpec((1, d), lambda i: (i, 0))
  shapes = [jax.ShapeDtypeStruct((n, d), dtype) if whole else
            jax.ShapeDtypeStruct((n // rows, d), dtype) for whole, dtype in outs]
  params = None
  if not INTERPRET:
    from jax.experimental.pallas import triton as plgpu  # pylint: disable=import-outside-toplevel
    params = plgpu.CompilerParams(num_warps=WARPS, num_stages=1)
  return pl.pallas_call(
      kernel, out_shape=shapes, grid=(n // rows,),
      in_specs=[block] * len(ins) + [vector] * len(vectors),
      out_specs=[block if whole else per_block for whole, _ in outs],
      compiler_params=params, interpret=INTERPRET, name=name)(*ins, *vectors)


def _forward(x, scale, bias, eps: float):
  x2 = x.reshape(-1, x.shape[-1])
  y, = _call(functools.partial(_forward_kernel, eps=eps), "layer_norm_forward", x2, [x2],
             [scale.astype(jnp.float32), bias.astype(jnp.float32)], [(True, x.dtype)])
  return y.reshape(x.shape)


def _backward(x, scale, bias, dy, dres, eps: float):
  d = x.shape[-1]
  x2 = x.reshape(-1, d)
  ins = [x2, dy.reshape(x2.shape)] + ([] if dres is None else [dres.reshape(x2.shape)])
  kernel = functools.partial(_backward_kernel, eps=eps, residual=dres is not None)
  dx, dscale, dbias = _call(kernel, "layer_norm_backward", x2, ins, [scale.astype(jnp.float32)],
                            [(True, x.dtype), (False, jnp.float32), (False, jnp.float32)])
  return (dx.reshape(x.shape), jnp.sum(dscale, axis=0).astype(scale.dtype),
          jnp.sum(dbias, axis=0).astype(bias.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def layer_norm(x, scale, bias, eps: float):
  """LayerNorm of x [..., d] (statistics in float32) with scale and bias [d], in x's dtype."""
  return _forward(x, scale, bias, eps)


def _layer_norm_fwd(x, scale, bias, eps):
  return _forward(x, scale, bias, eps), (x, scale, bias)


def _layer_norm_bwd(eps, res, dy):
  return _backward(*res, dy, None, eps)


layer_norm.defvjp(_layer_norm_fwd, _layer_norm_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def residual_layer_norm(x, scale, bias, eps: float):
  """(x, `layer_norm`(x)) for a pre-norm block, whose residual stream carries x on: the stream's
  gradient joins the norm's input gradient in the backward kernel."""
  return x, _forward(x, scale, bias, eps)


def _residual_fwd(x, scale, bias, eps):
  return (x, _forward(x, scale, bias, eps)), (x, scale, bias)


def _residual_bwd(eps, res, grads):
  dres, dy = grads
  return _backward(*res, dy, dres, eps)


residual_layer_norm.defvjp(_residual_fwd, _residual_bwd)
