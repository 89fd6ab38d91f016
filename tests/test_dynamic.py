"""Dynamic resolution (model.vision.slot_patches): images of several sizes packed into encoder
slots, each attending only within itself, with token-granular split sizes through the bridge."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mimo_jax import encoders
from mimo_jax.config import ConfigError
from mimo_jax.data import loader, meta
from mimo_jax.data.layout import layout_microbatch
from mimo_jax.data.tokenizer import IMG, Tokenizer
from mimo_jax.models.mimo import slot_mismatches
from mimo_jax.patches import grid_positions, patchify
from mimo_jax.step import Step
from mimo_jax.validation import validate
from tests.helpers import assert_close_trajectory, run_steps, image_layout
from tests.test_synthetic import _config as synthetic_config

P, S, C = 4, 2, 3  # patch size, pixel shuffle, channels


def _config(tmp_dir, topo=None, **data):
  cfg = synthetic_config(tmp_dir, topo, variant="dynamic")
  cfg.model.vision.image_slots = 24
  for k, v in data.items():  # data fields, or the image settings of model.vision
    setattr(cfg.data if hasattr(cfg.data, k) else cfg.model.vision, k, v)
  return cfg


@pytest.fixture(scope="module")
def synth_dir(tmp_path_factory):
  return tmp_path_factory.mktemp("dynamic")


def _image(h, w, code):
  rng = np.random.default_rng(code)
  return rng.integers(0, 256, size=(h, w, C), dtype=np.uint8)


def _layout(groups=2, slots=4, slot_patches=32):
  return image_layout(seq_len=40, tokens_per_image=4, groups=groups, slots=slots,
                image_shape=(16, 16, C), slot_patches=slot_patches, patch_size=P, downsample=S)


SIZES = [[(8, 8), (16, 16)], [], [(8, 16), (16, 8), (8, 8)], [(16, 16)]]


def _samples():
  return [{"images": [_image(h, w, 10 * b + i) for i, (h, w) in enumerate(sizes)],
           "tokens": np.array([IMG] * len(sizes) + [20 + b, 21], np.int32)}
          for b, sizes in enumerate(SIZES)]


def test_layout_packs_images_of_several_sizes_at_token_granularity():
  layout, samples, ids = _layout(), _samples(), [50, 51, 52, 53]
  mb = layout_microbatch(samples, ids, layout, Tokenizer())
  vision = mb.slots["vision"]
  # [rank, token, block, pixels]
  per_group = vision.inputs["patches_nqk"].reshape(2, -1, S * S, P * P * C)
  positions = mb.slots["vision"].inputs["patch_pos_nq"].reshape(2, -1, S * S)
  segments = mb.slots["vision"].inputs["patch_seg_nq"].reshape(2, -1, S * S)
  for b, (sample, sid) in enumerate(zip(samples, ids)):
    g, row = b // 2, mb.slots["vision"].pos_rl[b]
    where = row[row >= 0]  # this sample's image tokens, in placeholder order
    tokens = [(h // P) * (w // P) // (S * S) for h, w in SIZES[b]]  # 1, 4 or 2 an image
    assert len(where) == sum(tokens) == np.sum(mb.text.tokens_rl[b] == IMG)
    want = [patchify(img[None], P, S)[0].reshape(-1, S * S, P * P * C) for img in sample["images"]]
    want_pos = [grid_positions(h // P, w // P, S, 16 // P).reshape(-1, S * S) for h, w in SIZES[b]]
    if want:
      np.testing.assert_array_equal(per_group[g][where], np.concatenate(want))
      np.testing.assert_array_equal(positions[g][where], np.concatenate(want_pos))
    start = 0
    for t in tokens:  # one segment an image, the same for all its patches
      seg = segments[g][where[start:start + t]]
      assert np.all(seg == seg[0, 0]) and seg[0, 0] > 0
      start += t
  owners = mb.slots["vision"].owner_nt
  assert np.sum(owners >= 0) == sum((h // P) * (w // P) // 4 for s in SIZES for h, w in s)
  assert np.all((vision.inputs["patch_seg_nq"] > 0) == np.repeat(owners >= 0, S * S, axis=1))
  bad = slot_mismatches(jnp.asarray(owners), jnp.asarray(mb.slots["vision"].pos_rl),
                        jnp.asarray(mb.text.token_sample_rl), 2)
  assert int(bad) == 0
  patches = [(h // P) * (w // P) for s in SIZES for h, w in s]
  work = mb.stats.work["vision"]
  assert int(work["patches"]) == sum(patches)
  assert int(work["patches_sq"]) == sum(p * p for p in patches)


def test_an_image_too_large_for_a_slot_or_of_a_bad_size_is_an_error():
  samples = [{"images": [_image(16, 16, 0)], "tokens": np.array([IMG, 20], np.int32)}]
  with pytest.raises(ValueError,
                     match=r"sample 7 has an image of 4 tokens.*model\.vision\.slot_patches"):
    layout_microbatch(samples, [7], _layout(groups=1, slots=1, slot_patches=8), Tokenizer())
  samples = [{"images": [_image(12, 16, 0)], "tokens": np.array([IMG, 20], np.int32)}]
  with pytest.raises(ValueError, match=r"sample 7 has a 12x16 image; sides must be multiples of"):
    layout_microbatch(samples, [7], _layout(groups=1, slots=1), Tokenizer())
  fixed = image_layout(seq_len=40, tokens_per_image=4, groups=1, slots=1, image_shape=(16, 16, C),
                 patch_size=P, downsample=S)
  samples = [{"images": [_image(8, 8, 0)], "tokens": np.array([IMG, 20], np.int32)}]
  with pytest.raises(ValueError, match=r"sample 7 has a 8x8 image.*model\.vision\.slot_patches"):
    layout_microbatch(samples, [7], fixed, Tokenizer())


def _stepper(cfg):
  validate(cfg, len(jax.devices()))
  stepper = Step.build(cfg)
  return stepper, stepper.init_state(0)["vision"].params


def _encode(stepper, params, inputs):
  apply = stepper.programs.encoder_tokens["vision"]
  return np.asarray(apply(params, [inputs])[0])


def test_packed_encoder_matches_each_image_alone_and_the_fixed_size_path(synth_dir):
  stepper, params = _stepper(_config(synth_dir))
  sizes = [(8, 8), (16, 16), (8, 16)]
  images = [_image(h, w, i) for i, (h, w) in enumerate(sizes)]

  def row(imgs, length):
    """One slot holding `imgs` back to back, padded to `length` patches."""
    k = np.concatenate([patchify(im[None], P, S)[0] for im in imgs])
    pos = np.concatenate([grid_positions(im.shape[0] // P, im.shape[1] // P, S, 4) for im in imgs])
    seg = np.concatenate([np.full(len(patchify(im[None], P, S)[0]), i + 1)
                          for i, im in enumerate(imgs)])
    pad = length - len(k)
    return {"patches_nqk": jnp.asarray(np.pad(k, ((0, pad), (0, 0))))[None],
            "patch_pos_nq": jnp.asarray(np.pad(pos, (0, pad)), jnp.int32)[None],
            "patch_seg_nq": jnp.asarray(np.pad(seg, (0, pad)), jnp.int32)[None]}

  packed = _encode(stepper, params, row(images, 32))[0]
  start = 0
  for im in images:  # each image alone in a slot of exactly its patches
    n = im.shape[0] * im.shape[1] // (P * P)
    alone = _encode(stepper, params, row([im], n))[0]
    np.testing.assert_allclose(packed[start:start + n // 4], alone, rtol=1e-5, atol=1e-5)
    start += n // 4
  assert np.abs(packed[start:]).max() > 0  # padding tokens exist but no placeholder reads them
  full = {"images_nhwc": jnp.asarray(images[1])[None]}  # the largest size, through the plain ViT
  np.testing.assert_allclose(_encode(stepper, params, row([images[1]], 16))[0],
                             _encode(stepper, params, full)[0], rtol=1e-5, atol=1e-5)


def test_bicubic_positions_packed_match_each_image_alone(synth_dir):
  """position_resize=bicubic: a slot packed by the layout (taps and weights a patch) gives each
  image the tokens it gets alone through the plain ViT, its table resized to its own grid."""
  cfg = _config(synth_dir)
  cfg.model.vision.position_resize = "bicubic"
  stepper, params = _stepper(cfg)
  layout = loader.make_layout(cfg, 1)
  sizes = [(8, 8), (16, 8), (8, 16)]
  images = [_image(h, w, i) for i, (h, w) in enumerate(sizes)]
  sample = {"images": images, "tokens": np.array([IMG] * 3 + [20, 21], np.int32)}
  mb = layout_microbatch([sample], [0], layout, Tokenizer())
  inputs = mb.slots["vision"].inputs
  assert set(inputs) == {"patches_nqk", "patch_taps_nqt", "patch_tapw_nqt", "patch_seg_nq"}
  packed = _encode(stepper, params, {k: jnp.asarray(v) for k, v in inputs.items()})
  model = stepper.modules["vision"].bind(params)
  got = packed.reshape(-1, packed.shape[-1])
  start = 0
  for im in images:
    x = model.patches(jnp.asarray(im, jnp.float32)[None] / 255.0)
    alone = np.asarray(model.finish(stepper.modules["vision"].apply_blocks(params, x)))[0]
    np.testing.assert_allclose(got[start:start + len(alone)], alone, rtol=1e-5, atol=1e-5)
    start += len(alone)


@pytest.fixture(scope="module")
def reference(synth_dir):
  out = run_steps(_config(synth_dir), 3)[0]
  assert out[-1]["loss"] < out[0]["loss"]
  return out


def test_bicubic_positions_match_single_device(synth_dir, reference):
  """Also the fan-in parity of dynamic resolution (vision dp=4 -> language dp=2 tp=2, disjoint):
  the position resize happens inside the encoder, before the bridge."""
  one = _config(synth_dir)
  one.model.vision.position_resize = "bicubic"
  ref = run_steps(one, 3)[0]
  split = _config(synth_dir, {"vision": (0, 4, 1), "language": (4, 2, 2)})
  split.model.vision.position_resize = "bicubic"
  assert_close_trajectory(ref, run_steps(split, 3)[0], rtol=1e-4)
  # `reference` crops the table (its top-left part): another loss.
  assert abs(float(reference[0]["loss"]) - float(ref[0]["loss"])) > 1e-4


def test_packed_slots_keep_the_trajectory_of_one_image_a_slot(synth_dir):
  """Every image at the full size: the packed path (two images a slot) against the plain one."""
  plain = _config(synth_dir, image_sizes="", slot_patches=0, image_slots=0)
  ref = run_steps(plain, 3)[0]
  got = run_steps(_config(synth_dir, image_sizes="", slot_patches=32, image_slots=16), 3)[0]
  assert_close_trajectory(ref, got, rtol=1e-4)


def test_packing_density_does_not_change_the_loss(synth_dir, reference):
  """Images of several sizes: slots of 16 patches (about one image each) against 32."""
  got = run_steps(_config(synth_dir, slot_patches=16, image_slots=48), 3)[0]
  assert_close_trajectory(reference, got, rtol=1e-4)


def test_dynamic_resolution_colocated_with_vision_tp_matches_single_device(synth_dir, reference):
  """Colocated meshes, the encoder tensor-parallel. The disjoint layouts' parity is checked with
  the other features: fan-in by the bicubic test, fan-out by the bucket test below."""
  got = run_steps(_config(synth_dir, {"vision": (0, 4, 2), "language": (0, 8, 1)}), 3)[0]
  assert_close_trajectory(reference, got, rtol=1e-4)


def test_scalable_reads_with_packed_slots(synth_dir):
  cfg = _config(synth_dir, {"vision": (0, 4, 1), "language": (4, 2, 2)})
  path = loader.build_paths(cfg)["train"]
  full = loader.train_dataset(cfg, path, 2)[0]
  # vision dp rank 2 of 4
  where = loader.Locality(groups=frozenset(), slots={"vision": ((12, 18),)})
  got = loader.train_dataset(cfg, path, 2, where)[0]
  owners = [len({int(i) for i in ids.ravel() if i >= 0})
            for ids in full.slots["vision"].owner_nt[:, 12:18]]
  np.testing.assert_array_equal(got.stats.records_read, owners)
  assert sum(owners) < full.samples.ids_b.size
  g, f = got.slots["vision"], full.slots["vision"]
  for k in ("patches_nqk", "patch_pos_nq", "patch_seg_nq"):
    np.testing.assert_array_equal(g.inputs[k][:, 12:18], f.inputs[k][:, 12:18], err_msg=k)
  np.testing.assert_array_equal(g.owner_nt[:, 12:18], f.owner_nt[:, 12:18])
  for pick in (lambda b: b.samples.ids_b, lambda b: b.samples.tokens_b,
               lambda b: b.stats.target_tokens, lambda b: b.stats.work["vision"]["patches"],
               lambda b: b.stats.work["vision"]["patches_sq"]):
    np.testing.assert_array_equal(pick(got), pick(full))


def test_metadata_holds_every_image_size_and_old_sidecars_are_rebuilt(synth_dir):
  path = loader.build_paths(_config(synth_dir))["train"]
  records = loader.Records(path, "synthetic")
  sizes = set()
  for i in range(len(records)):
    got, images = records.meta[i].sizes["vision"], records.read(i)["images"]
    assert list(got) == [im.shape[:2] for im in images]
    sizes.update(got)
  assert sizes == {(8, 8), (16, 16), (8, 16), (16, 8)}
  want = [records.meta[i] for i in range(len(records))]
  np.savez(meta.path_of(path), text_tokens=records.meta.text_tokens)  # an older format
  got = loader.Records(path, "synthetic")
  assert [got.meta[i] for i in range(len(got))] == want


@pytest.mark.parametrize("data, field", [
    ({"image_sizes": "8,12"}, "data.image_sizes"),  # 12 is not a multiple of 4 * 2
    ({"image_sizes": "8,32"}, "data.image_sizes"),  # beyond model.vision.image_size
    ({"image_sizes": "8,16", "slot_patches": 0}, "data.image_sizes"),  # several sizes, no packing
    ({"image_sizes": "8,a"}, "data.image_sizes"),
    ({"slot_patches": 8}, "model.vision.slot_patches"),  # smaller than the largest image
    ({"slot_patches": 18}, "model.vision.slot_patches"),  # not a multiple of 2x2
])
def test_bad_dynamic_resolution_settings_name_the_field(synth_dir, data, field):
  with pytest.raises(ConfigError, match=rf"config\.{field}"):
    validate(_config(synth_dir, **data), 8)


@pytest.mark.parametrize("start", [0, 3])
def test_worker_processes_give_the_same_steps_in_order(synth_dir, start):
  """grain worker processes (data.worker_processes) build whole steps; a resumed iterator starts
  exactly at its step."""
  cfg = _config(synth_dir, worker_processes=2, workers=1)
  path = loader.build_paths(cfg)["train"]
  ds = loader.train_dataset(cfg, path, 1)
  it = loader.train_iterator(cfg, path, 1, start_step=start)
  try:
    for step in range(start, start + 4):
      got, want = next(it), ds[step]
      assert jax.tree.structure(got) == jax.tree.structure(want)
      for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(a, b)
  finally:
    it.close()


def test_slot_and_row_buckets_and_pipeline_order_keep_the_trajectory(synth_dir, reference):
  """Microbatches send only the slots their ranks fill (12 sizes) and the packed rows they fill
  (2 sizes), and run in Johnson's order: the same samples per step, fewer encoder slots and
  language rows, the single-device plain trajectory. Also the fan-out parity of dynamic resolution
  (vision dp=2 -> language dp=4, disjoint): token-granular split sizes through the bridge."""
  topo, packing = {"vision": (0, 2, 1), "language": (2, 4, 1)}, {"slot_patches": 16,
                                                                  "image_slots": 48}
  cfg = _config(synth_dir, topo, slot_buckets=12, microbatch_order="pipeline", pack_rows=8,
                row_buckets=2, **packing)
  path = loader.build_paths(cfg)["train"]
  plain = loader.train_dataset(_config(synth_dir, topo, **packing), path, 4)
  ds = loader.train_dataset(cfg, path, 4)
  S, reordered = encoders.get("vision").slots(cfg) // 4, 0
  for step in range(3):
    a, b = plain[step], ds[step]
    assert sorted(a.samples.ids_b.ravel()) == sorted(b.samples.ids_b.ravel())
    order = [int(np.flatnonzero(a.samples.ids_b[:, 0] == sid)[0])
             for sid in b.samples.ids_b[:, 0]]
    reordered += order != sorted(order)
    assert np.all(b.slots["vision"].sent >= b.slots["vision"].used_g.max(axis=1))
    assert np.all(b.slots["vision"].sent < S) and np.all(np.diff(b.slots["vision"].sent) >= 0)
    assert np.all(b.text.rows_sent >= b.stats.rows_used_g.max(axis=1))
    assert np.all(b.text.rows_sent == 1)  # two samples a rank fit one packed row of the two
  assert reordered  # Johnson's order differs from the stream's on this data
  assert_close_trajectory(reference, run_steps(cfg, 3)[0], rtol=1e-4)
