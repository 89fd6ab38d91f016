"""Pipeline parallelism (pipeline.py): the schedules against a plain loop, and the training step
with pipelined modules against the single-device run (docs/architecture.md, Numerics)."""

import dataclasses
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mimo_jax import topology
from mimo_jax.config import ConfigError
from mimo_jax.pipeline import Schedule, Stack
from mimo_jax.step import Step
from mimo_jax.validation import validate
from tests.helpers import assert_close_trajectory, run_steps, tiny_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAYERS, DIM, HIDDEN, BATCH = 8, 16, 32, 8


def _layer(p, x, shift):
  return x + jnp.tanh(x @ p["up"] + shift[..., None]) @ p["down"]


def _sequential(params, x_m, shift_m):
  def one(x, shift):
    for i in range(LAYERS):
      x = _layer(jax.tree.map(lambda a, i=i: a[i], params), x, shift)
    return x
  return jax.vmap(one)(x_m, shift_m)


@pytest.mark.parametrize("pp,dp,tp,virtual,micro,remat", [
    (1, 2, 2, 1, 4, "none"),
    (2, 2, 2, 1, 4, "none"),
    (4, 2, 1, 1, 5, "full"),
    (2, 2, 2, 2, 4, "dots"),
    (4, 1, 2, 2, 6, "none"),
    (2, 2, 2, 4, 2, "full"),
    (4, 2, 1, 1, 2, "none"),  # fewer microbatches than stages: padded (evaluation)
])
def test_schedule_matches_sequential_layers(pp, dp, tp, virtual, micro, remat):
  mesh = Mesh(np.array(jax.devices()[:pp * dp * tp]).reshape(pp, dp, tp), topology.AXES)
  schedule = Schedule(pp, virtual)
  keys = jax.random.split(jax.random.key(0), 4)
  params = {"up": 0.3 * jax.random.normal(keys[0], (LAYERS, DIM, HIDDEN)),
            "down": 0.3 * jax.random.normal(keys[1], (LAYERS, HIDDEN, DIM))}
  x_m = jax.random.normal(keys[2], (micro, BATCH, DIM))
  shift_m = jax.random.normal(keys[3], (micro, BATCH))
  stack = Stack(_layer, mesh, schedule, remat)
  lead = schedule.stage_spec()
  placed = jax.device_put(jax.tree.map(schedule.to_layout, params), {
      "up": NamedSharding(mesh, P(*lead, None, "tp")),
      "down": NamedSharding(mesh, P(*lead, "tp", None))})
  x_on = jax.device_put(x_m, NamedSharding(mesh, P(None, "dp")))

  loss = lambda out: jnp.sum(jnp.sin(out))
  want, (want_gp, want_gx) = jax.value_and_grad(
      lambda p, x: loss(_sequential(p, x, shift_m)), argnums=(0, 1))(params, x_m)
  got, (gp, gx) = jax.jit(jax.value_and_grad(
      lambda p, x: loss(stack(p, x, (shift_m,))), argnums=(0, 1)))(placed, x_on)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  gp = jax.tree.map(schedule.from_layout, gp)
  for a, b in zip(jax.tree.leaves((want_gp, want_gx)), jax.tree.leaves((gp, gx))):
    np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5 * float(jnp.max(jnp.abs(a))))


def test_bubble_formula():
  assert Schedule(4, 1).bubble(4) == pytest.approx(3 / 7)
  assert Schedule(4, 2).bubble(4) == pytest.approx(3 / 11)
  assert Schedule(1, 1).bubble(8) == 0


# ---- the training step -----------------------------------------------------------------------

STEPS = 4


def _deep(data_dir, microbatches=4, language_layers=4, **topo):
  """The tiny config with 4 layers per module (or `language_layers`), so that 2 and 4 stages
  (and 2x2 chunks) fit."""
  cfg = tiny_config(data_dir, **topo)
  cfg.model.vision.layers, cfg.model.language.layers = 4, language_layers
  cfg.data.microbatches = microbatches
  return cfg


@pytest.fixture(scope="module")
def reference(data_dir):
  return run_steps(_deep(data_dir, vision=(0, 1, 1), language=(0, 1, 1)), STEPS)[0]


