"""Llama-style decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU, an output head (or the
embedding table, tied). The variants of Llama-3.x and Qwen2 (norm epsilon, q/k/v biases, RoPE
scaling, tied embeddings) are config fields (LanguageConfig). Training runs the blocks as a
`pipeline.Stack`; generation runs them with a key-value cache (`LanguageModel.decode`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mimo_jax.config import LanguageConfig
from mimo_jax.models.fp8 import history_length
from mimo_jax.models.layers import Attention, KVCache, RMSNorm, SwiGLU, linear, stacked


class DecoderBlock(nnx.Module):

  def __init__(self, rngs: nnx.Rngs, cfg: LanguageConfig, dtype: jnp.dtype,
               attention: str = "xla", max_segments: int = 0):
    out_std = (2 * cfg.layers * cfg.dim) ** -0.5  # GPT-2 style scaled residual init
    self.norm1 = RMSNorm(cfg.dim, cfg.norm_eps)
    self.attn = Attention(rngs, cfg.dim, cfg.heads, cfg.kv_heads, dtype, bias=cfg.qkv_bias,
                          rope_theta=cfg.rope_theta, out_std=out_std, implementation=attention,
                          max_segments=max_segments, o_bias=False,
                          rope_scaling=cfg.rope_scaling_params(), fp8=cfg.fp8,
                          fp8_history=history_length(cfg))
    self.norm2 = RMSNorm(cfg.dim, cfg.norm_eps)
    self.mlp = SwiGLU(rngs, cfg.dim, cfg.mlp_dim, dtype, out_std=out_std, fp8=cfg.fp8,
                      fp8_history=history_length(cfg))

  def __call__(self, x_bld: jax.Array, positions_bl: jax.Array,
               segment_ids_bl: jax.Array | None = None,
               cache: KVCache | None = None) -> jax.Array | tuple[jax.Array, KVCache]:
    """The block's output; with `cache` (generation), (the output, the cache holding these
    tokens' keys and values)."""
    if cache is None:
      return self.finish(x_bld, self.mix(x_bld, positions_bl, segment_ids_bl))
    attended, cache = self.attn(self.norm1(x_bld), positions_bl, cache=cache)
    x_bld = x_bld + attended
    return x_bld + self.mlp(self.norm2(x_bld)), cache

  def mix(self, x_bld: jax.Array, positions_bl: jax.Array,
          segment_ids_bl: jax.Array | None = None) -> jax.Array:
    """The block's first part: its attention's heads before their output projection [b, l,
    heads · head_dim] (`Attention.mix`). What follows is position by position (`finish`)."""
    return self.attn.mix(self.norm1(x_bld), positions_bl, causal=True,
                         segment_ids_bl=segment_ids_bl)

  def finish(self, x_bld: jax.Array, mixed_bld: jax.Array) -> jax.Array:
    """The block's output from its input and `mix`'s result: the output projection, the MLP and
    the residuals, each position on its own (so they can run at some positions alone)."""
    x_bld = x_bld + self.attn.project(mixed_bld)
    return x_bld + self.mlp(self.norm2(x_bld))


class LanguageModel(nnx.Module):
  """`embed` maps tokens to vectors (images are merged in between), the stacked `blocks` run as a
  `pipeline.Stack` in training or with a key-value cache in generation (`decode`), `logits` maps
  the result to float32 logits."""

  def __init__(self, rngs: nnx.Rngs, cfg: LanguageConfig, vocab_size: int, dtype: jnp.dtype,
               attention: str = "xla", max_segments: int = 0):
    self.dtype = dtype
    self.embedding = nnx.Param(jax.random.normal(rngs.params(), (vocab_size, cfg.dim)))
    self.blocks = stacked(lambda r: DecoderBlock(r, cfg, dtype, attention, max_segments),
                          cfg.layers, rngs)
    self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
    self.tied = cfg.tie_embeddings
    if not self.tied:
      self.head = linear(rngs, cfg.dim, vocab_size, dtype)

  @property
  def layers(self) -> int:
    """How many blocks are stacked."""
    return jax.tree.leaves(nnx.state(self.blocks))[0].shape[0]

  def init_cache(self, valid_bt: jax.Array, dtype: jnp.dtype) -> KVCache:
    """An empty cache of every layer (stacked [layers, b, kv_heads, T, head_dim]) for rows of T
    slots, those that will hold a token marked in `valid_bt` [b, T]."""
    attn = self.blocks.attn
    b, slots = valid_bt.shape
    zeros = jnp.zeros((self.layers, b, attn.kv_heads, slots, attn.head_dim), dtype)
    first = jnp.zeros((), jnp.int32)
    return KVCache(zeros, zeros, first, valid_bt, first)

  def decode(self, x_bnd: jax.Array, positions_bn: jax.Array, cache: KVCache,
             layers: list | None = None) -> tuple[jax.Array, KVCache]:
    """n tokens of each row [b, n, dim] (a prompt, then one token a step) through every block,
    taking cache slots `cache.index`..: (the last block's output [b, n, dim], the cache holding
    them, its index moved past them). Each layer writes its new slots into the whole cache in
    place (`cached_attention`). The blocks run in a loop over their stacked parameters, or, given
    `layers` (`split_layers`: each layer's parameters apart), as straight-line code, one block
    after another: a loop that runs many times (generation's, a token at a time) then reads each
    layer's weights where they are instead of copying them out of the stack at every token."""
    graphdef, blocks = nnx.split(self.blocks)

    def layer(carry, xs):
      h_bnd, k, v = carry
      params, i = xs
      block = nnx.merge(graphdef, params)
      h_bnd, kv = block(h_bnd, positions_bn, cache=cache._replace(k=k, v=v, layer=i))
      return (h_bnd, kv.k, kv.v), None
    carry = (x_bnd, cache.k, cache.v)
    if layers is None:
      carry, _ = jax.lax.scan(layer, carry, (blocks, jnp.arange(self.layers, dtype=jnp.int32)))
    else:
      for i, params in enumerate(layers):
        carry, _ = layer(carry, (params, jnp.int32(i)))
    h_bnd, k, v = carry
    return h_bnd, cache._replace(k=k, v=v, index=cache.index + x_bnd.shape[1])

  def split_layers(self) -> list:
    """The stacked blocks' parameters one layer at a time, for `decode`'s `layers`."""
    _, blocks = nnx.split(self.blocks)
    return [jax.tree.map(lambda a, i=i: a[i], blocks) for i in range(self.layers)]

  def embed(self, tokens_bl: jax.Array) -> jax.Array:
    return jnp.take(self.embedding[...], tokens_bl, axis=0).astype(self.dtype)

  def logits(self, x_bld: jax.Array) -> jax.Array:
    x_bld = self.norm(x_bld)
    if self.tied:
      return (x_bld @ self.embedding[...].astype(self.dtype).T).astype(jnp.float32)
    return self.head(x_bld).astype(jnp.float32)
