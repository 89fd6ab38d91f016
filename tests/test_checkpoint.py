"""Checkpoints: exact resume, restore onto other topologies, bad checkpoints, a save killed with
SIGKILL, tools (preemption in real runs: test_faults.py; what checkpoints say:
test_checkpoint_messages.py)."""

import os
import shutil
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

from mimo_jax import checkpoint, checkpoint_config, checkpoint_steps, train, workdir
from mimo_jax.config import Config, ConfigError
from mimo_jax.state import ModuleState
from mimo_jax.step import Step
from tests.helpers import run_main, tiny_config
from tools import ckpt as ckpt_tool

WRITTEN = {"vision": (0, 2, 1), "language": (2, 2, 2)}
STEPS = 6


def _cfg(data_dir, workdir, **topo):
  cfg = tiny_config(data_dir, **(topo or WRITTEN))
  cfg.train.steps = STEPS
  cfg.checkpoint.every, cfg.checkpoint.keep = 2, 10
  cfg.run.workdir, cfg.run.log_every, cfg.run.progress = str(workdir), 1, "lines"
  cfg.eval.samples = 16
  return cfg


def _losses(records, first=1):
  return {r["step"]: (r["loss"], r["grad_norm"]) for r in records
          if "loss" in r and r["step"] >= first}


@pytest.fixture(scope="module")
def full_run(data_dir, tmp_path_factory):
  """An uninterrupted run with checkpoints at steps 2, 4 and 6."""
  workdir = tmp_path_factory.mktemp("full")
  return workdir, train.run(_cfg(data_dir, workdir))


def _resume_from(full_dir, workdir, step: int) -> None:
  """A workdir whose latest checkpoint is `step` of the full run (as if it stopped there)."""
  shutil.copytree(full_dir / "checkpoints", workdir / "checkpoints")
  for d in (workdir / "checkpoints").iterdir():
    if d.name.isdigit() and int(d.name) > step:
      shutil.rmtree(d)


def test_resume_is_bitwise(data_dir, full_run, tmp_path):
  full_dir, records = full_run
  _resume_from(full_dir, tmp_path, 2)
  resumed = train.run(_cfg(data_dir, tmp_path))
  got, want = _losses(resumed), _losses(records, first=3)
  assert sorted(got) == [3, 4, 5, 6]
  assert got == want  # bitwise: same floats


def test_restore_onto_other_topology(data_dir, full_run, tmp_path):
  """Written on vision dp2 and language dp2 tp2, restored on vision dp4 and language on one
  device (a checkpoint restored on a single device: test_multiprocess.py, from both of its
  two-process layouts)."""
  full_dir, records = full_run
  _resume_from(full_dir, tmp_path, 2)
  resumed = _losses(train.run(_cfg(data_dir, tmp_path, vision=(0, 4, 1), language=(4, 1, 1))))
  want = _losses(records, first=3)
  assert sorted(resumed) == sorted(want)
  for step, (loss, gnorm) in want.items():
    np.testing.assert_allclose(resumed[step], (loss, gnorm), rtol=1e-4, err_msg=f"step {step}")


def test_interrupted_save_is_ignored(data_dir, full_run, tmp_path):
  full_dir, records = full_run
  _resume_from(full_dir, tmp_path, 4)
  partial = tmp_path / "checkpoints" / "6.orbax-checkpoint-tmp-1700000000"
  (partial / "language").mkdir(parents=True)
  (partial / "language" / "junk").write_bytes(b"\0" * 100)
  unfinished = tmp_path / "checkpoints" / "8" / "language"  # no commit marker
  unfinished.mkdir(parents=True)
  (unfinished / "junk").write_bytes(b"\0" * 100)
  ckpt = checkpoint.Checkpointer(checkpoint_steps.directory(str(tmp_path)), ["vision", "language"],
                                 read_only=True)
  assert ckpt.latest_step() == 4
  ckpt.close()
  resumed = _losses(train.run(_cfg(data_dir, tmp_path)))
  assert resumed == _losses(records, first=5)


