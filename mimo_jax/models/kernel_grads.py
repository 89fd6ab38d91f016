"""Linear layers whose kernel gradients their matmuls make in float32.

A layer that keeps its kernel in float32 and computes in bfloat16 multiplies by the kernel's
bfloat16 cast; autodiff then makes the kernel's gradient in bfloat16 (the matmul's output type)
and casts it back to float32. Inside `float32_kernel_grads` (a trace-time switch: mimo_jax/fold.py
turns it on for the block stacks whose gradients accumulate layer by layer), a plain layer runs
`matmul`, whose backward makes that gradient in float32 in the matmul itself: then XLA can take a
float32 accumulator into the same cuBLAS call (its C operand) instead of a pass of its own over
the gradients. The forward pass and the input's gradient are as autodiff makes them; the kernel's
gradient is the same sum, without its rounding to bfloat16.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp
from flax import nnx

# Whether plain linear layers traced now make their kernels' gradients in float32. A context
# variable: each thread that traces (ahead-of-time compiles run in threads) sees its own.
_ON = contextvars.ContextVar("float32_kernel_grads", default=False)


@contextlib.contextmanager
def float32_kernel_grads():
  token = _ON.set(True)
  try:
    yield
  finally:
    _ON.reset(token)


def wrap(layer):
  """`layer` (any function) traced inside `float32_kernel_grads`."""
  def run(*args, **kw):
    with float32_kernel_grads():
      return layer(*args, **kw)
  return run


def _forward(x, w):
  return jax.lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())))


@jax.custom_vjp
def matmul(x: jax.Array, kernel: jax.Array) -> jax.Array:
  """x [..., k] (the compute dtype) times kernel [k, n] (float32) cast to x's dtype; the kernel's
  gradient comes out of its matmul in float32."""
  return _forward(x, kernel.astype(x.dtype))


def _matmul_fwd(x, kernel):
  return _forward(x, kernel.astype(x.dtype)), (x, kernel)


def _matmul_bwd(res, dy):
  x, kernel = res
  w = kernel.astype(x.dtype)
  dx = jax.lax.dot_general(dy, w, (((dy.ndim - 1,), (1,)), ((), ())))
  lead = tuple(range(x.ndim - 1))
  dk = jax.lax.dot_general(x, dy, ((lead, lead), ((), ())), preferred_element_type=jnp.float32)
  return dx.astype(x.dtype), dk.astype(kernel.dtype)


matmul.defvjp(_matmul_fwd, _matmul_bwd)


def _plain(layer) -> bool:
  """A linear layer as flax makes it (not FP8's dot, no adapters: models/lora.py's class), with a
  float32 kernel and a lower compute dtype."""
  return (type(layer) is nnx.Linear and layer.dot_general is jax.lax.dot_general
          and layer.precision is None and getattr(layer, "preferred_element_type", None) is None
          and layer.dtype is not None and layer.kernel[...].dtype == jnp.float32
          and jnp.dtype(layer.dtype) != jnp.float32)


def linear(layer, x: jax.Array) -> jax.Array:
  """`layer(x)`; inside `float32_kernel_grads`, a plain layer (`_plain`) through `matmul`."""
  if not (_ON.get() and _plain(layer)):
    return layer(x)
  y = matmul(x.astype(layer.dtype), layer.kernel[...])
  if layer.bias is not None:
    y = y + layer.bias[...].astype(layer.dtype)
  return y
