"""A device that runs out of memory: one line saying in what (the state, the training step, the
evaluation), XLA's allocation, the layout's bound, the fields that use less and how to go on;
nothing saved is lost. XLA's error is raised where the step or the eval would raise it."""

import jax
import pytest

from mimo_jax import checkpoint_steps, launch, memory, train
from mimo_jax.evaluate import Evaluator
from mimo_jax.step import Step
from tests.helpers import tiny_config

# XLA's words on an H200 (jax 0.11.2), and a buffer assignment's listing after them, as XLA's
# other out-of-memory errors have.
XLA = ("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 120.09GiB with allocator "
       "GPU_0_bfc on device 0. [tf-allocator-allocation-error=''] [executable_name='jit_update']"
       "\nBufferAssignment OOM Debugging.\nBufferAssignment stats:\n"
       "             parameter allocation:    6.00MiB\n")


def _cfg(data_dir, workdir):
  cfg = tiny_config(data_dir, vision=(0, 2, 1), language=(2, 2, 1))
  cfg.train.steps, cfg.checkpoint.every = 4, 2
  cfg.run.workdir, cfg.run.log_every, cfg.run.progress = str(workdir), 1, "lines"
  cfg.eval.samples = 16
  return cfg


def _fails_at(call: int, real):
  calls = [0]

  def fails(*args, **kw):
    calls[0] += 1
    if calls[0] == call:
      raise jax.errors.JaxRuntimeError(XLA)
    return real(*args, **kw)
  return fails


def test_the_step_and_the_eval_running_out_of_memory(data_dir, tmp_path, monkeypatch, capsys):
  cfg = _cfg(data_dir, tmp_path)
  monkeypatch.setattr(Step, "train_step", _fails_at(3, Step.train_step))
  with pytest.raises(memory.OutOfMemoryError) as e:
    train.run(cfg)
  line = str(e.value)
  assert line.startswith("a device ran out of memory in the training step (XLA: Out of memory "
                         "while trying to allocate 120.09GiB on device 0); mimo_jax/memory.py "
                         "counts at least "), line
  assert "\n" not in line and "BufferAssignment" not in line
  for fix in ("more data.microbatches (now 2, 16 samples each)",
              "set topology.language.remat=full", "shard its state over dp "
              "(topology.language.shard=full)", "add dp, tp or pp (language needs the most); "
              "then run the same command (a run resumes from its newest checkpoint)."):
    assert fix in line, (fix, line)
  assert launch._explain(e.value) == (line, 1)  # launch's last line, status 1, no traceback
  assert checkpoint_steps.complete_steps(tmp_path / "checkpoints") == [2]

  monkeypatch.undo()
  monkeypatch.setattr(Evaluator, "__call__", _fails_at(1, Evaluator.__call__))
  with pytest.raises(memory.OutOfMemoryError,
                     match=r"^a device ran out of memory in the evaluation \(XLA: .*; mimo_jax"
                           r"/memory.py counts .*\. To use less, a smaller eval\.batch \(now 16\), "
                           r"shard"):
    train.run(cfg)  # resumes from step 2, trains 3 and 4, then its final eval fails
  assert checkpoint_steps.complete_steps(tmp_path / "checkpoints") == [2, 4]
  assert "saved step" not in capsys.readouterr().out  # step 4 was saved before the eval


def test_an_error_that_is_not_memory_is_left_alone():
  assert memory.xla_out_of_memory(ValueError("RESOURCE_EXHAUSTED: too many open files")) is None
  try:
    try:
      raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Failed to allocate request for "
                                       "2.99GiB (3206250496B) on device ordinal 0")
    except jax.errors.JaxRuntimeError as cause:
      raise RuntimeError("the step failed") from cause
  except RuntimeError as e:
    assert memory.xla_out_of_memory(e) == ("Failed to allocate request for 2.99GiB "
                                           "(3206250496B) on device ordinal 0")
