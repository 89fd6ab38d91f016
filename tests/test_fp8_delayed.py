"""FP8 delayed scaling (model.<module>.fp8_scaling=delayed, mimo_jax/models/fp8.py): the op against
current scaling, saturation, the histories rolling over steps, training against bfloat16 and
current scaling, parity of dp and microbatches with one device, and resume."""

import pathlib
import shutil

import jax
import jax.extend.core as jax_core
import jax.numpy as jnp
import numpy as np
import pytest

from mimo_jax import optim, train
from mimo_jax.config import ConfigError
from mimo_jax.checkpoint_reader import Reader
from mimo_jax.models import fp8
from mimo_jax.trees import paths
from mimo_jax.validation import validate
from tests import helpers
from tests.helpers import run_steps, tiny_config

DN = (((2,), (0,)), ((), ()))
H = 4


def _operands():
  x = (jax.random.normal(jax.random.key(0), (2, 16, 64)) * 3).astype(jnp.bfloat16)
  ws = [(jax.random.normal(jax.random.key(i), (64, n)) * 64**-0.5).astype(jnp.bfloat16)
        for i, n in ((1, 32), (2, 48))]
  gs = [jax.random.normal(jax.random.key(3 + i), (2, 16, w.shape[1])) * 1e-3
        for i, w in enumerate(ws)]
  return x, ws, gs


def _history(amax, older=(0.5, 0.25)) -> jax.Array:
  """A history whose maximum is `amax` (newest), smaller entries behind it."""
  h = np.zeros(H, np.float32)
  h[0] = amax
  h[1:1 + len(older)] = [amax * o for o in older]
  return jnp.asarray(h)


def _amax(a) -> float:
  return float(jnp.max(jnp.abs(a.astype(jnp.float32))))


def _loss(ys, gs):
  return sum(jnp.sum(y.astype(jnp.float32) * g) for y, g in zip(ys, gs))


def _delayed_value_and_grads(x, ws, xh, gh, gs):
  f = lambda x, ws, xh, gh: _loss(fp8.delayed_matmuls(x, ws, xh, gh), gs)
  return jax.jit(jax.value_and_grad(f, (0, 1, 2, 3)))(x, ws, xh, gh)


