"""The MLPs' activations (models/activations.py): jax.nn's forward pass, its gradients, and a
backward pass that keeps nothing but the input."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import print_saved_residuals

from mimo_jax.models.activations import ACTIVATIONS

PLAIN = {
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
}


def _gelu_tanh(x):
  t = np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3))
  return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * np.sqrt(2 / np.pi) * (1 + 3 * 0.044715 * x * x)


def _gelu(x):
  erf = np.vectorize(math.erf)
  return 0.5 * (1 + erf(x / np.sqrt(2))) + x * np.exp(-0.5 * x * x) / np.sqrt(2 * np.pi)


def _quick_gelu(x):
  s = 1 / (1 + np.exp(-1.702 * x))
  return s + 1.702 * x * s * (1 - s)


DERIVATIVES = {"gelu_tanh": _gelu_tanh, "gelu": _gelu, "quick_gelu": _quick_gelu}  # float64


def _inputs(dtype):
  rng = np.random.default_rng(0)
  x = np.concatenate([rng.normal(size=500) * 3, np.linspace(-8, 8, 101)])
  return jnp.asarray(x, dtype), jnp.asarray(rng.normal(size=x.shape), dtype)


@pytest.mark.parametrize("name", sorted(PLAIN))
def test_the_values_and_gradients_are_autodiffs_of_the_plain_function(name):
  act, plain = ACTIVATIONS[name], PLAIN[name]
  x, g = _inputs(jnp.float32)
  np.testing.assert_array_equal(act(x), plain(x))
  got = jax.vjp(act, x)[1](g)[0]
  want = jax.vjp(plain, x)[1](g)[0]
  # Both in float32, each against the derivative in float64: as close as autodiff's (where
  # 0.5 · (1 + tanh) cancels, neither is closer than a few 1e-6).
  truth = np.asarray(g, np.float64) * DERIVATIVES[name](np.asarray(x, np.float64))
  err = lambda a: np.abs(np.asarray(a, np.float64) - truth)
  # A few float32 roundings of terms of order |g| (the derivative's parts are of order 1).
  ulps = 8 * np.finfo(np.float32).eps * (np.abs(np.asarray(g, np.float64)) + np.abs(truth))
  assert np.all(err(got) <= err(want) + ulps), np.max(err(got) - err(want) - ulps)
  assert np.max(err(got)) < 1e-5
  # bfloat16: the same forward pass; the derivative, in float32 here, within bfloat16's rounding.
  xb, gb = x.astype(jnp.bfloat16), g.astype(jnp.bfloat16)
  np.testing.assert_array_equal(act(xb), plain(xb))
  got = jax.vjp(act, xb)[1](gb)[0]
  assert got.dtype == jnp.bfloat16
  exact = jax.vjp(plain, xb.astype(jnp.float32))[1](gb.astype(jnp.float32))[0]
  np.testing.assert_allclose(got.astype(jnp.float32), exact, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("name", sorted(PLAIN))
def test_the_backward_pass_keeps_only_the_input(name, capsys):
  x, _ = _inputs(jnp.bfloat16)
  print_saved_residuals(lambda x: jnp.sum(ACTIVATIONS[name](x)), x)
  kept = [line for line in capsys.readouterr().out.splitlines() if "[" in line]
  assert kept == ["bf16[601] from the argument x"], kept
  print_saved_residuals(lambda x: jnp.sum(PLAIN[name](x)), x)  # what autodiff would keep
  assert len([line for line in capsys.readouterr().out.splitlines() if "[" in line]) > 1