# Saves step 1, then step 2 until orbax renames its finished staging folder into place, where it
# kills itself (SIGKILL): the last moment of a save, its folder complete but not yet the step.
_KILLED_SAVE = """
import os, signal, sys
import jax.numpy as jnp
from mimo_jax.checkpoint import Checkpointer
from mimo_jax.config import Config
from mimo_jax.state import ModuleState
ckpt = Checkpointer(sys.argv[1], ["language"], async_save=False)
state = lambda v: {"language": ModuleState({"w": jnp.full((64, 64), v, jnp.float32)}, None)}
ckpt.save(1, state(1.0), Config(), force=True, params_only=True)
rename = os.rename
def killed(src, dst, *args, **kwargs):
  if os.path.basename(str(dst)) == "2":
    os.kill(os.getpid(), signal.SIGKILL)
  return rename(src, dst, *args, **kwargs)
os.rename = killed
ckpt.save(2, state(2.0), Config(), force=True, params_only=True)
"""


def test_a_save_killed_with_sigkill_leaves_the_steps_before_it_and_the_next_save_works(
    tmp_path, capsys):
  path = tmp_path / "checkpoints"
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  proc = subprocess.run([sys.executable, "-c", _KILLED_SAVE, str(path)], cwd=root,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True,
                        text=True, timeout=120)
  assert proc.returncode == -signal.SIGKILL, proc.stderr
  assert any(p.name.startswith("2.") for p in path.iterdir())  # the save it was in
  assert checkpoint_steps.complete_steps(str(path)) == [1]
  assert ckpt_tool.main(["check", str(tmp_path)]) == 0
  assert "step 1: " in capsys.readouterr().out
  # The next writer (a rerun) saves step 2 again over what the killed one left.
  ckpt = checkpoint.Checkpointer(str(path), ["language"], async_save=False)
  ckpt.save(2, {"language": ModuleState({"w": np.full((64, 64), 2.0, np.float32)}, None)},
            Config(), force=True, params_only=True)
  ckpt.close()
  assert checkpoint_steps.complete_steps(str(path)) == [1, 2]
  assert sorted(p.name for p in path.iterdir()) == ["1", "2"]
  assert ckpt_tool.main(["check", str(tmp_path)]) == 0


def test_mismatched_model_is_a_clear_error(data_dir, full_run, tmp_path):
  full_dir, _ = full_run
  _resume_from(full_dir, tmp_path, 2)
  cfg = _cfg(data_dir, tmp_path)
  cfg.model.language.mlp_dim = 64
  with pytest.raises(ConfigError, match=r"model\.language\.mlp_dim=128 \(this run: 64\)"):
    train.run(cfg)
  cfg = _cfg(data_dir, tmp_path)
  cfg.data.global_batch = 16
  with pytest.raises(ConfigError, match=r"data\.global_batch=32"):
    train.run(cfg)
  # Every field that changes the sample order or the eval set is named, with the value to keep.
  for field, value in (("train_samples", 1500), ("image_probs", "0.25,0.25,0.25,0.25"), ("eval_samples", 100)):
    cfg = _cfg(data_dir, tmp_path)
    kept = getattr(cfg.data, field)
    setattr(cfg.data, field, value)
    with pytest.raises(ConfigError, match=rf"--config\.data\.{field}={kept!r}"):
      train.run(cfg)
  assert not (tmp_path / "metrics.jsonl").exists()  # nothing written


def test_missing_module_and_corrupt_checkpoint(data_dir, full_run, tmp_path):
  """One error naming the step and the fix, without the storage spec of the failed read."""
  full_dir, _ = full_run
  _resume_from(full_dir, tmp_path, 2)
  cfg = _cfg(data_dir, tmp_path)
  meta = {"modules": ["language"], "config": {}, "data": {}}
  with pytest.raises(checkpoint.CheckpointError, match="has no module vision"):
    checkpoint_config.check_compatible(meta, cfg, "ckpt", 2)
  chunks = [f for f in (tmp_path / "checkpoints" / "2" / "language").rglob("*")
            if f.is_file() and f.parent.name == "d"]  # the array data files
  assert chunks
  for f in chunks:
    f.write_bytes(b"garbage")
  with pytest.raises(checkpoint.CheckpointError,
                     match=r"step 2 could not be restored: .*damaged or incomplete") as err:
    train.run(cfg)
  assert "tensorstore_spec" not in str(err.value)


