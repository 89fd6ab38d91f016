"""Gradient accumulators held layer by layer (`train.fold_grads`, mimo_jax/fold.py): the matmul
whose backward makes its kernel's gradient in float32 (models/kernel_grads.py), where the layout
folds, and bfloat16 training with folded accumulators against stacked ones, on one device and on
a tensor-parallel layout; tools.accumulate_bench's forms and flags (its figures are a GPU's)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mimo_jax import fold, programs
from mimo_jax.memory import context
from mimo_jax.models import kernel_grads
from mimo_jax.models import layers as L
from mimo_jax.step import Step
from tools import accumulate_bench
from tests.helpers import bf16_config, run_steps, tiny_config

STEPS = 4
SINGLE = {"vision": (0, 1, 1), "language": (0, 1, 1)}
TP = {"vision": (0, 1, 1), "language": (1, 1, 2)}


def _bf16(data_dir, fold_grads: bool = True, **topo):
  cfg = tiny_config(data_dir, **(topo or SINGLE))
  cfg.model.dtype = "bfloat16"
  cfg.train.fold_grads = fold_grads
  return cfg


def _rel(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_the_matmul_is_the_layers_and_makes_the_kernels_gradient_unrounded():
  """A bfloat16 layer with a float32 kernel: inside `float32_kernel_grads` its output and its
  input's gradient are autodiff's, bit for bit; its kernel's gradient is the float32 product that
  autodiff rounds to bfloat16 (and casts back)."""
  layer = L.linear(nnx.Rngs(params=0), 64, 48, jnp.bfloat16, bias=True)
  layer.bias[...] = jax.random.normal(jax.random.key(1), (48,))
  x = jax.random.normal(jax.random.key(2), (2, 16, 64), jnp.bfloat16)
  dy = jax.random.normal(jax.random.key(3), (2, 16, 48), jnp.bfloat16)
  graph, params = nnx.split(layer)

  def vjp(fn):
    y, back = jax.vjp(lambda p, x: fn(nnx.merge(graph, p), x), params, x)
    return y, *back(dy)
  y0, dp0, dx0 = vjp(lambda m, x: kernel_grads.linear(m, x))  # outside the switch: layer(x)
  y1, dp1, dx1 = vjp(kernel_grads.wrap(kernel_grads.linear))
  assert y1.dtype == jnp.bfloat16 and np.array_equal(y1, y0) and np.array_equal(dx1, dx0)
  np.testing.assert_array_equal(dp1["bias"][...], dp0["bias"][...])
  want = jnp.einsum("blk,bln->kn", x.astype(jnp.float32), dy.astype(jnp.float32))
  got, rounded = dp1["kernel"][...], dp0["kernel"][...]
  assert got.dtype == rounded.dtype == jnp.float32
  assert _rel(got, want) < 1e-6 < 1e-4 < _rel(rounded, want) < 2**-8
  np.testing.assert_array_equal(got.astype(jnp.bfloat16), rounded.astype(jnp.bfloat16))


@pytest.mark.parametrize("change,folded", [
    ({}, {"vision", "language"}),
    ({"train.fold_grads": False}, set()),
    ({"model.dtype": "float32"}, set()),
    ({"topology.language.remat": "dots"}, {"vision"}),
    ({"topology.vision.unroll": False}, {"language"}),
    ({"topology.language.shard": "full", "layout": {"vision": (0, 2, 1), "language": (0, 2, 1)}},
     {"vision"}),  # FSDP gathers the language model's layers
    ({"layout": {"vision": (0, 2, 1), "language": (0, 2, 1)}}, set()),  # kept per dp rank
    ({"model.language.fp8": True}, {"vision"}),
    ({"model.vision.lora.rank": 4}, {"language"}),
    ({"layout": {"vision": (0, 1, 1), "language": (1, 1, 1, 2)}}, set()),  # pipelined; split
], ids=["default", "off", "float32", "remat", "rolled", "fsdp", "per_rank", "fp8", "lora",
        "pipelined"])
def test_which_modules_fold(data_dir, change, folded):
  cfg = _bf16(data_dir, **change.get("layout", SINGLE))
  for key, value in change.items():
    if key != "layout":
      *path, field = key.split(".")
      node = cfg
      for part in path:
        node = getattr(node, part)
      setattr(node, field, value)
  ctx = context(cfg)
  assert ctx.mode.folded == folded
  for n, p in ctx.plan.modules.items():
    acc = jax.eval_shape(lambda p=p, n=n: programs.accumulator(
        ctx, ctx.mode, {n: p.abstract_params}))["grads"][n]
    layers = [a for a in jax.tree.leaves(acc, is_leaf=fold.is_layers) if fold.is_layers(a)]
    assert bool(layers) == (n in folded)
    if layers:  # q, k, v, o and the MLP's kernels, each as its layers' slices
      assert len(layers) == (7 if n == "language" else 6)
      assert all(len(a.items) == p.abstract_params["blocks"]["attn"]["q"]["kernel"].shape[0]
                 for a in layers)


@pytest.fixture(scope="module")
def folded_run(data_dir, bf16_reference):
  """The metrics of _bf16(data_dir) (folded), trained once a session (conftest.py)."""
  assert _bf16(data_dir) == bf16_config(data_dir) and len(bf16_reference) == STEPS
  return bf16_reference


def test_folded_accumulators_train_as_stacked_ones(data_dir, folded_run):
  """The same loss; the same gradients but their bfloat16 rounding (the first step's norm within
  1e-4, not equal); the trajectories within bfloat16 training's spread."""
  got = folded_run
  assert Step.build(_bf16(data_dir)).ctx.mode.folded == {"vision", "language"}
  ref, step_ref, _, _ = run_steps(_bf16(data_dir, False), STEPS)
  assert not step_ref.ctx.mode.folded
  values = lambda run, key: np.array([float(m[key]) for m in run])
  assert values(got, "loss")[0] == values(ref, "loss")[0]
  assert 0 < _rel(values(got, "grad_norm")[0], values(ref, "grad_norm")[0]) < 1e-4
  for key in ("loss", "grad_norm"):
    np.testing.assert_allclose(values(got, key), values(ref, key), rtol=1e-2, err_msg=key)
  assert values(got, "loss")[-1] < values(got, "loss")[0]


