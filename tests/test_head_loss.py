"""The head and cross-entropy only where a target carries loss, a chunk at a time
(models/head_loss.py, train.loss_chunk): the loss and gradients of the logits at every position."""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from mimo_jax.config import LanguageConfig
from mimo_jax.models import head_loss
from mimo_jax.models.llm import DecoderBlock, LanguageModel
from mimo_jax.step import Step
from tests.helpers import assert_close_trajectory, run_steps, tiny_config

VOCAB = 50


def _model(tied: bool):
  cfg = LanguageConfig(dim=32, layers=1, heads=4, kv_heads=2, mlp_dim=64, tie_embeddings=tied)
  return nnx.split(LanguageModel(nnx.Rngs(0), cfg, VOCAB, jnp.float32))


def _rows(share: float, seed: int = 0):
  """h [2 microbatches, 4 rows, 12 positions, 32], targets, and weights: `share` of them 1."""
  rng = np.random.default_rng(seed)
  h = jnp.asarray(rng.normal(size=(2, 4, 12, 32)), jnp.float32)
  targets = jnp.asarray(rng.integers(0, VOCAB, size=(2, 4, 12)))
  weights = jnp.asarray((rng.random((2, 4, 12)) < share).astype(np.float32))
  return h, targets, weights


def _every_position(graphdef, state, h, targets, weights):
  logits = nnx.merge(graphdef, state).logits(h)
  return jnp.sum(optax.softmax_cross_entropy_with_integer_labels(logits, targets) * weights)