@pytest.mark.parametrize("topo,remat", [
    pytest.param({"vision": (0, 1, 1), "language": (1, 1, 1, 2)}, None, id="language-pp2"),
    pytest.param({"vision": (0, 1, 1, 2), "language": (2, 1, 2, 2)}, ("full", "dots"),
                 id="vision-pp2-to-language-pp2tp2-remat-full-dots"),
    pytest.param({"vision": (0, 1, 1), "language": (1, 1, 1, 2, 2)}, None,
                 id="language-circular-v2"),
    pytest.param({"vision": (0, 2, 1, 2), "language": (0, 2, 1, 2, 2)},
                 ("dots_attention", "full"), id="colocated-dp2pp2-circular-remat-dots_attn"),
])
def test_pipelined_step_matches_single_device(data_dir, reference, topo, remat):
  """With each remat policy of the vision and language stages too (on CPUs attention is XLA's,
  which dots_attention recomputes as dots does; on GPUs it also keeps cuDNN's attention outputs).
  (Four GPipe stages: test_interleaved_pp4tp2_run_resumes_onto_gpipe's second half.)"""
  cfg = _deep(data_dir, **topo)
  if remat:
    cfg.topology.vision.remat, cfg.topology.language.remat = remat
  assert_close_trajectory(reference, run_steps(cfg, STEPS)[0], rtol=1e-4)


def test_circular_layout_is_canonical_in_checkpoints(data_dir):
  """A circular-schedule state converts to the same [layers, ...] arrays a pp=1 run holds, and
  back; checkpoints hold that form, so they restore onto any pipeline layout.

  Bit for bit across two layouts' programs, so in a process under XLA's default CPU emitters:
  the classic ones that conftest.py picks to compile faster round the initializer of one layout's
  program an ulp apart from the other's (172 of 4096 elements)."""
  flags = os.environ.get("XLA_FLAGS", "").replace("--xla_cpu_use_fusion_emitters=false", "")
  code = ("import jax; jax.config.update('jax_num_cpu_devices', 8); "
          "from tests.test_pipeline import circular_layout_is_canonical as check; "
          f"check({data_dir!r})")
  proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                        env=dict(os.environ, XLA_FLAGS=flags), timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]


