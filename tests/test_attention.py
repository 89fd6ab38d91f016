"""Attention over packed rows: the segment runs handed to cuDNN describe exactly the segment-id
mask, and (on a Hopper GPU) cuDNN's packed attention matches XLA's masked attention, forward and
backward, for the ViT's packed images and the decoder's packed rows. Rows of an odd length, which
cuDNN runs padded by one position, give the unpadded attention. Inside a pipeline's stages
(manual over pp only) cuDNN's attention runs manual over the other axes too, and trains (two
GPUs)."""

import contextlib
import io
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import print_saved_residuals
from jax.sharding import Mesh, PartitionSpec as P

from mimo_jax.config import Config, row_segments
from mimo_jax.encoders.vision import slot_images
from mimo_jax.models.mimo import attention_implementation
from mimo_jax.data.layout import place_items
from mimo_jax import topology
from mimo_jax.models.layers import attention, even_attention, packed_attention, segment_runs
from mimo_jax.models.manual import whole_manual
from mimo_jax.pipeline import REMAT_POLICIES, Schedule, Stack
from tests.helpers import image_layout
from tests.test_synthetic import _config as synthetic_config

# Rows as the data layout writes them: contiguous segments 1, 2, ... then padding (0).
ROWS = np.array([
    [1] * 5 + [2] * 40 + [3] * 3 + [0] * 16,  # three segments and padding
    [1] * 64,  # one segment filling the row
    [0] * 64,  # an empty row (padding only)
    [1] + [2] * 62 + [3],  # segments of one token at both ends, no padding
], np.int32)


def _mask_from_runs(offsets, lengths, l):
  """[b, l, l]: token i may see token j when both lie in the same run."""
  run = np.full((offsets.shape[0], l), -1)
  for r in range(offsets.shape[0]):
    for j, (o, n) in enumerate(zip(offsets[r], lengths[r])):
      if o >= 0:
        run[r, o:o + n] = j
  assert np.all(run >= 0), "every token (padding included) belongs to a run"
  return run[:, :, None] == run[:, None, :]


def test_segment_runs_describe_the_segment_mask():
  offsets, lengths = jax.device_get(segment_runs(jnp.asarray(ROWS), max_segments=4))
  np.testing.assert_array_equal(offsets[0], [0, 5, 45, 48])
  np.testing.assert_array_equal(lengths[0], [5, 40, 3, 16])
  np.testing.assert_array_equal(offsets[1], [0, -1, -1, -1])
  np.testing.assert_array_equal(lengths[2], [64, -1, -1, -1])
  want = ROWS[:, :, None] == ROWS[:, None, :]
  np.testing.assert_array_equal(_mask_from_runs(offsets, lengths, ROWS.shape[1]), want)


def test_runs_are_bounded_by_the_config(tmp_path):
  cfg = synthetic_config(tmp_path, variant="dynamic")  # sizes 8, 16, 8x16, 16x8; 32-patch slots
  assert slot_images(cfg) == 32 // 4  # 8x8 images of 2x2 patches of 4 pixels
  assert row_segments(cfg) == 0  # no packed rows
  cfg.data.pack_rows = 2
  assert row_segments(cfg) == cfg.data.micro_batch + 1


def test_layout_never_packs_more_images_into_a_slot_than_the_bound():
  layout = image_layout(seq_len=40, tokens_per_image=4, groups=1, slots=2, image_shape=(16, 16, 3),
                  slot_patches=32, patch_size=4, downsample=2, slot_images=3)
  places = place_items([[1, 1, 1, 1], [1]], [7, 8], layout.encoders[0])  # five 1-token images
  slots = [slot for sample in places for slot, _ in sample]
  assert slots == [0, 0, 0, 1, 1]  # the fourth image goes to the next slot although slot 0 has room
  with pytest.raises(ValueError, match="model.vision.image_slots"):
    place_items([[1] * 7], [9], layout.encoders[0])


