"""The audio encoder trains beside vision and the language model on its own layouts with the
single-device float32 trajectory (4 steps, 1e-4 on loss and gradient norm): three disjoint
meshes, audio fan-in (more audio ranks than language ranks) under FSDP, fan-out with audio in
two pipeline stages, audio colocated with the language model with its own tp (2, the language
model's 1) under ZeRO-1 and full remat, a run resumed onto another layout, and clips packed
several a slot on the fan-in layout against their own single-device run; the three meshes' audio
remats with the "dots" policy. An FP8 audio tower (delayed scaling) records its abs-maxes and
tracks the float32 run. Samples carry synthetic log-mel clips of varying length (0-2 windows),
so padding tokens are dropped and each clip's tokens differ."""

import dataclasses

import jax
import numpy as np
import pytest

from mimo_jax import checkpoint
from mimo_jax.batch import stack
from mimo_jax.config import ModuleTopology
from mimo_jax.data import digits
from mimo_jax.data.layout import layout_microbatch
from mimo_jax.data.loader import make_layout
from mimo_jax.data.tokenizer import IMG, Tokenizer
from mimo_jax.encoders.audio import AUDIO_TOKEN, AudioConfig
from mimo_jax.models import fp8
from mimo_jax.step import Step
from mimo_jax.trees import paths
from mimo_jax.validation import validate
from tests.helpers import assert_close_trajectory, run_steps, tiny_config

STEPS = 4
# Qwen2-Audio's tower layout (pooled, padding masked) at toy size: 16-frame windows, 4 tokens each.
TOWER = dict(mel_bins=8, positions=8, dim=32, layers=2, heads=4, mlp_dim=64, pool=2,
             mask_padding=True, projector="mlp", projector_hidden=64, max_audios=1,
             max_windows=2)


# Packed slots: 8 a microbatch of 64 frames (32 positions), clips sharing them (encoders/audio.py).
PACKED = dict(slot_frames=64, audio_slots=8)


def _config(data_dir, vision, audio, language, packed=False, **audio_topology):
  cfg = tiny_config(data_dir, vision=vision, language=language)
  offset, dp, tp, *pp = audio
  cfg.add_encoder("audio", AudioConfig(**TOWER, **(PACKED if packed else {})),
                  ModuleTopology(offset, dp, tp, *pp, **audio_topology))
  cfg.data.seq_len = 32  # room for 3 images of 4 tokens and a clip of 8
  return cfg