@pytest.mark.parametrize("tied", [False, True], ids=["head", "tied"])
@pytest.mark.parametrize("groups,chunk", [(1, 4), (2, 5), (4, 64)])
def test_the_loss_and_gradients_are_those_of_every_positions_logits(tied, groups, chunk):
  """Groups of rows compacted on their own (dp ranks), chunks that divide a group's positions or
  not, one chunk holding them all; the head's parameters and the rows' gradients, jitted."""
  graphdef, state = _model(tied)
  h, targets, weights = _rows(0.3)
  assert 0 < float(weights.sum()) < weights.size
  want, (g_state, g_h) = jax.value_and_grad(_every_position, argnums=(1, 2))(
      graphdef, state, h, targets, weights)
  chunked = lambda s, h: head_loss.label_loss(nnx.merge(graphdef, s), h, targets, weights,
                                              groups, chunk)
  got, (c_state, c_h) = jax.jit(jax.value_and_grad(chunked, argnums=(0, 1)))(state, h)
  np.testing.assert_allclose(got, want, rtol=1e-6)
  np.testing.assert_allclose(jax.jit(chunked)(state, h), want, rtol=1e-6)  # no gradients asked
  for a, b in zip(jax.tree.leaves(c_state), jax.tree.leaves(g_state), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(c_h, g_h, rtol=1e-5, atol=1e-6)
  # Positions without loss get no gradient; a frozen head (stop_gradient) still passes it on.
  assert not np.any(np.asarray(c_h)[np.asarray(weights) == 0])
  frozen = jax.grad(lambda h: chunked(jax.lax.stop_gradient(state), h))(h)
  np.testing.assert_allclose(frozen, g_h, rtol=1e-5, atol=1e-6)


def _block_tail():
  """The head's model, a decoder block of its size (split) and `finish` as a Tail applies it."""
  graphdef, state = _model(False)
  cfg = LanguageConfig(dim=32, layers=1, heads=4, kv_heads=2, mlp_dim=64)
  block_def, block = nnx.split(DecoderBlock(nnx.Rngs(1), cfg, jnp.float32))
  finish = lambda s, x, mixed: nnx.merge(block_def, s).finish(x, mixed)
  return graphdef, state, block_def, block, finish


@pytest.mark.parametrize("groups,chunk", [(1, 4), (2, 5)])
def test_the_last_blocks_rest_in_the_loop_gives_the_whole_blocks_loss_and_gradients(groups,
                                                                                    chunk):
  """A `Tail` (the block's output projection and MLP, `DecoderBlock.finish`) run in the chunks:
  the loss and the gradients of every position's block output and logits, with respect to the
  tail's parameters, the head's and both inputs (the block's input, its mixed heads); a frozen
  part of the tail (stop_gradient) gets none and changes no other."""
  graphdef, state, block_def, block, finish = _block_tail()
  x, targets, weights = _rows(0.3)
  mixed = jnp.asarray(np.random.default_rng(1).normal(size=x.shape), jnp.float32)

  def every(state, block, x, mixed):
    out = nnx.merge(block_def, block).finish(x, mixed)
    return _every_position(graphdef, state, out, targets, weights)

  def chunked(state, block, x, mixed):
    tail = head_loss.Tail(block, finish)
    return head_loss.label_loss(nnx.merge(graphdef, state), (x, mixed), targets, weights,
                                groups, chunk, tail)
  want, g_want = jax.value_and_grad(every, argnums=(0, 1, 2, 3))(state, block, x, mixed)
  got, g_got = jax.jit(jax.value_and_grad(chunked, argnums=(0, 1, 2, 3)))(state, block, x, mixed)
  np.testing.assert_allclose(got, want, rtol=1e-6)
  np.testing.assert_allclose(jax.jit(chunked)(state, block, x, mixed), want, rtol=1e-6)
  assert float(jnp.sum(jnp.abs(g_want[1]["mlp"]["down"]["kernel"][...]))) > 0
  for a, b in zip(jax.tree.leaves(g_got), jax.tree.leaves(g_want), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  # The MLP frozen: the other parameters' and the inputs' gradients are unchanged.
  def frozen_mlp(state, block, x, mixed):
    block = nnx.State({**block, "mlp": jax.lax.stop_gradient(block["mlp"])})
    return chunked(state, block, x, mixed)
  g_frozen = jax.jit(jax.grad(frozen_mlp, argnums=(0, 1, 2, 3)))(state, block, x, mixed)
  assert not any(np.any(np.asarray(g)) for g in jax.tree.leaves(g_frozen[1]["mlp"]))
  rest = lambda g: (g[0], {k: v for k, v in g[1].items() if k != "mlp"}, g[2], g[3])
  for a, b in zip(jax.tree.leaves(rest(g_frozen)), jax.tree.leaves(rest(g_got)), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def _converts(jaxpr, shapes: set, inside: bool = False, found=None) -> list[bool]:
  """For each float32 -> other cast of an array of one of `shapes` in `jaxpr` (sub-jaxprs
  included): whether it is inside a loop's body."""
  found = [] if found is None else found
  for eqn in jaxpr.eqns:
    if (eqn.primitive.name == "convert_element_type" and eqn.invars[0].aval.dtype == jnp.float32
        and eqn.invars[0].aval.shape in shapes and eqn.outvars[0].aval.dtype != jnp.float32):
      found.append(inside)
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      _converts(sub, shapes, inside or eqn.primitive.name == "while", found)
  return found


def test_in_bfloat16_the_kernels_are_cast_once_before_the_chunks():
  """A bfloat16 model's head and tail kernels (float32 parameters) are cast before the loop, not
  in each chunk, and the chunked loss and gradients are those of every position's logits to
  bfloat16's precision (the gradients of the cast kernels, summed in float32)."""
  cfg = LanguageConfig(dim=32, layers=1, heads=4, kv_heads=2, mlp_dim=64)
  graphdef, state = nnx.split(LanguageModel(nnx.Rngs(0), cfg, VOCAB, jnp.bfloat16))
  block_def, block = nnx.split(DecoderBlock(nnx.Rngs(1), cfg, jnp.bfloat16))
  finish = lambda s, x, mixed: nnx.merge(block_def, s).finish(x, mixed)
  x, targets, weights = _rows(0.3)
  x = x.astype(jnp.bfloat16)
  mixed = jnp.asarray(np.random.default_rng(1).normal(size=x.shape), jnp.bfloat16)

  def chunked(state, block, x, mixed):
    return head_loss.label_loss(nnx.merge(graphdef, state), (x, mixed), targets, weights, 2, 4,
                                head_loss.Tail(block, finish))

  def every(state, block, x, mixed):
    out = nnx.merge(block_def, block).finish(x, mixed)
    return _every_position(graphdef, state, out, targets, weights)
  grad = jax.value_and_grad(chunked, argnums=(0, 1, 2, 3))
  kernels = {a.shape for a in jax.tree.leaves((state, block)) if a.ndim >= 2}
  assert len(kernels) >= 3  # the head's, the output projection's, the MLP's
  converts = _converts(jax.make_jaxpr(grad)(state, block, x, mixed).jaxpr, kernels)
  assert converts and not any(converts), converts
  got, g_got = jax.jit(grad)(state, block, x, mixed)
  want, g_want = jax.value_and_grad(every, argnums=(0, 1, 2, 3))(state, block, x, mixed)
  np.testing.assert_allclose(got, want, rtol=1e-2)
  for a, b in zip(jax.tree.leaves(g_got), jax.tree.leaves(g_want), strict=True):
    assert a.dtype == b.dtype
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=5e-2,
                               atol=2e-2 * float(jnp.max(jnp.abs(b.astype(jnp.float32)))))


def test_rows_without_loss_give_zero_loss_and_gradients():
  graphdef, state = _model(False)
  h, targets, _ = _rows(0.0)
  loss, (g_state, g_h) = jax.value_and_grad(
      lambda s, h: head_loss.label_loss(nnx.merge(graphdef, s), h, targets, jnp.zeros(h.shape[:3]),
                                        2, 4), argnums=(0, 1))(state, h)
  assert float(loss) == 0
  assert all(not np.any(np.asarray(g)) for g in jax.tree.leaves((g_state, g_h)))


def test_a_rank_holds_one_chunks_logits():
  """XLA's memory analysis of the loss and its gradients over 8192 positions of a 16384-word
  vocabulary: the logits of every position are 512 MiB in float32, a chunk of 512's 32 MiB."""
  graphdef, state = nnx.split(LanguageModel(
      nnx.Rngs(0), LanguageConfig(dim=64, layers=1, heads=4, kv_heads=2, mlp_dim=64), 16384,
      jnp.float32))
  h = jax.ShapeDtypeStruct((1, 4, 2048, 64), jnp.float32)
  targets = jax.ShapeDtypeStruct((1, 4, 2048), jnp.int32)
  weights = jax.ShapeDtypeStruct((1, 4, 2048), jnp.float32)

  def temporaries(loss):
    fn = jax.jit(jax.grad(lambda s, h, t, w: loss(nnx.merge(graphdef, s), h, t, w),
                          argnums=(0, 1)))
    return fn.lower(state, h, targets, weights).compile().memory_analysis().temp_size_in_bytes
  every = temporaries(lambda m, h, t, w: jnp.sum(
      optax.softmax_cross_entropy_with_integer_labels(m.logits(h), t) * w))
  chunked = temporaries(lambda m, h, t, w: head_loss.label_loss(m, h, t, w, 1, 512))
  assert every >= 512 * 2**20, every
  assert chunked < every / 4, (chunked, every)


@pytest.mark.parametrize("chunk", [0, 5], ids=["every-position", "chunks-of-5"])
def test_a_training_run_gives_the_single_device_trajectory(data_dir, single_reference, chunk):
  """The reference runs the default (a chunk larger than a rank's positions: one); chunks of 5
  split each microbatch's targets over several, 0 computes every position's logits. With a chunk
  the last block's output projection and MLP run in the loop (`train.last_block_in_loss`); with
  0 the block runs whole."""
  cfg = tiny_config(data_dir, vision=(0, 1, 1), language=(0, 1, 1))
  cfg.train.loss_chunk = chunk
  metrics, step, _, _ = run_steps(cfg, 3)
  assert step.ctx.last_block_in_loss(True) == bool(chunk)
  assert_close_trajectory(single_reference[:3], metrics, rtol=1e-5)


@pytest.mark.parametrize("microbatches", [1, 2])
def test_every_block_but_the_last_then_its_tail_is_the_whole_stack(data_dir, microbatches):
  """`Context._with_tail` on stacked microbatches [M, rows, l, d]: the stack of every block but
  the last, the last one's mixed heads, and the tail's `finish` of them give the whole stack's
  outputs."""
  from mimo_jax.sharding import BLOCKS  # pylint: disable=import-outside-toplevel
  cfg = tiny_config(data_dir, vision=(0, 1, 1), language=(0, 1, 1))
  step = Step.build(cfg)
  ctx, params = step.ctx, step.init_state(0, optimizer=False)["language"].params
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(microbatches, 2, 12, cfg.model.language.dim)), jnp.float32)
  positions = jnp.broadcast_to(jnp.arange(12, dtype=jnp.int32), x.shape[:3])
  (h, mixed), tail = ctx._with_tail(params)(x, (positions,))  # pylint: disable=protected-access
  assert h.shape == x.shape and mixed.shape[:3] == x.shape[:3]
  got = jax.vmap(lambda h, m: tail.apply(tail.params, h, m))(h, mixed)
  want = ctx.stacks["language"](params[BLOCKS], x, (positions,))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def _tail_in(cfg, train: bool = True) -> bool:
  from mimo_jax import memory  # pylint: disable=import-outside-toplevel
  return memory.context(cfg).last_block_in_loss(train)  # abstract meshes: no devices


