"""Encoders as plug-ins: a second, tests-only encoder (tests/toy_encoder.py) trains beside vision
and the language model on three meshes, with the single-device float32 trajectory."""

import dataclasses
import functools
import json
import os
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mimo_jax import checkpoint_config, encoders, memory, optim, run_paths
from mimo_jax.batch import stack
from mimo_jax.config import ConfigError, ModuleTopology, from_dict, param_groups
from mimo_jax.data import digits, loader, meta
from mimo_jax.data.layout import layout_microbatch
from mimo_jax.data.loader import make_layout
from mimo_jax.data.tokenizer import IMG, Tokenizer
from mimo_jax.modules import build_modules
from mimo_jax.validation import validate
from tests import toy_encoder
from tests.helpers import assert_close_trajectory, run_steps, tiny_config

STEPS = 4


@pytest.fixture(autouse=True)
def _registered():
  encoders.register(toy_encoder.Signal())
  yield
  encoders.unregister("signal")


def _config(data_dir, vision, signal, language):
  cfg = tiny_config(data_dir, vision=vision, language=language)
  cfg.add_encoder("signal", toy_encoder.SignalConfig(), ModuleTopology(*signal))
  cfg.data.seq_len = 32  # room for 3 images and 2 signals of 4 tokens each
  return cfg


def _samples(steps, micro, microbatches):
  """Samples with 0-3 images and 0-2 signals, given as token ids: items' placeholders first,
  then text ids the digits vocabulary has, never the signal placeholder."""
  tr_x, _, _, _ = digits.split_images()
  rng = np.random.default_rng(3)

  def sample(s, m, i):
    k, j = int(rng.integers(0, 4)), int(rng.integers(0, 3))
    images = [np.asarray(tr_x[(97 * s + 31 * m + 7 * i + q) % len(tr_x)], np.uint8).reshape(8, 8)
              for q in range(k)]
    signals = [rng.standard_normal(16).astype(np.float32) for _ in range(j)]
    text = rng.integers(5, 17, size=int(rng.integers(2, 5)))
    tokens = [IMG] * k + [toy_encoder.PLACEHOLDER] * j + text.tolist()
    return {"images": images, "signals": signals, "tokens": np.asarray(tokens, np.int32)}

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


def test_three_meshes_match_single_device(data_dir):
  ref_cfg = _config(data_dir, (0, 1, 1), (0, 1, 1), (0, 1, 1))
  ref, ref_step, ref_state, ref_init = run_steps(ref_cfg, STEPS, batches=_batches(ref_cfg))
  assert ref_step.ctx.mode.fused  # every module on device 0: one program a microbatch
  assert ref[-1]["loss"] < ref[0]["loss"]
  cfg = _config(data_dir, (0, 2, 1), (2, 2, 1), (4, 2, 2))
  got, step, state, init = run_steps(cfg, STEPS, batches=_batches(cfg))
  assert list(step.plan.modules) == ["vision", "signal", "language"]
  assert not step.ctx.mode.fused
  assert {d.id for d in step.plan["signal"].mesh.devices.flat} == {2, 3}
  assert_close_trajectory(ref, got, rtol=1e-4)
  # The signal encoder trained: its parameters moved, alike on both layouts.
  for a, b, c in zip(jax.tree.leaves(init["signal"]), jax.tree.leaves(state["signal"].params),
                     jax.tree.leaves(ref_state["signal"].params)):
    assert not np.allclose(a, np.asarray(b))
    np.testing.assert_allclose(np.asarray(b), np.asarray(c), rtol=1e-4, atol=1e-6)
  batch = _batches(cfg)(2)[0]
  assert int(batch.stats.items["signal"].sum()) > 0 and int(batch.stats.items["vision"].sum()) > 0


def test_unregistered_or_unplaced_encoders_are_config_errors(data_dir):
  cfg = _config(data_dir, (0, 1, 1), (0, 1, 1), (0, 1, 1))
  del cfg.topology.encoders["signal"]
  with pytest.raises(ConfigError, match="config.topology.signal"):
    validate(cfg, 8)
  cfg = _config(data_dir, (0, 1, 1), (0, 1, 1), (0, 1, 1))
  encoders.unregister("signal")
  with pytest.raises(ConfigError, match="no encoder 'signal' is registered"):
    validate(cfg, 8)


