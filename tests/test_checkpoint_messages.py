"""What checkpoints say: a failed read's line, a step moved aside and why, a file or folder the
user may not read, tools.ckpt's usage and the placement it shows (the checkpoints themselves:
test_checkpoint.py)."""

import os

import numpy as np
import pytest

from mimo_jax import checkpoint
from mimo_jax.config import Config, ConfigError
from mimo_jax.state import ModuleState
from tests.helpers import run_main
from tools import ckpt as ckpt_tool


def test_a_failed_reads_line_names_the_array_and_file_not_the_storage_spec():
  """orbax wraps tensorstore's error, which names the array and the file, in one whose first line
  runs into a multi-line storage spec: the line said is tensorstore's."""
  from mimo_jax.checkpoint_orbax import read_failure
  cause = ValueError('OUT_OF_RANGE: Error reading "params.w/0.0.0" in OCDBT database at local '
                     'file "/c/30/vision/": Requested byte range [0, 64) is not valid for value '
                     'of size 50\n[tensorstore_spec=...]')
  try:
    try:
      raise cause
    except ValueError as e:
      raise Exception("Encountered error while reading array index: (slice(0, 2, 1),). See full "
                      "TensorStore details: <bound method spec of TensorStore({\n  'base': {"
                      ) from e
  except Exception as e:  # pylint: disable=broad-except
    said = read_failure(e)
  assert said == ('OUT_OF_RANGE: Error reading "params.w/0.0.0" in OCDBT database at local file '
                  '"/c/30/vision/": Requested byte range [0, 64) is not valid for value of size 50')
  alone = Exception("Encountered error while reading array index: (slice(0, 2, 1),). See full "
                    "TensorStore details: <bound method spec of TensorStore({\n  'base': {")
  assert read_failure(alone) == "Encountered error while reading array index: (slice(0, 2, 1),)."


def test_a_step_moved_aside_is_said_with_its_reason():
  """A run's opening line for each step folder it moved aside says why, by the suffix the
  checkpointer gave it (a restore_step's newer steps were called "not a complete step")."""
  from mimo_jax.checkpoint_steps import why_aside as _why_aside
  assert "newer than checkpoint.restore_step" in _why_aside("/w.1/checkpoints/30.replaced-2")
  assert "never completed" in _why_aside("/w/checkpoints/12.uncommitted")


def _two_steps(tmp_path):
  """A checkpoints folder of steps 1 and 2, a parameter each, saved as a run saves them."""
  path = tmp_path / "checkpoints"
  ckpt = checkpoint.Checkpointer(str(path), ["language"], async_save=False)
  for step in (1, 2):
    ckpt.save(step, {"language": ModuleState({"w": np.full((4,), step, np.float32)}, None)},
              Config(), force=True, params_only=True)
  ckpt.close()
  return path


def test_a_step_this_user_may_not_read_is_named_with_the_fix_never_called_damaged(tmp_path,
                                                                                 monkeypatch):
  """A file or folder of a step that the user may not read (chmod 000, or another user's folder:
  simulated, as root reads them) stops a resume and every tool with one line naming it and the
  fix; the step is never called damaged, moved aside or passed over for an older one."""
  import builtins  # pylint: disable=import-outside-toplevel
  path = _two_steps(tmp_path)
  listing = lambda: sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
  before = listing()
  meta, folder = path / "2" / "meta" / "metadata", path / "2"
  opened, stat = builtins.open, os.stat

  def no_read(file, *args, **kwargs):  # the step's metadata file, mode 000
    if os.fspath(file) == str(meta):
      raise PermissionError(13, "Permission denied", os.fspath(file))
    return opened(file, *args, **kwargs)

  def no_entry(name, *args, **kwargs):  # the step's folder, another user's (mode 700)
    if os.fspath(name).startswith(f"{folder}{os.sep}"):
      raise PermissionError(13, "Permission denied", os.fspath(name))
    return stat(name, *args, **kwargs)
  for module, name, fn, denied in ((builtins, "open", no_read, f"file {meta}"),
                                   (os, "stat", no_entry, f"folder {folder}")):
    line = (f"cannot read the checkpoint {denied}: permission denied; fix its permissions, and "
            "run the same command again (nothing was moved aside or deleted).")
    with monkeypatch.context() as patch:
      patch.setattr(module, name, fn)
      with pytest.raises(ConfigError) as err:
        ckpt = checkpoint.Checkpointer(str(path), ["language"])  # as a run opens it
        try:
          assert ckpt.resume_step() == 2  # the newest: never step 1 in its place
          ckpt.read_meta(2)
        finally:
          ckpt.close()
      assert str(err.value) == line
      for args in (("inspect",), ("check",), ("export", "--out", tmp_path / "out.safetensors")):
        out = run_main(ckpt_tool.main, *args[:1], str(tmp_path), *args[1:])
        assert out.returncode == 2 and out.stderr == f"tools.ckpt: error: {line}\n", out
        assert "step 2" not in out.stdout, out.stdout
    assert listing() == before  # nothing moved aside, written or deleted