def test_the_last_block_finishes_in_the_loss_where_the_layout_allows(data_dir):
  """Blocks not pipelined and unrolled, a chunked loss, no FP8 histories, no LoRA dropout while
  training; FP8 with current scaling and LoRA without dropout keep it."""
  base = lambda **topo: tiny_config(data_dir, **(topo or {"vision": (0, 1, 1),
                                                          "language": (0, 1, 1)}))
  assert _tail_in(base()) and _tail_in(base(), train=False)
  cfg = base()
  cfg.train.last_block_in_loss = False
  assert not _tail_in(cfg)
  cfg = base()
  cfg.train.loss_chunk = 0
  assert not _tail_in(cfg)
  cfg = base()
  cfg.topology.language.unroll = False
  assert not _tail_in(cfg)
  assert not _tail_in(base(vision=(0, 1, 1), language=(1, 1, 1, 2)))
  cfg = base()
  cfg.model.language.fp8 = True
  assert _tail_in(cfg)
  cfg.model.language.fp8_scaling = "delayed"
  assert not _tail_in(cfg)
  cfg = base()
  cfg.model.language.lora.rank = 4
  assert _tail_in(cfg)
  cfg.model.language.lora.dropout = 0.1
  assert not _tail_in(cfg) and _tail_in(cfg, train=False)


def test_the_eval_loss_is_that_of_every_positions_logits(data_dir):
  from mimo_jax.data import loader  # pylint: disable=import-outside-toplevel
  from mimo_jax.evaluate import Evaluator  # pylint: disable=import-outside-toplevel
  losses = []
  for chunk in (0, 5):
    cfg = tiny_config(data_dir, vision=(0, 1, 1), language=(0, 1, 1))
    cfg.train.loss_chunk = chunk
    step = Step.build(cfg)
    batches = loader.eval_batches(cfg, loader.build_paths(cfg)["eval"], 1)[:2]
    losses.append(Evaluator(step)(step.init_state(0), batches)["eval_loss"])
  assert np.isfinite(losses[0]) and losses[0] > 0
  np.testing.assert_allclose(losses[1], losses[0], rtol=1e-6)