def test_sidecar_and_scalable_reads_cover_every_encoder(data_dir, tmp_path):
  """The metadata sidecar keeps every encoder's item sizes, and a process that holds only some of
  the signal encoder's slots reads exactly the records whose signals lie there."""
  cfg = _config(data_dir, (0, 2, 1), (2, 2, 1), (4, 2, 2))
  micro = cfg.data.micro_batch
  samples = _samples(1, 2 * micro, 1)[0][0]
  shard = str(tmp_path / "toy.array_record")
  meta.write(shard, samples, Tokenizer())
  table = meta.load(shard, len(samples), samples.__getitem__, ("vision", "signal"))
  tok = Tokenizer()
  for i, sample in enumerate(samples):
    assert table[i] == meta.row(sample, tok)
    assert table[i].sizes["signal"] == ((16,),) * len(sample["signals"])
    assert table[i].sizes["vision"] == ((8, 8),) * len(sample["images"])
  records = types.SimpleNamespace(meta=table, read=samples.__getitem__)
  layout = make_layout(cfg, 2)
  S = layout.encoder("signal").slots
  for start in (0, micro):
    elements = [(start + i, start + i) for i in range(micro)]
    batch = functools.partial(loader._layout_batch,  # pylint: disable=protected-access
                              elements, layout, tok, lambda pos: pos, cfg.data, records)
    full = batch(loader.Locality())
    got = batch(loader.Locality(groups=frozenset(), slots={"signal": ((S // 2, S),)}))
    owners = {int(i) for i in full.slots["signal"].owner_nt[S // 2:].ravel() if i >= 0}
    assert int(got.stats.records_read) == len(owners) and 0 < len(owners) < micro
    assert int(full.stats.records_read) == micro
    g, f = got.slots["signal"], full.slots["signal"]
    np.testing.assert_array_equal(g.inputs["signals_ns"][S // 2:], f.inputs["signals_ns"][S // 2:])
    np.testing.assert_array_equal(g.owner_nt[S // 2:], f.owner_nt[S // 2:])
    assert not g.inputs["signals_ns"][:S // 2].any()  # the other rank's slots stay empty here
    for pick in (lambda b: b.samples.ids_b, lambda b: b.samples.tokens_b,
                 lambda b: b.samples.answer_b, lambda b: b.stats.target_tokens,
                 lambda b: b.stats.items["signal"], lambda b: b.slots["vision"].used_g):
      np.testing.assert_array_equal(pick(got), pick(full))


def _update(cfg, module, params) -> dict:
  """The first optimizer update of a module's parameters for gradients of ones (one small
  program)."""
  tx = optim.module_transform(cfg, module.groups(params))
  return jax.jit(lambda p: tx.update(jax.tree.map(jnp.ones_like, p), tx.init(p), p)[0])(params)


def test_any_encoder_has_groups_to_freeze_and_scale_and_its_config_sizes_it(data_dir):
  """The toy encoder's parameter groups (`signal`, `signal_projector`) take optim.freeze and
  optim.lr_mult; its own config sets its items, slots and sizes, which validation and memory.py
  count and check (nothing compiled)."""
  cfg = _config(data_dir, (0, 2, 1), (2, 2, 1), (4, 2, 2))
  assert param_groups(cfg) == ("vision", "vision_projector", "signal", "signal_projector",
                               "language")
  module = build_modules(cfg)["signal"]
  params = jax.tree.map(lambda a: np.full(a.shape, 0.5, a.dtype), module.abstract_params())
  groups = module.groups(params)
  assert groups["projector"]["kernel"] == "signal_projector"
  assert set(jax.tree.leaves(groups)) == {"signal", "signal_projector"}
  cfg.optim.warmup_steps = 0  # the first update at the full learning rate
  base = _update(cfg, module, params)
  cfg.optim.lr_mult = "signal=0.5"
  validate(cfg, 8)
  half = _update(cfg, module, params)
  cfg.optim.lr_mult, cfg.optim.freeze = "", "signal"
  validate(cfg, 8)
  frozen = _update(cfg, module, params)
  for part in ("embed", "blocks", "projector"):
    for b, h, f in zip(*(jax.tree.leaves(u[part]) for u in (base, half, frozen))):
      assert np.abs(b).max() > 0
      if part == "projector":  # its own group: neither scaled nor frozen
        np.testing.assert_array_equal(h, b)
        np.testing.assert_array_equal(f, b)
      else:
        np.testing.assert_allclose(h, 0.5 * b, rtol=1e-6)
        assert not np.any(f)
  # Memory: its activations from its own config (each slot's tokens at the block input and the
  # MLP's hidden units, float32), gradients only for groups that train.
  s, t = cfg.model.signal, cfg.topology.signal
  need = memory.module_bytes(cfg)
  assert need["signal"]["activations"] == (
      s.layers * cfg.data.micro_batch * s.max_signals // t.dp * s.tokens * 3 * s.dim * 4)
  assert need["signal"]["gradients"] > 0
  cfg.optim.freeze = "signal,signal_projector"
  assert memory.module_bytes(cfg)["signal"]["gradients"] == 0
  # Devices that hold the other modules, and this one as it is; a wider tower is refused, named.
  limit = max(sum(need[n].values()) for n in ("vision", "language")) + 1
  assert sum(need["signal"].values()) < limit
  s.dim = 512
  with pytest.raises(ConfigError, match=r"^config\.topology\.signal\.shard: signal needs"):
    memory.check(cfg, limit)
  # Its items count towards data.seq_len, its slots are its own config's.
  s.dim, s.max_signals = 32, 8
  assert make_layout(cfg, 2).encoder("signal").slots == cfg.data.micro_batch * 8
  with pytest.raises(ConfigError, match=r"^config\.data\.seq_len: 32 cannot hold 3 images of "
                     r"\d+ tokens, 8 signals of 4 tokens plus their answer; use >= \d+\.$"):
    validate(cfg, 8)


def test_data_settings_an_encoder_took_over_read_back_and_pin_the_data_as_before(data_dir):
  """A config written when the image settings were data fields (data.max_images, image_slots,
  slot_patches) reads back with them in model.vision; a checkpoint keeps max_images under its old
  key, and the settings are no model field a resume must keep."""
  cfg = tiny_config(data_dir)
  v = cfg.model.vision
  v.max_images, v.image_slots, cfg.data.image_probs = 2, 8, "0.2,0.4,0.4"
  old = json.loads(json.dumps(dataclasses.asdict(cfg)))
  tower = old["model"].pop("encoders")["vision"]
  old["data"].update({f: tower.pop(f) for f in ("max_images", "image_slots", "slot_patches")})
  old["model"]["vision"] = tower
  old["topology"]["vision"] = old["topology"].pop("encoders")["vision"]
  assert from_dict(old) == cfg
  saved = dataclasses.asdict(cfg)["model"]
  # A step written before (max_images among the data fields) is checked on it as before.
  meta = {"modules": list(cfg.topology.modules()), "config": {"model": saved},
          "data": {"max_images": 3, "image_probs": cfg.data.image_probs}}
  with pytest.raises(ConfigError, match=r"trained on other data: model\.vision\.max_images=3 "
                     r"\(this run: 2\)\. .* Keep --config\.model\.vision\.max_images=3,"):
    checkpoint_config.check_compatible(meta, cfg, "ckpt", 1)
  cfg.model.init_from = "ckpt"  # given, and not read by a resume: the advice says so
  with pytest.raises(ConfigError, match=r"start the new stage in a new run\.workdir \(model\."
                     r"init_from, given, is read by new runs only\)"):
    checkpoint_config.check_compatible(meta, cfg, "ckpt", 1)
  cfg.model.init_from = ""
  v.image_slots, v.slot_patches, v.max_images, v.dim = 16, 4, 3, 48
  cfg.model.layer_norm = "xla"  # how the step computes, not what: free to differ
  assert checkpoint_config.model_differences(saved, cfg) == ["model.vision.dim=32 (this run: 48)"]
  # A step written before encoders had their own section names the same field.
  assert (checkpoint_config.model_differences(old["model"], cfg) ==
          ["model.vision.dim=32 (this run: 48)"])


def test_a_checkpoint_saves_the_paths_of_an_encoder_without_init_from(data_dir, tmp_path):
  """A plug-in encoder's config need not have `init_from` (the toy's has none): the config a
  checkpoint stores, its paths made absolute, leaves that section as it is."""
  cfg = _config(data_dir, (0, 1, 1), (0, 1, 1), (0, 1, 1))
  cfg.model.language.init_from = "runs/a:3"
  saved = run_paths.absolute(cfg)
  assert saved.model.signal == cfg.model.signal
  assert saved.model.language.init_from == f"{os.path.abspath('runs/a')}:3"


def test_a_registered_encoder_s_config_reads_back_typed(data_dir):
  """A config holding the toy encoder (registered by the test, not built in) reads back from its
  JSON form with `model.signal` and `topology.signal` typed, equal to the config written; once
  the encoder is unregistered, the section is one error naming it."""
  cfg = _config(data_dir, (0, 1, 1), (0, 1, 1), (0, 1, 1))
  cfg.model.signal.dim, cfg.topology.signal.remat = 16, "full"
  saved = json.loads(json.dumps(dataclasses.asdict(cfg)))
  again = from_dict(saved)
  assert isinstance(again.model.signal, toy_encoder.SignalConfig) and again == cfg
  encoders.unregister("signal")
  with pytest.raises(ConfigError, match=r"^config\.model\.encoders\.signal: no encoder 'signal' "
                     r"is registered"):
    from_dict(saved)