def test_a_damaged_json_file_of_a_step_is_named(tmp_path):
  """A step's metadata file or a module's tree metadata cut short (orbax's JSON error names no
  file) is named, relative to the step's folder, by the tools and by a run that reads it."""
  path = _two_steps(tmp_path)
  for name in ("2/meta/metadata", "1/language/_METADATA"):
    with open(path / name, "r+b") as f:
      f.truncate(os.path.getsize(path / name) // 2)
  out = run_main(ckpt_tool.main, "check", str(tmp_path))
  lines = out.stdout.splitlines()
  assert lines[0].startswith("step 1: FAILED: language: unreadable (language/_METADATA: "), lines
  assert lines[1].startswith("step 2: FAILED: meta: unreadable (meta/metadata: "), lines
  ckpt = checkpoint.Checkpointer(str(path), ["language"])  # as a run opens it
  try:
    for read, said in ((lambda: ckpt.read_meta(2), "has no readable metadata (meta/metadata: "),
                       (lambda: ckpt.saved_arrays(1, ["language"]),
                        "could not be restored: language/_METADATA: ")):
      with pytest.raises(ConfigError) as err:
        read()
      assert said in str(err.value), str(err.value)
  finally:
    ckpt.close()


def test_a_damaged_orbax_record_of_a_save_is_one_note_and_the_step_passes(tmp_path, caplog,
                                                                          monkeypatch):
  """A step's _CHECKPOINT_METADATA cut short (orbax's own record of the save, which no restore
  reads): the step restores whole, so `check` passes it with one note naming the file, what it
  means and the fix (inspect says it on stderr), and orbax's ERROR about it is not logged."""
  import builtins  # pylint: disable=import-outside-toplevel
  path = _two_steps(tmp_path)
  record = path / "2" / "_CHECKPOINT_METADATA"
  with open(record, "r+b") as f:
    f.truncate(os.path.getsize(record) // 2)
  for command, shown, said in (("check", "stdout", "step 2: note: "),
                               ("inspect", "stderr", "tools.ckpt: note: step 2: ")):
    caplog.clear()
    out = run_main(ckpt_tool.main, command, str(tmp_path))
    assert out.returncode == 0, out
    notes = [ln for ln in getattr(out, shown).splitlines() if "_CHECKPOINT_METADATA" in ln]
    assert len(notes) == 1, notes
    assert notes[0].startswith(f"{said}{record} is damaged (Unterminated string") and \
        notes[0].endswith(
        "so nothing of the step is lost with it; delete the file (orbax then notes, as a "
        "warning, that it is missing)."), notes
    assert [r for r in caplog.records if "_CHECKPOINT_METADATA" in r.getMessage()] == []
    assert command != "check" or "step 2: 1 arrays restored, ok" in out.stdout, out.stdout
  from mimo_jax import checkpoint_orbax  # pylint: disable=import-outside-toplevel
  opened = builtins.open

  def no_read(file, *args, **kwargs):  # the record, mode 000: said unreadable
    if os.fspath(file) == str(record):
      raise PermissionError(13, "Permission denied", os.fspath(file))
    return opened(file, *args, **kwargs)
  monkeypatch.setattr(builtins, "open", no_read)
  assert checkpoint_orbax.step_record_failure(str(path / "2")) == "unreadable (Permission denied)"


def test_a_damaged_orbax_record_is_one_note_where_a_resume_or_tool_reads_the_step(tmp_path,
                                                                                caplog, capsys):
  """A resume (Checkpointer.checked_meta: the run's notes) and the tools that read through
  Reader (tools.hf export, tools.generate, tools.eval) say a step's damaged _CHECKPOINT_METADATA
  as one note, once per read of the step; orbax's ERROR about it is not logged."""
  path = _two_steps(tmp_path)
  record = path / "2" / "_CHECKPOINT_METADATA"
  with open(record, "r+b") as f:
    f.truncate(os.path.getsize(record) // 2)
  said = f"{record} is damaged (Unterminated string"
  from mimo_jax.checkpoint_reader import Reader  # pylint: disable=import-outside-toplevel
  reader = Reader(str(tmp_path))
  reader.note("tools.generate")
  for step in (2, 2, 1):
    reader.meta(step)
  reader.close()
  err = capsys.readouterr().err.splitlines()
  assert [ln for ln in err if "_CHECKPOINT_METADATA" in ln] == err, err
  assert len(err) == 1 and err[0].startswith(f"tools.generate: note: step 2: {said}"), err
  ckpt = checkpoint.Checkpointer(str(path), ["language"])  # as a run opens it
  try:
    ckpt.checked_meta(2, Config())
  finally:
    ckpt.close()
  assert [n for n in ckpt.notes if "_CHECKPOINT_METADATA" in n] == [err[0].split(": ", 3)[3]]
  assert [r for r in caplog.records if "_CHECKPOINT_METADATA" in r.getMessage()] == []


def _lora_steps(tmp_path, steps: tuple[int, ...]):
  """A LoRA run's checkpoints folder: its base in step 0 (parameters only), then `steps`
  (parameters and optimizer state), saved naming step 0's `w` as their frozen weights (as
  name_base sets the base)."""
  from mimo_jax.checkpoint_steps import Base  # pylint: disable=import-outside-toplevel
  w, a = np.arange(6, dtype=np.float32), np.ones((2,), np.float32)
  path = tmp_path / "checkpoints"
  ckpt = checkpoint.Checkpointer(str(path), ["language"], async_save=False)
  zero = ckpt.save(0, {"language": ModuleState({"w": w, "a": a}, None)}, Config(), force=True,
                   params_only=True)["fingerprints"]["language"]
  ckpt.base = Base(".", 0, {"language": {"params/w": zero["params/w"]}})
  for step in steps:
    ckpt.save(step, {"language": ModuleState({"w": w, "a": a}, {"mu": a})}, Config(), force=True)
  ckpt.close()
  return path


def test_check_of_a_lora_run_whose_only_passing_step_is_its_base_advises_no_restore_step(
    tmp_path):
  """A LoRA run's step 0 (its frozen base) is the only step that passed: restore_step=0 names the
  newest step, so the advice is to move the failed steps out and start again, which resumes
  from step 0."""
  path = _lora_steps(tmp_path, (2, 4))
  for step in (2, 4):
    meta = path / str(step) / "meta" / "metadata"
    with open(meta, "r+b") as f:
      f.truncate(os.path.getsize(meta) // 2)
  out = run_main(ckpt_tool.main, "check", str(tmp_path))
  assert out.returncode == 2, out
  assert "--config.checkpoint.restore_step=0" not in out.stderr, out.stderr
  assert (f"only step 0 passed (the weights the run started from): move the failed steps 2, 4 "
          f"out of {path} (e.g. `mv {path}/4 {path}/4.damaged`) and start the run again") in \
      out.stderr, out.stderr
  for step in (2, 4):
    os.rename(path / str(step), path / f"{step}.damaged")
  ckpt = checkpoint.Checkpointer(str(path), ["language"])  # the run started again, as advised
  try:
    assert ckpt.resume_step() == 0
  finally:
    ckpt.close()


def test_inspect_of_a_lora_step_says_its_frozen_weights_are_in_its_base(tmp_path):
  """A LoRA run's step holds its adapters and trained groups, not its frozen weights: inspect
  counts the parameters as this step's and names the base step that holds the frozen ones, with
  their count and the model's; a base that is gone is said so (exit 0: the step is as shown)."""
  path = _lora_steps(tmp_path, (2,))
  said = lambda what: (f"frozen base: {what}, not in this step but in its base, step 0 of "
                       f"{path} (a LoRA run saves its frozen weights once)")
  for line in (said("6 parameters (language 6; 1 array)") + "; with them the model has 8 "
               "parameters.",
               said("1 array") + ", which is not there (moved or deleted): put it back, or "
               "resume with --config.checkpoint.base=DIR naming where it is now."):
    if "not there" in line:
      os.rename(path / "0", path / "0.moved")
    out = run_main(ckpt_tool.main, "inspect", str(tmp_path))
    assert out.returncode == 0 and out.stderr == "", out
    lines = out.stdout.splitlines()
    assert "total: 2 parameters in this step (the weights it trained)" in lines, lines
    assert line in lines, lines


def test_a_base_folder_this_user_may_not_list_is_named_with_the_fix(tmp_path, monkeypatch):
  """A LoRA run's frozen base (checkpoint_steps.Base) in a folder this user may enter but not
  list (mode 711, or another user's: simulated, as root lists them) stops a resume with one line
  naming that folder and the fix, checkpoint.base among it, as the run's own folder does; never a
  raw PermissionError, and nothing moved aside."""
  import jax  # pylint: disable=import-outside-toplevel
  from mimo_jax.checkpoint_steps import Base  # pylint: disable=import-outside-toplevel
  w, a = np.arange(4, dtype=np.float32), np.ones((2,), np.float32)
  base, run = tmp_path / "base" / "checkpoints", tmp_path / "run" / "checkpoints"
  ckpt = checkpoint.Checkpointer(str(base), ["language"], async_save=False)
  zero = ckpt.save(0, {"language": ModuleState({"w": w, "a": a}, None)}, Config(), force=True,
                   params_only=True)["fingerprints"]["language"]
  ckpt.close()
  ckpt = checkpoint.Checkpointer(str(run), ["language"], async_save=False)
  ckpt.base = Base(str(base), 0, {"language": {"params/w": zero["params/w"]}})  # w stays there
  ckpt.save(2, {"language": ModuleState({"w": w, "a": a}, {"mu": a})}, Config(), force=True)
  ckpt.close()
  one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  spec = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one)
  abstract = {"language": {"params": {"w": spec(w), "a": spec(a)}, "opt_state": {"mu": spec(a)}}}

  def resume():
    ckpt = checkpoint.Checkpointer(str(run), ["language"])  # as a run opens it
    try:
      return ckpt.restore(ckpt.resume_step(), abstract, Config())[0]["language"].params
    finally:
      ckpt.close()
  np.testing.assert_array_equal(resume()["w"], w)  # read from the base
  listing = lambda: sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
  before = listing()
  listdir, scandir = os.listdir, os.scandir
  for denied in (base / "0", base):  # its step's folder, its checkpoints folder
    def no_list(name=".", fn=listdir, denied=denied):
      if os.path.abspath(os.fspath(name)) == str(denied):
        raise PermissionError(13, "Permission denied", os.fspath(name))
      return fn(name)
    with monkeypatch.context() as patch:
      patch.setattr(os, "listdir", no_list)
      patch.setattr(os, "scandir", lambda name=".", d=denied: no_list(name, scandir, d))
      with pytest.raises(ConfigError) as err:
        resume()
    assert str(err.value) == (
        f"cannot read the checkpoint folder {denied} (the frozen base of step 2): "
        "permission denied; fix its permissions, or name another copy of that base with "
        "--config.checkpoint.base=DIR (a workdir or its checkpoints folder), and run the same "
        "command again (nothing was moved aside or deleted).")
  assert listing() == before  # nothing moved aside, written or deleted


def test_the_tools_usage_names_the_module_it_runs_as(capsys):
  """`python -m tools.ckpt --help` shows the command that runs it (not `tools.tools.ckpt`); its
  errors stay one line starting `tools.ckpt: error:`."""
  for args, usage in (([], "python -m tools.ckpt [-h]"), (["inspect"], "python -m tools.ckpt "
                                                                         "inspect [-h]")):
    with pytest.raises(SystemExit) as stop:
      ckpt_tool.main([*args, "--help"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: {usage}")
  with pytest.raises(SystemExit) as stop:
    ckpt_tool.main(["inspect"])
  assert stop.value.code == 2
  assert capsys.readouterr().err.startswith("tools.ckpt: error: the following arguments")


def test_inspect_names_a_modules_stages_and_sharding():
  assert ckpt_tool.placement({"dp": 2, "tp": 1, "pp": 1, "virtual": 1, "schedule": "auto",
                              "shard": "none", "offset": 0}) == "dp=2 tp=1 offset=0"
  assert ckpt_tool.placement({"dp": 1, "tp": 2, "pp": 2, "virtual": 2, "schedule": "1f1b",
                              "shard": "full", "offset": 1}) == \
      "dp=1 tp=2 pp=2 virtual=2 schedule=1f1b shard=full offset=1"
  assert ckpt_tool.placement({"dp": 4, "tp": 1, "offset": 0}) == "dp=4 tp=1 offset=0"  # older
