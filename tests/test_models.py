"""Unit tests of the model modules: layers, the ViT and the decoder, and Whisper's named shapes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mimo_jax.config import LanguageConfig
from mimo_jax.encoders.vision import VisionConfig
from mimo_jax.models import layers, llm, vit, whisper
from mimo_jax.trees import paths


def test_rmsnorm_and_layernorm_follow_their_formulas():
  x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
  rms = layers.RMSNorm(8)(jnp.asarray(x))
  np.testing.assert_allclose(rms, x / np.sqrt(np.mean(x * x, -1, keepdims=True) + 1e-6),
                             rtol=1e-5)
  ln = layers.LayerNorm(8)(jnp.asarray(x))
  mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
  np.testing.assert_allclose(ln, (x - mean) / np.sqrt(var + 1e-6), rtol=1e-4, atol=1e-5)


def test_rope_rotates_pairs_and_keeps_relative_positions():
  rng = np.random.default_rng(1)
  q, k = (jnp.asarray(rng.standard_normal((1, 1, 1, 8)), jnp.float32) for _ in range(2))
  at = lambda x, p: layers.rope(x, jnp.asarray([[p]]), 10_000.0)
  np.testing.assert_allclose(jnp.linalg.norm(at(q, 5)), jnp.linalg.norm(q), rtol=1e-5)
  # <rope(q, i), rope(k, j)> depends on i - j only.
  dot = lambda i, j: float(jnp.sum(at(q, i) * at(k, j)))
  np.testing.assert_allclose(dot(7, 3), dot(14, 10), rtol=1e-4)


def test_causal_attention_sees_only_earlier_tokens():
  attn = layers.Attention(nnx.Rngs(0), 16, 4, 2, jnp.float32, rope_theta=10_000.0)
  x = jnp.asarray(np.random.default_rng(2).standard_normal((1, 6, 16)), jnp.float32)
  pos = jnp.arange(6)[None]
  out = attn(x, pos, causal=True)
  changed = attn(x.at[:, 4:].set(0.0), pos, causal=True)
  np.testing.assert_allclose(out[:, :4], changed[:, :4], rtol=1e-5, atol=1e-6)
  assert not np.allclose(out[:, 4:], changed[:, 4:])


def _linears(dtype, sizes, seed=0, lora_rank=0):
  from mimo_jax.config import LoraConfig  # pylint: disable=import-outside-toplevel
  from mimo_jax.models import lora  # pylint: disable=import-outside-toplevel
  rngs = nnx.Rngs(params=seed)
  out = nnx.List([layers.linear(rngs, 32, n, dtype, bias=b) for n, b in sizes])
  for i, layer in enumerate(out):
    if layer.bias is not None:
      layer.bias[...] = jax.random.normal(jax.random.key(10 + i), layer.bias.shape)
  if lora_rank:
    lora.attach(out, LoraConfig(rank=lora_rank, alpha=2 * lora_rank, targets="0|2"), rngs)
    for layer in out:
      if hasattr(layer, "lora_b"):
        layer.lora_b[...] = jax.random.normal(jax.random.key(20), layer.lora_b.shape)
  return out


@pytest.mark.parametrize("groups,lora_rank", [(1, 0), (4, 0), (4, 2)])
def test_joined_linears_are_each_layer_and_so_are_their_gradients(groups, lora_rank):
  """Layers sharing an input run as one matmul of their joined kernels (q, k, v; gate, up): each
  result, the input's gradient and every parameter's gradient are those of the layers alone."""
  ls = _linears(jnp.float32, ((64, True), (16, False), (16, True)), lora_rank=lora_rank)
  x = jax.random.normal(jax.random.key(1), (2, 5, 32))
  gs = [jax.random.normal(jax.random.key(2 + i), (2, 5, l.out_features)) for i, l in
        enumerate(ls)]
  graph, params = nnx.split(ls)

  def loss(joined):
    def f(x, params):
      model = list(nnx.merge(graph, params))
      ys = layers._apply(x, model, False, groups) if joined else [l(x) for l in model]
      return sum(jnp.sum(y * g) for y, g in zip(ys, gs)), ys
    return f
  (_, got), got_grads = jax.value_and_grad(loss(True), (0, 1), has_aux=True)(x, params)
  (_, want), want_grads = jax.value_and_grad(loss(False), (0, 1), has_aux=True)(x, params)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
  assert jax.tree.structure(got_grads) == jax.tree.structure(want_grads)
  for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_joined_kernels_move_nothing_between_tensor_parallel_devices():
  """Kernels split over tp by whole heads (or hidden units) join on each device: the step of a
  joined q, k, v under a column-split sharding holds no collective."""
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=import-outside-toplevel
  mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
  ls = _linears(jnp.float32, ((64, True), (16, False), (16, True)))
  graph, params = nnx.split(ls)
  params = jax.tree.map(
      lambda a: jax.device_put(a, NamedSharding(mesh, P(*(None,) * (a.ndim - 1), "tp"))), params)
  x = jax.device_put(jnp.ones((4, 32)), NamedSharding(mesh, P()))

  def f(params, x):
    ys = layers._apply(x, list(nnx.merge(graph, params)), False, 4)
    return [jax.lax.with_sharding_constraint(y, NamedSharding(mesh, P(None, "tp"))) for y in ys]
  compiled = jax.jit(jax.grad(lambda p, x: sum(jnp.sum(y ** 2) for y in f(p, x)))).lower(
      params, x).compile().as_text()
  forward = jax.jit(f).lower(params, x).compile().as_text()
  for hlo in (forward, compiled):
    for op in ("all-gather", "all-to-all", "collective-permute", "all-reduce"):
      assert f" {op}(" not in hlo and f" {op}-start(" not in hlo, op


def test_vit_and_decoder_shapes():
  v, lm = VisionConfig(), LanguageConfig()
  enc = vit.VisionEncoder(nnx.Rngs(0), v, lm, jnp.float32)
  images = jnp.zeros((2, v.image_size, v.image_size, v.channels))
  x = enc.patches(images)
  assert x.shape == (2, v.patches, v.dim)
  assert enc.finish(x).shape == (2, v.tokens_per_image, lm.dim)
  dec = llm.LanguageModel(nnx.Rngs(0), lm, 17, jnp.float32)
  h = dec.embed(jnp.zeros((2, 5), jnp.int32))
  assert h.shape == (2, 5, lm.dim) and dec.logits(h).shape == (2, 5, 17)
  assert dec.logits(h).dtype == jnp.float32


# Whisper's published encoder sizes (the openai/whisper model cards and HF configs): layers,
# width, heads, mel bins; the MLP is 4 x the width and a 30 s window 1500 positions.
WHISPER = {"tiny": (4, 384, 6, 80), "base": (6, 512, 8, 80), "small": (12, 768, 12, 80),
           "medium": (24, 1024, 16, 80), "large": (32, 1280, 20, 80),
           "large-v2": (32, 1280, 20, 80), "large-v3": (32, 1280, 20, 128)}


@pytest.mark.parametrize("name", WHISPER)
def test_whisper_shapes_by_name_are_the_published_ones(name):
  depth, dim, heads, mels = WHISPER[name]
  cfg = whisper.shaped(name, pool=2)
  assert (cfg.layers, cfg.dim, cfg.heads, cfg.mlp_dim, cfg.mel_bins, cfg.positions, cfg.pool) == (
      depth, dim, heads, 4 * dim, mels, 1500, 2)
  enc = nnx.eval_shape(lambda: whisper.WhisperEncoder(nnx.Rngs(0), cfg, LanguageConfig(),
                                                      jnp.float32))
  shapes = {k: v.shape for k, v in paths(nnx.state(enc, nnx.Param)).items()}
  assert shapes["conv1/kernel/value"] == (3, mels, dim) and shapes["pos/value"] == (1500, dim)
  assert shapes["blocks/attn/q/kernel/value"] == (depth, dim, dim)
  assert shapes["blocks/mlp/up/kernel/value"] == (depth, dim, 4 * dim)
