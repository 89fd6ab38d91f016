"""Training stages (LLaVA's recipe on the digits model): a resume that trains other groups, a new
run started from another run's weights (`model.init_from`), the errors of runs that do not match
their checkpoint or source, and the step time of the first logged window."""

import dataclasses
import os
import pathlib
import shutil
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from mimo_jax import (checkpoint, checkpoint_config, checkpoint_reader, checkpoint_steps,
                      fingerprint, train)
from mimo_jax.batch import total
from mimo_jax.data import loader
from mimo_jax.models import lora as lora_module
from mimo_jax.modules import build_modules
from mimo_jax.state import ModuleState
from mimo_jax.step import Step
from tests.helpers import tiny_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
STEPS = 2  # of stage 1
COMPILE_S = 3.0  # what stage 1's first dispatch takes on top (a stand-in for compilation)


def _cfg(data_dir, workdir, freeze: str, steps: int):
  """The tiny digits model on one device, float32, one layer a module (compiles fastest)."""
  cfg = tiny_config(data_dir)
  cfg.model.vision.layers = cfg.model.language.layers = 1
  cfg.optim.freeze, cfg.train.steps = freeze, steps
  cfg.run.workdir, cfg.run.log_every = str(workdir), 1
  cfg.eval.samples, cfg.eval.batch = 16, 16
  return cfg


@pytest.fixture(scope="module")
def stage1(data_dir, tmp_path_factory):
  """Stage 1: the projector alone trained for STEPS steps, logged once (at the last step); its
  first dispatch takes COMPILE_S seconds longer, as a slow compilation would."""
  workdir = tmp_path_factory.mktemp("stage1")
  cfg = _cfg(data_dir, workdir, "vision,language", STEPS)
  cfg.run.log_every = STEPS
  dispatch, calls = Step.train_step, []

  def slow_first(self, state, batch):
    if not calls:
      time.sleep(COMPILE_S)
    calls.append(1)
    return dispatch(self, state, batch)
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(Step, "train_step", slow_first)
    records = train.run(cfg)
  return workdir, cfg, records


def _copy(stage1_dir, workdir):
  shutil.copytree(stage1_dir / "checkpoints", workdir / "checkpoints")


def _restore(cfg, workdir, step):
  """`step` of `workdir` restored for `cfg` (and the checkpointer's notes)."""
  trainer = Step.build(cfg)
  ckpt = checkpoint.Checkpointer(checkpoint_steps.directory(str(workdir)), list(trainer.modules),
                                 read_only=True)
  try:
    state, _ = ckpt.restore(step, trainer.abstract_state(canonical=True), cfg,
                            trainer.fresh_opt_state)
  finally:
    ckpt.close()
  return state, ckpt.notes


def _opt(state, module: str) -> dict:
  return {k: np.asarray(v) for k, v in fingerprint.paths(state[module].opt_state).items()}


def test_first_window_step_time_excludes_compilation(stage1):
  """The first record averages the steps of its window from the end of the first dispatch, which
  compiles the step: a slow compilation is not step time."""
  _, _, records = stage1
  record = [r for r in records if "loss" in r]
  assert [r["step"] for r in record] == [STEPS]
  assert record[0]["step_time_s"] < COMPILE_S / STEPS / 2, record[0]


def test_the_last_record_is_its_windows_mean_not_its_wait_behind_the_step_before():
  """The loop dispatches a step while the one before it runs: the last step's time from its
  dispatch holds that wait too (twice the step where the host runs ahead)."""
  from mimo_jax.metrics import StepWindow  # pylint: disable=import-outside-toplevel
  window = StepWindow()
  for end in (10.0, 11.0, 12.0, 13.0):  # the first step's end starts the window
    window.completed(end, 100)
  took, info = window.timing(13.0, 11.0, {"tokens": 100})  # the last, dispatched at 11.0
  assert (took, info["tokens"]) == (1.0, 100)