def test_delayed_equals_current_when_the_history_holds_the_operands_abs_max():
  x, ws, gs = _operands()
  # The cotangent each result receives is g in the result's dtype (bfloat16).
  g_amax = [_amax(g.astype(jnp.bfloat16)) for g in gs]
  xh = [_history(_amax(x))] * len(ws)
  gh = [_history(a) for a in g_amax]
  current = lambda x, ws: _loss(fp8.matmuls(x, ws), gs)
  want_loss, want = jax.jit(jax.value_and_grad(current, (0, 1)))(x, ws)
  got_loss, got = _delayed_value_and_grads(x, ws, xh, gh, gs)
  for a, b in zip(fp8.delayed_matmuls(x, ws, xh, gh), fp8.matmuls(x, ws)):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  assert float(got_loss) == float(want_loss)
  for a, b in zip(jax.tree.leaves(got[:2]), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  # The histories' gradients are the abs-maxes this call saw, newest slot only.
  for h in got[2]:
    np.testing.assert_array_equal(np.asarray(h), [_amax(x), 0, 0, 0])
  for h, a in zip(got[3], g_amax):
    np.testing.assert_array_equal(np.asarray(h), [a, 0, 0, 0])


def test_a_history_below_the_operand_saturates_without_nan():
  x, ws, gs = _operands()
  small = 1 / 64  # every history a 64th of its operand's abs-max: most values beyond the range
  xh = [_history(_amax(x) * small)] * len(ws)
  gh = [_history(_amax(g) * small) for g in gs]
  ys = fp8.delayed_matmuls(x, ws, xh, gh)
  _, grads = _delayed_value_and_grads(x, ws, xh, gh, gs)
  for a in list(ys) + jax.tree.leaves(grads):
    assert bool(jnp.all(jnp.isfinite(a.astype(jnp.float32))))
  # The input saturates at the FP8 maximum times its scale: the products are those of x clipped.
  top = float(jnp.finfo(fp8.FORWARD).max)
  scale = float(fp8.history_scale(xh, fp8.FORWARD))
  assert _amax(x) > 4 * top * scale
  clipped = jnp.clip(x.astype(jnp.float32), -top * scale, top * scale)
  for y, w in zip(ys, ws):
    exact_clipped = jax.lax.dot_general(clipped, w.astype(jnp.float32), DN)
    exact = jax.lax.dot_general(x.astype(jnp.float32), w.astype(jnp.float32), DN)
    rel = lambda a, b: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
    assert rel(y.astype(jnp.float32), exact_clipped) < 0.06  # FP8 rounding of clipped values
    assert rel(y.astype(jnp.float32), exact) > 0.3  # far from the unclipped product


def test_an_empty_history_casts_at_scale_one():
  x, ws, gs = _operands()
  zeros = [jnp.zeros(H)] * len(ws)
  ys = fp8.delayed_matmuls(x, ws, zeros, zeros)
  assert float(fp8.history_scale(zeros, fp8.FORWARD)) == 1.0
  for y, w in zip(ys, ws):
    qw, sw = fp8.quantize(w, fp8.FORWARD)
    qx = x.astype(jnp.float32).astype(fp8.FORWARD)  # |x| < 448: nothing to clip at scale 1
    want = jax.lax.dot_general(qx, qw, DN, preferred_element_type=jnp.bfloat16) * sw.astype(
        jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(want, np.float32))


def _activation_reductions(eqn) -> bool:
  """Whether `eqn` (or a jaxpr it calls) takes an abs-max over an operand of rank > 1."""
  if eqn.primitive.name == "reduce_max" and eqn.invars[0].aval.ndim > 1:
    return True
  return any(_activation_reductions(e) for j in jax_core.jaxprs_in_params(eqn.params)
             for e in j.eqns)


def _casts_waiting_on_a_reduction(fn, *args) -> dict[str, bool]:
  """For each cast of an input or gradient [2, 16, n] to FP8 in `fn`'s jaxpr: whether an abs-max
  over a whole activation-sized operand is among what it depends on."""
  jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
  made_by = {v: e for e in jaxpr.eqns for v in e.outvars}

  def waits(eqn, seen) -> bool:
    if id(eqn) in seen:
      return False
    seen.add(id(eqn))
    return _activation_reductions(eqn) or any(
        waits(made_by[v], seen) for v in eqn.invars
        if not isinstance(v, jax_core.Literal) and v in made_by)
  return {f"{e.params['new_dtype']}{e.outvars[0].aval.shape}": waits(e, set())
          for e in jaxpr.eqns if e.primitive.name == "convert_element_type"
          and jnp.dtype(e.params["new_dtype"]) in (fp8.FORWARD, fp8.BACKWARD)
          and e.outvars[0].aval.ndim == 3}


def test_delayed_casts_wait_on_no_reduction():
  """What delayed scaling is for: an input's and a gradient's cast depend on their histories
  alone, so XLA may fuse them into the kernels producing their operands. Under current scaling
  each waits for its operand's abs-max."""
  x, ws, gs = _operands()
  hs = [jnp.ones(H)] * len(ws)
  delayed = lambda x, ws: _loss(fp8.delayed_matmuls(x, ws, hs, hs), gs)
  current = lambda x, ws: _loss(fp8.matmuls(x, ws), gs)
  for fn, want in ((delayed, False), (current, True)):
    casts = _casts_waiting_on_a_reduction(jax.grad(fn, (0, 1)), x, ws)
    # The input (e4m3, once for both kernels) and each result's incoming gradient (e5m2).
    assert sorted(casts) == ["float8_e4m3fn(2, 16, 64)", "float8_e5m2(2, 16, 32)",
                             "float8_e5m2(2, 16, 48)"], casts
    assert all(w == want for w in casts.values()), casts


def test_histories_roll_in_each_steps_abs_max():
  """Steps of a matmul whose operands grow: after N of them each history holds their abs-maxes,
  newest first (optim.roll_histories' rule), and entries older than H steps are gone."""
  x, ws, gs = _operands()
  xh, gh = [jnp.zeros(H)] * len(ws), [jnp.zeros(H)] * len(ws)
  seen_x, seen_g = [], [[] for _ in ws]
  for step in range(H + 2):
    f = 1.5**step
    xs, gss = (x * f).astype(jnp.bfloat16), [g * f for g in gs]
    _, grads = _delayed_value_and_grads(xs, ws, xh, gh, gss)
    xh = [fp8.roll(h, r) for h, r in zip(xh, grads[2])]
    gh = [fp8.roll(h, r) for h, r in zip(gh, grads[3])]
    seen_x.insert(0, _amax(xs))
    for s, g in zip(seen_g, gss):
      s.insert(0, _amax(g.astype(jnp.bfloat16)))
  for h in xh:
    np.testing.assert_array_equal(np.asarray(h), np.float32(seen_x[:H]))
  for h, s in zip(gh, seen_g):
    np.testing.assert_array_equal(np.asarray(h), np.float32(s[:H]))


# ---- training ---------------------------------------------------------------------------------

STEPS, HISTORY = 4, 3  # a history shorter than the run: its oldest entry leaves
SINGLE = {"vision": (0, 1, 1), "language": (0, 1, 1)}


def _cfg(data_dir, workdir=None, fp8_on=True, **topo):
  cfg = tiny_config(data_dir, **(topo or SINGLE))
  cfg.model.dtype = "bfloat16"
  for name in ("vision", "language"):
    section = cfg.model.module(name)
    section.fp8 = fp8_on
    section.fp8_scaling, section.fp8_history = ("delayed", HISTORY) if fp8_on else ("current", 16)
  if workdir is not None:
    cfg.checkpoint.every, cfg.checkpoint.keep = 1, 10
    cfg.run.workdir, cfg.run.log_every = str(workdir), 1
    cfg.eval.samples = 16
  return cfg


def _histories(flat: dict) -> dict[str, np.ndarray]:
  """The abs-max histories of flat parameters (`module/path` -> array)."""
  return {k: np.asarray(v) for k, v in flat.items() if fp8.is_history(k)}


def _flat(state: dict) -> dict[str, np.ndarray]:
  return {f"{n}/{k}": v for n, s in state.items()
          for k, v in paths(jax.device_get(s.params)).items()}


def _saved(workdir, step: int) -> dict[str, np.ndarray]:
  reader = Reader(str(workdir))
  try:
    return _histories(reader.params(step, reader.meta(step)))
  finally:
    reader.close()


def _losses(records) -> dict[int, float]:
  return {r["step"]: r["loss"] for r in records if "loss" in r}


@pytest.fixture(scope="module")
def full_run(data_dir, tmp_path_factory):
  """A delayed-scaling run on one device with a checkpoint every step: (workdir, records)."""
  workdir = tmp_path_factory.mktemp("delayed")
  return workdir, train.run(_cfg(data_dir, workdir))


def test_each_history_holds_the_last_steps_abs_maxes(full_run):
  workdir, _ = full_run
  saved = [_saved(workdir, s) for s in range(1, STEPS + 1)]
  # Every FP8 matmul's input and incoming gradient, in both modules' stacked blocks [L, H].
  assert {k.split("/")[0] for k in saved[0]} == {"vision", "language"}
  assert len(saved[0]) == 2 * (7 + 6)  # q, k, v, o and the MLP's (SwiGLU 3, GeluMLP 2) each
  for key in saved[0]:
    for step, h in enumerate((s[key] for s in saved), start=1):
      assert h.shape[-1] == HISTORY and h.dtype == np.float32
      assert np.all(h[..., :min(step, HISTORY)] > 0), (key, step, h)  # a value each step
      assert np.all(h[..., step:] == 0), (key, step, h)  # nothing before the first step
      if step > 1:  # rolled by one: the previous step's history behind the newest abs-max
        np.testing.assert_array_equal(h[..., 1:], saved[step - 2][key][..., :-1], err_msg=key)
  grads = [saved[-1][k] for k in saved[-1] if k.endswith(fp8.GRAD_HISTORY)]
  inputs = [saved[-1][k] for k in saved[-1] if k.endswith(fp8.INPUT_HISTORY)]
  assert max(float(g.max()) for g in grads) < 0.1 < min(float(x.min()) for x in inputs)


def test_training_with_delayed_scaling_tracks_bfloat16(data_dir, full_run, bf16_reference):
  losses = np.array(list(_losses(full_run[1]).values()))
  # The bfloat16 run of _cfg(fp8_on=False), trained once a session (conftest.py).
  assert _cfg(data_dir, fp8_on=False) == helpers.bf16_config(data_dir)
  bf16 = np.array([m["loss"] for m in bf16_reference])
  assert len(losses) == STEPS and not np.array_equal(losses, bf16)  # really in FP8
  np.testing.assert_allclose(losses, bf16, rtol=1e-2)
  assert losses[-1] < losses[0]


def _float32_steps(data_dir, topo: dict, shard: str = "none"
                   ) -> tuple[list[float], dict[str, np.ndarray]]:
  """Losses and final histories of delayed FP8 matmuls computing in float32. Validation refuses
  FP8 beside float32 (FP8 stands in for bfloat16 GEMMs), but the op runs there: in bfloat16 the
  rounding of another row layout moves abs-maxes by several percent (measured: up to 9% after one
  step), which would hide a wrong combination; float32 isolates the plumbing."""
  cfg = _cfg(data_dir, **topo)
  cfg.model.dtype = "float32"
  for name in topo:
    cfg.topology.module(name).shard = shard
    cfg.model.module(name).fp8_history = 4  # a length dp divides: FSDP could split it
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(helpers, "validate", lambda *_: None)
    got, _, state, _ = run_steps(cfg, STEPS)
  for name, s in state.items():  # whole on every device, never split over dp or tp
    for path, leaf in paths(s.params).items():
      assert not fp8.is_history(path) or leaf.sharding.is_fully_replicated, (name, path)
  return [float(m["loss"]) for m in got], _histories(_flat(state))


@pytest.fixture(scope="module")
def float32_single(data_dir):
  return _float32_steps(data_dir, SINGLE)


@pytest.mark.parametrize("topo,shard", [
    ({"vision": (0, 2, 1), "language": (0, 2, 1)}, "none"),  # one program a microbatch, per rank
    ({"vision": (0, 2, 1), "language": (2, 2, 1)}, "none"),  # each module's own programs
    # FSDP and tp: gradients made in global-view programs, the histories kept whole.
    ({"vision": (0, 2, 1), "language": (2, 2, 2)}, "full"),
], ids=["fused_dp2", "split_dp2", "fsdp_tp2"])
def test_data_parallel_and_microbatches_give_the_single_device_run(data_dir, float32_single, topo,
                                                                   shard):
  """Two microbatches a step on two dp ranks: the recorded abs-maxes are combined by maximum
  over microbatches and ranks, so losses and histories are the one-device run's (test_parity's
  float32 tolerance; a sum instead of a maximum would double them)."""
  want_losses, want = float32_single
  losses, hist = _float32_steps(data_dir, topo, shard)
  assert sorted(hist) == sorted(want)
  for k, h in hist.items():
    assert np.all(h > 0), k
    np.testing.assert_allclose(h, want[k], rtol=1e-5, err_msg=k)
  np.testing.assert_allclose(losses, want_losses, rtol=1e-5)


def test_resume_continues_exactly(data_dir, full_run, tmp_path):
  workdir, records = full_run
  shutil.copytree(workdir / "checkpoints", tmp_path / "checkpoints")
  for d in (tmp_path / "checkpoints").iterdir():
    if d.name.isdigit() and int(d.name) > 2:
      shutil.rmtree(d)
  resumed = train.run(_cfg(data_dir, tmp_path))
  got, want = _losses(resumed), _losses(records)
  assert sorted(got) == [3, 4]
  assert all(got[s] == want[s] for s in got)  # bitwise
  for k, h in _saved(tmp_path, STEPS).items():
    np.testing.assert_array_equal(h, _saved(workdir, STEPS)[k], err_msg=k)


@pytest.mark.parametrize("change,field,words", [
    (lambda c: setattr(c.model.language, "fp8_scaling", "late"), "fp8_scaling", "current or"),
    (lambda c: setattr(c.model.vision, "fp8_history", 0), "fp8_history", ">= 1"),
    (lambda c: setattr(c.model.language, "fp8", False), "fp8_scaling", "fp8=true"),
    (lambda c: setattr(c.topology.language, "pp", 2), "fp8_scaling", "pipelined"),
    (lambda c: setattr(c.optim, "freeze", "vision"), "fp8_scaling", "freeze"),
    # With LoRA the base is frozen anyway: the adapters frozen, no backward runs through the tower
    (lambda c: (setattr(c.model.vision.lora, "rank", 2),
                setattr(c.optim, "freeze", "vision_lora")), "fp8_scaling", "freezes vision_lora"),
], ids=["scaling", "history", "no_fp8", "pipelined", "frozen", "frozen_adapters"])
def test_bad_or_unsupported_settings_are_refused(data_dir, change, field, words):
  cfg = _cfg(data_dir)
  change(cfg)
  module = "vision" if field == "fp8_history" or "freeze" in words else "language"
  with pytest.raises(ConfigError, match=rf"^config\.model\.{module}\.{field}: .*{words}"):
    validate(cfg)


def test_histories_are_outside_the_optimizer_clip_and_norm():
  params = {"kernel": jnp.ones((2, 2)), fp8.INPUT_HISTORY: jnp.full((3,), 100.0)}
  labels = {"kernel": "language", fp8.INPUT_HISTORY: optim.AMAX}
  grads = {"kernel": jnp.ones((2, 2)), fp8.INPUT_HISTORY: jnp.array([7.0, 0, 0])}
  assert float(optim.trainable_sq_norm(grads, labels)) == 4.0
  tx = optim.module_transform(tiny_config(""), labels)
  state = tx.init(params)
  moments = [x for x in jax.tree.leaves(state) if getattr(x, "shape", ()) == (3,)]
  assert not moments  # Adam's moments for the kernel alone
  rolled = optim.roll_histories(params, grads, labels)
  np.testing.assert_array_equal(rolled[fp8.INPUT_HISTORY], [7.0, 100.0, 100.0])
  assert rolled["kernel"] is params["kernel"]
  both = optim.combine(grads, grads, labels)
  np.testing.assert_array_equal(both[fp8.INPUT_HISTORY], [7.0, 0, 0])
  np.testing.assert_array_equal(both["kernel"], 2 * np.ones((2, 2)))
  ranks = optim.reduce_ranks(jax.tree.map(lambda g: jnp.stack([g, 2 * g]), grads), labels)
  np.testing.assert_array_equal(ranks[fp8.INPUT_HISTORY], [14.0, 0, 0])
  np.testing.assert_array_equal(ranks["kernel"], 3 * np.ones((2, 2)))


def test_lora_adapters_train_beside_delayed_scaling(data_dir, tmp_path_factory):
  """The language model's adapters train while its base stays frozen; its histories still record
  through the base (the adapters' gradients flow through it) and are saved with the trained part
  of each step (the base step holds the frozen weights). (A resume restores what a step saved:
  test_resume_continues_exactly; with adapters, tests/test_lora_resume.py.)"""
  c = _cfg(data_dir, tmp_path_factory.mktemp("lora_full"))
  c.model.language.lora.rank = 4
  c.train.steps = 3
  full = pathlib.Path(c.run.workdir)
  train.run(c)
  saved = _saved(full, 3)
  assert saved.keys() == _saved(full, 2).keys()
  assert any(np.any(saved[k] != h) for k, h in _saved(full, 2).items())  # rolled since step 2
  lang = {k: h for k, h in saved.items() if k.startswith("language/")}
  assert len(lang) == 14 and all(np.all(h > 0) for h in lang.values())
  reader = Reader(str(full))
  try:
    first, last = (reader.params(s, reader.meta(s)) for s in (0, 3))
  finally:
    reader.close()
  q = "language/blocks/attn/q/"
  np.testing.assert_array_equal(last[q + "kernel"], first[q + "kernel"])  # the frozen base
  assert np.abs(last[q + "lora_b"]).max() > 0  # the adapters trained (B starts at zero)