def test_tools_inspect_export_check(data_dir, full_run, tmp_path):
  full_dir, _ = full_run
  run = lambda *a: run_main(ckpt_tool.main, *a)  # `python -m tools.ckpt`, in this process
  cfg = _cfg(data_dir, full_dir)
  stepper = Step.build(cfg)
  counts = {n: sum(int(np.prod(x.shape)) for x in jax.tree.leaves(a))
            for n, a in {n: p.abstract_params for n, p in stepper.plan.modules.items()}.items()}
  out = run("inspect", str(full_dir), "--params")
  assert out.returncode == 0, out.stderr
  assert "steps: 2, 4, 6 (showing 6)" in out.stdout
  assert f"module vision: {counts['vision']:,} parameters" in out.stdout
  assert f"module language: {counts['language']:,} parameters" in out.stdout
  assert "6 steps done, 192 samples consumed" in out.stdout
  assert "language/embedding" in out.stdout
  target = tmp_path / "model.safetensors"
  out = run("export", str(full_dir), "--step", "4", "--out", str(target))
  assert out.returncode == 0, out.stderr
  tensors = load_file(str(target))
  ckpt = checkpoint.Checkpointer(checkpoint_steps.directory(str(full_dir)), list(stepper.modules),
                                 read_only=True)
  state, _ = ckpt.restore(4, stepper.abstract_state(), cfg)
  ckpt.close()
  np.testing.assert_array_equal(tensors["language/embedding"],
                                np.asarray(state["language"].params["embedding"]))
  abstract = [p.abstract_params for p in stepper.plan.modules.values()]
  assert len(tensors) == sum(len(jax.tree.leaves(a)) for a in abstract)
  out = run("check", str(full_dir))
  arrays = sum(len(jax.tree.leaves(a)) for a in abstract)
  assert out.returncode == 0, out.stdout + out.stderr
  assert out.stdout.count(f": {arrays} arrays restored, ok") == 3, out.stdout
  out = run("export", str(full_dir), "--step", "5", "--out", str(target))
  assert out.returncode == 2 and "no step 5" in out.stderr


def test_keep_holds_the_newest_checkpoints(data_dir, tmp_path):
  cfg = _cfg(data_dir, tmp_path)
  cfg.checkpoint.every, cfg.checkpoint.keep = 1, 2
  cfg.train.steps = 4
  train.run(cfg)
  assert checkpoint_steps.complete_steps(checkpoint_steps.directory(str(tmp_path))) == [3, 4]


def test_a_checkpointer_that_saved_nothing_leaves_no_folder_it_made(tmp_path):
  """A run that fails before its first save (the capacity check, its first step out of memory)
  leaves no empty checkpoints folder, which would read as a run that saved; a folder that was
  there already stays."""
  made = tmp_path / "new" / "checkpoints"
  checkpoint.Checkpointer(str(made), ["language"], async_save=False).close()
  assert not made.exists() and (tmp_path / "new").is_dir()
  found = tmp_path / "old" / "checkpoints"
  found.mkdir(parents=True)
  checkpoint.Checkpointer(str(found), ["language"], async_save=False).close()
  assert found.is_dir()