def test_resume_training_more_groups(data_dir, stage1, tmp_path, capsys):
  """Stage 1 -> stage 2 in the same workdir: optim.freeze=vision,language then vision. The
  language model starts with fresh Adam moments (and the LR schedule at the run's step), the
  projector keeps its own, the step and the data position carry on. Then a resume that freezes
  the language model again and changes optim.lr_mult."""
  stage1_dir, _, _ = stage1
  _copy(stage1_dir, tmp_path)
  cfg = _cfg(data_dir, tmp_path, "vision", STEPS + 1)
  state, notes = _restore(cfg, tmp_path, STEPS)
  assert any("language starts with fresh optimizer state" in n for n in notes), notes
  language, vision = _opt(state, "language"), _opt(state, "vision")
  assert language, "the language model has optimizer state now"
  for k, v in language.items():
    if k.endswith("/0/count"):
      assert v == 0, k  # Adam's bias correction starts afresh
    elif k.endswith("count"):
      assert v == STEPS, k  # the LR schedule at the run's step
    else:
      assert not v.any(), k  # fresh moments
  moments = [v for k, v in vision.items() if "/mu/" in k]
  assert moments and all(v.any() for v in moments)  # the projector's, carried on
  assert {int(v) for k, v in vision.items() if k.endswith("count")} == {STEPS}
  before = {n: jax.device_get(s.params) for n, s in state.items()}

  records = [r for r in train.run(cfg) if "loss" in r]
  assert [r["step"] for r in records] == [STEPS + 1]
  assert "language starts with fresh optimizer state" in capsys.readouterr().out
  # The data position carried on: step STEPS + 1 trained on the stream's batch STEPS.
  trainer = Step.build(cfg)
  stream = loader.train_dataset(cfg, loader.build_paths(cfg)["train"], trainer.ctx.groups)
  seen = lambda b: (total(b, lambda s: s.target_tokens), total(b, lambda s: s.items["vision"]))
  assert (records[0]["target_tokens"], records[0]["images"]) == seen(stream[STEPS])
  assert seen(stream[STEPS]) != seen(stream[0])
  after, _ = _restore(cfg, tmp_path, STEPS + 1)
  changed = lambda n, part, was=before, now=after: any(
      not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(was[n][part]),
                                               jax.tree.leaves(now[n].params[part])))
  assert changed("language", "blocks") and changed("vision", "projector")
  assert not changed("vision", "blocks")  # still frozen

  # Then the language model frozen again and the projector at half the learning rate
  # (optim.lr_mult): the language model's moments stay on disk, the projector's carry on.
  cfg = _cfg(data_dir, tmp_path, "vision,language", STEPS + 2)
  cfg.optim.lr_mult = "vision_projector=0.5"
  state, notes = _restore(cfg, tmp_path, STEPS + 1)
  assert any("language (now frozen) drops its" in n for n in notes), notes
  assert not _opt(state, "language")
  for k, v in _opt(state, "vision").items():
    np.testing.assert_array_equal(v, _opt(after, "vision")[k], err_msg=k)
  was = {n: jax.device_get(s.params) for n, s in after.items()}
  assert [r["step"] for r in train.run(cfg) if "loss" in r] == [STEPS + 2]
  last, _ = _restore(cfg, tmp_path, STEPS + 2)
  assert changed("vision", "projector", was, last)
  assert not changed("language", "blocks", was, last) and not changed("vision", "blocks", was, last)


@pytest.fixture(scope="module")
def stage2(data_dir, stage1, tmp_path_factory):
  """Stage 2 as LLaVA runs it: a new workdir with model.init_from=STAGE1 and optim.freeze=vision,
  one step: its config and records."""
  stage1_dir, _, _ = stage1
  cfg = _cfg(data_dir, tmp_path_factory.mktemp("stage2"), "vision", 1)
  cfg.model.init_from = str(stage1_dir)
  return cfg, train.run(cfg)


def test_init_from_starts_a_new_stage(data_dir, stage1, stage2, tmp_path):
  """Stage 2's first loss is the loss of stage 1's final weights on the same batch."""
  stage1_dir, cfg1, _ = stage1
  cfg, records = stage2
  first = [r for r in records if "loss" in r]
  assert [r["step"] for r in first] == [1]

  # The reference: stage 1's step restored as it was saved, stage 2's step on its first batch.
  ref_cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, init_from=""))
  trainer = Step.build(ref_cfg)
  saved, _ = _restore(cfg1, stage1_dir, STEPS)
  vision = jax.device_get(saved["vision"].params)
  state = trainer.from_canonical({n: ModuleState(s.params, trainer.fresh_opt_state(n, s.params))
                                  for n, s in saved.items()})
  paths = loader.build_paths(ref_cfg)
  batch = loader.train_dataset(ref_cfg, paths["train"], trainer.ctx.groups)[0]
  _, metrics = trainer.train_step(state, batch)
  np.testing.assert_allclose(first[0]["loss"], float(metrics["loss"]), rtol=1e-6)

  # A module's init_from takes a run too (WORKDIR:STEP): that module's parameters, the others'
  # from the seed.
  cfg = _cfg(data_dir, tmp_path / "other", "", 1)
  cfg.model.vision.init_from = f"{stage1_dir}:{STEPS}"
  trainer = Step.build(cfg)
  init = trainer.init_state(cfg.train.seed)
  for a, b in zip(jax.tree.leaves(init["vision"].params), jax.tree.leaves(vision)):
    np.testing.assert_array_equal(np.asarray(a), b)  # the trained projector too


