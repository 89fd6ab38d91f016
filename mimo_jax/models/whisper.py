"""Audio encoder: Whisper's (two convolutions, sinusoidal positions, pre-LN blocks, final norm),
optionally Qwen2-Audio's tower (padded frames masked, average pooling before the final norm),
followed by a projector into the language model's width.

A window is `frames` = 2 · `positions` log-mel frames (30 s in Whisper: 3000 frames, 1500
positions); the stride-2 convolution makes one position of two frames. Of a window whose first
`n` frames hold audio only its first `window_tokens(n)` tokens are kept (`compact`): a 4 s clip
yields 4 s of tokens. Whisper attends over the whole window, padding included, as transformers'
WhisperEncoder does (so the kept tokens equal its hidden states); with `mask_padding` (Qwen2-Audio)
the keys of padded positions are masked, as Qwen2AudioForConditionalGeneration masks them.

Packed slots (`packed_embed`, `packed_finish`) hold several windows of any length one after the
other, each encoded as it would be alone on its own frames (no padding): segment-aware
convolutions, positions restarting per window, attention block-diagonal by window (the blocks'
segment ids) and each window's own pooling.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mimo_jax.config import LanguageConfig, LoraConfig
from mimo_jax.models.activations import ACTIVATIONS
from mimo_jax.models.fp8 import history_length
from mimo_jax.models.layers import Attention, GeluMLP, LayerNorm, linear, stacked
from mimo_jax.models.whisper_windows import window_tokens

PROJECTORS = ("linear", "mlp")
# Whisper's encoder shapes (dim, layers, heads, mlp_dim, mel_bins), for `shaped`.
SHAPES = {
    "tiny": (384, 4, 6, 1536, 80), "base": (512, 6, 8, 2048, 80),
    "small": (768, 12, 12, 3072, 80), "medium": (1024, 24, 16, 4096, 80),
    "large": (1280, 32, 20, 5120, 80), "large-v2": (1280, 32, 20, 5120, 80),
    "large-v3": (1280, 32, 20, 5120, 128),
}


@dataclasses.dataclass
class WhisperConfig:
  """The tower's architecture and its projector."""
  mel_bins: int = 8  # log-mel bins of a frame (Whisper: 80; large-v3 and Qwen2-Audio: 128)
  positions: int = 8  # positions of a window: its frames / 2 (Whisper: 1500, a 30 s window)
  dim: int = 32
  layers: int = 2
  heads: int = 4
  mlp_dim: int = 64
  norm_eps: float = 1e-5
  activation: str = "gelu"  # of the blocks' MLP (the convolutions' is GELU): config.ACTIVATIONS
  # Average pooling of this many positions before the final norm (Qwen2-Audio's tower: 2).
  pool: int = 1
  # Padded positions masked as attention keys (Qwen2-Audio); Whisper attends to its padding.
  mask_padding: bool = False
  projector: str = "mlp"  # "linear" (Qwen2-Audio's) or "mlp" (LLaVA's two layers)
  projector_hidden: int = 64  # of the "mlp" projector
  projector_activation: str = "gelu"
  # The blocks' linear layers as FP8 matmuls (models/fp8.py); needs model.dtype=bfloat16.
  fp8: bool = False
  # FP8 scaling (models/fp8.py): "current" (each operand's scale from its own abs-max at the
  # call) or "delayed" (inputs' and incoming gradients' scales from abs-max histories of
  # fp8_history steps kept in the model's state).
  fp8_scaling: str = "current"
  fp8_history: int = 16
  lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)  # adapters (models/lora.py)

  @property
  def frames(self) -> int:
    """Log-mel frames of one window."""
    return 2 * self.positions

  @property
  def tokens_per_window(self) -> int:
    return self.positions // self.pool

  def window_tokens(self, frames: int) -> int:
    """Tokens kept of a window whose first `frames` frames hold audio (`window_tokens`)."""
    return int(window_tokens(frames, self.pool))


def shaped(name: str, **fields) -> WhisperConfig:
  """A Whisper encoder's shape by name (tiny ... large-v3), 30 s windows, `fields` on top."""
  dim, layers, heads, mlp, mels = SHAPES[name]
  return WhisperConfig(**{**dict(mel_bins=mels, positions=1500, dim=dim, layers=layers,
                                 heads=heads, mlp_dim=mlp), **fields})


