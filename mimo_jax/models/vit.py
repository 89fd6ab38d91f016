"""Vision encoder: ViT (patch embedding, pre-norm blocks) followed by an MLP projector."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mimo_jax.config import LanguageConfig, VisionConfig
from mimo_jax.models.layers import Attention, GeluMLP, LayerNorm, linear, stacked
from mimo_jax.patches import grid_positions, patchify


class ViTBlock(nnx.Module):

  def __init__(self, rngs: nnx.Rngs, cfg: VisionConfig, dtype: jnp.dtype, attention: str = "xla",
               max_segments: int = 0):
    self.norm1 = LayerNorm(cfg.dim)
    self.attn = Attention(rngs, cfg.dim, cfg.heads, cfg.heads, dtype, bias=True,
                          implementation=attention, max_segments=max_segments)
    self.norm2 = LayerNorm(cfg.dim)
    self.mlp = GeluMLP(rngs, cfg.dim, cfg.mlp_dim, dtype)

  def __call__(self, x_npd: jax.Array, segment_ids_np: jax.Array | None = None) -> jax.Array:
    """With `segment_ids_np` (images packed into rows) a patch attends only to its own image's."""
    x_npd = x_npd + self.attn(self.norm1(x_npd), segment_ids_bl=segment_ids_np)
    return x_npd + self.mlp(self.norm2(x_npd))


class VisionEncoder(nnx.Module):
  """Images [n, h, w, c] -> projected image tokens [n, patches / downsample², language dim]:
  `patches` (embedding and positions), the stacked `blocks` (run as a `pipeline.Stack`), then
  `finish` (norm, pixel shuffle, projector). Patches are in block order (patches.py); the learned
  position table covers the largest image's grid, and a smaller image (dynamic resolution,
  `packed_patches`) uses its top-left part."""

  def __init__(self, rngs: nnx.Rngs, cfg: VisionConfig, lm: LanguageConfig, dtype: jnp.dtype,
               attention: str = "xla", max_segments: int = 0):
    self.patch, self.downsample = cfg.patch_size, cfg.downsample
    self.dtype = dtype
    patch_dim = cfg.patch_size**2 * cfg.channels
    self.embed = linear(rngs, patch_dim, cfg.dim, dtype, bias=True)
    self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (cfg.patches, cfg.dim)))
    self.blocks = stacked(lambda r: ViTBlock(r, cfg, dtype, attention, max_segments), cfg.layers,
                          rngs)
    self.norm = LayerNorm(cfg.dim)
    # LLaVA's two-layer MLP projector, mapping encoder features to the language model's width.
    self.projector = GeluMLP(rngs, cfg.dim * cfg.downsample**2, cfg.projector_hidden, dtype,
                             d_out=lm.dim)

  def patches(self, images_nhwc: jax.Array) -> jax.Array:
    """Images of the full size [n, h, w, c] -> embedded patches [n, patches, dim]."""
    _, h, w, _ = images_nhwc.shape
    p, s = self.patch, self.downsample
    pos = grid_positions(h // p, w // p, s, w // p)
    return self.packed_patches(patchify(images_nhwc, p, s), jnp.asarray(pos)[None])

  def packed_patches(self, patches_npk: jax.Array, pos_np: jax.Array) -> jax.Array:
    """Pixels of patches [n, k, p*p*c] at position ids [n, k] -> embedded patches [n, k, dim]."""
    x_npd = self.embed(patches_npk.astype(self.dtype))
    return x_npd + self.pos[...].astype(self.dtype)[pos_np]

  def finish(self, x_npd: jax.Array) -> jax.Array:
    x_npd = self.norm(x_npd)
    n, k, d = x_npd.shape
    s2 = self.downsample**2  # pixel shuffle: s*s consecutive patches (one block) -> one token
    return self.projector(x_npd.reshape(n, k // s2, s2 * d))
