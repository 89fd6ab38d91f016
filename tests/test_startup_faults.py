"""A run that fails or stops before its first step leaves nothing it made behind: not its workdir,
an empty metrics file, TensorBoard's folder or a lock; what was there before it stays."""

import pytest

from mimo_jax import train, workdir
from mimo_jax.data import capacity
from mimo_jax.step import Step
from tests.helpers import tiny_config


def _cfg(data_dir, work):
  cfg = tiny_config(data_dir)
  cfg.run.workdir = str(work)
  return cfg


def test_a_failed_capacity_check_leaves_no_workdir_it_made(data_dir, tmp_path):
  """The capacity check fails before anything compiles: the workdir the run made (its parents
  too) is gone again; a workdir that was there stays, with what it held."""
  cfg = _cfg(data_dir, tmp_path / "new" / "run")
  cfg.model.vision.image_slots = 2
  with pytest.raises(capacity.CapacityError, match="model.vision.image_slots=2 is too small"):
    train.run(cfg)
  assert list(tmp_path.iterdir()) == []
  kept = tmp_path / "kept"
  kept.mkdir()
  (kept / "notes.txt").write_text("mine")
  cfg.run.workdir = str(kept)
  with pytest.raises(capacity.CapacityError):
    train.run(cfg)
  assert sorted(p.name for p in kept.iterdir()) == ["notes.txt"]


def test_a_first_step_that_fails_leaves_no_metrics_file(data_dir, tmp_path, monkeypatch):
  """A failure after the outputs are open, in the first step: the empty metrics file, the
  TensorBoard folder, the lock and the workdir this run made are gone."""

  def fails(*_):
    raise RuntimeError("the first step failed")
  monkeypatch.setattr(Step, "init_state", lambda *_: {})  # compiles nothing: the step fails
  monkeypatch.setattr(Step, "train_step", fails)
  work = tmp_path / "run"
  cfg = _cfg(data_dir, work)
  cfg.run.compile_ahead = 0
  with pytest.raises(RuntimeError, match="the first step failed"):
    train.run(cfg)
  assert not work.exists()


def test_only_what_the_run_made_and_holds_nothing_is_removed(tmp_path):
  """Records or a checkpoints folder keep everything; files that were there before stay."""
  def run_writes(path, records: str, saved: bool = False):
    made = workdir.Made(str(path))
    (path / "tb").mkdir(parents=True, exist_ok=True)
    (path / "tb" / "events.out.tfevents.1.host").write_bytes(b"header")
    (path / "metrics.jsonl").write_text(records)
    if saved:
      (path / "checkpoints" / "1").mkdir(parents=True)
    lock = workdir.Lock(str(path)).acquire()
    made.remove_unused(lock)
    assert not (path / workdir.LOCK).exists()

  run_writes(tmp_path / "a", "")
  assert not (tmp_path / "a").exists()
  run_writes(tmp_path / "b", '{"step": 1}\n')
  assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["metrics.jsonl", "tb"]
  run_writes(tmp_path / "c", "", saved=True)
  assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["checkpoints", "metrics.jsonl",
                                                                "tb"]
  # A run that did not take the lock (another run holds it) removes none of the files.
  busy = tmp_path / "e"
  busy.mkdir()
  made = workdir.Made(str(busy))
  (busy / "metrics.jsonl").write_text("")  # the other run's
  made.remove_unused(None)
  assert (busy / "metrics.jsonl").exists()
  # An empty metrics file and TensorBoard events from before: not this run's to remove.
  old = tmp_path / "d"
  (old / "tb").mkdir(parents=True)
  (old / "metrics.jsonl").write_text("")
  run_writes(old, "")
  assert sorted(p.name for p in old.iterdir()) == ["metrics.jsonl", "tb"]
