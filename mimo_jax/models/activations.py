"""The MLPs' activations, each differentiated from its input alone.

Autodiff of `jax.nn.gelu(x, approximate=True)` keeps the tanh it computed for the backward pass:
XLA writes it beside the activation in the forward pass and reads it back in the backward one, a
tensor of the MLP's hidden width each way (for a ViT-L/14 microbatch of 48 images, 226 MB a layer
each way). Here the backward pass keeps only the input, which the layer before wrote anyway, and
computes the derivative from it in float32: the forward pass is `jax.nn.gelu`'s, unchanged.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp


def from_input(f: Callable, derivative: Callable) -> Callable:
  """`f` with a VJP that keeps only its input x and multiplies the incoming gradient by
  `derivative(x)`, both in float32, cast back to x's dtype."""

  @jax.custom_vjp
  def act(x):
    return f(x)

  def fwd(x):
    return f(x), x

  def bwd(x, g):
    x32 = x.astype(jnp.float32)
    return ((g.astype(jnp.float32) * derivative(x32)).astype(x.dtype),)

  act.defvjp(fwd, bwd)
  return act


_C = math.sqrt(2 / math.pi)
_K = 0.044715


def _gelu_tanh_derivative(x: jax.Array) -> jax.Array:
  # 0.5 · (1 + tanh(u)) is sigmoid(2u): no cancellation where tanh(u) is near -1.
  s = jax.nn.sigmoid(2 * _C * (x + _K * x**3))
  return s + 2 * _C * x * s * (1 - s) * (1 + 3 * _K * x * x)


def _gelu_derivative(x: jax.Array) -> jax.Array:
  # 0.5 · (1 + erf(x / √2)) as 0.5 · erfc(-x / √2): no cancellation where erf is near -1.
  return 0.5 * jax.lax.erfc(-x / math.sqrt(2)) + x * jnp.exp(-0.5 * x * x) / math.sqrt(
      2 * math.pi)


def _quick_gelu(x: jax.Array) -> jax.Array:
  return x * jax.nn.sigmoid(1.702 * x)


def _quick_gelu_derivative(x: jax.Array) -> jax.Array:
  s = jax.nn.sigmoid(1.702 * x)
  return s + 1.702 * x * s * (1 - s)


ACTIVATIONS = {
    "gelu_tanh": from_input(lambda x: jax.nn.gelu(x, approximate=True), _gelu_tanh_derivative),
    "gelu": from_input(lambda x: jax.nn.gelu(x, approximate=False), _gelu_derivative),
    "quick_gelu": from_input(_quick_gelu, _quick_gelu_derivative),  # CLIP's
}
# Each activation's derivative, as its backward pass computes it (float32).
DERIVATIVES = {"gelu_tanh": _gelu_tanh_derivative, "gelu": _gelu_derivative,
               "quick_gelu": _quick_gelu_derivative}
