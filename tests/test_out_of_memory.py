"""A device that runs out of memory: one line saying where (placing the state, the training
step, the evaluation), XLA's allocation, the bound of the modules on that device and the fields
that use less, and how to go on; nothing saved is lost, and a checkpoint read that runs out is not
called damaged. XLA's error is raised where the step, the restore or the eval would raise it."""

import jax
import pytest

from mimo_jax import checkpoint_steps, fingerprint, launch, memory, train, xla_errors
from mimo_jax.evaluate import Evaluator
from mimo_jax.step import Step
from tests.helpers import tiny_config

# XLA's words on an H200 (jax 0.11.2), and a buffer assignment's listing after them, as XLA's
# other out-of-memory errors have.
XLA = ("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 120.09GiB with allocator "
       "GPU_0_bfc on device {}. [tf-allocator-allocation-error=''] [executable_name='jit_update']"
       "\nBufferAssignment OOM Debugging.\nBufferAssignment stats:\n"
       "             parameter allocation:    6.00MiB\n")


def _cfg(data_dir, workdir):
  cfg = tiny_config(data_dir, vision=(0, 2, 1), language=(2, 2, 1))
  cfg.train.steps, cfg.checkpoint.every = 4, 2
  cfg.run.workdir, cfg.run.log_every, cfg.run.progress = str(workdir), 1, "lines"
  cfg.eval.samples = 16
  return cfg


def _fails(real, device: int, at=lambda *args: True):
  """`real`, raising XLA's error on `device` the first time `at(*args)` holds."""
  done = []

  def fails(*args, **kw):
    if not done and at(*args):
      done.append(1)
      raise jax.errors.JaxRuntimeError(XLA.format(device))
    return real(*args, **kw)
  return fails


def _raised(cfg) -> str:
  with pytest.raises(memory.OutOfMemoryError) as e:
    train.run(cfg)
  line = str(e.value)
  assert "\n" not in line and "BufferAssignment" not in line and "tf-allocator" not in line
  assert launch._explain(e.value) == (line, 1)  # launch's last line, status 1, no traceback
  return line


def test_the_state_the_step_and_the_eval_running_out_of_memory(data_dir, tmp_path, monkeypatch,
                                                                capsys):
  cfg = _cfg(data_dir, tmp_path)
  calls = []
  monkeypatch.setattr(Step, "train_step", _fails(Step.train_step, 2,
                                                 lambda *_: calls.append(1) or len(calls) == 3))
  line = _raised(cfg)  # step 3, on language's first device
  assert line.startswith("a device ran out of memory in the training step (XLA: Out of memory "
                         "while trying to allocate 120.09GiB on device 2); mimo_jax/memory.py "
                         "counts at least "), line
  for fix in (" MiB for language there, without XLA's temporaries. To use less, more "
              "data.microbatches (now 2, 16 samples each), set topology.language.remat=full, "
              "shard its state over dp (topology.language.shard=full) or add dp, tp or pp; then "
              "run the same command (a run resumes from its newest checkpoint).",):
    assert fix in line, (fix, line)
  assert checkpoint_steps.complete_steps(tmp_path / "checkpoints") == [2]
  monkeypatch.undo()

  # Reading step 2 back runs out on device 0: the state's, and not a damaged checkpoint.
  monkeypatch.setattr(fingerprint, "compile_ahead", _fails(fingerprint.compile_ahead, 0))
  line = _raised(cfg)
  assert line.startswith("a device ran out of memory while placing the state (XLA: Out of "
                         "memory while trying to allocate 120.09GiB on device 0); "), line
  assert " for vision there, " in line and "damaged" not in line
  assert ("To use less, shard its state over dp (topology.vision.shard=full) or add dp, tp or "
          "pp;") in line, line
  monkeypatch.undo()

  # Step 4's result runs out as it is waited for, as on a GPU (here it finished, and is saved
  # after the error; checkpoint.every 3 saved step 3 before).
  monkeypatch.setattr(train._Loop, "_flush", _fails(
      train._Loop._flush, 3, lambda loop, *_: loop.pending[0] == 4))
  cfg.checkpoint.every = 3
  assert " in the training step " in _raised(cfg)
  assert checkpoint_steps.complete_steps(tmp_path / "checkpoints") == [2, 3, 4]
  assert f"after the device ran out of memory: saved step 4 to {tmp_path}" in capsys.readouterr().out
  monkeypatch.undo()

  monkeypatch.setattr(Evaluator, "__call__", _fails(Evaluator.__call__, 3))
  line = _raised(cfg)  # resumes from step 4, the last, whose final eval fails
  assert line.startswith("a device ran out of memory in the evaluation (XLA: "), line
  assert ". To use less, a smaller eval.batch (now 16), shard its state over dp " in line, line


def test_only_xlas_memory_errors_are_taken_for_one():
  assert xla_errors.out_of_memory(ValueError("RESOURCE_EXHAUSTED: Out of memory")) is None
  assert xla_errors.out_of_memory(jax.errors.JaxRuntimeError(
      "RESOURCE_EXHAUSTED: Received message larger than max")) is None
  try:
    try:
      raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Failed to allocate request for "
                                       "2.99GiB (3206250496B) on device ordinal 0")
    except jax.errors.JaxRuntimeError as cause:
      raise RuntimeError("the step failed") from cause
  except RuntimeError as e:
    said = xla_errors.out_of_memory(e)
  assert said == "Failed to allocate request for 2.99GiB (3206250496B) on device ordinal 0"
  assert xla_errors.device_ordinal(said) == 0