def sinusoids(positions: int, dim: int) -> np.ndarray:
  """Whisper's position table [positions, dim]: sines then cosines of log-spaced timescales."""
  inc = math.log(10000) / (dim // 2 - 1)
  inv = np.exp(-inc * np.arange(dim // 2, dtype=np.float32)).astype(np.float32)
  t = np.arange(positions, dtype=np.float32)[:, None] * inv[None]
  return np.concatenate([np.sin(t), np.cos(t)], axis=1).astype(np.float32)


class WhisperBlock(nnx.Module):
  """Pre-LN: attention (biases on q, v and the output, none on k), then the MLP. `segments`: most
  runs of equal segment ids a row holds (packed slots; cuDNN's packed attention is sized by it)."""

  def __init__(self, rngs: nnx.Rngs, cfg: WhisperConfig, dtype: jnp.dtype, attention: str = "xla",
               segments: int = 0):
    self.norm1 = LayerNorm(cfg.dim, cfg.norm_eps)
    self.attn = Attention(rngs, cfg.dim, cfg.heads, cfg.heads, dtype, bias=True, k_bias=False,
                          implementation=attention,
                          max_segments=segments or (2 if cfg.mask_padding else 0), fp8=cfg.fp8,
                          fp8_history=history_length(cfg))
    self.norm2 = LayerNorm(cfg.dim, cfg.norm_eps)
    self.mlp = GeluMLP(rngs, cfg.dim, cfg.mlp_dim, dtype, activation=cfg.activation, fp8=cfg.fp8,
                       fp8_history=history_length(cfg))

  def __call__(self, x_npd: jax.Array, valid_np: jax.Array | None = None) -> jax.Array:
    """With `valid_np` (1 = audio, 0 = padding; Qwen2-Audio) audio attends only to audio; what
    padding sees never reaches a kept token. In a packed slot it holds each window's segment id
    (1, 2, ...; 0 = padding): attention is block-diagonal by window."""
    x_npd = x_npd + self.attn(self.norm1(x_npd), segment_ids_bl=valid_np)
    return x_npd + self.mlp(self.norm2(x_npd))


class WhisperEncoder(nnx.Module):
  """Log-mel windows [n, frames, mel_bins] -> `embed` (convolutions and positions) -> the stacked
  `blocks` (a `pipeline.Stack`) -> `finish` (pooling, final norm, projector) -> [n, tokens, d].
  The position table is a parameter (checkpoints hold it) that never trains (`FIXED`)."""

  def __init__(self, rngs: nnx.Rngs, cfg: WhisperConfig, lm: LanguageConfig, dtype: jnp.dtype,
               attention: str = "xla"):
    self.cfg, self.dtype = cfg, dtype
    conv = lambda d_in, stride: nnx.Conv(
        d_in, cfg.dim, kernel_size=(3,), strides=(stride,), padding=((1, 1),), dtype=dtype,
        param_dtype=jnp.float32, kernel_init=nnx.initializers.normal((3 * d_in)**-0.5),
        rngs=rngs)
    self.conv1, self.conv2 = conv(cfg.mel_bins, 1), conv(cfg.dim, 2)
    self.pos = nnx.Param(jnp.asarray(sinusoids(cfg.positions, cfg.dim)))
    self.blocks = stacked(lambda r: WhisperBlock(r, cfg, dtype, attention), cfg.layers, rngs)
    self.norm = LayerNorm(cfg.dim, cfg.norm_eps)
    if cfg.projector == "linear":
      self.projector = linear(rngs, cfg.dim, lm.dim, dtype, bias=True)
    else:
      self.projector = GeluMLP(rngs, cfg.dim, cfg.projector_hidden, dtype, d_out=lm.dim,
                               activation=cfg.projector_activation)

  def embed(self, mel_nfm: jax.Array) -> jax.Array:
    """Windows [n, frames, mel_bins] -> [n, positions, dim]."""
    act = ACTIVATIONS["gelu"]  # the convolutions' is exact GELU whatever the blocks' activation
    x = act(self.conv1(mel_nfm.astype(self.dtype)))
    x = act(self.conv2(x))
    return x + jax.lax.stop_gradient(self.pos[...]).astype(self.dtype)

  def packed_embed(self, mel_nfm: jax.Array, seg_nf: jax.Array, pos_nq: jax.Array) -> jax.Array:
    """Packed slots [n, frames, mel_bins] whose frames carry their window's segment id `seg_nf`
    (1, 2, ...; 0 = none) -> [n, frames / 2, dim], each window as if convolved alone: no tap
    reads another window's frame or a frame of none (the convolutions' zero padding), windows
    start at even frames, and positions `pos_nq` restart at 0 in each."""
    act = ACTIVATIONS["gelu"]
    x = act(segment_conv(self.conv1, mel_nfm.astype(self.dtype), seg_nf, 1))
    x = x * (seg_nf > 0)[..., None].astype(x.dtype)
    x = act(segment_conv(self.conv2, x, seg_nf, 2))
    return x + jax.lax.stop_gradient(self.pos[...]).astype(self.dtype)[pos_nq]

  def packed_finish(self, x_nqd: jax.Array, token_pos_nt: jax.Array) -> jax.Array:
    """The blocks' output of packed slots -> their tokens [n, t, language dim]: token i the mean
    of `pool` positions from `token_pos_nt[:, i]` (its window's own pooling), normed, projected."""
    idx_ntp = token_pos_nt[..., None] + jnp.arange(self.cfg.pool)
    x_ntd = jax.vmap(lambda x, i: x[i].mean(axis=1))(x_nqd, idx_ntp)
    return self.projector(self.norm(x_ntd))

  def valid(self, frames_n: jax.Array) -> jax.Array:
    """Which positions [n, positions] hold audio (1) or padding (0), of windows whose first
    `frames_n` frames are audio: the blocks' mask side input."""
    conv = window_tokens(frames_n, 1)  # positions the convolutions make of the audio
    return (jnp.arange(self.cfg.positions)[None] < conv[:, None]).astype(jnp.int32)

  def features(self, x_npd: jax.Array) -> jax.Array:
    """The blocks' output -> the tower's features [n, positions / pool, dim] (pooled, normed)."""
    p = self.cfg.pool
    if p > 1:
      n, k, d = x_npd.shape
      x_npd = x_npd[:, :k // p * p].reshape(n, k // p, p, d).mean(axis=2)
    return self.norm(x_npd)

  def finish(self, x_npd: jax.Array) -> jax.Array:
    return self.projector(self.features(x_npd))


def segment_conv(conv: nnx.Conv, x_nfc: jax.Array, seg_nf: jax.Array, stride: int) -> jax.Array:
  """`conv` (kernel 3, padding 1) of rows of segments: a tap reads a neighbour only of its own
  segment id (else zero, as at a sequence's end), centred on frames 0, stride, 2·stride, ..."""
  kernel, bias = conv.kernel[...].astype(x_nfc.dtype), conv.bias[...].astype(x_nfc.dtype)
  shift = lambda a, by, fill: jnp.roll(a, by, axis=1).at[:, 0 if by > 0 else -1].set(fill)
  same = lambda by: (shift(seg_nf, by, -1) == seg_nf)[..., None].astype(x_nfc.dtype)
  prev, nxt = shift(x_nfc, 1, 0) * same(1), shift(x_nfc, -1, 0) * same(-1)
  pick = lambda a: a[:, ::stride]
  return pick(prev) @ kernel[0] + pick(x_nfc) @ kernel[1] + pick(nxt) @ kernel[2] + bias


def compact(tok_nwtd: jax.Array, frames_nw: jax.Array, pool: int) -> jax.Array:
  """Each slot's windows [n, w, t, d] -> its kept tokens [n, w·t, d]: window after window, the
  tokens of padding dropped, zeros after the last."""
  n, w, t, d = tok_nwtd.shape
  kept_nw = window_tokens(frames_nw, pool)
  start_nw = jnp.cumsum(kept_nw, axis=1) - kept_nw
  idx = jnp.arange(t)[None, None]
  dest = jnp.where(idx < kept_nw[..., None], start_nw[..., None] + idx, w * t)  # w·t: dropped
  out = jnp.zeros((n, w * t, d), tok_nwtd.dtype)
  rows = jnp.broadcast_to(jnp.arange(n)[:, None, None], dest.shape)
  return out.at[rows, dest].set(tok_nwtd, mode="drop")
