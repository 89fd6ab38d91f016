"""Vision encoder: ViT (patch embedding, pre-norm blocks) followed by an MLP projector."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mimo_jax.config import LanguageConfig, VisionConfig
from mimo_jax.models.layers import Attention, GeluMLP, LayerNorm, linear, stacked


class ViTBlock(nnx.Module):

  def __init__(self, rngs: nnx.Rngs, cfg: VisionConfig, dtype: jnp.dtype, attention: str = "xla"):
    self.norm1 = LayerNorm(cfg.dim)
    self.attn = Attention(rngs, cfg.dim, cfg.heads, cfg.heads, dtype, bias=True,
                          implementation=attention)
    self.norm2 = LayerNorm(cfg.dim)
    self.mlp = GeluMLP(rngs, cfg.dim, cfg.mlp_dim, dtype)

  def __call__(self, x_npd: jax.Array) -> jax.Array:
    x_npd = x_npd + self.attn(self.norm1(x_npd))
    return x_npd + self.mlp(self.norm2(x_npd))


class VisionEncoder(nnx.Module):
  """Images [n, h, w, c] -> projected image tokens [n, patches, language dim]: `patches`
  (embedding and positions), the stacked `blocks` (run as a `pipeline.Stack`), then `finish`
  (norm, projector)."""

  def __init__(self, rngs: nnx.Rngs, cfg: VisionConfig, lm: LanguageConfig, dtype: jnp.dtype,
               attention: str = "xla"):
    self.patch, self.downsample = cfg.patch_size, cfg.downsample
    self.dtype = dtype
    patch_dim = cfg.patch_size**2 * cfg.channels
    self.embed = linear(rngs, patch_dim, cfg.dim, dtype, bias=True)
    self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (cfg.patches, cfg.dim)))
    self.blocks = stacked(lambda r: ViTBlock(r, cfg, dtype, attention), cfg.layers, rngs)
    self.norm = LayerNorm(cfg.dim)
    # LLaVA's two-layer MLP projector, mapping encoder features to the language model's width.
    self.projector = GeluMLP(rngs, cfg.dim * cfg.downsample**2, cfg.projector_hidden, dtype,
                             d_out=lm.dim)

  def patches(self, images_nhwc: jax.Array) -> jax.Array:
    n, h, w, c = images_nhwc.shape
    p = self.patch
    x = images_nhwc.reshape(n, h // p, p, w // p, p, c).transpose(0, 1, 3, 2, 4, 5)
    x_npd = self.embed(x.reshape(n, (h // p) * (w // p), p * p * c).astype(self.dtype))
    return x_npd + self.pos[...].astype(self.dtype)

  def finish(self, x_npd: jax.Array) -> jax.Array:
    x_npd = self.norm(x_npd)
    s = self.downsample
    if s > 1:  # pixel shuffle: s x s neighbouring patches -> one token
      n, p, d = x_npd.shape
      side = int(round(p**0.5))
      x = x_npd.reshape(n, side // s, s, side // s, s, d).transpose(0, 1, 3, 2, 4, 5)
      x_npd = x.reshape(n, (side // s) ** 2, s * s * d)
    return self.projector(x_npd)