def test_a_host_limited_save_copies_a_batch_at_a_time(tmp_path, caplog):
  """With `host_gb` every array is deferred, so orbax copies them off the devices in batches of
  at most that many GB (its default copies all at once, ignoring the limit); the arrays read back
  as saved."""
  import logging  # pylint: disable=import-outside-toplevel
  cfg = tiny_config(str(tmp_path / "data"))
  step = Step.build(cfg)
  state = step.canonical(step.init_state(0, optimizer=False))
  assert all(s.opt_state is None for s in state.values())
  path = str(tmp_path / "ckpt")
  ckpt = checkpoint.Checkpointer(path, list(step.modules), async_save=False, host_gb=1)
  assert ckpt.host_batched
  caplog.set_level(logging.INFO, logger="absl")
  ckpt.save(0, state, cfg, force=True, params_only=True)
  ckpt.close()
  batches = [r.getMessage() for r in caplog.records
             if "deprioritized arrays" in r.getMessage() and "Scheduling" in r.getMessage()]
  assert len(batches) == len(step.modules), batches  # one batch a module: all fit in 1 GB
  assert not [r for r in caplog.records if "No prioritized params" in r.getMessage()]
  reader = checkpoint.Checkpointer(path, list(step.modules), read_only=True)
  restored, _ = reader.restore(0, step.abstract_state(canonical=True), cfg,
                               fresh_opt_state=lambda n, p: None)
  for n in step.modules:
    for a, b in zip(jax.tree.leaves(restored[n].params), jax.tree.leaves(state[n].params)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _saved(tmp_path, cfg, params_only: bool):
  """A checkpointer holding step 1 of `cfg`'s initial state (or its parameters only), and the
  step that restores it."""
  step = Step.build(cfg)
  state = step.canonical(step.init_state(0, optimizer=not params_only))
  ckpt = checkpoint.Checkpointer(str(tmp_path / "ckpt"), list(step.modules), async_save=False)
  ckpt.save(1, state, cfg, force=True, params_only=params_only)
  return ckpt, step


def test_a_params_only_step_pins_no_data(data_dir, tmp_path):
  """An import's step (parameters only) resumes with any data: it was trained on none."""
  cfg = tiny_config(data_dir)
  cfg.data.task, cfg.data.seed = "synthetic", 5
  ckpt, step = _saved(tmp_path, cfg, params_only=True)
  cfg = tiny_config(data_dir)  # digits, seed 0
  state, _ = ckpt.restore(1, step.abstract_state(canonical=True), cfg, step.fresh_opt_state)
  ckpt.close()
  assert set(state) == set(step.modules) and not ckpt.notes


def test_a_restore_reads_orbax_metadata_once_and_compiles_its_checks_beside_the_read(
    data_dir, tmp_path, monkeypatch, caplog):
  """orbax's metadata of a step opens every array: a restore reads it once. The fingerprints'
  programs compile in a thread of their own while the arrays are read, and the check on the read
  arrays compiles nothing more."""
  import logging  # pylint: disable=import-outside-toplevel
  ckpt, step = _saved(tmp_path, tiny_config(data_dir), params_only=False)
  reads = []
  metadata = ckpt._mngr.item_metadata  # pylint: disable=protected-access
  monkeypatch.setattr(ckpt._mngr, "item_metadata",  # pylint: disable=protected-access
                      lambda s: reads.append(s) or metadata(s))
  jax.clear_caches()  # the fingerprint programs compile in this restore, not before it
  caplog.set_level(logging.WARNING)
  logged = jax.config.jax_log_compiles
  jax.config.update("jax_log_compiles", True)  # for every thread (the context is per thread)
  try:
    state, _ = ckpt.restore(1, step.abstract_state(canonical=True), tiny_config(data_dir),
                            step.fresh_opt_state)
  finally:
    jax.config.update("jax_log_compiles", logged)
  ckpt.close()
  assert reads == [1]
  compiles = [r.threadName for r in caplog.records
              if r.getMessage().startswith("Compiling jit(_device)")]
  assert compiles == ["fingerprint-compile"] * len(step.modules), compiles
  assert set(state) == set(step.modules)


def test_other_converted_data_is_refused_unless_allowed(data_dir, tmp_path):
  """Converted data (data.task=conversations) is fingerprinted in the meta: another data.dir
  with other records is refused naming it and the flag, allowed with the flag; the same data
  moved elsewhere resumes as it is."""
  from mimo_jax.data import digits  # pylint: disable=import-outside-toplevel
  cfg = tiny_config(data_dir)
  first = digits.build(data_dir, cfg.data.train_samples, cfg.data.eval_samples, cfg.data.probs())
  other = digits.build(str(tmp_path / "other"), 300, 50, cfg.data.probs())
  cfg.data.task, cfg.data.dir, cfg.data.image_token = "conversations", first, 3
  cfg.model.language.vocab_size = 32
  ckpt, step = _saved(tmp_path, cfg, params_only=False)
  abstract = step.abstract_state(canonical=True)
  cfg.data.dir = other
  with pytest.raises(checkpoint.CheckpointError) as err:
    ckpt.restore(1, abstract, cfg, step.fresh_opt_state)
  message = str(err.value)
  assert f"data.dir={other!r} (the step's: {first!r})" in message
  assert "its train shard" in message and "its eval shard" in message
  assert "--config.checkpoint.allow_data_change=true" in message and "damaged" not in message
  cfg.checkpoint.allow_data_change = True
  ckpt.restore(1, abstract, cfg, step.fresh_opt_state)
  assert "the data position carries on at step 1" in ckpt.notes[-1]
  moved = shutil.copytree(first, tmp_path / "moved")
  cfg.data.dir, cfg.checkpoint.allow_data_change = str(moved), False
  ckpt.restore(1, abstract, cfg, step.fresh_opt_state)
  ckpt.close()


def test_a_lock_that_names_no_run_is_refused_by_a_run_and_noted_by_the_tools(full_run, tmp_path):
  """A run.lock that is not the host-and-pid record a run writes (a list, a pid that is not a
  number, empty, not JSON) is an unreadable lock: a run stops with one line naming it (nothing
  written), and the read-only tools note it and read on as if no run held the workdir."""
  full_dir, _ = full_run
  _resume_from(full_dir, tmp_path, STEPS)
  lock = tmp_path / "run.lock"
  said = (f"{lock} is unreadable (not a lock naming a host and pid); delete it if no run uses "
          "this workdir.")
  for text in ("[1, 2]", '{"host": "vm", "pid": "abc"}', "", "garbage"):
    lock.write_text(text)
    with pytest.raises(workdir.WorkdirError) as err:
      workdir.Lock(str(tmp_path)).acquire()
    assert str(err.value) == said
    assert sorted(os.listdir(tmp_path)) == ["checkpoints", "run.lock"]  # nothing written
    assert lock.read_text() == text
    assert workdir.live_run(str(tmp_path)) is None
    out = run_main(ckpt_tool.main, "inspect", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert out.stderr == f"tools.ckpt: note: {said}\n"


def test_metadata_edited_or_without_its_digest_is_refused_by_the_run_and_every_tool(full_run,
                                                                                    tmp_path):
  """Every step this code saves holds a digest of its metadata: metadata edited (its digest
  kept) or without a digest is refused by a resume, `check`, `inspect` and `export` (writing
  nothing), each naming the step and the file."""
  import json  # pylint: disable=import-outside-toplevel
  full_dir, _ = full_run
  _resume_from(full_dir, tmp_path, STEPS)
  path = tmp_path / "checkpoints"
  file = path / str(STEPS) / "meta" / "metadata"
  saved = json.loads(file.read_text())
  assert saved["digest"] == checkpoint_steps.digest(saved)
  edited = dict(saved, data=dict(saved["data"], steps_done=1))
  for meta, wrong in ((edited, "does not match its digest"),
                      ({k: v for k, v in saved.items() if k != "digest"}, "holds no digest")):
    file.write_text(json.dumps(meta))
    ckpt = checkpoint.Checkpointer(str(path), ["vision", "language"], read_only=True)
    with pytest.raises(checkpoint.CheckpointError,
                       match=rf"step {STEPS} has metadata that {wrong} \({file}\)\. Its files are "
                       "damaged"):
      ckpt.read_meta(STEPS)
    ckpt.close()
    out = run_main(ckpt_tool.main, "check", str(tmp_path), "--step", str(STEPS))
    assert out.returncode == 2 and f"step {STEPS}: FAILED: meta: {wrong}" in out.stdout, out
    line = (f"tools.ckpt: error: step {STEPS} of {path} has metadata that {wrong} ({file}): its "
            "files are damaged;")
    for args in (("inspect",), ("export", "--out", tmp_path / "out.safetensors")):
      out = run_main(ckpt_tool.main, *args[:1], str(tmp_path), *args[1:])
      assert out.returncode == 2 and out.stdout == "", out
      assert out.stderr.startswith(line) and out.stderr.count("\n") == 1, out.stderr
    assert not [p for p in tmp_path.iterdir() if "out.safetensors" in p.name]


def test_a_run_that_stops_with_an_error_before_training_renames_nothing(data_dir, full_run,
                                                                          tmp_path):
  """The folders a run moves aside (an uncommitted step, steps newer than restore_step) are
  moved once its checks have passed: a run refused before training leaves checkpoints/ as it
  was. A plain file named like a step is refused, never renamed as a step."""
  full_dir, _ = full_run
  _resume_from(full_dir, tmp_path, STEPS)
  ckpts = tmp_path / "checkpoints"
  (ckpts / "6" / "commit_success.txt").unlink()  # 6: uncommitted
  (ckpts / "7").mkdir()  # uncommitted, empty
  (ckpts / "8").touch()  # a file
  (ckpts / "9").mkdir()
  (ckpts / "9" / "commit_success.txt").touch()  # committed, without metadata
  listing = lambda: sorted(p.name for p in ckpts.iterdir())
  before = listing()
  cfg = _cfg(data_dir, tmp_path)
  with pytest.raises(checkpoint.CheckpointError, match=rf"{ckpts / '8'} is a file, not a step's "
                     rf"folder \(a save of step 8 would fail on it\); move it out of {ckpts}\."):
    train.run(cfg)
  assert listing() == before
  (ckpts / "8").unlink()
  before = listing()
  with pytest.raises(checkpoint.CheckpointError, match="step 9 has no readable metadata"):
    train.run(cfg)
  assert listing() == before
  cfg.checkpoint.restore_step, cfg.model.language.layers = 2, cfg.model.language.layers + 1
  with pytest.raises(checkpoint.CheckpointError):  # another model: refused after restore_step
    train.run(cfg)
  assert listing() == before