@pytest.mark.parametrize("causal,heads,kv_heads", [(False, 4, 4), (True, 4, 2)])
def test_odd_rows_padded_by_one_position_give_the_unpadded_attention(causal, heads, kv_heads):
  """The padding as cuDNN gets it (`even_attention`), run by XLA here: no query sees the added
  key and the added query is dropped, forward and backward."""
  b, l = 3, 9
  keys = jax.random.split(jax.random.key(2), 4)
  q = jax.random.normal(keys[0], (b, l, heads, 16), jnp.float32)
  k = jax.random.normal(keys[1], (b, l, kv_heads, 16), jnp.float32)
  v = jax.random.normal(keys[2], (b, l, kv_heads, 16), jnp.float32)
  dout = jax.random.normal(keys[3], (b, l, heads, 16), jnp.float32)
  plain = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal)
  padded = lambda q, k, v: even_attention(q, k, v, causal, "xla")
  want, want_vjp = jax.vjp(plain, q, k, v)
  got, got_vjp = jax.vjp(padded, q, k, v)
  assert got.shape == want.shape
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  for g, w in zip(got_vjp(dout), want_vjp(dout)):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


gpu = pytest.mark.skipif(
    jax.default_backend() != "gpu" or not jax.devices()[0].device_kind.startswith(("NVIDIA H",
                                                                                    "NVIDIA B")),
    reason="cuDNN's packed attention needs a Hopper (or later) GPU")


@gpu
@pytest.mark.parametrize("causal,heads,kv_heads", [(False, 4, 4), (True, 8, 2)])
def test_cudnn_packed_attention_matches_masked_attention(causal, heads, kv_heads):
  rows = jnp.asarray(np.repeat(ROWS, 2, axis=1))  # l = 128
  b, l = rows.shape
  keys = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(keys[0], (b, l, heads, 64), jnp.float32)
  k = jax.random.normal(keys[1], (b, l, kv_heads, 64), jnp.float32)
  v = jax.random.normal(keys[2], (b, l, kv_heads, 64), jnp.float32)
  dout = jax.random.normal(keys[3], (b, l, heads, 64), jnp.float32)
  mask = rows[:, None, :, None] == rows[:, None, None, :]

  def masked(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal,
                                        implementation="xla")

  def packed(q, k, v):
    return packed_attention(q, k, v, rows, max_segments=4, causal=causal)

  def value_and_grads(fn, dtype):
    args = [a.astype(dtype) for a in (q, k, v)]
    out, vjp = jax.vjp(jax.jit(fn), *args)
    return [np.asarray(x, np.float32) for x in (out, *vjp(dout.astype(dtype)))]

  reference = value_and_grads(masked, jnp.float32)  # float32, XLA
  xla_bf16 = value_and_grads(masked, jnp.bfloat16)
  cudnn_bf16 = value_and_grads(packed, jnp.bfloat16)
  for name, want, base, got in zip(("out", "dq", "dk", "dv"), reference, xla_bf16, cudnn_bf16):
    err, base_err = np.max(np.abs(got - want)), np.max(np.abs(base - want))
    # cuDNN in bfloat16 is as close to the float32 reference as XLA in bfloat16 (2x margin)
    assert err <= 2 * base_err + 1e-3, (name, err, base_err)


@gpu
@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("axis", ["batch", "heads"])
def test_cudnn_packed_attention_sharded_over_rows_or_heads(axis):
  """Rows split over data parallelism, or heads over tensor parallelism: each shard's packed
  offsets must describe its own rows (cuDNN's partitioner cuts them with the rows)."""
  # pylint: disable-next=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  rows = jnp.asarray(np.repeat(ROWS, 2, axis=1))
  b, l = rows.shape
  keys = jax.random.split(jax.random.key(1), 3)
  q, k, v = (jax.random.normal(key, (b, l, 8, 64), jnp.bfloat16) for key in keys)
  fn = jax.jit(lambda q, k, v, rows: packed_attention(q, k, v, rows, 4, causal=True))
  want = np.asarray(fn(q, k, v, rows), np.float32)
  mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
  spec = P("x") if axis == "batch" else P(None, None, "x")
  put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))
  got = fn(put(q, spec), put(k, spec), put(v, spec), put(rows, P("x") if axis == "batch" else P()))
  # A shard may pick another kernel tiling: a few bfloat16 ulps; wrong offsets would be O(1) off.
  np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=0, atol=2e-2)
  assert np.abs(want).max() > 0.5