def circular_layout_is_canonical(data_dir):
  """test_circular_layout_is_canonical_in_checkpoints, in its own process."""
  assert len(jax.devices()) == 8

  def stepper(**topo):
    cfg = _deep(data_dir, **topo)
    return Step.build(cfg)
  circular = stepper(vision=(0, 1, 1, 2, 2), language=(4, 1, 1, 2, 2))
  plain = stepper(vision=(0, 1, 1), language=(0, 1, 1))
  state = circular.init_state(0)
  blocks = state["language"].params["blocks"]["attn"]["q"]["kernel"]
  assert blocks.shape[:2] == (2, 2)  # [virtual, layers / virtual, ...]
  canonical = circular.canonical(state)
  want = plain.init_state(0)
  for name in want:
    for a, b in zip(jax.tree.leaves(want[name].params), jax.tree.leaves(canonical[name].params)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  back = circular.from_canonical(canonical)
  for a, b in zip(jax.tree.leaves(state["language"].opt_state),
                  jax.tree.leaves(back["language"].opt_state)):
    assert a.sharding == b.sharding
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("change,field", [
    (lambda c: setattr(c.topology.language, "pp", 3), "config.topology.language.pp"),
    (lambda c: setattr(c.data, "microbatches", 2), "config.data.microbatches"),
    (lambda c: setattr(c.topology.vision, "virtual", 2), "config.topology.vision.virtual"),
    (lambda c: setattr(c.topology.language, "remat", "some"), "config.topology.language.remat"),
    (lambda c: setattr(c.topology.language, "virtual", 0), "config.topology.language.virtual"),
])
def test_invalid_pipeline_configs(data_dir, change, field):
  cfg = _deep(data_dir, vision=(0, 1, 1), language=(1, 1, 1, 4))
  change(cfg)
  with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
    validate(cfg, 8)


def test_checkpoint_moves_between_pipeline_layouts(data_dir, tmp_path):
  """Saved from a circular two-stage run, restored onto one device, and back: same arrays."""
  from mimo_jax import checkpoint

  def stepper(**topo):
    cfg = _deep(data_dir, **topo)
    return cfg, Step.build(cfg)
  cfg_c, circular = stepper(vision=(0, 2, 1, 2, 2), language=(4, 1, 2, 2, 2))
  cfg_p, plain = stepper(vision=(0, 1, 1), language=(0, 1, 1))
  state = run_steps(cfg_c, 2)[2]  # trained a little: optimizer moments are not zero
  ckpt = checkpoint.Checkpointer(str(tmp_path / "a"), list(circular.modules))
  ckpt.save(2, circular.canonical(state), cfg_c, force=True)
  ckpt.wait()
  restored, _ = ckpt.restore(2, plain.abstract_state(canonical=True), cfg_p)
  on_one = plain.from_canonical(restored)
  ckpt.save(3, plain.canonical(on_one), cfg_p, force=True)
  ckpt.close()
  again = circular.from_canonical(checkpoint.Checkpointer(str(tmp_path / "a"), list(
      circular.modules)).restore(3, circular.abstract_state(canonical=True), cfg_c)[0])
  for name in state:
    for a, b in zip(jax.tree.leaves((state[name].params, state[name].opt_state)),
                    jax.tree.leaves((again[name].params, again[name].opt_state))):
      assert a.shape == b.shape and a.sharding == b.sharding
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  q = on_one["language"].params["blocks"]["attn"]["q"]["kernel"]
  assert q.shape[0] == 4 and len(q.sharding.device_set) == 1


def test_bfloat16_pipeline_on_cpu_is_a_clear_error(data_dir):
  from mimo_jax.validation import validate_backend
  cfg = _deep(data_dir, vision=(0, 1, 1), language=(1, 1, 1, 2))
  cfg.model.dtype = "bfloat16"
  with pytest.raises(ConfigError, match=r"config\.model\.dtype: .*language pp > 1"):
    validate_backend(cfg, "cpu")
  validate_backend(cfg, "gpu")
  cfg.topology.language.pp = 1
  validate_backend(cfg, "cpu")


# ---- schedules with backward tasks (1f1b, interleaved_1f1b) -----------------------------------

def _scheduled(data_dir, schedules: dict, shard: dict | None = None, language_layers=4, **topo):
  cfg = _deep(data_dir, language_layers=language_layers, **topo)
  for name, schedule in schedules.items():
    cfg.topology.module(name).schedule = schedule
  for name, mode in (shard or {}).items():
    cfg.topology.module(name).shard = mode
  return cfg


@pytest.mark.parametrize("topo,schedules,shard", [
    pytest.param({"vision": (0, 8, 1), "language": (0, 1, 2, 4)}, {"language": "1f1b"}, None,
                 id="language-pp4tp2-1f1b"),
    pytest.param({"vision": (0, 1, 1, 2, 2), "language": (2, 1, 1, 2)},
                 {"vision": "interleaved_1f1b", "language": "1f1b"}, None,
                 id="vision-pp2-interleaved-language-pp2-1f1b"),
    pytest.param({"vision": (0, 2, 1, 2), "language": (4, 2, 1, 2, 2)},
                 {"vision": "1f1b", "language": "interleaved_1f1b"},
                 {"vision": "full", "language": "full"},
                 id="fsdp-vision-dp2pp2-1f1b-language-dp2pp2-interleaved"),
])
def test_1f1b_step_matches_single_device(data_dir, reference, topo, schedules, shard):
  got = run_steps(_scheduled(data_dir, schedules, shard, **topo), STEPS)[0]
  assert_close_trajectory(reference, got, rtol=1e-4)


@pytest.fixture(scope="module")
def reference_8(data_dir):
  """The single-device trajectory with 8 language layers: 4 stages of 2 chunks."""
  return run_steps(_deep(data_dir, language_layers=8, vision=(0, 1, 1), language=(0, 1, 1)),
                   STEPS)[0]


def test_interleaved_pp4tp2_run_resumes_onto_gpipe(data_dir, reference_8, tmp_path):
  """The language model on 4 stages of 2 chunks with tp2 under interleaved 1F1B: the
  single-device trajectory for four steps; saved after two and restored onto GPipe (one chunk a
  stage: another layout), the two after that again (a checkpoint holds no schedule)."""
  from mimo_jax import checkpoint
  from mimo_jax.data import loader
  topo = {"vision": (0, 8, 1), "language_layers": 8}
  cfg_a = _scheduled(data_dir, {"language": "interleaved_1f1b"}, language=(0, 1, 2, 4, 2), **topo)
  first, step_a, state, _ = run_steps(cfg_a, 2)
  ckpt = checkpoint.Checkpointer(str(tmp_path / "a"), list(step_a.modules), async_save=False)
  ckpt.save(2, step_a.canonical(state), cfg_a, force=True)
  ckpt.close()

  def rest(cfg, step, state):
    ds = loader.train_dataset(cfg, loader.build_paths(cfg)["train"], step.ctx.groups)
    out = []
    for s in range(2, STEPS):
      state, metrics = step.train_step(state, ds[s])
      out.append(jax.device_get(metrics))
    return out
  assert_close_trajectory(reference_8, first + rest(cfg_a, step_a, state), rtol=1e-4)
  cfg_b = _scheduled(data_dir, {}, language=(0, 1, 2, 4), **topo)
  validate(cfg_b, len(jax.devices()))
  step_b = Step.build(cfg_b)
  restored, _ = checkpoint.Checkpointer(str(tmp_path / "a"), list(step_b.modules),
                                        read_only=True).restore(
      2, step_b.abstract_state(canonical=True), cfg_b)
  assert_close_trajectory(reference_8, first + rest(cfg_b, step_b, step_b.from_canonical(restored)),
                          rtol=1e-4)


@pytest.mark.parametrize("change,field,words", [
    (lambda t: setattr(t, "schedule", "zb"), "topology.language.schedule", "unknown pipeline"),
    (lambda t: setattr(t, "virtual", 2), "topology.language.virtual", "schedule=interleaved_1f1b"),
    (lambda t: (setattr(t, "virtual", 2), setattr(t, "schedule", "interleaved_1f1b"),
                setattr(t, "pp", 3)), "data.microbatches", "multiple of 3"),
    (lambda t: (setattr(t, "schedule", "interleaved_1f1b")), "topology.language.virtual",
     "schedule=1f1b"),
    (lambda t: setattr(t, "pp", 1), "topology.language.schedule", "needs pipeline stages"),
])
def test_invalid_schedules(data_dir, change, field, words):
  cfg = _scheduled(data_dir, {"language": "1f1b"}, vision=(0, 1, 1), language=(1, 1, 1, 4))
  validate(cfg, 8)  # 1f1b on 4 stages, 4 microbatches
  change(cfg.topology.language)
  with pytest.raises(ConfigError, match=field.replace(".", r"\.") + ".*" + words):
    validate(cfg, 8)


def test_the_language_steps_memory_under_1f1b_is_at_most_pp_over_m_of_gpipes(tmp_path):
  """XLA's memory analysis of the language model's compiled step (a device: one stage), p=4,
  M=8, two layers a stage, a vocabulary of 4096: GPipe (remat none) keeps every microbatch's
  internals; 1F1B under remat=full a stage's chunk inputs in flight and one chunk's internals,
  and the head takes the stack's outputs a microbatch at a time under both (inside 1F1B's
  schedule), so that no schedule keeps every microbatch's logits. On CPUs, where every stage runs
  the step's kind of task, 1F1B's temporaries are 0.34 of GPipe's (7,696,208 against 22,831,080
  bytes); at most p/M. (Under remat=none there its forwards' residuals for up to 2p − 1
  microbatches come to 0.99 of GPipe's, 22,535,392 bytes.)"""
  from mimo_jax.data import loader
  p, m = 4, 8

  def temporaries(schedule: str) -> int:
    cfg = _deep(str(tmp_path), microbatches=m, language_layers=8, vision=(0, 1, 1),
                language=(1, 1, 1, p))
    cfg.topology.language.schedule = schedule
    cfg.topology.language.remat = "full" if schedule == "1f1b" else "none"
    cfg.data.task, cfg.model.language.vocab_size = "synthetic", 4096
    validate(cfg, len(jax.devices()))
    step = Step.build(cfg)
    batch = loader.train_dataset(cfg, loader.build_paths(cfg)["train"], step.ctx.groups)[0]
    program, seen = step.programs.language_step, []

    def capture(*args):
      seen.append(program.lower(*args).compile().memory_analysis().temp_size_in_bytes)
      return program(*args)
    step.programs = dataclasses.replace(step.programs, language_step=capture)
    step.train_step(step.init_state(0), batch)
    return seen[0]
  gpipe, one_f_one_b = temporaries("gpipe"), temporaries("1f1b")
  assert 0 < one_f_one_b <= p / m * gpipe, (one_f_one_b, gpipe)


def test_memory_check_counts_each_schedules_microbatches_in_flight(data_dir):
  from mimo_jax import memory
  cfg = _deep(data_dir, microbatches=8, vision=(0, 1, 1), language=(1, 1, 1, 4))
  gpipe = memory.module_bytes(cfg)["language"]["activations"]
  assert memory.in_flight(cfg, "language") == (8, 0)
  cfg.topology.language.schedule = "1f1b"
  internals, inputs = memory.in_flight(cfg, "language")  # phased: at most 2p - 1 in flight
  assert 1 < internals <= 2 * 4 and 0 < inputs <= 2 * 4 - 1
  cfg.topology.language.remat = "full"  # a backward runs its chunk again: one chunk's internals
  assert memory.in_flight(cfg, "language")[0] == 1
  cfg.topology.language.remat = "none"
  assert memory.module_bytes(cfg)["language"]["activations"] < gpipe
  cfg.topology.language.pp = 1
  cfg.topology.language.schedule = ""
  assert memory.in_flight(cfg, "language") == (1, 0)
