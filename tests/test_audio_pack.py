"""Packed audio slots (model.audio.slot_frames): several clips share a slot, each encoded as it
would be alone on its own frames, and the layout accounts for their room and tokens."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mimo_jax.config import ModuleTopology
from mimo_jax.data import audio
from mimo_jax.data.layout import layout_microbatch, place_items
from mimo_jax.data.loader import make_layout
from mimo_jax.data.tokenizer import Tokenizer
from mimo_jax.encoders import audio as audio_encoder
from mimo_jax.encoders.audio import AUDIO_TOKEN, AudioConfig
from mimo_jax.models.activations import ACTIVATIONS
from mimo_jax.validation import validate
from tests.helpers import tiny_config

# 16-frame windows; a slot of 48 frames (24 positions) holds clips of 5, 16, 3 and 21 (16 + 5)
# frames, 3 + 8 + 2 + 11 positions: adjacent clips, odd lengths, a clip of two windows.
TOWER = dict(mel_bins=8, positions=8, dim=32, layers=2, heads=4, mlp_dim=64, projector="mlp",
             projector_hidden=64, max_audios=1, max_windows=2, slot_frames=48)
FRAMES = (5, 16, 3, 21)


def _config(data_dir, pool, **fields):
  cfg = tiny_config(data_dir, vision=(0, 1, 1), language=(0, 1, 1))
  cfg.add_encoder("audio", AudioConfig(**{**TOWER, "pool": pool, "mask_padding": pool == 2,
                                          **fields}), ModuleTopology(0, 1, 1))
  cfg.data.seq_len = 32
  return cfg


def _clips(seed=3):
  rng = np.random.default_rng(seed)
  return [rng.standard_normal((16 * -(-f // 16), 8)).astype(np.float32) for f in FRAMES]


def _alone(model, module, params, mel_fm, frames, pool):
  """A clip's tokens encoded alone: each window on exactly its audio frames (the convolutions'
  zero padding at its ends, positions from 0, attention over its own positions, its pooling)."""
  act, out = ACTIVATIONS["gelu"], []
  for w, f in enumerate(audio_encoder.clip_windows(frames, 16)):
    x = act(model.conv2(act(model.conv1(jnp.asarray(mel_fm[None, 16 * w:16 * w + f])))))
    x = x + model.pos[...][:x.shape[1]]
    out.append(model.finish(module.apply_blocks(params, x))[0][:audio.window_tokens(f, pool)])
  return np.concatenate(out)


@pytest.mark.parametrize("pool", [1, 2])
def test_packed_clips_equal_their_encoding_alone(data_dir, pool):
  cfg = _config(data_dir, pool)
  enc = audio_encoder.ENCODER
  slots = enc.slot_layout(cfg, 1, 2)
  tokens = [slots.item_tokens((f,), i) for i, f in enumerate(FRAMES)]
  rooms = [slots.item_room((f,), t) for f, t in zip(FRAMES, tokens)]
  assert rooms == [3, 8, 2, 11] and sum(rooms) == slots.room == 24
  assert tokens == [audio.clip_tokens(f, pool) for f in FRAMES]
  places = place_items([[t] for t in tokens], list(range(4)), slots, [[r] for r in rooms])
  assert [p[0][0] for p in places] == [0, 0, 0, 0]  # all four share the first slot
  inputs = slots.empty()
  for k, (clip, f, t, ((slot, start),)) in enumerate(zip(_clips(), FRAMES, tokens, places)):
    slots.write(inputs, slot, start, t, clip, (f,), k + 1)
  seg = inputs["mel_seg_nf"][0]
  # windows start at even frames (0, 6, 22, 26, 42), one segment each, nothing in the other slot
  assert [int(np.flatnonzero(seg == s)[0]) for s in range(1, 6)] == [0, 6, 22, 26, 42]
  assert not inputs["mel_seg_nf"][1].any()
  module = enc.module(cfg)
  params = module.init(cfg.train.seed + enc.seed_salt)
  model = module.bind(params)
  run = lambda p: lambda x, side: jax.vmap(lambda x1, *s: module.apply_blocks(p, x1, *s))(x, *side)
  encode = jax.jit(lambda p, i: enc.encode(module.bind(p), run(p), i))
  got = np.asarray(encode(params, {k: jnp.asarray(v)[None] for k, v in inputs.items()}))
  for clip, f, t, ((slot, start),) in zip(_clips(), FRAMES, tokens, places):
    want = _alone(model, module, params, clip, f, pool)
    assert want.shape == (t, cfg.model.language.dim)
    np.testing.assert_allclose(got[0, slot, start:start + t], want, rtol=1e-5, atol=1e-5)
  # the one-piece forward (tools.generate's) encodes a clip as packing does: the two-window clip
  clip, f, t = _clips()[3], FRAMES[3], tokens[3]
  one = audio_encoder.audio_tokens(cfg, params, clip.reshape(2, 16, 8),
                                   audio_encoder.clip_windows(f, 16))
  np.testing.assert_allclose(one, _alone(model, module, params, clip, f, pool), rtol=1e-5,
                             atol=1e-5)


def test_the_layout_packs_clips_and_counts_their_room(data_dir):
  """Four clips of one rank share one slot of 24 positions; a fifth opens the next; the tokens
  each placeholder reads are its own clip's, and the work counts positions, not windows."""
  cfg = _config(data_dir, 2, audio_slots=2)
  cfg.data.global_batch, cfg.data.microbatches = 5, 1
  validate(cfg, len(jax.devices()))
  layout = make_layout(cfg, 1)
  e = layout.encoder("audio")
  assert (e.slot_tokens, e.room, e.tokens_field) == (12, 24, "model.audio.slot_frames")
  clips = _clips() + [_clips(4)[1]]
  frames = FRAMES + (16,)
  samples = [{"images": [], "audios": [c], "audio_frames": [f],
              "tokens": np.asarray([AUDIO_TOKEN, 7, 8], np.int32)} for c, f in zip(clips, frames)]
  batch = layout_microbatch(samples, [10, 11, 12, 13, 14], layout, Tokenizer())
  s = batch.slots["audio"]
  tokens = [audio.clip_tokens(f, 2) for f in frames]  # 1, 4, 1, 5, 4
  assert int(s.used_g[0]) == 2 and int(batch.stats.item_tokens["audio"]) == sum(tokens)
  owners = s.owner_nt[0][s.owner_nt[0] >= 0].tolist()
  assert owners == [10] * 1 + [11] * 4 + [12] * 1 + [13] * 5
  assert s.owner_nt[1].tolist()[:4] == [14] * 4 and (s.owner_nt[1][4:] == -1).all()
  for b, t in enumerate(tokens):  # each placeholder reads its own clip's tokens
    at = s.pos_rl[b][s.pos_rl[b] >= 0]
    assert len(at) == t and (s.owner_nt.reshape(-1)[at] == 10 + b).all()
  positions = [3, 8, 2, 8, 3, 8]  # each window's
  assert batch.stats.work["audio"] == {"positions": sum(positions),
                                       "positions_sq": sum(q * q for q in positions),
                                       "tokens": sum(tokens)}
  # a slot too small for the longest clip, and too few slots, are errors naming the fields
  with pytest.raises(ValueError, match="max_windows"):
    validate(_config(data_dir, 2, slot_frames=30), len(jax.devices()))
  odd = _config(data_dir, 2, slot_frames=34)  # 17 positions
  odd.model.attention = "cudnn"
  with pytest.raises(ValueError, match="model.attention.*packed rows are 17 positions"):
    validate(odd, len(jax.devices()))
  # windows whose padding is masked are packed rows too (cuDNN's packed attention): odd refused
  masked = _config(data_dir, 1, positions=9, mask_padding=True, slot_frames=0)
  masked.model.attention = "cudnn"
  with pytest.raises(ValueError, match="model.attention.*packed rows are 9 positions"):
    validate(masked, len(jax.devices()))
  one = dataclasses.replace(e, slots=1)
  with pytest.raises(ValueError, match="model.audio.audio_slots"):
    place_items([[t] for t in tokens], [10, 11, 12, 13, 14], one,
                [[e.item_room((f,), t)] for f, t in zip(frames, tokens)])
