"""Transformer building blocks shared by the ViT and the decoder.

Tensor parallelism is Megatron's column/row split: the first matmul of attention and MLP is split
on its output features (heads, hidden units) over the mesh axis `tp`, the second on its input
features, so each block needs one reduction. The split is declared by path rules
(`sharding.TP_RULES`), not by the modules, which never see a mesh.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from mimo_jax import compat
from mimo_jax.models import fp8 as fp8_ops
from mimo_jax.models import kernel_grads
from mimo_jax.models.activations import ACTIVATIONS
from mimo_jax.models import lora
from mimo_jax.models.manual import whole_manual
from mimo_jax.models import norm_kernels

def stacked(make, n: int, rngs: nnx.Rngs) -> nnx.Module:
  """`n` layers built by `make(rngs)`, parameters stacked on a new leading axis (one key each), so
  that `pipeline.Stack` can scan over them or split them into pipeline stages."""
  keys = jax.random.split(rngs.params(), n)
  return nnx.vmap(lambda key: make(nnx.Rngs(params=key)))(keys)


def linear(rngs: nnx.Rngs, d_in: int, d_out: int, dtype: jnp.dtype, bias: bool = False,
           std: float | None = None, fp8: bool = False, fp8_history: int = 0) -> nnx.Linear:
  """`fp8`: its matmul in FP8 (models/fp8.py); the parameters are the same. `fp8_history` > 0:
  with delayed scaling, from abs-max histories of that many steps (`fp8.add_histories`)."""
  init = nnx.initializers.normal(std if std is not None else d_in**-0.5)
  extra = {"dot_general": fp8_ops.dot_general} if fp8 else {}
  layer = nnx.Linear(d_in, d_out, use_bias=bias, dtype=dtype, param_dtype=jnp.float32,
                     kernel_init=init, rngs=rngs, **extra)
  if fp8 and fp8_history:
    fp8_ops.add_histories(layer, fp8_history)
  return layer


def _apply(x: jax.Array, layers, fp8: bool, groups: int = 1) -> list[jax.Array]:
  """Each linear layer of `layers` on the same input x [..., k] (attention's q, k and v; SwiGLU's
  gate and up). In FP8 they run as one matmul of their kernels side by side (`join`; `groups`
  divides every layer's output features into the blocks that tensor parallelism keeps together,
  heads or hidden units): one GEMM for the forward pass, one for the input's gradient and one for
  the kernels' instead of one each per layer, and the input, the joined kernel and the joined
  incoming gradient quantized once (one scale each, as a fused projection has): a dense FP8 step
  on an H200 measured 1.1% faster so (docs/benchmarks.md). In other dtypes each layer runs alone:
  joined, the bfloat16 step measured the same, and the joined kernel would be a value of its own,
  which the remat policy `none` keeps for the backward pass where FSDP gathers the kernels (the
  FP8 matmul keeps its quantized kernel either way). LoRA adapters (models/lora.py) run beside
  the FP8 matmul in the compute dtype."""
  if not fp8:
    return [kernel_grads.linear(layer, x) for layer in layers]
  dtype = layers[0].dtype or x.dtype
  widths = [layer.kernel.shape[-1] for layer in layers]
  w = join([layer.kernel[...].astype(dtype) for layer in layers], groups)
  if fp8_ops.delayed(layers[0]):
    y = fp8_ops.delayed_matmuls(
        x.astype(dtype), [w], [getattr(l, fp8_ops.INPUT_HISTORY)[...] for l in layers],
        [[getattr(l, fp8_ops.GRAD_HISTORY)[...] for l in layers]], dtype)[0]
  else:
    y = fp8_ops.matmuls(x.astype(dtype), [w], dtype)[0]
  ys = split(y, widths, groups)
  return [y + lora.delta(layer, x) if layer.bias is None
          else y + layer.bias[...].astype(dtype) + lora.delta(layer, x)
          for y, layer in zip(ys, layers)]


def join(kernels: list[jax.Array], groups: int) -> jax.Array:
  """Kernels [k, n_i] side by side as one [k, sum n_i], block by block: each kernel's features
  are seen as [groups, n_i / groups] and the i-th blocks of every kernel are put together. Tensor
  parallelism splits the features of each kernel into contiguous parts of whole blocks (heads,
  hidden units; `groups` a multiple of tp), so a device's part of the joined kernel is its parts of
  the kernels: joining moves nothing between devices. `split` undoes it on a result."""
  if len(kernels) == 1:
    return kernels[0]
  k = kernels[0].shape[0]
  parts = [w.reshape(k, groups, w.shape[-1] // groups) for w in kernels]
  return jnp.concatenate(parts, axis=-1).reshape(k, -1)


def split(y: jax.Array, widths: list[int], groups: int) -> list[jax.Array]:
  """A result [..., sum n_i] of a joined kernel (`join`) as each kernel's [..., n_i]."""
  if len(widths) == 1:
    return [y]
  lead = y.shape[:-1]
  blocks = y.reshape(*lead, groups, -1)
  cuts = [0]
  for n in widths:
    cuts.append(cuts[-1] + n // groups)
  return [blocks[..., a:b].reshape(*lead, n) for a, b, n in zip(cuts, cuts[1:], widths)]


def _call(layer: nnx.Linear, x: jax.Array) -> jax.Array:
  """`layer(x)` (`kernel_grads.linear`), or with delayed FP8 scaling, its histories' matmul
  (`fp8.delayed_matmuls`)."""
  return _apply(x, (layer,), True)[0] if fp8_ops.delayed(layer) else kernel_grads.linear(layer, x)


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
  """LayerNorm computed in float32; with `kernel`, by the Pallas kernels of norm_kernels.py where
  they run (a GPU, a width that is a power of two), else by XLA."""

  def __init__(self, dim: int, eps: float = 1e-6, kernel: bool = False):
    self.scale = nnx.Param(jnp.ones((dim,), jnp.float32))
    self.bias = nnx.Param(jnp.zeros((dim,), jnp.float32))
    self.eps = eps
    self.kernel = kernel

  def __call__(self, x: jax.Array) -> jax.Array:
    if self.kernel and norm_kernels.supported(x.shape[-1]):
      return norm_kernels.layer_norm(x, self.scale[...], self.bias[...], self.eps)
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
    return (y * self.scale[...] + self.bias[...]).astype(x.dtype)

  def with_residual(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(x, self(x)) for a pre-norm block whose residual stream carries x on (with the kernels,
    the stream's gradient joins the norm's in one backward kernel)."""
    if self.kernel and norm_kernels.supported(x.shape[-1]):
      return norm_kernels.residual_layer_norm(x, self.scale[...], self.bias[...], self.eps)
    return x, self(x)


def rope_frequencies(head_dim: int, theta: float,
                     scaling: tuple[float, float, float, int] | None = None) -> jax.Array:
  """The rotary frequencies [head_dim / 2] in float32. `scaling` = (factor, low_freq_factor,
  high_freq_factor, original_positions) applies Llama-3.1's: wavelengths beyond
  original_positions / low_freq_factor are slowed by `factor`, those below
  original_positions / high_freq_factor kept, and those between interpolated smoothly."""
  half = head_dim // 2
  freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
  if scaling is None:
    return freq
  factor, low, high, original = scaling
  wavelen = 2 * math.pi / freq
  scaled = jnp.where(wavelen > original / low, freq / factor, freq)
  smooth = (original / wavelen - low) / (high - low)
  smoothed = (1 - smooth) * scaled / factor + smooth * scaled
  medium = ~(wavelen < original / high) & ~(wavelen > original / low)
  return jnp.where(medium, smoothed, scaled)


def rope(x_blhd: jax.Array, positions_bl: jax.Array, freq: jax.Array | float) -> jax.Array:
  """Rotary position embedding (half-split convention), computed in float32; `freq` is
  `rope_frequencies(...)` or a base theta."""
  half = x_blhd.shape[-1] // 2
  if not isinstance(freq, jax.Array):
    freq = rope_frequencies(2 * half, freq)
  angle = positions_bl[..., None, None].astype(jnp.float32) * freq  # [b, l, 1, half]
  sin, cos = jnp.sin(angle), jnp.cos(angle)
  x1, x2 = jnp.split(x_blhd.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_blhd.dtype)


def segment_runs(segment_ids_bl: jax.Array, max_segments: int) -> tuple[jax.Array, jax.Array]:
  """Start offsets [b, M] and lengths [b, M] of the runs of equal ids in each row (M =
  `max_segments`, unused entries -1). Rows hold contiguous segments with the padding (id 0) as
  one more run at the end; a row with more runs than M would lose the rest, so the data layout
  caps them (data/layout.py)."""
  b, l = segment_ids_bl.shape
  first = jnp.ones((b, 1), bool)
  starts = jnp.concatenate([first, segment_ids_bl[:, 1:] != segment_ids_bl[:, :-1]], axis=1)
  idx = jax.vmap(lambda s: jnp.nonzero(s, size=max_segments, fill_value=l)[0])(starts)
  idx = idx.astype(jnp.int32)
  ends = jnp.concatenate([idx[:, 1:], jnp.full((b, 1), l, jnp.int32)], axis=1)
  used = idx < l
  return jnp.where(used, idx, -1), jnp.where(used, ends - idx, -1)


def packed_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids_bl: jax.Array,
                     max_segments: int, causal: bool) -> jax.Array:
  """cuDNN's fused attention over rows of packed segments [b, l, heads, head_dim]: each token
  attends only within its run of equal segment ids (causally if `causal`), as the masked XLA
  attention does, without materialising the [l, l] mask. The segment layout goes to cuDNN as
  per-row offsets and lengths (its packed "THD" mode, Hopper GPUs and later).

  The public `jax.nn.dot_product_attention` takes no segment layout, hence the private call
  (compat.packed_attention). Key and value heads are repeated to the query's count first:
  grouped-query heads scale the key offsets wrongly in some jax releases (jax-ml/jax#39521).
  """
  groups = q.shape[2] // k.shape[2]
  if groups > 1:
    k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
  offsets, lengths = segment_runs(segment_ids_bl, max_segments)
  offsets = jnp.concatenate([offsets, jnp.full((offsets.shape[0], 1), -1, jnp.int32)], axis=1)
  return whole_manual(functools.partial(compat.packed_attention, causal=causal), q, k, v,
                      offsets, lengths)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None, causal: bool,
              implementation: str) -> jax.Array:
  """`jax.nn.dot_product_attention` over rows [b, l, heads, head_dim]. jax's cuDNN attention
  refuses to train odd lengths (jax 0.11.2): rows of an odd length (a CLIP tower's 577 positions
  with its class token, SigLIP-so400m's 729) run through it padded by one position
  (`even_attention`)."""
  if implementation == "cudnn" and mask is None:
    if q.shape[1] % 2:
      return even_attention(q, k, v, causal, implementation)
    return whole_manual(functools.partial(jax.nn.dot_product_attention, is_causal=causal,
                                          implementation=implementation), q, k, v)
  return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal,
                                      implementation=implementation)


def even_attention(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool,
                   implementation: str) -> jax.Array:
  """Attention of rows of an odd length l, computed on l + 1 positions: the added key is outside
  every row's key length, so no query sees it, and the added query's output is dropped."""
  l = q.shape[1]
  pad = lambda x: jnp.pad(x, ((0, 0), (0, 1), (0, 0), (0, 0)))
  # The lengths [b] are made from q, so that they follow its batch: a leading axis that vmap
  # adds, and its batch sharding (a constant would be whole on every data-parallel shard). The
  # heads are reduced, not sliced, as tensor parallelism splits them.
  first = jnp.max(q[:, 0, :, 0].astype(jnp.float32), axis=-1)
  lengths = jnp.where(jnp.isnan(first), l, l).astype(jnp.int32)
  within = lambda q, k, v, n: jax.nn.dot_product_attention(
      q, k, v, is_causal=causal, query_seq_lengths=n, key_value_seq_lengths=n,
      implementation=implementation)
  return whole_manual(within, pad(q), pad(k), pad(v), lengths)[:, :l]


class KVCache(NamedTuple):
  """The keys and values of a batch's tokens so far, for generation: `k`, `v` [layers, b,
  kv_heads, T, head_dim], every attention layer's, heads first (each layer's [b, kv_heads, T,
  head_dim] is what its attention's matmuls read, with no transpose), and `layer`, the one that
  an attention reads and writes. The tokens being run take slots `index`, `index` + 1, ...; a
  query sees the slots at or before its own that `valid_bt` marks (a left-padded prompt's padding
  is not), later ones hold nothing yet."""
  k: jax.Array
  v: jax.Array
  index: jax.Array  # int32 scalar: the slot of the first token being run
  valid_bt: jax.Array
  layer: jax.Array  # int32 scalar: the attention layer whose keys and values are read and written


def cached_attention(q_bnhd: jax.Array, k_bnkd: jax.Array, v_bnkd: jax.Array,
                     cache: KVCache) -> tuple[jax.Array, KVCache]:
  """Attention of n new tokens over layer `cache.layer` of a key-value cache, after writing their
  keys and values there at `cache.index`: (output [b, n, heads, head_dim] in float32, the cache
  holding them, its index left for the model to move once every layer has run). Only the new
  tokens' slots are written (in place, where the cache is a loop's carry). Scores and
  softmax are float32, as transformers' eager attention computes them; masked scores take
  float32's minimum (finite, as transformers masks: a padding query that sees no key stays
  finite). The matmuls read the cache in its own dtype and sum in float32: the queries and (as
  transformers' eager attention does) the probabilities are cast to it, so a bfloat16 cache is
  never copied to float32 at every new token."""
  b, n, heads, head_dim = q_bnhd.shape
  kv_heads = k_bnkd.shape[2]
  at = (cache.layer, 0, 0, cache.index, 0)
  put = lambda all_, new: jax.lax.dynamic_update_slice(
      all_, new.transpose(0, 2, 1, 3)[None].astype(all_.dtype), at)
  k_all, v_all = put(cache.k, k_bnkd), put(cache.v, v_bnkd)
  k, v = (jax.lax.dynamic_index_in_dim(a, cache.layer, keepdims=False) for a in (k_all, v_all))
  qg = q_bnhd.reshape(b, n, kv_heads, heads // kv_heads, head_dim).astype(k.dtype)
  scores = jnp.einsum("bnkgd,bktd->bkgnt", qg, k,
                      preferred_element_type=jnp.float32) * head_dim**-0.5
  slot = jnp.arange(k.shape[2])
  query = cache.index + jnp.arange(n)
  causal = (slot[None, :] <= query[:, None])[None, None, None]
  allowed = cache.valid_bt[:, None, None, None, :] & causal
  scores = jnp.where(allowed, scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1)
  # Heads first out of the matmul, then moved: the one form of the two XLA's CPU backend runs
  # with bfloat16 operands and a float32 result.
  out = jnp.einsum("bkgnt,bktd->bkgnd", probs.astype(v.dtype), v,
                   preferred_element_type=jnp.float32).transpose(0, 3, 1, 2, 4)
  return out.reshape(b, n, heads, head_dim), cache._replace(k=k_all, v=v_all)


class Attention(nnx.Module):
  """Multi-head attention with grouped-query heads; optional RoPE and causal mask.

  Packed rows (segment ids) use XLA's masked attention, or cuDNN's packed attention when the
  implementation is "cudnn" and `max_segments` (most runs of equal ids in a row, padding
  included) is set. Given a `KVCache` (generation), the tokens attend causally to the cache
  instead (`cached_attention`); without one nothing of the cache is computed.
  """

  def __init__(self, rngs: nnx.Rngs, dim: int, heads: int, kv_heads: int, dtype: jnp.dtype,
               bias: bool = False, rope_theta: float | None = None, out_std: float | None = None,
               implementation: str = "xla", max_segments: int = 0, o_bias: bool | None = None,
               rope_scaling: tuple | None = None, fp8: bool = False, k_bias: bool | None = None,
               fp8_history: int = 0):
    """`bias`: on q, k, v and (unless `o_bias` or `k_bias` say otherwise: Whisper's k has none)
    o. `rope_scaling`: see `rope_frequencies`. `fp8`: the four projections in FP8, with delayed
    scaling over `fp8_history` steps if that is > 0 (`linear`)."""
    lin = functools.partial(linear, fp8=fp8, fp8_history=fp8_history)
    self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
    self.rope_theta = rope_theta
    self.rope_scaling = rope_scaling
    self.implementation = implementation  # "xla" or "cudnn" (fused flash attention on GPUs)
    self.max_segments = max_segments
    self.q = lin(rngs, dim, heads * self.head_dim, dtype, bias)
    self.k = lin(rngs, dim, kv_heads * self.head_dim, dtype, bias if k_bias is None else k_bias)
    self.v = lin(rngs, dim, kv_heads * self.head_dim, dtype, bias)
    self.o = lin(rngs, heads * self.head_dim, dim, dtype, bias if o_bias is None else o_bias,
                 std=out_std)
    self.fp8 = fp8

  def __call__(self, x_bld: jax.Array, positions_bl: jax.Array | None = None,
               causal: bool = False, segment_ids_bl: jax.Array | None = None,
               cache: KVCache | None = None) -> jax.Array | tuple[jax.Array, KVCache]:
    """The output [b, l, dim]; with `cache`, (the output, the cache holding these tokens)."""
    b, l, _ = x_bld.shape
    if cache is not None:
      q, k, v = self._qkv(x_bld, positions_bl)
      out, cache = cached_attention(q, k, v, cache)
      return _call(self.o, out.reshape(b, l, self.heads * self.head_dim).astype(x_bld.dtype)), \
          cache
    return self.project(self.mix(x_bld, positions_bl, causal, segment_ids_bl))

  def project(self, mixed: jax.Array) -> jax.Array:
    """The output projection of `mix`'s result."""
    return _call(self.o, mixed)

  def mix(self, x_bld: jax.Array, positions_bl: jax.Array | None = None, causal: bool = False,
          segment_ids_bl: jax.Array | None = None) -> jax.Array:
    """The heads' outputs side by side [b, l, heads · head_dim], before the output projection
    (`project`): `__call__` without a cache is `project(mix(...))`."""
    b, l, _ = x_bld.shape
    q, k, v = self._qkv(x_bld, positions_bl)
    mask, implementation = None, self.implementation
    if segment_ids_bl is not None and implementation == "cudnn" and self.max_segments:
      out = packed_attention(q, k, v, segment_ids_bl, self.max_segments, causal)
    else:
      if segment_ids_bl is not None:  # packed rows: no attention across samples
        mask = segment_ids_bl[:, None, :, None] == segment_ids_bl[:, None, None, :]
        implementation = "xla"
      out = attention(q, k, v, mask, causal, implementation)
    return out.reshape(b, l, self.heads * self.head_dim)

  def _qkv(self, x_bld: jax.Array, positions_bl: jax.Array | None) -> tuple[jax.Array, ...]:
    """Queries [b, l, heads, head_dim], keys and values [b, l, kv_heads, head_dim], RoPE applied."""
    b, l, _ = x_bld.shape
    q, k, v = _apply(x_bld, (self.q, self.k, self.v), self.fp8, groups=self.kv_heads)
    q = q.reshape(b, l, self.heads, self.head_dim)
    k = k.reshape(b, l, self.kv_heads, self.head_dim)
    v = v.reshape(b, l, self.kv_heads, self.head_dim)
    if self.rope_theta is not None:
      freq = rope_frequencies(self.head_dim, self.rope_theta, self.rope_scaling)
      q = rope(q, positions_bl, freq)
      k = rope(k, positions_bl, freq)
    return q, k, v


def _hidden(h: jax.Array, fp8: bool) -> jax.Array:
  """An MLP's activations before its down projection, made by a fusion of their own (behind an
  optimization barrier, so XLA fuses them with nothing on either side): a dense VLM step on an
  H200 measured 1.0% and 1.6% faster so, in two calls (docs/benchmarks.md). An FP8 down
  projection, which quantizes them, is left to XLA's fusion (not measured with the barrier)."""
  return h if fp8 else jax.lax.optimization_barrier(h)


class SwiGLU(nnx.Module):

  def __init__(self, rngs: nnx.Rngs, dim: int, hidden: int, dtype: jnp.dtype,
               out_std: float | None = None, fp8: bool = False, fp8_history: int = 0):
    lin = functools.partial(linear, fp8=fp8, fp8_history=fp8_history)
    self.gate = lin(rngs, dim, hidden, dtype)
    self.up = lin(rngs, dim, hidden, dtype)
    self.down = lin(rngs, hidden, dim, dtype, std=out_std)
    self.fp8 = fp8

  def __call__(self, x: jax.Array) -> jax.Array:
    gate, up = _apply(x, (self.gate, self.up), self.fp8, groups=self.up.kernel.shape[-1])
    return _call(self.down, _hidden(jax.nn.silu(gate) * up, self.fp8))


class GeluMLP(nnx.Module):
  """up, activation (`ACTIVATIONS`: GELU's tanh approximation by default), down; with biases."""

  def __init__(self, rngs: nnx.Rngs, dim: int, hidden: int, dtype: jnp.dtype,
               d_out: int | None = None, activation: str = "gelu_tanh", fp8: bool = False,
               fp8_history: int = 0):
    lin = functools.partial(linear, bias=True, fp8=fp8, fp8_history=fp8_history)
    self.up = lin(rngs, dim, hidden, dtype)
    self.down = lin(rngs, hidden, d_out or dim, dtype)
    self.activation = activation
    self.fp8 = fp8

  def __call__(self, x: jax.Array) -> jax.Array:
    return _call(self.down, _hidden(ACTIVATIONS[self.activation](_call(self.up, x)), self.fp8))