def test_a_tensor_parallel_language_model_folds_and_tracks_one_device(data_dir, folded_run):
  got, step, _, _ = run_steps(_bf16(data_dir, **TP), STEPS)
  assert step.ctx.mode.folded == {"language"}  # the encoder's own programs stay stacked
  ref = folded_run
  for key in ("loss", "grad_norm"):
    np.testing.assert_allclose([float(m[key]) for m in got], [float(m[key]) for m in ref],
                               rtol=5e-3, err_msg=key)  # measured: 1.8e-3 at most


def test_the_accumulate_bench_sums_one_gradient_in_each_form_and_bad_flags_are_one_line():
  """Its forms sum the same gradients (the folded and in-place forms unrounded, the stacked one
  within bfloat16's rounding); on a CPU nothing is folded; a bad flag or no GPU is one line."""
  k = jax.random.split(jax.random.key(0))
  x, dy = (jax.random.normal(key, (8, 64), jnp.bfloat16) for key in k)
  assert 1e-5 < accumulate_bench.distance(x, dy, 3) < 1e-2
  zeros = jnp.zeros((2, 64, 64))
  folded = jnp.stack(accumulate_bench.folded(x, dy, list(zeros)))
  np.testing.assert_array_equal(accumulate_bench.in_place(x, dy, zeros), folded)
  lowered = jax.jit(accumulate_bench.folded).lower(x, dy, list(zeros))
  assert accumulate_bench.folded_matmuls(lowered.compile().as_text()) == 0
  assert accumulate_bench.folded_matmuls('{"beta":1,"alpha_real":1} {"beta":0}') == 1
  for flags, said in ((["--shape", "8x8"], "--shape '8x8': give positions x rows x columns"),
                      (["--layers", "0"], "--layers 0: give 1 or more"),
                      (["--repeat", "0"], "--repeat 0: give 1 or more"), ([], "needs a GPU")):
    with pytest.raises(SystemExit, match=said):
      accumulate_bench.main(flags)
