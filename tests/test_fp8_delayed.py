"""FP8 delayed scaling (model.<module>.fp8_scaling=delayed, mimo_jax/models/fp8.py): the op against
current scaling, saturation, the histories rolling over steps, training against bfloat16 and
current scaling, parity of dp and microbatches with one device, and resume."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mimo_jax.models import fp8

DN = (((2,), (0,)), ((), ()))
H = 4


def _operands():
  x = (jax.random.normal(jax.random.key(0), (2, 16, 64)) * 3).astype(jnp.bfloat16)
  ws = [(jax.random.normal(jax.random.key(i), (64, n)) * 64**-0.5).astype(jnp.bfloat16)
        for i, n in ((1, 32), (2, 48))]
  gs = [jax.random.normal(jax.random.key(3 + i), (2, 16, w.shape[1])) * 1e-3
        for i, w in enumerate(ws)]
  return x, ws, gs


def _history(amax, older=(0.5, 0.25)) -> jax.Array:
  """A history whose maximum is `amax` (newest), smaller entries behind it."""
  h = np.zeros(H, np.float32)
  h[0] = amax
  h[1:1 + len(older)] = [amax * o for o in older]
  return jnp.asarray(h)


def _amax(a) -> float:
  return float(jnp.max(jnp.abs(a.astype(jnp.float32))))


def _loss(ys, gs):
  return sum(jnp.sum(y.astype(jnp.float32) * g) for y, g in zip(ys, gs))


def _delayed_value_and_grads(x, ws, xh, gh, gs):
  f = lambda x, ws, xh, gh: _loss(fp8.delayed_matmuls(x, ws, xh, gh), gs)
  return jax.jit(jax.value_and_grad(f, (0, 1, 2, 3)))(x, ws, xh, gh)


def test_delayed_equals_current_when_the_history_holds_the_operands_abs_max():
  x, ws, gs = _operands()
  # The cotangent each result receives is g in the result's dtype (bfloat16).
  g_amax = [_amax(g.astype(jnp.bfloat16)) for g in gs]
  xh = [_history(_amax(x))] * len(ws)
  gh = [_history(a) for a in g_amax]
  current = lambda x, ws: _loss(fp8.matmuls(x, ws), gs)
  want_loss, want = jax.jit(jax.value_and_grad(current, (0, 1)))(x, ws)
  got_loss, got = _delayed_value_and_grads(x, ws, xh, gh, gs)
  for a, b in zip(fp8.delayed_matmuls(x, ws, xh, gh), fp8.matmuls(x, ws)):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  assert float(got_loss) == float(want_loss)
  for a, b in zip(jax.tree.leaves(got[:2]), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  # The histories' gradients are the abs-maxes this call saw, newest slot only.
  for h in got[2]:
    np.testing.assert_array_equal(np.asarray(h), [_amax(x), 0, 0, 0])
  for h, a in zip(got[3], g_amax):
    np.testing.assert_array_equal(np.asarray(h), [a, 0, 0, 0])


def test_a_history_below_the_operand_saturates_without_nan():
  x, ws, gs = _operands()
  small = 1 / 64  # every history a 64th of its operand's abs-max: most values beyond the range
  xh = [_history(_amax(x) * small)] * len(ws)
  gh = [_history(_amax(g) * small) for g in gs]
  ys = fp8.delayed_matmuls(x, ws, xh, gh)
  _, grads = _delayed_value_and_grads(x, ws, xh, gh, gs)
  for a in list(ys) + jax.tree.leaves(grads):
    assert bool(jnp.all(jnp.isfinite(a.astype(jnp.float32))))
  # The input saturates at the FP8 maximum times its scale: the products are those of x clipped.
  top = float(jnp.finfo(fp8.FORWARD).max)
  scale = float(fp8.history_scale(xh, fp8.FORWARD))
  assert _amax(x) > 4 * top * scale
  clipped = jnp.clip(x.astype(jnp.float32), -top * scale, top * scale)
  for y, w in zip(ys, ws):
    exact_clipped = jax.lax.dot_general(clipped, w.astype(jnp.float32), DN)
    exact = jax.lax.dot_general(x.astype(jnp.float32), w.astype(jnp.float32), DN)
    rel = lambda a, b: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
    assert rel(y.astype(jnp.float32), exact_clipped) < 0.06  # FP8 rounding of clipped values
    assert rel(y.astype(jnp.float32), exact) > 0.3  # far from the unclipped product


def test_an_empty_history_casts_at_scale_one():
  x, ws, gs = _operands()
  zeros = [jnp.zeros(H)] * len(ws)
  ys = fp8.delayed_matmuls(x, ws, zeros, zeros)
  assert float(fp8.history_scale(zeros, fp8.FORWARD)) == 1.0
  for y, w in zip(ys, ws):
    qw, sw = fp8.quantize(w, fp8.FORWARD)
    qx = x.astype(jnp.float32).astype(fp8.FORWARD)  # |x| < 448: nothing to clip at scale 1
    want = jax.lax.dot_general(qx, qw, DN, preferred_element_type=jnp.bfloat16) * sw.astype(
        jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(want, np.float32))


def test_histories_roll_in_each_steps_abs_max():
  """Steps of a matmul whose operands grow: after N of them each history holds their abs-maxes,
  newest first (optim.roll_histories' rule), and entries older than H steps are gone."""
  x, ws, gs = _operands()
  xh, gh = [jnp.zeros(H)] * len(ws), [jnp.zeros(H)] * len(ws)
  seen_x, seen_g = [], [[] for _ in ws]
  for step in range(H + 2):
    f = 1.5**step
    xs, gss = (x * f).astype(jnp.bfloat16), [g * f for g in gs]
    _, grads = _delayed_value_and_grads(xs, ws, xh, gh, gss)
    xh = [fp8.roll(h, r) for h, r in zip(xh, grads[2])]
    gh = [fp8.roll(h, r) for h, r in zip(gh, grads[3])]
    seen_x.insert(0, _amax(xs))
    for s, g in zip(seen_g, gss):
      s.insert(0, _amax(g.astype(jnp.bfloat16)))
  for h in xh:
    np.testing.assert_array_equal(np.asarray(h), np.float32(seen_x[:H]))
  for h, s in zip(gh, seen_g):
    np.testing.assert_array_equal(np.asarray(h), np.float32(s[:H]))