@gpu
@pytest.mark.parametrize("l,head_dim", [(577, 64), (729, 72)])  # CLIP-336 + class token; SigLIP
def test_cudnn_attention_of_odd_rows_matches_xla(l, head_dim):
  """cuDNN refuses to train odd lengths as they are; padded (`attention`), it is as close to the
  float32 reference as XLA in bfloat16."""
  keys = jax.random.split(jax.random.key(3), 4)
  q, k, v, dout = (jax.random.normal(key, (4, l, 4, head_dim), jnp.float32) for key in keys)

  def value_and_grads(fn, dtype):
    out, vjp = jax.vjp(jax.jit(fn), *(a.astype(dtype) for a in (q, k, v)))
    return [np.asarray(x, np.float32) for x in (out, *vjp(dout.astype(dtype)))]

  xla = lambda q, k, v: attention(q, k, v, None, False, "xla")
  reference, xla_bf16 = value_and_grads(xla, jnp.float32), value_and_grads(xla, jnp.bfloat16)
  cudnn_bf16 = value_and_grads(lambda q, k, v: attention(q, k, v, None, False, "cudnn"),
                               jnp.bfloat16)
  for name, want, base, got in zip(("out", "dq", "dk", "dv"), reference, xla_bf16, cudnn_bf16):
    err, base_err = np.max(np.abs(got - want)), np.max(np.abs(base - want))
    assert err <= 2 * base_err + 1e-3, (name, err, base_err)


def _stand_in_for_a_gpu(monkeypatch):
  """jax's checks for a cuDNN GPU stood in for, so that cuDNN's attention traces and lowers for
  CUDA on CPUs."""
  fa = pytest.importorskip("jax._src.cudnn.fused_attention_stablehlo")
  for name, value in (("check_cudnn_version", lambda: 91000),
                      ("check_compute_capability", lambda capability: True),
                      ("is_cuda_compute_capability_equal", lambda capability: False)):
    if not hasattr(fa, name):
      pytest.skip(f"this jax has no {name} to stand in for")
    monkeypatch.setattr(fa, name, value)


def test_padded_cudnn_attention_traces_under_vmap(monkeypatch):
  """`pipeline.Stack` runs its layers under vmap over microbatches: the padded rows' key lengths
  must follow the added axis (a constant [b] made jax's cuDNN batcher fail to reshape them).
  Traced only (no GPU here): jax's checks for a cuDNN GPU are stood in for."""
  _stand_in_for_a_gpu(monkeypatch)
  # [microbatch, b, l, heads, head_dim], l odd
  q, k, v, w = (jnp.ones((2, 3, 9, 4, 16), jnp.bfloat16) for _ in range(4))

  def loss(q, k, v, w):
    return jnp.sum(attention(q, k, v, None, False, "cudnn").astype(jnp.float32) * w)
  jaxpr = jax.make_jaxpr(jax.vmap(jax.value_and_grad(loss, (0, 1, 2))))(q, k, v, w)
  assert "dot_product_attention" in str(jaxpr)


def test_auto_gives_cudnn_odd_plain_rows_and_xla_odd_packed_ones(monkeypatch):
  """Plain rows of any length train with cuDNN (odd ones padded); packed rows of an odd length
  (cuDNN's packed attention refuses them) get XLA's attention."""
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  cfg = Config()
  cfg.model.dtype = "bfloat16"
  assert attention_implementation(cfg) == "cudnn"  # any plain rows, 577 included
  assert attention_implementation(cfg, packed=2048) == "cudnn"
  assert attention_implementation(cfg, packed=17) == "xla"
  cfg.model.dtype = "float32"
  assert attention_implementation(cfg) == "xla"


