"""The LayerNorm kernels (models/norm_kernels.py) against XLA's LayerNorm: forward, the input's,
scale's and bias's gradients, the residual stream's gradient added in the backward kernel, under
vmap (pipeline.Stack) and in a ViT block; which runs use them. On CPU the kernels run through
Pallas' interpreter; on a Hopper GPU as Triton kernels (`JAX_PLATFORMS=cuda`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mimo_jax.config import Config, ConfigError
from mimo_jax.encoders.vision import VisionConfig
from mimo_jax.models import layers, mimo, norm_kernels, vit
from mimo_jax.validation import validate, validate_backend

on_gpu = jax.default_backend() == "gpu"


@pytest.fixture(autouse=True)
def interpreted(monkeypatch):
  if not on_gpu:
    monkeypatch.setattr(norm_kernels, "INTERPRET", True)


def _inputs(shape, dtype, seed=0):
  k = jax.random.split(jax.random.key(seed), 5)
  d = shape[-1]
  x = (2 * jax.random.normal(k[0], shape) + 0.5).astype(dtype)
  dy, dres = (jax.random.normal(key, shape).astype(dtype) for key in k[1:3])
  scale = 1 + 0.1 * jax.random.normal(k[3], (d,))
  bias = 0.1 * jax.random.normal(k[4], (d,))
  return x, scale, bias, dy, dres


def _xla(x, scale, bias):
  norm = layers.LayerNorm(x.shape[-1], 1e-6)
  norm.scale[...], norm.bias[...] = scale, bias
  return norm(x)


def _close(got, want, tol):
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  assert np.linalg.norm(got - want) <= tol * np.linalg.norm(want), np.abs(got - want).max()


# [..., d]: rows that the kernel's block of rows divides, and 3 * 5 = 15 rows that it does not
@pytest.mark.parametrize("shape", [(2, 12, 64), (3, 5, 32)])
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-6), (jnp.bfloat16, 1e-2)])
def test_kernels_give_xlas_layer_norm_and_its_gradients(shape, dtype, tol):
  x, scale, bias, dy, dres = _inputs(shape, dtype)
  want, vjp = jax.vjp(_xla, x, scale, bias)
  want_grads = vjp(dy)
  got, vjp = jax.vjp(lambda *a: norm_kernels.layer_norm(*a, 1e-6), x, scale, bias)
  assert got.dtype == dtype
  _close(got, want, tol)
  for g, w in zip(vjp(dy), want_grads):
    _close(g, w, tol)
  # The residual stream's gradient joins the input's in the backward kernel (one rounding).
  (passed, got), vjp = jax.vjp(lambda *a: norm_kernels.residual_layer_norm(*a, 1e-6),
                               x, scale, bias)
  assert passed is x or np.array_equal(passed, x)
  _close(got, want, tol)
  dx, dscale, dbias = vjp((dres, dy))
  _close(dx, want_grads[0].astype(jnp.float32) + dres.astype(jnp.float32), tol)
  _close(dscale, want_grads[1], tol)
  _close(dbias, want_grads[2], tol)


def test_kernels_under_vmap_as_pipeline_stacks_run_layers():
  x, scale, bias, dy, _ = _inputs((2, 3, 8, 32), jnp.float32)
  loss = lambda f: lambda x, s, b: jnp.sum(jax.vmap(f, in_axes=(0, None, None))(x, s, b) * dy)
  want = jax.grad(loss(_xla), (0, 1, 2))(x, scale, bias)
  got = jax.grad(loss(lambda *a: norm_kernels.layer_norm(*a, 1e-6)), (0, 1, 2))(x, scale, bias)
  for g, w in zip(got, want):
    _close(g, w, 1e-6)


def test_a_vit_block_with_the_kernels_is_the_block_without():
  cfg = VisionConfig()
  cfg.dim, cfg.heads, cfg.mlp_dim = 64, 4, 128
  blocks = [vit.ViTBlock(nnx.Rngs(0), cfg, jnp.float32, norm_kernel=k) for k in (False, True)]
  x, *_ = _inputs((2, 16, 64), jnp.float32, seed=1)

  def loss_and_grads(block):
    graph, params = nnx.split(block)
    loss = lambda p, x: jnp.sum(jnp.sin(nnx.merge(graph, p)(x)))
    return jax.value_and_grad(loss, (0, 1))(params, x)
  with jax.default_matmul_precision("float32"):  # a GPU's default would round the matmuls
    (want, want_grads), (got, got_grads) = map(loss_and_grads, blocks)  # to TensorFloat-32
  np.testing.assert_allclose(got, want, rtol=1e-6)
  # Per leaf against the largest gradient: the keys' bias has none (softmax ignores it), so
  # its rounding is all it holds.
  scale = max(np.abs(w).max() for w in jax.tree.leaves(want_grads))
  for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6 * scale)


def test_auto_uses_the_kernels_on_a_gpu_for_a_tower_on_one_device_a_replica(monkeypatch):
  """In one pipeline stage too: jax 0.11.2 refuses a kernel inside a stage's shard_map."""
  cfg = Config()
  cfg.add_encoder("vision", VisionConfig())
  assert mimo.layer_norm_kernel(cfg, "vision") == on_gpu
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  assert mimo.layer_norm_kernel(cfg, "vision")
  cfg.topology.vision.dp = 2
  assert not mimo.layer_norm_kernel(cfg, "vision")
  cfg.topology.vision.dp, cfg.topology.vision.pp = 1, 2  # pipeline stages: XLA's norms
  assert not mimo.layer_norm_kernel(cfg, "vision")
  cfg.model.layer_norm = "xla"
  cfg.topology.vision.pp = 1
  assert not mimo.layer_norm_kernel(cfg, "vision")


def test_pallas_layer_norm_is_refused_where_it_cannot_run():
  cfg = Config()
  cfg.add_encoder("vision", VisionConfig())
  cfg.model.layer_norm = "triton"
  with pytest.raises(ConfigError, match=r"model\.layer_norm: must be auto, xla or pallas"):
    validate(cfg, 1)
  cfg.model.layer_norm = "pallas"
  with pytest.raises(ConfigError, match=r"model\.layer_norm: pallas runs on GPUs"):
    validate_backend(cfg, "cpu")
  validate_backend(cfg, "gpu")
  cfg.model.vision.dim = 1152  # SigLIP-so400m's
  with pytest.raises(ConfigError, match=r"model\.vision\.dim: .*power of two.* is 1152"):
    validate_backend(cfg, "gpu")
  cfg.model.vision.dim = 1024
  cfg.topology.vision.dp = 2
  with pytest.raises(ConfigError, match=r"vision \(dp=2, tp=1, pp=1\) splits its rows"):
    validate_backend(cfg, "gpu")
  cfg.topology.vision.dp, cfg.topology.vision.pp = 1, 2  # a kernel inside a pipeline stage
  with pytest.raises(ConfigError, match=r"vision \(dp=1, tp=1, pp=2\) splits its rows or its "
                     r"layers"):
    validate_backend(cfg, "gpu")