def _samples(steps, micro, microbatches):
  """Samples with 0-3 images and 0-1 clips of 3-32 audio frames (1-2 windows of 16), then text."""
  tr_x, _, _, _ = digits.split_images()
  rng = np.random.default_rng(5)
  frames = TOWER["positions"] * 2

  def sample(s, m, i):
    k = int(rng.integers(0, 4))
    images = [np.asarray(tr_x[(89 * s + 37 * m + 5 * i + q) % len(tr_x)], np.uint8).reshape(8, 8)
              for q in range(k)]
    audios, lengths = [], []
    if rng.random() < 0.75:
      n = int(rng.integers(3, 2 * frames + 1))
      windows = -(-n // frames)
      audios.append(rng.standard_normal((windows * frames, TOWER["mel_bins"])).astype(np.float32))
      lengths.append(n)
    text = rng.integers(5, 17, size=int(rng.integers(2, 5)))
    tokens = [IMG] * k + [AUDIO_TOKEN] * len(audios) + text.tolist()
    return {"images": images, "audios": audios, "audio_frames": lengths,
            "tokens": np.asarray(tokens, np.int32)}

  return [[[sample(s, m, i) for i in range(micro)] for m in range(microbatches)]
          for s in range(steps)]


def _batches(cfg):
  micro = cfg.data.micro_batch
  steps = _samples(STEPS, micro, cfg.data.microbatches)

  def make(lang_dp):
    layout = make_layout(cfg, lang_dp)
    return [stack([layout_microbatch(samples, [1000 * s + 100 * m + i for i in range(micro)],
                                     layout, Tokenizer())
                   for m, samples in enumerate(step)]) for s, step in enumerate(steps)]
  return make


@pytest.fixture(scope="module")
def reference(data_dir):
  cfg = _config(data_dir, (0, 1, 1), (0, 1, 1), (0, 1, 1))
  ref, step, state, init = run_steps(cfg, STEPS, batches=_batches(cfg))
  assert step.ctx.mode.fused
  assert ref[-1]["loss"] < ref[0]["loss"]
  # The audio tower trained, its fixed position table did not.
  moved = jax.tree.map(lambda a, b: not np.allclose(a, np.asarray(b)), init["audio"],
                       jax.device_get(state["audio"].params))
  assert not moved["pos"] and moved["conv1"]["kernel"] and moved["blocks"]["attn"]["q"]["kernel"]
  assert moved["projector"]["up"]["kernel"]
  return ref


LAYOUTS = {
    "three_meshes": dict(vision=(0, 2, 1), audio=(2, 2, 1), language=(4, 2, 2), remat="dots"),
    "fan_in_fsdp": dict(vision=(0, 1, 1), audio=(1, 4, 1), language=(5, 2, 1), shard="full"),
    "fan_out_pp": dict(vision=(0, 1, 1), audio=(1, 1, 1, 2), language=(4, 4, 1)),
    # Audio tp2 where the language model on the same devices is tp1 (dp2 -> dp4).
    "colocated_tp_zero1": dict(vision=(0, 2, 1), audio=(4, 2, 2), language=(4, 4, 1),
                               shard="optimizer", remat="full"),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_audio_layouts_match_single_device(data_dir, reference, name):
  cfg = _config(data_dir, **LAYOUTS[name])
  got, step, _, _ = run_steps(cfg, STEPS, batches=_batches(cfg))
  assert list(step.plan.modules) == ["vision", "audio", "language"]
  assert_close_trajectory(reference, got, rtol=1e-4)
  batch = _batches(cfg)(step.ctx.groups)[1]
  assert int(batch.stats.items["audio"].sum()) > 0


@pytest.fixture(scope="module")
def reference_packed(data_dir):
  cfg = _config(data_dir, (0, 1, 1), (0, 1, 1), (0, 1, 1), packed=True)
  ref, _, _, _ = run_steps(cfg, STEPS, batches=_batches(cfg))
  assert ref[-1]["loss"] < ref[0]["loss"]
  return ref


def test_packed_audio_slots_match_single_device(data_dir, reference_packed):
  """Clips packed several a slot (model.audio.slot_frames) on the fan-in layout under FSDP: the
  single-device packed trajectory."""
  cfg = _config(data_dir, **LAYOUTS["fan_in_fsdp"], packed=True)
  got, step, _, _ = run_steps(cfg, STEPS, batches=_batches(cfg))
  assert_close_trajectory(reference_packed, got, rtol=1e-4)
  batch = _batches(cfg)(step.ctx.groups)[0]
  assert int(batch.slots["audio"].inputs["mel_seg_nf"].max()) >= 2  # slots shared by clips


def test_an_fp8_audio_tower_records_its_abs_maxes_and_trains(data_dir, reference):
  """model.audio.fp8 with delayed scaling, the other modules in bfloat16: each block linear's
  input and incoming gradient keep one abs-max a step, and the losses stay within
  tests/test_fp8.py's 1% of the float32 run (measured: 0.09%; bfloat16 alone 0.02%)."""
  cfg = _config(data_dir, (0, 1, 1), (0, 1, 1), (0, 1, 1))
  cfg.model.dtype = "bfloat16"
  a = cfg.model.audio
  a.fp8, a.fp8_scaling, a.fp8_history = True, "delayed", 2 * STEPS
  got, _, state, _ = run_steps(cfg, STEPS, batches=_batches(cfg))
  histories = {f"{n}/{k}": np.asarray(v) for n, s in state.items()
               for k, v in paths(jax.device_get(s.params)).items() if fp8.is_history(k)}
  assert len(histories) == 2 * 6  # q, k, v, o and the MLP's two
  for key, h in histories.items():
    assert key.startswith("audio/") and h.shape == (TOWER["layers"], 2 * STEPS), key
    assert np.all(h[:, :STEPS] > 0) and np.all(h[:, STEPS:] == 0), (key, h)
  losses = np.array([float(m["loss"]) for m in got])
  np.testing.assert_allclose(losses, [m["loss"] for m in reference], rtol=1e-2)


def test_resume_onto_another_layout(data_dir, reference, tmp_path):
  """Two steps on three meshes, saved; restored onto the fan-out layout for two more: the
  trajectory is the single-device one."""
  first = _config(data_dir, **LAYOUTS["three_meshes"])
  got, step, state, _ = run_steps(first, 2, batches=_batches(first))
  ckpt = checkpoint.Checkpointer(str(tmp_path / "ckpt"), list(step.modules), async_save=False)
  ckpt.save(2, step.canonical(state), first, force=True)
  ckpt.wait()
  second = _config(data_dir, **LAYOUTS["fan_out_pp"])
  validate(second, len(jax.devices()))
  step2 = Step.build(second)
  restored, _ = ckpt.restore(2, step2.abstract_state(canonical=True), second,
                             step2.fresh_opt_state)
  state2 = step2.from_canonical(restored)
  for batch in _batches(second)(step2.ctx.groups)[2:]:
    state2, metrics = step2.train_step(state2, batch)
    got.append(jax.device_get(metrics))
  ckpt.close()
  assert_close_trajectory(reference, got, rtol=1e-4)


def test_synthetic_task_trains_with_audio_clips(data_dir, tmp_path):
  """data.task=synthetic gives each sample its clips (features remade from their seeds on
  reading, the same each time), the layout drops their padding's tokens, and steps train on
  packed slots in the number the capacity check names."""
  from mimo_jax.data import loader, synthetic  # pylint: disable=import-outside-toplevel
  cfg = _config(data_dir, (0, 1, 1), (0, 1, 1), (0, 1, 1))
  cfg.data.task, cfg.data.dir = "synthetic", str(tmp_path)
  cfg.model.vision.max_images, cfg.data.image_probs = 1, "0.5,0.5"
  cfg.data.seq_len, cfg.data.text_len = 32, 6
  cfg.data.train_samples, cfg.data.eval_samples, cfg.eval.samples = 64, 16, 16
  cfg.model.language.vocab_size = 64
  path = synthetic.paths(cfg)["train"]
  assert "-a1_16_2_8_4-" in path  # the clips' settings name the shard
  source = loader._source(path, "synthetic")  # pylint: disable=protected-access
  first, again = source[0][1], source[0][1]
  frames = first["audio_frames"][0]
  assert 4 <= frames <= 32 and first["audios"][0].shape == (16 * -(-frames // 16), 8)
  np.testing.assert_array_equal(first["audios"][0], again["audios"][0])
  assert int((first["tokens"] == AUDIO_TOKEN).sum()) == 1
  # Packed slots (2 of 32 positions where 16 would take a clip each): the capacity check counts
  # each clip's room (its positions), names the slots the run needs, and the loader lays out
  # every microbatch in them, each placeholder reading its own clip's tokens.
  from mimo_jax.data import capacity  # pylint: disable=import-outside-toplevel
  cfg.model.audio.slot_frames, cfg.model.audio.audio_slots = 64, 2
  validate(cfg, len(jax.devices()))
  with pytest.raises(capacity.CapacityError, match=r"model.audio.audio_slots=2 is too small") \
      as e:
    capacity.check_capacity(cfg, path, 1, 0, 2)
  need = int(str(e.value).split("set model.audio.audio_slots=")[1].split(" ")[0])
  assert 2 < need < cfg.data.micro_batch  # fewer slots than clips: they share slots
  cfg.model.audio.audio_slots = need
  assert capacity.check_capacity(cfg, path, 1, 0, 2)
  got, _, _, _ = run_steps(cfg, 2)
  assert all(np.isfinite(float(m["loss"])) for m in got)
  assert all(int(m["mismatches"]) == 0 for m in got)
