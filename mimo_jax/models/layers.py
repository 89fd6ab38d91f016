"""Transformer building blocks shared by the ViT and the decoder.

Tensor parallelism is Megatron's column/row split: the first matmul of attention and MLP is split
on its output features (heads, hidden units) over the mesh axis `tp`, the second on its input
features, so each block needs one reduction. The split is declared by path rules (`TP_RULES`), not
by the modules, which never see a mesh.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

COLUMN = P(None, "tp")  # kernel [in, out]: out split
ROW = P("tp", None)  # kernel [in, out]: in split
COLUMN_BIAS = P("tp")

# (path regex, spec) pairs; the first match wins, unmatched parameters are replicated.
TP_RULES = (
    (r".*attn/(q|k|v)/kernel$", COLUMN),
    (r".*attn/(q|k|v)/bias$", COLUMN_BIAS),
    (r".*attn/o/kernel$", ROW),
    (r"(.*/)?(mlp|projector)/(gate|up)/kernel$", COLUMN),
    (r"(.*/)?(mlp|projector)/(gate|up)/bias$", COLUMN_BIAS),
    (r"(.*/)?(mlp|projector)/down/kernel$", ROW),
)


def stacked(make, n: int, rngs: nnx.Rngs) -> nnx.Module:
  """`n` layers built by `make(rngs)`, parameters stacked on a new leading axis (one key each), so
  that `pipeline.Stack` can scan over them or split them into pipeline stages."""
  keys = jax.random.split(rngs.params(), n)
  return nnx.vmap(lambda key: make(nnx.Rngs(params=key)))(keys)


def linear(rngs: nnx.Rngs, d_in: int, d_out: int, dtype: jnp.dtype, bias: bool = False,
           std: float | None = None) -> nnx.Linear:
  init = nnx.initializers.normal(std if std is not None else d_in**-0.5)
  return nnx.Linear(d_in, d_out, use_bias=bias, dtype=dtype, param_dtype=jnp.float32,
                    kernel_init=init, rngs=rngs)


class RMSNorm(nnx.Module):
  """RMSNorm computed in float32."""

  def __init__(self, dim: int, eps: float = 1e-6):
    self.scale = nnx.Param(jnp.ones((dim,), jnp.float32))
    self.eps = eps

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (y * self.scale[...]).astype(x.dtype)


class LayerNorm(nnx.Module):
  """LayerNorm computed in float32."""

  def __init__(self, dim: int, eps: float = 1e-6):
    self.scale = nnx.Param(jnp.ones((dim,), jnp.float32))
    self.bias = nnx.Param(jnp.zeros((dim,), jnp.float32))
    self.eps = eps

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
    return (y * self.scale[...] + self.bias[...]).astype(x.dtype)


def rope(x_blhd: jax.Array, positions_bl: jax.Array, theta: float) -> jax.Array:
  """Rotary position embedding (half-split convention), computed in float32."""
  half = x_blhd.shape[-1] // 2
  freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
  angle = positions_bl[..., None, None].astype(jnp.float32) * freq  # [b, l, 1, half]
  sin, cos = jnp.sin(angle), jnp.cos(angle)
  x1, x2 = jnp.split(x_blhd.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_blhd.dtype)


class Attention(nnx.Module):
  """Multi-head attention with grouped-query heads; optional RoPE and causal mask."""

  def __init__(self, rngs: nnx.Rngs, dim: int, heads: int, kv_heads: int, dtype: jnp.dtype,
               bias: bool = False, rope_theta: float | None = None, out_std: float | None = None,
               implementation: str = "xla"):
    self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
    self.rope_theta = rope_theta
    self.implementation = implementation  # "xla" or "cudnn" (fused flash attention on GPUs)
    self.q = linear(rngs, dim, heads * self.head_dim, dtype, bias)
    self.k = linear(rngs, dim, kv_heads * self.head_dim, dtype, bias)
    self.v = linear(rngs, dim, kv_heads * self.head_dim, dtype, bias)
    self.o = linear(rngs, heads * self.head_dim, dim, dtype, bias, std=out_std)

  def __call__(self, x_bld: jax.Array, positions_bl: jax.Array | None = None,
               causal: bool = False, segment_ids_bl: jax.Array | None = None) -> jax.Array:
    b, l, _ = x_bld.shape
    q = self.q(x_bld).reshape(b, l, self.heads, self.head_dim)
    k = self.k(x_bld).reshape(b, l, self.kv_heads, self.head_dim)
    v = self.v(x_bld).reshape(b, l, self.kv_heads, self.head_dim)
    if self.rope_theta is not None:
      q = rope(q, positions_bl, self.rope_theta)
      k = rope(k, positions_bl, self.rope_theta)
    mask, implementation = None, self.implementation
    if segment_ids_bl is not None:  # packed rows: no attention across samples
      mask = segment_ids_bl[:, None, :, None] == segment_ids_bl[:, None, None, :]
      implementation = "xla"
    out = jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal,
                                       implementation=implementation)
    return self.o(out.reshape(b, l, self.heads * self.head_dim))


class SwiGLU(nnx.Module):

  def __init__(self, rngs: nnx.Rngs, dim: int, hidden: int, dtype: jnp.dtype,
               out_std: float | None = None):
    self.gate = linear(rngs, dim, hidden, dtype)
    self.up = linear(rngs, dim, hidden, dtype)
    self.down = linear(rngs, hidden, dim, dtype, std=out_std)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class GeluMLP(nnx.Module):

  def __init__(self, rngs: nnx.Rngs, dim: int, hidden: int, dtype: jnp.dtype,
               d_out: int | None = None):
    self.up = linear(rngs, dim, hidden, dtype, bias=True)
    self.down = linear(rngs, hidden, d_out or dim, dtype, bias=True)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.down(jax.nn.gelu(self.up(x)))
