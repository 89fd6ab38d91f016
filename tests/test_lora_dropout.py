"""LoRA dropout (`model.language.lora.dropout`, models/lora.py): the adapters' input is dropped in
training only, with masks drawn per sample, position, layer, projection and feature, so every
layout trains the single-device trajectory and a resume the uninterrupted one."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mimo_jax import topology, whole
from mimo_jax.config import ConfigError
from mimo_jax.data import loader
from mimo_jax.models import lora
from mimo_jax.modules import build_modules
from mimo_jax.pipeline import Schedule, Stack
from mimo_jax.step import Step
from tests.helpers import assert_close_trajectory, run_steps
from tests.test_lora import STEPS, lora_config

RATE = 0.3


def dropout_config(data_dir, rate: float = RATE, vision_lora: bool = False, **topo):
  cfg = lora_config(data_dir, vision_lora, **topo)
  cfg.model.language.lora.dropout = rate
  return cfg


@pytest.fixture(scope="module")
def single(data_dir):
  """The single-device run with dropout: (metrics, step, final state, initial parameters)."""
  return run_steps(dropout_config(data_dir), STEPS)


def _masks(seeds, salts=(1,), features=4096):
  return np.stack([np.asarray(lora.Dropout(RATE, seeds).keep(s, features)) for s in salts])


def test_masks_drop_the_rate_and_differ_by_token_layer_and_projection():
  samples = jnp.arange(64, dtype=jnp.int32)[:, None] * jnp.ones((1, 16), jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), (64, 16))
  seeds = lora.token_seeds(0, "language", samples, positions)  # [64 samples, 16 positions]
  layer0, layer1 = (lora._combine(seeds, i) for i in (0, 1))  # pylint: disable=protected-access
  q, k = _masks(layer0, salts=(11, 12))
  dropped = 1 - q.mean()
  # 4M draws: the standard deviation of the fraction is 2.2e-4.
  assert abs(dropped - RATE) < 2e-3, dropped
  # Independent masks agree on p² + (1-p)² of the elements.
  agree = lambda a, b: float(np.mean(a == b))
  same = RATE**2 + (1 - RATE)**2
  assert abs(agree(q, k) - same) < 5e-3  # projections of one layer
  assert abs(agree(q, _masks(layer1, salts=(11,))[0]) - same) < 5e-3  # layers
  assert abs(agree(q[0], q[1]) - same) < 1e-2  # samples (a step's or another step's)
  assert abs(agree(q[:, 0], q[:, 1]) - same) < 1e-2  # positions
  other_seed = _masks(lora._combine(lora.token_seeds(1, "language", samples, positions), 0),
                      (11,))[0]
  assert abs(agree(q, other_seed) - same) < 5e-3  # train.seed
  other_module = _masks(lora._combine(lora.token_seeds(0, "vision", samples, positions), 0),
                        (11,))[0]
  assert abs(agree(q, other_module) - same) < 5e-3  # a module's rows against another's


def test_dropout_scales_what_it_keeps():
  x = jnp.ones((8, 16, 256), jnp.float32)
  seeds = lora.token_seeds(3, "language", jnp.zeros((8, 16), jnp.int32),
                           jnp.zeros((8, 16), jnp.int32) + jnp.arange(16, dtype=jnp.int32))
  y = np.asarray(lora.Dropout(RATE, seeds).apply(x, 5))
  assert set(np.unique(y)) == {0.0, np.float32(1 / (1 - RATE))}
  # bfloat16: each kept value is rounded once; a scale rounded to bfloat16 first (1.109 for
  # 1 / 0.9) would shrink what is kept by 0.16% on average.
  dropout = lora.Dropout(0.1, seeds)
  x = jax.random.uniform(jax.random.key(0), (8, 16, 256), jnp.float32, 1, 2).astype(jnp.bfloat16)
  kept = np.asarray(dropout.keep(5, 256))
  y = np.asarray(dropout.apply(x, 5), np.float64)
  assert abs(y.sum() / np.asarray(x, np.float64)[kept].sum() * 0.9 - 1) < 2e-4


def test_a_resume_may_change_the_rate_not_the_adapters(data_dir):
  """The rate is how a run trains: a checkpoint of another rate is no other model."""
  from dataclasses import asdict
  from mimo_jax.checkpoint_config import model_differences
  saved = asdict(dropout_config(data_dir, rate=0.1).model)
  assert model_differences(saved, dropout_config(data_dir, rate=0.2)) == []
  other = dropout_config(data_dir, rate=0.2)
  other.model.language.lora.rank *= 2
  assert model_differences(saved, other) == ["model.language.lora.rank=4 (this run: 8)"]
  # Without adapters on either side (rank 0) the other lora fields shape nothing.
  none = dropout_config(data_dir, rate=0.1)
  none.model.language.lora.rank = 0
  saved = asdict(none.model)
  none.model.language.lora.alpha *= 2
  none.model.language.lora.targets = "attn/q"
  assert model_differences(saved, none) == []


def test_a_module_with_nothing_to_train_does_not_drop(data_dir):
  """Its tower runs forward only in a split layout; the fused program must not drop there
  either (the same loss on every layout)."""
  cfg = dropout_config(data_dir, vision_lora=True, vision=(0, 1, 1), language=(0, 1, 1))
  cfg.model.vision.lora.dropout = RATE
  assert "vision" in Step.build(cfg).ctx.dropping
  cfg.optim.freeze = "vision_lora,vision_projector"
  assert "vision" not in Step.build(cfg).ctx.dropping


@pytest.mark.parametrize("virtual,name", [(1, ""), (2, ""), (1, "1f1b"), (2, "interleaved_1f1b")])
def test_an_indexed_stack_gives_each_layer_its_index_on_every_stage(virtual, name):
  # What a layer's masks are drawn by: its place in the whole stack, whichever stage and chunk
  # runs it, in the forward and in a schedule's own backward tasks.
  layers, dim = 8, 4
  layer = lambda p, x, index, shift: x + jnp.tanh(x @ p["w"] + shift[..., None] / 4) * (index - 3.5)
  keys = jax.random.split(jax.random.key(0), 3)
  params = {"w": 0.3 * jax.random.normal(keys[0], (layers, dim, dim))}
  x_m = jax.random.normal(keys[1], (4, 2, dim))
  shift_m = jax.random.randint(keys[2], (4, 2), -4, 4)  # integer: 1F1B's side inputs are

  def sequential(p, x_m):
    for i in range(layers):
      x_m = jax.vmap(lambda x, s, i=i: layer(jax.tree.map(lambda a: a[i], p), x, i, s))(
          x_m, shift_m)
    return x_m
  mesh = Mesh(np.array(jax.devices()[:2]).reshape(2, 1, 1), topology.AXES)
  schedule = Schedule(2, virtual, name)
  stack = Stack(layer, mesh, schedule, indexed=True)
  placed = jax.device_put(jax.tree.map(schedule.to_layout, params),
                          NamedSharding(mesh, P(*schedule.stage_spec())))
  loss = lambda out: jnp.sum(out * out)
  want, want_g = jax.value_and_grad(lambda p: loss(sequential(p, x_m)))(params)
  got, g = jax.jit(jax.value_and_grad(lambda p: loss(stack(p, x_m, (shift_m,)))))(placed)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  np.testing.assert_allclose(schedule.from_layout(g["w"]), want_g["w"], rtol=1e-4,
                             atol=1e-5 * float(jnp.max(jnp.abs(want_g["w"]))))


def test_a_bad_rate_is_refused(data_dir):
  for rate in (-0.1, 1.0):
    with pytest.raises(ConfigError, match=r"model\.language\.lora\.dropout.*\[0, 1\)"):
      build_modules(dropout_config(data_dir, rate))
  cfg = dropout_config(data_dir)
  cfg.model.vision.lora.rank, cfg.model.vision.lora.dropout = 2, 0.1
  cfg.model.vision.slot_patches = 8
  with pytest.raises(ConfigError, match=r"model\.vision\.lora\.dropout.*packed a slot"):
    build_modules(cfg)
  from mimo_jax.encoders.audio import AudioConfig  # pylint: disable=import-outside-toplevel
  from mimo_jax.config import ModuleTopology  # pylint: disable=import-outside-toplevel
  cfg = dropout_config(data_dir)
  cfg.add_encoder("audio", AudioConfig(slot_frames=64), ModuleTopology(0, 1, 1))
  cfg.model.audio.lora.rank, cfg.model.audio.lora.dropout = 2, 0.1
  with pytest.raises(ConfigError, match=r"model\.audio\.lora\.dropout.*packed a slot"):
    build_modules(cfg)
  cfg = dropout_config(data_dir)
  cfg.model.language.lora.targets = "attn/q$,head"
  with pytest.raises(ConfigError, match=r"model\.language\.lora\.dropout.*head"):
    build_modules(cfg)["language"].init(0)


def test_dropout_changes_the_adapters_gradients_not_the_first_loss(single, data_dir):
  plain = run_steps(lora_config(data_dir), 2)[0]
  # B = 0 at first: the adapters add nothing whatever their input, so the first loss is equal;
  # B's gradient reads the dropped input (the trained projector's then differs too).
  assert float(single[0][0]["loss"]) == float(plain[0]["loss"])
  for got, want in zip(single[0], plain):
    assert abs(float(got["grad_norm"]) / float(want["grad_norm"]) - 1) > 1e-3


def test_evaluation_does_not_drop(single, data_dir):
  _, step, state, _ = single
  plain = Step.build(lora_config(data_dir))
  batch = loader.train_dataset(step.cfg, loader.build_paths(step.cfg)["train"],
                               step.ctx.groups)[0]
  x = step.place(batch.microbatch(0))
  params = state["language"].params
  one = lambda t: jax.tree.map(lambda a: a[None], t)

  def logits(s, train):
    tokens = s.encode(state, x)
    pos = {n: x.slots[n].pos_rl for n in tokens}
    return np.asarray(jax.jit(lambda p: s.ctx.logits(p, one(x.text), one(tokens), one(pos),
                                                     s.ctx.groups, False, train=train))(params))
  evaluated, trained = logits(step, False), logits(step, True)
  np.testing.assert_array_equal(evaluated, logits(plain, False))
  # Training drops (the adapters have moved from zero), evaluation does not.
  assert np.max(np.abs(trained - evaluated)) > 1e-4
  # Nor the one-piece forward that generation, export and the HF checks run.
  ids = np.asarray(batch.text.tokens_rl[0, :2])
  host = jax.device_get(params)
  np.testing.assert_array_equal(whole.language_logits(step.cfg, host, ids),
                                whole.language_logits(plain.cfg, host, ids))


@pytest.mark.parametrize("topo", [  # split programs with language dp2 (dp2-tp2 holds dp2 alone)
    pytest.param({"vision": (0, 2, 1), "language": (2, 2, 2)}, id="dp2-tp2"),
    pytest.param({"vision": (0, 2, 1), "language": (2, 2, 1, 2)}, id="dp2-pp2"),
    pytest.param({"vision": (0, 2, 1), "language": (2, 4, 1), "shard": "full"}, id="fsdp4"),
])
def test_layout_matches_single_device(data_dir, single, topo):
  topo = dict(topo)
  shard = topo.pop("shard", None)
  cfg = dropout_config(data_dir, **topo)
  if shard:
    cfg.topology.language.shard = shard
  got = run_steps(cfg, STEPS)[0]
  assert_close_trajectory(single[0], got, rtol=1e-4)


def test_1f1b_and_the_fused_program_match_single_device(data_dir, single):
  # 1F1B's backward tasks run each chunk again (pipeline.Stack._backward); the fused program
  # differentiates every module rank by rank in one shard_map.
  cfg = dropout_config(data_dir, vision=(0, 2, 1), language=(2, 2, 1, 2))
  cfg.topology.language.schedule = "1f1b"
  assert_close_trajectory(single[0], run_steps(cfg, STEPS)[0], rtol=1e-4)
  fused = dropout_config(data_dir, vision=(0, 4, 1), language=(0, 4, 1))
  assert Step.build(fused).ctx.mode.fused
  assert_close_trajectory(single[0], run_steps(fused, STEPS)[0], rtol=1e-4)


def test_resume_draws_the_uninterrupted_masks(data_dir, tmp_path):
  from mimo_jax import train  # pylint: disable=import-outside-toplevel
  from tests.test_lora_resume import _cfg, _from_step_2, _losses  # pylint: disable=import-outside-toplevel

  def cfg(workdir):
    c = _cfg(data_dir, workdir, vision=(0, 1, 1), language=(0, 1, 1))
    c.model.language.lora.dropout = RATE
    return c
  full = train.run(cfg(tmp_path / "full"))
  _from_step_2(tmp_path / "full", tmp_path / "resumed")
  got = _losses(train.run(cfg(tmp_path / "resumed")))
  assert sorted(got) == [3, 4] and got == _losses(full, first=3)


def test_a_scope_belongs_to_the_thread_that_opened_it():
  # Programs compile ahead in other threads (precompile.py): one tracing a layer in a scope must
  # not make another thread's program drop.
  import threading  # pylint: disable=import-outside-toplevel
  opened, seen = threading.Event(), []
  release = threading.Event()

  def tracing():
    with lora.scope(lora.Dropout(RATE, jnp.zeros((2, 3), jnp.uint32))):
      opened.set()
      release.wait(10)
  t = threading.Thread(target=tracing)
  t.start()
  opened.wait(10)
  seen.append(list(lora._scopes()))  # pylint: disable=protected-access
  release.set()
  t.join()
  assert seen == [[]]


def test_an_image_row_is_named_by_its_sample_its_place_and_its_patch():
  from mimo_jax.encoders import vision  # pylint: disable=import-outside-toplevel
  owners = jnp.array([5, 5, 7, 5, -1], jnp.int32)[:, None] * jnp.ones((1, 4), jnp.int32)
  ids, positions = vision._image_rows({}, owners, rows=3)  # pylint: disable=protected-access
  np.testing.assert_array_equal(ids[:, 0], [5, 5, 7, 5, -1])
  np.testing.assert_array_equal(positions, [[0, 1, 2], [3, 4, 5], [0, 1, 2], [6, 7, 8], [0, 1, 2]])


def _tower_config(data_dir, **topo):
  cfg = dropout_config(data_dir, vision_lora=True, **topo)
  cfg.model.vision.lora.dropout = 0.2
  return cfg


def test_tower_dropout_matches_single_device(data_dir):
  # One image a slot: a tower row is named by its sample, the image's place among the sample's
  # images and the patch (encoders/vision.py), wherever the slot lies.
  single = run_steps(_tower_config(data_dir), STEPS)[0]
  no_tower_dropout = run_steps(dropout_config(data_dir, vision_lora=True), 1)[0]
  assert abs(float(single[0]["grad_norm"]) / float(no_tower_dropout[0]["grad_norm"]) - 1) > 1e-3
  fused = _tower_config(data_dir, vision=(0, 4, 1), language=(0, 4, 1))
  assert Step.build(fused).ctx.mode.fused
  assert_close_trajectory(single, run_steps(fused, STEPS)[0], rtol=1e-4)
  # (The tower's split programs: test_audio_dropout_matches_single_device's.)


def test_audio_dropout_matches_single_device(data_dir):
  # A clip a slot: a window position is named by its sample, the clip's place among the
  # sample's clips, the window and the position (encoders/audio.py); here with the tower in two
  # pipeline stages beside a language model of four dp ranks.
  from tests.test_audio_parity import LAYOUTS, _batches, _config  # pylint: disable=import-outside-toplevel

  def cfg(rate, **layout):
    c = _config(data_dir, **layout)
    c.model.audio.lora.rank, c.model.audio.lora.dropout = 2, rate
    c.optim.freeze = "vision,vision_projector,audio_projector,language"  # adapters alone train
    return c
  one = dict(vision=(0, 1, 1), audio=(0, 1, 1), language=(0, 1, 1))
  single = cfg(0.2, **one)
  ref = run_steps(single, STEPS, batches=_batches(single))[0]
  plain = cfg(0.0, **one)
  undropped = run_steps(plain, STEPS, batches=_batches(plain))[0]
  # Far beyond the parity's tolerance once the adapters have moved.
  assert max(abs(float(a["grad_norm"]) / float(b["grad_norm"]) - 1)
             for a, b in zip(ref, undropped)) > 1e-2
  piped = cfg(0.2, **LAYOUTS["fan_out_pp"])
  assert_close_trajectory(ref, run_steps(piped, STEPS, batches=_batches(piped))[0], rtol=1e-4)