def _qkv_dout(b, l, heads, kv_heads, head_dim, dtype=jnp.float32, seed=4):
  keys = jax.random.split(jax.random.key(seed), 4)
  shapes = [(b, l, heads), (b, l, kv_heads), (b, l, kv_heads), (b, l, heads)]
  return [jax.random.normal(key, s + (head_dim,), dtype) for key, s in zip(keys, shapes)]


eight = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices (the CPU suite's)")


@eight
def test_attention_inside_a_stage_runs_manual_over_the_other_axes():
  """In a shard_map manual over pp alone (a pipeline stage), `whole_manual` runs the attention in
  a shard_map of its own over dp and tp (rows over dp, heads over tp): the same values and
  gradients as outside. Outside any shard_map it adds nothing."""
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), topology.AXES)
  q, k, v, dout = _qkv_dout(4, 16, 4, 2, 8)
  plain = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)
  staged = jax.shard_map(lambda *a: whole_manual(plain, *a), mesh=mesh, in_specs=(P(),) * 3,
                         out_specs=P(), axis_names={"pp"})
  want, want_vjp = jax.vjp(plain, q, k, v)
  got, got_vjp = jax.vjp(jax.jit(staged), q, k, v)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  for g, w in zip(got_vjp(dout), want_vjp(dout)):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
  jaxpr = str(jax.make_jaxpr(staged)(q, k, v))
  manual = re.findall(r"newly_manual_axes=frozenset\(\{(.*?)\}\)", jaxpr)
  assert sorted(sorted(a.replace("'", "").split(", ")) for a in manual) == [["dp", "tp"], ["pp"]]
  assert "shard_map" not in str(jax.make_jaxpr(lambda *a: whole_manual(plain, *a))(q, k, v))
  # Rows that do not split over dp (an eval batch's slots) stay whole on each rank.
  one = [a[:1] for a in (q, k, v, dout)]
  want, want_vjp = jax.vjp(plain, *one[:3])
  got, got_vjp = jax.vjp(jax.jit(staged), *one[:3])
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  for g, w in zip(got_vjp(one[3]), want_vjp(one[3])):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
  # remat dots_attention keeps its output (as cuDNN's attention outputs outside a stage); dots
  # does not.
  def saved(policy):
    kept = jax.shard_map(lambda *a: jax.checkpoint(  # sin's backward reads the output
        lambda *a: jnp.sin(whole_manual(plain, *a)), policy=REMAT_POLICIES[policy])(*a),
        mesh=mesh, in_specs=(P(),) * 3, out_specs=P(), axis_names={"pp"})
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
      print_saved_residuals(kept, q, k, v)
    return printed.getvalue()
  assert "f32[4,16,4,8] output of shard_map" in saved("dots_attention"), saved("dots_attention")
  assert "output of shard_map" not in saved("dots"), saved("dots")
  # An integer argument (packed rows' segments) is split over dp and gets no gradient.
  rows = jnp.asarray(ROWS[:, ::4])  # [4, 16]
  masked = lambda q, k, v, rows: jax.nn.dot_product_attention(
      q, k, v, mask=rows[:, None, :, None] == rows[:, None, None, :])
  staged = jax.shard_map(lambda *a: whole_manual(masked, *a), mesh=mesh, in_specs=(P(),) * 4,
                         out_specs=P(), axis_names={"pp"})
  want, want_vjp = jax.vjp(lambda q, k, v: masked(q, k, v, rows), q, k, v)
  got, got_vjp = jax.vjp(lambda q, k, v: jax.jit(staged)(q, k, v, rows), q, k, v)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  for g, w in zip(got_vjp(dout), want_vjp(dout)):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def _attention_stack(mesh, kind, remat="none"):
  """Stacked layers whose attention is cuDNN's, plain, odd (padded) or packed, in `mesh`'s
  pipeline stages; returns the stack and its side input (the rows' segment ids)."""
  def layer(w_i, x, seg):
    h = jnp.einsum("blhd,de->blhe", x, w_i.astype(x.dtype))
    if kind == "packed":
      return x + packed_attention(h, h, h, seg, 4, causal=True)
    return x + attention(h, h, h, None, True, "cudnn")
  pp = mesh.shape["pp"]
  return Stack(layer, mesh, Schedule(pp, 1), remat)


