"""Image tokens land at their own sample's placeholders, for every slot grouping."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mimo_jax.data.layout import layout_microbatch
from mimo_jax.data.tokenizer import DIGIT_WORDS, IMG, Tokenizer
from mimo_jax.models.mimo import merge_images, slot_mismatches
from tests.helpers import image_layout

T, D, L = 4, 8, 24


def _sample(sid: int, k: int) -> dict:
  """k images whose pixels all equal a code unique to (sample, image)."""
  if k == 0:
    return {"images": np.zeros((0, 8, 8), np.uint8), "text": "after one : two"}
  images = np.stack([np.full((8, 8), 1 + (3 * sid + i) % 16, np.uint8) for i in range(k)])
  return {"images": images, "text": " ".join(["<img>"] * k) + " : " +
          " ".join(DIGIT_WORDS[:k])}


def _fake_encoder(images_nhwc: np.ndarray) -> np.ndarray:
  """Token t of an image = its pixel code * 100 + t, in every feature."""
  code = images_nhwc[:, 0, 0, 0].astype(np.int64)  # raw pixels travel as uint8
  return np.broadcast_to((code[:, None] * 100 + np.arange(T))[..., None],
                         (len(code), T, D)).astype(np.float32)


@pytest.mark.parametrize("groups", [1, 2, 4])
@pytest.mark.parametrize("counts", [[0, 1, 3, 1, 0, 3, 2, 1], [0] * 8, [3] * 8])
def test_merge_places_own_images(groups, counts):
  samples = [_sample(i, k) for i, k in enumerate(counts)]
  ids = list(range(100, 100 + len(samples)))
  layout = image_layout(seq_len=L, tokens_per_image=T, groups=groups, slots=8 * 3)
  mb = layout_microbatch(samples, ids, layout, Tokenizer())
  x = jnp.full((len(samples), L, D), -1.0)
  vision = mb.slots["vision"]
  merged = np.asarray(merge_images(x, jnp.asarray(_fake_encoder(vision.inputs["images_nhwc"])),
                                   jnp.asarray(vision.pos_rl), groups))
  for b, s in enumerate(samples):
    pos = np.flatnonzero(mb.text.tokens_rl[b] == IMG)
    assert len(pos) == len(s["images"]) * T
    want = np.concatenate([(1 + (3 * b + i) % 16) * 100 + np.arange(T)
                           for i in range(len(s["images"]))] or [np.zeros(0)])
    np.testing.assert_array_equal(merged[b, pos, 0], want)
    rest = np.setdiff1d(np.arange(L), pos)
    assert np.all(merged[b, rest] == -1.0)  # text positions untouched
  assert mb.samples.items_b.tolist() == counts
  bad = slot_mismatches(jnp.asarray(vision.owner_nt), jnp.asarray(vision.pos_rl),
                        jnp.asarray(mb.text.token_sample_rl), groups)
  assert int(bad) == 0


@pytest.mark.parametrize("groups", [1, 2])
def test_merge_gradients_go_to_the_placed_tokens_and_the_text(groups):
  """The backward pass: an image token's gradient is its placeholder's; a token no placeholder
  shows (an empty slot) gets none; text positions pass theirs to x, placeholders none."""
  counts = [0, 1, 3, 1, 0, 3, 2, 1]
  samples = [_sample(i, k) for i, k in enumerate(counts)]
  layout = image_layout(seq_len=L, tokens_per_image=T, groups=groups, slots=8 * 3)
  mb = layout_microbatch(samples, list(range(len(samples))), layout, Tokenizer())
  pos = np.asarray(mb.slots["vision"].pos_rl)
  emb = jnp.asarray(np.random.default_rng(0).normal(size=(8 * 3, T, D)), jnp.float32)
  x = jnp.zeros((len(samples), L, D))
  dy = np.random.default_rng(1).normal(size=(len(samples), L, D)).astype(np.float32)
  g_x, g_emb = jax.grad(lambda x, e: jnp.sum(merge_images(x, e, jnp.asarray(pos), groups) * dy),
                        argnums=(0, 1))(x, emb)
  want = np.zeros((groups, emb.size // groups // D, D), np.float32)
  rows = len(samples) // groups
  for b in range(len(samples)):
    for t in np.flatnonzero(pos[b] >= 0):
      want[b // rows, pos[b, t]] += dy[b, t]
  np.testing.assert_array_equal(np.asarray(g_emb).reshape(want.shape), want)
  assert 0 < np.count_nonzero(np.any(want, axis=-1)) < want.shape[0] * want.shape[1]
  np.testing.assert_array_equal(np.asarray(g_x), np.where(pos[..., None] >= 0, 0, dy))


def test_mismatch_detected_when_slots_are_swapped():
  samples = [_sample(i, 2) for i in range(4)]
  layout = image_layout(seq_len=L, tokens_per_image=T, groups=2, slots=12)
  mb = layout_microbatch(samples, [10, 11, 12, 13], layout, Tokenizer())
  owners = mb.slots["vision"].owner_nt
  swapped = np.concatenate([owners[6:], owners[:6]])  # ranks exchanged
  bad = slot_mismatches(jnp.asarray(swapped), jnp.asarray(mb.slots["vision"].pos_rl),
                        jnp.asarray(mb.text.token_sample_rl), 2)
  assert int(bad) == 4 * 2 * T


def test_capacity_overflow_names_the_sample():
  samples = [_sample(i, 3) for i in range(4)]
  layout = image_layout(seq_len=L, tokens_per_image=T, groups=2, slots=8)  # 4 slots a rank
  with pytest.raises(ValueError, match=r"sample 21 needs 3 images.*model.vision.image_slots"):
    layout_microbatch(samples, [20, 21, 22, 23], layout, Tokenizer())


def test_too_long_sample_is_an_error():
  layout = image_layout(seq_len=10, tokens_per_image=T, groups=1, slots=8)
  with pytest.raises(ValueError, match=r"sample 5 needs \d+ tokens.*data.seq_len"):
    layout_microbatch([_sample(0, 3)], [5], layout, Tokenizer())
