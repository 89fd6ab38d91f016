"""FP8 matmuls (model.<module>.fp8, mimo_jax/models/fp8.py): the quantization, the matmul and its
gradients against float32, and training against bfloat16 on one device and on a tp layout."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mimo_jax.config import ConfigError
from mimo_jax.models import fp8
from mimo_jax.validation import validate
from tests.helpers import bf16_config, language_step_hlo, run_steps, tiny_config

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
def bf16_losses(data_dir, bf16_reference):
  """The losses of _bf16(data_dir, False), trained once a session (conftest.py)."""
  assert _bf16(data_dir, False) == bf16_config(data_dir) and len(bf16_reference) == STEPS
  return np.array([m["loss"] for m in bf16_reference])


FAN_IN_TP = {"vision": (0, 4, 1), "language": (4, 2, 2)}


@pytest.fixture(scope="module")
def fan_in_tp_run(data_dir):
  """FP8 training on disjoint meshes, the language model tensor-parallel: its step is its own
  program (run_steps' results)."""
  return run_steps(_bf16(data_dir, True, **FAN_IN_TP), STEPS)


@pytest.mark.parametrize("topo,settings", [
    (SINGLE, {}),
    (FAN_IN_TP, {}),
    # FSDP with the remat policy that keeps FP8 inputs (and re-gathers and re-quantizes kernels).
    ({"vision": (0, 2, 1), "language": (2, 2, 1)}, {"shard": "full", "remat": "dots"}),
], ids=["single", "fan_in_tp", "fsdp_remat_dots"])
def test_training_in_fp8_tracks_bfloat16(data_dir, bf16_losses, request, topo, settings):
  cfg = _bf16(data_dir, True, **topo)
  for name in ("vision", "language"):
    for field, value in settings.items():
      setattr(cfg.topology.module(name), field, value)
  if topo is FAN_IN_TP:
    got, step, state, _ = request.getfixturevalue("fan_in_tp_run")
  else:
    got, step, state, _ = run_steps(cfg, STEPS)
  assert all(p.dtype == np.float32 for s in state.values() for p in jax.tree.leaves(s.params))
  losses = np.array([float(m["loss"]) for m in got])
  assert not np.array_equal(losses, bf16_losses)  # really computed in FP8
  np.testing.assert_allclose(losses, bf16_losses, rtol=1e-2)  # measured: 0.4% on one device
  assert losses[-1] < losses[0]


def test_the_language_step_holds_fp8_dots(data_dir, fan_in_tp_run):
  _, step, state, _ = fan_in_tp_run  # the last user of its state (the step below donates it)
  cfg = _bf16(data_dir, True, **FAN_IN_TP)
  from mimo_jax.data import loader  # pylint: disable=import-outside-toplevel
  ds = loader.train_dataset(cfg, loader.build_paths(cfg)["train"], step.ctx.groups)
  hlo = "\n".join(language_step_hlo(step, state, ds[STEPS]))
  assert hlo and "f8e4m3fn" in hlo and "f8e5m2" in hlo


def test_joined_linears_match_each_layer_and_its_gradients():
  """q, k, v (or gate and up) run as one FP8 matmul of their joined kernels, quantized at one
  scale. Where each kernel's and each incoming gradient's abs-max is the same, that scale is
  each layer's own: the results and every gradient are each layer's FP8 ones."""
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from mimo_jax.models import layers as L  # pylint: disable=import-outside-toplevel
  rngs = nnx.Rngs(params=0)
  ls = [L.linear(rngs, 256, n, jnp.bfloat16, bias=b, fp8=True)
        for n, b in ((128, True), (64, False), (64, True))]
  for i, layer in enumerate(ls):
    layer.kernel[...] = layer.kernel[...].at[i, 0].set(0.5)  # one abs-max for every kernel
    if layer.bias is not None:
      layer.bias[...] = jax.random.normal(jax.random.key(3), layer.bias.shape)
  x = jax.random.normal(jax.random.key(0), (2, 16, 256), jnp.bfloat16)
  gs = [jax.random.normal(jax.random.key(4 + i), (2, 16, l.out_features)).at[0, 0, 0].set(8.0)
        for i, l in enumerate(ls)]
  graph, params = nnx.split(nnx.List(ls))

  def loss(joined):
    def f(x, params):
      model = list(nnx.merge(graph, params))
      ys = L._apply(x, model, True, groups=4) if joined else [layer(x) for layer in model]
      return sum(jnp.sum(y.astype(jnp.float32) * g) for y, g in zip(ys, gs)), ys
    return f
  (_, got), got_grads = jax.value_and_grad(loss(True), (0, 1), has_aux=True)(x, params)
  (_, want), want_grads = jax.value_and_grad(loss(False), (0, 1), has_aux=True)(x, params)
  for a, b in zip(got, want):
    assert a.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  # The kernels' gradients are the same products; x's sums three in one product against three
  # rounded to bfloat16 and added.
  assert jax.tree.structure(got_grads[1]) == jax.tree.structure(want_grads[1])
  for a, b in zip(jax.tree.leaves(got_grads[1]), jax.tree.leaves(want_grads[1])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  np.testing.assert_allclose(np.asarray(got_grads[0], np.float32),
                             np.asarray(want_grads[0], np.float32), rtol=2**-7,
                             atol=2**-7 * float(jnp.max(jnp.abs(want_grads[0]))))


@pytest.mark.parametrize("remat", ["dots", "dots_attention"])
def test_remat_keeps_fp8_operands_not_float32_products(remat, capsys):
  from mimo_jax.pipeline import REMAT_POLICIES  # pylint: disable=import-outside-toplevel
  w1 = jax.random.normal(jax.random.key(1), (64, 128), jnp.bfloat16)
  w2 = jax.random.normal(jax.random.key(2), (128, 64), jnp.bfloat16)

  def mlp(x, w1, w2):
    h = jax.nn.gelu(fp8.dot_general(x, w1, DN))
    return fp8.dot_general(h, w2, DN)

  f = jax.checkpoint(mlp, policy=REMAT_POLICIES[remat])
  jax.ad_checkpoint.print_saved_residuals(
      lambda x, w1, w2: jnp.sum(f(x, w1, w2).astype(jnp.float32)),
      jnp.ones((2, 16, 64), jnp.bfloat16), w1, w2)
  saved = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
  kept = [line for line in saved if "named 'fp8_operand'" in line]
  # Both matmuls' FP8 inputs (as their bytes) with their scales, not the kernels (an FSDP kernel
  # would stay gathered), and the first one's bfloat16 output.
  assert sorted(line.split(" ")[0] for line in kept) == [
      "f32[]", "f32[]", "u8[2,16,128]", "u8[2,16,64]"], saved
  assert sum(line.startswith("bf16[2,16,128] output of dot_general") for line in saved) == 1
  assert not [line for line in saved if line.startswith("f32[2,")], saved


@pytest.mark.parametrize("remat", ["dots", "dots_attention", "full", "everything"])
def test_remat_computes_what_no_remat_does(remat):
  """jax.checkpoint passes saved floating residuals through reduce_precision, which for
  float8_e4m3fn means IEEE e4m3 (up to 240, then infinity): FP8 residuals are kept as bytes."""
  from mimo_jax.pipeline import REMAT_POLICIES  # pylint: disable=import-outside-toplevel
  policy = (jax.checkpoint_policies.everything_saveable if remat == "everything"
            else REMAT_POLICIES[remat])
  x = jax.random.normal(jax.random.key(0), (2, 16, 64), jnp.bfloat16) * 4
  w1 = jax.random.normal(jax.random.key(1), (64, 128), jnp.bfloat16)
  w2 = jax.random.normal(jax.random.key(2), (128, 64), jnp.bfloat16)

  def mlp(x, w1, w2):
    return fp8.dot_general(jax.nn.gelu(fp8.dot_general(x, w1, DN)), w2, DN)

  def value_and_grads(f):
    loss = lambda x, w1, w2: jnp.sum(f(x, w1, w2).astype(jnp.float32) ** 2)
    return jax.tree.leaves(jax.jit(jax.value_and_grad(loss, (0, 1, 2)))(x, w1, w2))

  want = value_and_grads(mlp)
  got = value_and_grads(jax.checkpoint(mlp, policy=policy))
  # Quantized values reach the top of e4m3fn's range, past IEEE e4m3's 240.
  assert float(jnp.max(jnp.abs(fp8.quantize(x, fp8.FORWARD)[0].astype(jnp.float32)))) > 240
  for a, b in zip(got, want):
    assert bool(jnp.all(jnp.isfinite(a)))
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