def test_a_lora_stage_over_a_run_without_adapters_starts_at_its_outputs(data_dir, stage1, stage2,
                                                                        tmp_path):
  """Language LoRA over stage 1, which has no adapters (model.init_from, or the language model's
  own init_from): its weights with fresh adapters from the seed (B = 0), so the first loss is
  exactly stage 2's (stage 1's weights without adapters); then the adapters train over the frozen
  base. A source with adapters of another rank is another model still."""
  stage1_dir, _, _ = stage1

  def lora(workdir, rank=4):
    cfg = _cfg(data_dir, workdir, "vision", 1)
    cfg.model.language.lora.rank, cfg.model.language.lora.alpha = rank, 8.0
    cfg.checkpoint.every, cfg.eval.every = 1, 0
    return cfg
  cfg = lora(tmp_path / "lora")
  cfg.model.init_from = str(stage1_dir)
  records = train.run(cfg)
  first = [r["loss"] for r in records if "loss" in r]
  assert first == [r["loss"] for r in stage2[1] if "loss" in r]

  reader = lambda workdir: checkpoint_reader.Reader(str(workdir))
  source, lora_run = reader(stage1_dir), reader(tmp_path / "lora")
  try:
    was = source.params(STEPS, source.meta(STEPS))
    start, end = (lora_run.params(s, lora_run.meta(s)) for s in (0, 1))
  finally:
    source.close()
    lora_run.close()
  seed = fingerprint.paths(build_modules(cfg)["language"].init(cfg.train.seed))
  adapters = {k for k in start if lora_module.is_adapter(k)}
  assert adapters and set(start) - adapters == set(was)
  for k in adapters:  # the seed's: A drawn, B zero
    np.testing.assert_array_equal(start[k], seed[k[len("language/"):]], err_msg=k)
    assert k.endswith("lora_a") or not start[k].any(), k
  for k, v in was.items():
    np.testing.assert_array_equal(start[k], v, err_msg=k)
  assert all(not np.array_equal(end[k], start[k]) for k in adapters)
  for k, v in start.items():
    if k not in adapters and not k.startswith("vision/projector/"):
      np.testing.assert_array_equal(end[k], v, err_msg=k)  # the frozen base

  # The language model's own init_from naming stage 1: the same start.
  own = lora(tmp_path / "own")
  own.model.language.init_from = f"{stage1_dir}:{STEPS}"
  trainer = Step.build(own)
  got = fingerprint.paths(jax.device_get(trainer.canonical(trainer.init_state(own.train.seed))["language"]
                             .params))
  assert set(got) == {k[len("language/"):] for k in start if k.startswith("language/")}
  for k, v in got.items():
    np.testing.assert_array_equal(v, start["language/" + k], err_msg=k)

  # A source with adapters needs this run's lora config.
  other = lora(tmp_path / "rank8", rank=8)
  other.model.init_from = str(tmp_path / "lora")
  with pytest.raises(checkpoint.CheckpointError,
                     match=r"was written for another model: model\.language\.lora\.rank=4 "
                           r"\(this run: 8\)"):
    train.run(other)
  assert not (tmp_path / "rank8").exists()


