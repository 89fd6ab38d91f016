"""Vision encoder: ViT (patch embedding, pre-norm blocks) followed by an MLP projector."""

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from mimo_jax.config import LanguageConfig, LoraConfig
from mimo_jax.models.fp8 import history_length
from mimo_jax.models.layers import Attention, GeluMLP, LayerNorm, linear, stacked
from mimo_jax.patches import bicubic_taps, grid_positions, patchify


POSITION_RESIZE = ("crop", "bicubic")  # patches.py


@dataclasses.dataclass
class ViTConfig:
  """The tower's architecture: a ViT (patch embedding, pre-norm blocks) and its projector."""
  image_size: int = 8
  channels: int = 1
  patch_size: int = 4
  dim: int = 64
  layers: int = 2
  heads: int = 4
  mlp_dim: int = 128
  projector_hidden: int = 128
  # Pixel shuffle before the projector: each s x s block of patches becomes one image token of
  # s*s*dim features (InternVL's token compression); 1 = one token a patch.
  downsample: int = 1
  # Tower variants (tools.hf import sets them from an HF config.json). The defaults are SigLIP's
  # layout; CLIP has a class token, no patch-embedding bias, a LayerNorm before the blocks and
  # quick_gelu. The class token is dropped from the features the projector sees.
  class_token: bool = False
  patch_bias: bool = True
  pre_norm: bool = False
  # LayerNorm on the last block's output (SigLIP's post_layernorm); LLaVA reads hidden states
  # without it.
  final_norm: bool = True
  norm_eps: float = 1e-6
  activation: str = "gelu_tanh"  # of the ViT's MLP: one of config.ACTIVATIONS
  projector_activation: str = "gelu_tanh"  # of the projector's MLP (LLaVA: gelu)
  # Per-channel mean and std the [0, 1] pixels are normalised with on device, comma-separated
  # ("" = none); e.g. SigLIP's "0.5,0.5,0.5".
  pixel_mean: str = ""
  pixel_std: str = ""
  # Positions of an image whose patch grid differs from the table's (image_size / patch_size a
  # side; dynamic resolution): "crop" takes the table's top-left part, "bicubic" resizes the table
  # to the image's grid as Hugging Face's towers do with interpolate_pos_encoding (patches.py).
  position_resize: str = "crop"
  # The blocks' linear layers (attention and MLP) as FP8 matmuls (mimo_jax/models/fp8.py);
  # needs model.dtype=bfloat16.
  fp8: bool = False
  # FP8 scaling (models/fp8.py): "current" (each operand's scale from its own abs-max at the
  # call) or "delayed" (inputs' and incoming gradients' scales from abs-max histories of
  # fp8_history steps kept in the model's state).
  fp8_scaling: str = "current"
  fp8_history: int = 16
  lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)  # adapters (models/lora.py)

  @property
  def patches(self) -> int:
    return (self.image_size // self.patch_size) ** 2

  @property
  def positions(self) -> int:
    """Rows of the position table: the patches and the class token's."""
    return self.patches + int(self.class_token)

  def pixel_norm(self) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
    """(mean, std) per channel, or None."""
    if not self.pixel_mean and not self.pixel_std:
      return None
    return (tuple(float(x) for x in self.pixel_mean.split(",")),
            tuple(float(x) for x in self.pixel_std.split(",")))

  @property
  def tokens_per_image(self) -> int:
    """Image tokens the language model receives per image (after `downsample`)."""
    return self.patches // self.downsample**2


class ViTBlock(nnx.Module):

  def __init__(self, rngs: nnx.Rngs, cfg: ViTConfig, dtype: jnp.dtype, attention: str = "xla",
               max_segments: int = 0, norm_kernel: bool = False):
    """`norm_kernel`: the LayerNorms through the Pallas kernels (layers.LayerNorm)."""
    kernel = norm_kernel
    self.norm1 = LayerNorm(cfg.dim, cfg.norm_eps, kernel)
    self.attn = Attention(rngs, cfg.dim, cfg.heads, cfg.heads, dtype, bias=True,
                          implementation=attention, max_segments=max_segments, fp8=cfg.fp8,
                          fp8_history=history_length(cfg))
    self.norm2 = LayerNorm(cfg.dim, cfg.norm_eps, kernel)
    self.mlp = GeluMLP(rngs, cfg.dim, cfg.mlp_dim, dtype, activation=cfg.activation, fp8=cfg.fp8,
                       fp8_history=history_length(cfg))

  def __call__(self, x_npd: jax.Array, segment_ids_np: jax.Array | None = None) -> jax.Array:
    """With `segment_ids_np` (images packed into rows) a patch attends only to its own image's."""
    x_npd, y_npd = self.norm1.with_residual(x_npd)
    x_npd = x_npd + self.attn(y_npd, segment_ids_bl=segment_ids_np)
    x_npd, y_npd = self.norm2.with_residual(x_npd)
    return x_npd + self.mlp(y_npd)


class VisionEncoder(nnx.Module):
  """Images [n, h, w, c] -> projected image tokens [n, patches / downsample², language dim]:
  `patches` (embedding and positions), the stacked `blocks` (run as a `pipeline.Stack`), then
  `finish` (norm, pixel shuffle, projector). Patches are in block order (patches.py); the learned
  position table covers the grid of `image_size`, and an image of another grid (dynamic
  resolution, `packed_patches`) uses its top-left part or, with `position_resize=bicubic`, the
  table resized to its grid.

  Pixels arrive in [0, 1] and are normalised per channel if the config says so. CLIP's layout
  (`class_token`, `pre_norm`, no patch bias) puts a class token first, position row 0, which
  `finish` drops; `final_norm` off gives the hidden states LLaVA reads."""

  def __init__(self, rngs: nnx.Rngs, cfg: ViTConfig, lm: LanguageConfig, dtype: jnp.dtype,
               attention: str = "xla", max_segments: int = 0, norm_kernel: bool = False):
    self.patch, self.downsample = cfg.patch_size, cfg.downsample
    self.grid, self.position_resize = cfg.image_size // cfg.patch_size, cfg.position_resize
    self.dtype = dtype
    self.pixel_norm = cfg.pixel_norm()
    self.first = int(cfg.class_token)  # position rows (and tokens) before the patches'
    patch_dim = cfg.patch_size**2 * cfg.channels
    self.embed = linear(rngs, patch_dim, cfg.dim, dtype, bias=cfg.patch_bias)
    if cfg.class_token:
      self.cls = nnx.Param(0.02 * jax.random.normal(rngs.params(), (cfg.dim,)))
    self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (cfg.positions, cfg.dim)))
    if cfg.pre_norm:
      self.pre_norm = LayerNorm(cfg.dim, cfg.norm_eps)
    self.blocks = stacked(lambda r: ViTBlock(r, cfg, dtype, attention, max_segments, norm_kernel),
                          cfg.layers, rngs)
    if cfg.final_norm:
      self.norm = LayerNorm(cfg.dim, cfg.norm_eps)
    # LLaVA's two-layer MLP projector, mapping encoder features to the language model's width.
    self.projector = GeluMLP(rngs, cfg.dim * cfg.downsample**2, cfg.projector_hidden, dtype,
                             d_out=lm.dim, activation=cfg.projector_activation)

  def patches(self, images_nhwc: jax.Array) -> jax.Array:
    """Images [n, h, w, c] (all of one size) -> embedded patches [n, patches, dim]."""
    _, h, w, _ = images_nhwc.shape
    p, s = self.patch, self.downsample
    x = patchify(images_nhwc, p, s)
    if self.position_resize == "bicubic":
      ids, weights = bicubic_taps(h // p, w // p, self.grid, s)
      return self.packed_patches(x, jnp.asarray(ids)[None], jnp.asarray(weights)[None])
    if h // p > self.grid or w // p > self.grid:
      raise ValueError(f"a {h}x{w} image has more patches a side than the position table's "
                       f"{self.grid}; position_resize=bicubic resizes the table.")
    return self.packed_patches(x, jnp.asarray(grid_positions(h // p, w // p, s, self.grid))[None])

  def packed_patches(self, patches_npk: jax.Array, pos_np: jax.Array,
                     weights_npt: jax.Array | None = None) -> jax.Array:
    """Pixels of patches [n, k, p*p*c] in [0, 1] at position ids [n, k] -> embedded patches
    [n, k, dim] (with the class token first: [n, 1 + k, dim]). With `weights_npt` the ids are
    taps [n, k, t] and a patch's position is their weighted sum (a resized table, in float32)."""
    patches_npk = patches_npk.astype(jnp.float32)
    if self.pixel_norm is not None:  # per channel: the channel is the fastest axis of a patch
      mean, std = (jnp.tile(jnp.asarray(v, jnp.float32), patches_npk.shape[-1] // len(v))
                   for v in self.pixel_norm)
      patches_npk = (patches_npk - mean) / std
    pos = self.pos[...].astype(self.dtype)
    if weights_npt is None:
      pos_npd = pos[pos_np + self.first]
    else:
      pos_npd = jnp.einsum("nkt,nktd->nkd", weights_npt.astype(jnp.float32),
                           self.pos[...].astype(jnp.float32)[pos_np + self.first],
                           precision=jax.lax.Precision.HIGHEST).astype(self.dtype)
    x_npd = self.embed(patches_npk.astype(self.dtype)) + pos_npd
    if self.first:
      cls = jnp.broadcast_to(self.cls[...].astype(self.dtype) + pos[0],
                             (x_npd.shape[0], 1, x_npd.shape[2]))
      x_npd = jnp.concatenate([cls, x_npd], axis=1)
    if hasattr(self, "pre_norm"):
      x_npd = self.pre_norm(x_npd)
    return x_npd

  def features(self, x_npd: jax.Array) -> jax.Array:
    """The blocks' output -> the tower's features (final norm if any, class token dropped)."""
    if hasattr(self, "norm"):
      x_npd = self.norm(x_npd)
    return x_npd[:, self.first:]

  def finish(self, x_npd: jax.Array) -> jax.Array:
    x_npd = self.features(x_npd)
    n, k, d = x_npd.shape
    s2 = self.downsample**2  # pixel shuffle: s*s consecutive patches (one block) -> one token
    return self.projector(x_npd.reshape(n, k // s2, s2 * d))
