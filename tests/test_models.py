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


@pytest.mark.parametrize("groups", [1, 4])
def test_a_joined_kernels_result_splits_into_each_kernels(groups):
  """FP8's q, k, v (gate, up) run as one matmul of their joined kernels (layers.join): the split
  result is each kernel's product."""
  ws = [jax.random.normal(jax.random.key(i), (32, n)) for i, n in enumerate((64, 16, 16))]
  x = jax.random.normal(jax.random.key(5), (2, 5, 32))
  got = layers.split(x @ layers.join(ws, groups), [64, 16, 16], groups)
  for a, w in zip(got, ws):
    np.testing.assert_allclose(a, x @ w, rtol=1e-6, atol=1e-6)


def test_joined_kernels_move_nothing_between_tensor_parallel_devices():
  """Kernels split over tp by whole heads (or hidden units) join on each device: a joined q, k, v
  matmul and its gradient, under a column-split sharding, hold no collective."""
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=import-outside-toplevel
  mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
  column = NamedSharding(mesh, P(None, "tp"))
  ws = [jax.device_put(jax.random.normal(jax.random.key(i), (32, n)), column)
        for i, n in enumerate((64, 16, 16))]
  x = jax.device_put(jnp.ones((4, 32)), NamedSharding(mesh, P()))

  def f(ws, x):
    ys = layers.split(x @ layers.join(ws, 4), [64, 16, 16], 4)
    return [jax.lax.with_sharding_constraint(y, column) for y in ys]
  backward = jax.jit(jax.grad(lambda ws, x: sum(jnp.sum(y ** 2) for y in f(ws, x)))).lower(
      ws, x).compile().as_text()
  forward = jax.jit(f).lower(ws, x).compile().as_text()
  for hlo in (forward, backward):
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
