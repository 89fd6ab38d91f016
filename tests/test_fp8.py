"""FP8 matmuls (model.<module>.fp8, mimo_jax/models/fp8.py): the quantization, the matmul and its
gradients against float32, and training against bfloat16 on one device and on a tp layout."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mimo_jax.config import ConfigError
from mimo_jax.models import fp8
from mimo_jax.validation import validate
from tests.helpers import language_step_hlo, run_steps, tiny_config

STEPS = 4
SINGLE = {"vision": (0, 1, 1), "language": (0, 1, 1)}
DN = (((2,), (0,)), ((), ()))


def _rel(a, b) -> float:
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("dtype", [fp8.FORWARD, fp8.BACKWARD])
def test_quantize_spans_the_range_and_inverts(dtype):
  x = jax.random.normal(jax.random.key(0), (64, 96), jnp.float32) * 3e-3
  q, scale = fp8.quantize(x, dtype)
  top = float(jnp.finfo(dtype).max)
  assert q.dtype == dtype
  assert np.frexp(np.float32(scale))[0] == 0.5  # a power of two
  assert top / 2 <= float(jnp.max(jnp.abs(q.astype(jnp.float32)))) <= top  # spans the range
  back = q.astype(jnp.float32) * scale
  mantissa = jnp.finfo(dtype).nmant
  big = jnp.abs(x) > 0.1 * jnp.max(jnp.abs(x))  # normal numbers of the FP8 type
  assert float(jnp.max(jnp.abs(back - x)[big] / jnp.abs(x)[big])) <= 2.0**-(mantissa + 1) * 1.01
  zq, zscale = fp8.quantize(jnp.zeros((4, 4)), dtype)
  assert float(zscale) == 1.0 and not bool(jnp.any(jnp.isnan(zq.astype(jnp.float32))))


def test_matmul_and_gradients_are_fp8_rounded_float32_ones():
  x = jax.random.normal(jax.random.key(0), (4, 16, 256), jnp.bfloat16)
  w = (jax.random.normal(jax.random.key(1), (256, 64)) * 256**-0.5).astype(jnp.bfloat16)
  g = jax.random.normal(jax.random.key(2), (4, 16, 64), jnp.float32)
  exact = lambda x, w: jax.lax.dot_general(x.astype(jnp.float32), w.astype(jnp.float32), DN)
  ours = lambda x, w: fp8.dot_general(x, w, DN)
  assert ours(x, w).dtype == jnp.bfloat16
  # e4m3 operands: 3 mantissa bits, about 4% off in a product of random data; e5m2 gradients 6%.
  err = _rel(ours(x, w), exact(x, w))
  assert 0.01 < err < 0.06, err
  loss = lambda f: lambda x, w: jnp.sum(f(x, w).astype(jnp.float32) * g)
  want = jax.grad(loss(exact), (0, 1))(x, w)
  got = jax.jit(jax.grad(loss(ours), (0, 1)))(x, w)
  for a, b in zip(got, want):
    assert a.dtype == jnp.bfloat16
    assert 0.01 < _rel(a, b) < 0.09, _rel(a, b)


def test_other_contractions_are_refused():
  with pytest.raises(ValueError, match="only inputs"):
    fp8.dot_general(jnp.ones((2, 3)), jnp.ones((2, 3)), (((0,), (0,)), ((), ())))


def test_fp8_needs_bfloat16(data_dir):
  cfg = tiny_config(data_dir, **SINGLE)
  cfg.model.language.fp8 = True
  with pytest.raises(ConfigError, match=r"^config\.model\.language\.fp8: FP8 matmuls stand in"):
    validate(cfg, 1)


def _bf16(data_dir, fp8_on: bool, **topo):
  cfg = tiny_config(data_dir, **(topo or SINGLE))
  cfg.model.dtype = "bfloat16"
  cfg.model.vision.fp8 = cfg.model.language.fp8 = fp8_on
  return cfg


@pytest.fixture(scope="module")
def bf16_losses(data_dir):
  return np.array([float(m["loss"]) for m in run_steps(_bf16(data_dir, False), STEPS)[0]])


@pytest.mark.parametrize("topo", [SINGLE, {"vision": (0, 4, 1), "language": (4, 2, 2)}],
                         ids=["single", "fan_in_tp"])
def test_training_in_fp8_tracks_bfloat16(data_dir, bf16_losses, topo):
  got, step, state, _ = run_steps(_bf16(data_dir, True, **topo), STEPS)
  assert all(p.dtype == np.float32 for s in state.values() for p in jax.tree.leaves(s.params))
  losses = np.array([float(m["loss"]) for m in got])
  assert not np.array_equal(losses, bf16_losses)  # really computed in FP8
  np.testing.assert_allclose(losses, bf16_losses, rtol=1e-2)  # measured: 0.4% on one device
  assert losses[-1] < losses[0]


def test_the_language_step_holds_fp8_dots(data_dir):
  cfg = _bf16(data_dir, True, vision=(0, 1, 1), language=(1, 1, 1))  # its own program
  _, step, state, _ = run_steps(cfg, 1)
  from mimo_jax.data import loader  # pylint: disable=import-outside-toplevel
  ds = loader.train_dataset(cfg, loader.build_paths(cfg)["train"], step.ctx.groups)
  hlo = "\n".join(language_step_hlo(step, state, ds[1]))
  assert hlo and "f8e4m3fn" in hlo and "f8e5m2" in hlo