def test_init_from_another_model_is_one_error(data_dir, stage1, tmp_path):
  """A source written for another model: one error naming the field, before anything is
  written; a missing step names the steps there are."""
  stage1_dir, _, _ = stage1
  cfg = _cfg(data_dir, tmp_path / "stage2", "vision", 1)
  cfg.model.init_from = str(stage1_dir)
  cfg.model.language.mlp_dim = 64
  with pytest.raises(checkpoint.CheckpointError,
                     match=r"config\.model\.init_from: .* was written for another model: "
                           r"model\.language\.mlp_dim=128 \(this run: 64\)\. Start from it "
                           r"with that run's model config \(--config\.model\.language\."
                           r"mlp_dim=128\)\.$"):
    train.run(cfg)
  # A source whose workdir holds its config file (an import's config.py) is named by it.
  (stage1_dir / "config.py").write_text("")
  try:
    with pytest.raises(checkpoint.CheckpointError,
                       match=rf"Start from it with its config: --config={stage1_dir}/config\.py\.$"):
      train.run(cfg)
  finally:
    (stage1_dir / "config.py").unlink()
  cfg = _cfg(data_dir, tmp_path / "stage2", "vision", 1)
  cfg.model.init_from = f"{stage1_dir}:7"
  with pytest.raises(checkpoint.CheckpointError, match=rf"no complete step 7; it holds {STEPS}"):
    train.run(cfg)
  # One step's folder, and a negative step: each named with the spec that works.
  cfg.model.init_from = str(stage1_dir / "checkpoints" / str(STEPS))
  with pytest.raises(checkpoint.CheckpointError,
                     match=rf"optionally with :STEP \({stage1_dir}:{STEPS} for this step\)\.$"):
    train.run(cfg)
  cfg.model.init_from = f"{stage1_dir}:-1"
  with pytest.raises(checkpoint.CheckpointError,
                     match=r"the step '-1' is not a step number \(0 or more\); give WORKDIR:STEP"):
    train.run(cfg)
  assert not (tmp_path / "stage2").exists()


def test_resume_of_another_model_is_a_mismatch_not_damage(data_dir, stage1, tmp_path):
  """`python -m mimo_jax.launch` on a workdir whose checkpoint has another model field: one
  line naming the field and the flag that keeps it, exit status 2; not called damaged."""
  stage1_dir, _, _ = stage1
  _copy(stage1_dir, tmp_path)
  proc = subprocess.run(
      [sys.executable, "-m", "mimo_jax.launch", "--config=tests/configs/tiny.py",
       f"--config.run.workdir={tmp_path}", f"--config.data.dir={data_dir}",
       "--config.optim.freeze=vision", f"--config.train.steps={STEPS + 1}",
       "--config.model.vision.layers=1", "--config.model.language.layers=1",
       "--config.model.language.mlp_dim=64"],
      cwd=ROOT, capture_output=True, text=True, timeout=300,
      env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert proc.returncode == 2, proc.stderr[-2000:]
  lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
  assert len(lines) == 1 and lines[0].startswith("mimo_jax: error: "), proc.stderr
  assert "model.language.mlp_dim=128 (this run: 64)" in lines[0]
  assert "--config.model.language.mlp_dim=128" in lines[0]
  assert "damaged" not in lines[0]
  assert not (tmp_path / "metrics.jsonl").exists()


def test_a_checkpoint_without_a_module_of_the_run_names_the_flags_that_start_from_it(stage1):
  """A step that lacks a module the run has: one error naming the module and the flags that
  start a new stage from the modules it holds; not called damaged."""
  stage1_dir, cfg, _ = stage1
  path = checkpoint_steps.directory(str(stage1_dir))
  ckpt = checkpoint.Checkpointer(path, ["vision", "language"], read_only=True)
  try:
    meta = dict(ckpt.read_meta(STEPS), modules=["language"])
  finally:
    ckpt.close()
  with pytest.raises(checkpoint.CheckpointError) as e:
    checkpoint_config.check_compatible(meta, cfg, path, STEPS)
  message = str(e.value)
  assert "has no module vision; it holds language" in message, message
  assert f"--config.model.language.init_from={stage1_dir}" in message, message
  assert "\n" not in message and "damaged" not in message


def test_parameters_of_other_shapes_under_the_same_config_name_the_flag_to_start_afresh(
    data_dir, stage1):
  """A step whose parameters have other shapes than the run's model of the same config (the
  model code changed): one error naming the shapes and the flag that starts afresh; not
  called damaged."""
  stage1_dir, cfg, _ = stage1
  other = _cfg(data_dir, stage1_dir, "vision,language", STEPS)
  other.model.language.mlp_dim = 64  # what other code would make of the same config
  trainer = Step.build(other)
  ckpt = checkpoint.Checkpointer(checkpoint_steps.directory(str(stage1_dir)), list(trainer.modules),
                                 read_only=True)
  try:
    with pytest.raises(checkpoint.CheckpointError) as e:
      ckpt.restore(STEPS, trainer.abstract_state(canonical=True), cfg, trainer.fresh_opt_state)
  finally:
    ckpt.close()
  message = str(e.value)
  assert "holds other parameters than this run's model" in message and "128" in message, message
  assert "--config.run.workdir=NEW_DIR" in message, message
  assert "\n" not in message and "damaged" not in message