@eight
@pytest.mark.parametrize("kind,l,remat", [("plain", 128, "none"), ("odd", 129, "none"),
                                          ("packed", 128, "none"), ("plain", 128, "dots")])
def test_cudnn_attention_in_pipeline_stages_lowers_for_gpus(monkeypatch, kind, l, remat):
  """Two pipeline stages of dp 2 and tp 2 with cuDNN's attention, trained, lower for CUDA (here,
  on CPUs): the partitioner's refusal and jax's wrong residual shapes were found at this stage."""
  _stand_in_for_a_gpu(monkeypatch)
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), topology.AXES)
  stack = _attention_stack(mesh, kind, remat)
  rows = jnp.asarray(np.stack([np.repeat(ROWS, 2, axis=1)[:, :l]] * 2))  # [M=2, 4, l]
  x = jnp.ones((2, 4, l, 4, 64), jnp.bfloat16)
  w = jnp.ones((4, 64, 64))
  f = lambda w, x: jnp.sum(stack(w, x, (rows,)).astype(jnp.float32) ** 2)
  lowered = jax.jit(jax.value_and_grad(f, (0, 1))).trace(w, x).lower(lowering_platforms=("cuda",))
  assert "custom_call" in lowered.as_text() and "cudnn" in lowered.as_text()


@gpu
@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("l,packed", [(128, False), (129, False), (128, True)])
def test_cudnn_attention_trains_in_two_pipeline_stages(l, packed):
  """A stack of attention layers in two pipeline stages with cuDNN's attention (plain, odd rows
  padded, packed rows) compiles and gives the gradients of XLA's attention in one stage, as
  closely as XLA's in bfloat16 does (jax 0.11.2's partitioner refused it there before)."""
  b = 4
  rows = jnp.asarray(np.repeat(ROWS, 2, axis=1)[:, :l] if packed else np.ones((b, l), np.int32))
  q = jax.random.normal(jax.random.key(4), (2, b, l, 4, 64))  # two microbatches
  w = 0.05 * jax.random.normal(jax.random.key(5), (4, 64, 64))

  def loss(implementation, pp, dtype):
    mesh = Mesh(np.array(jax.devices()[:pp]).reshape(pp, 1, 1), topology.AXES)
    if implementation == "cudnn":
      stack = _attention_stack(mesh, "packed" if packed else "plain")
    else:
      mask = rows[:, None, :, None] == rows[:, None, None, :]
      stack = Stack(lambda w_i, x, seg: x + attention(
          *[jnp.einsum("blhd,de->blhe", x, w_i.astype(x.dtype))] * 3, mask, True, "xla"),
          mesh, Schedule(pp, 1))
    f = lambda w, x: jnp.sum(stack(w, x, (jnp.stack([rows, rows]),)).astype(jnp.float32) ** 2)
    return jax.jit(jax.value_and_grad(f, (0, 1)))(w, q.astype(dtype))

  reference = loss("xla", 1, jnp.float32)
  base, got = loss("xla", 1, jnp.bfloat16), loss("cudnn", 2, jnp.bfloat16)
  for name, want, b_, g in zip(("loss", "dw", "dx"), jax.tree.leaves(reference),
                               jax.tree.leaves(base), jax.tree.leaves(got)):
    want, b_, g = (np.asarray(a, np.float32) for a in (want, b_, g))
    err, base_err = np.max(np.abs(g - want)), np.max(np.abs(b_ - want))
    assert err <= 2 * base_err + 1e-3 * np.max(np.abs(want)), (name, err, base_err)
