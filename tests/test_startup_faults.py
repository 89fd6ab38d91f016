"""Faults at start-up. A run that fails or stops before its first step leaves nothing it made
behind: not its workdir, an empty metrics file, TensorBoard's folder or a lock; what was there
before it stays. The measuring tools that plan or spawn runs (tools.plan, tools.fp8_check,
tools.restart_bench) refuse a bad flag, input file or run config in one line before any work.
Ctrl-C while a command imports its modules is one line, not a traceback."""

import importlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from mimo_jax import checkpoint, precompile, train, workdir
from mimo_jax.data import capacity, conversion, digits
from mimo_jax.step import Step
from tests.helpers import tiny_config
from tests.test_lora import lora_config

ROOT = pathlib.Path(__file__).resolve().parents[1]

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


def _importing(pid: int) -> bool:
  """Whether process `pid` handles SIGTERM itself (Linux's /proc/PID/status) and has loaded numpy
  but not JAX's library yet (/proc/PID/maps): launch's handlers, amid its imports (numpy's come
  after its first line; before it, mimo_jax/__init__.py's guard handles SIGTERM too)."""
  with open(f"/proc/{pid}/status", encoding="utf-8") as f:
    caught = next(line.split()[1] for line in f if line.startswith("SigCgt:"))
  with open(f"/proc/{pid}/maps", encoding="utf-8") as f:
    maps = f.read()
  return (bool(int(caught, 16) >> (signal.SIGTERM - 1) & 1) and "_multiarray_umath" in maps
          and "jaxlib" not in maps)


def test_a_signal_while_launch_imports_ends_the_run_in_one_line(data_dir, tmp_path):
  """Ctrl-C in launch's first seconds (importing JAX and orbax) is the start-up's one line and
  status 0, as later in the start-up, not a KeyboardInterrupt's traceback: nothing is made."""
  work = tmp_path / "run"
  got = _interrupted([sys.executable, "-m", "mimo_jax.launch", f"--config.run.workdir={work}",
                      f"--config.data.dir={data_dir}"], _importing, "no handler before the imports")
  assert got == (0, "SIGINT before the first step: nothing to save.\n", ""), got[2][-3000:]
  assert not work.exists()


def _numpy_loaded(pid: int) -> bool:
  with open(f"/proc/{pid}/maps", encoding="utf-8") as f:
    return "_multiarray_umath" in f.read()


def _interrupted(cmd: list[str], ready, never: str,
                 sig: int = signal.SIGINT) -> tuple[int, str, str]:
  """`cmd` sent `sig` once `ready(pid)`: its status, stdout and stderr."""
  proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  try:
    deadline = time.time() + 60
    while not ready(proc.pid):
      assert proc.poll() is None and time.time() < deadline, never
      time.sleep(0.005)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
  finally:
    proc.kill()
  return proc.returncode, out, err


@pytest.mark.parametrize("sig,status,said", [(signal.SIGINT, 130, "Ctrl-C"),
                                              (signal.SIGTERM, 143, "SIGTERM")])
def test_ctrl_c_while_a_tool_imports_is_one_line_and_status_130(sig, status, said):
  """Ctrl-C (or SIGTERM) while `python -m tools.ckpt` imports (numpy loaded, JAX's and orbax's
  imports to come: mimo_jax/starting.py) is one line and status 130 (143), not a
  KeyboardInterrupt's traceback from inside an import (nor a silent death)."""
  # numpy's library mapped (/proc/PID/maps): past tools/__init__.py
  got = _interrupted([sys.executable, "-m", "tools.ckpt", "--help"], _numpy_loaded,
                     "numpy was never imported", sig)
  assert got == (status, "", f"tools.ckpt: interrupted ({said}) while starting; nothing was "
                 "written.\n"), got[2]


def test_a_signal_before_the_run_makes_anything_ends_it_in_one_line(data_dir, tmp_path,
                                                                    monkeypatch, capsys):
  """A signal while the run checks its config and builds its step (or one its caller took:
  launch's, while it imported) ends it before anything is made, in one line."""
  built = Step.build

  def build_then_signal(cfg, *args, **kw):
    trainer = built(cfg, *args, **kw)
    os.kill(os.getpid(), signal.SIGTERM)
    return trainer
  def unhandled(*_):
    raise AssertionError("the run had no handler of SIGTERM")
  monkeypatch.setattr(Step, "build", build_then_signal)
  cfg = _cfg(data_dir, tmp_path / "new" / "run")
  kept = signal.signal(signal.SIGTERM, unhandled)
  try:
    assert train.run(cfg) == []
  finally:
    signal.signal(signal.SIGTERM, kept)
  monkeypatch.setattr(Step, "build", built)
  assert train.run(cfg, pending=lambda: "SIGINT") == []
  assert capsys.readouterr().out.splitlines() == [
      "SIGTERM before the first step: nothing to save.",
      "SIGINT before the first step: nothing to save."]
  assert list(tmp_path.iterdir()) == []


def test_a_signal_while_the_tasks_data_is_built_stops_it_at_once(data_dir, tmp_path,
                                                                 monkeypatch, capsys):
  """A signal while the built-in task builds its data on first use stops the build where it is,
  leaves none of it (nor the data.dir it made), and ends the run in one line."""
  wrote = digits._write_source

  def write_then_signal(*args):
    wrote(*args)
    os.kill(os.getpid(), signal.SIGINT)
  monkeypatch.setattr(digits, "_write_source", write_then_signal)
  monkeypatch.setattr(conversion, "convert", lambda *a, **k: pytest.fail("the build went on"))
  cfg = _cfg(data_dir, tmp_path / "run")
  cfg.data.dir = str(tmp_path / "new" / "data")
  assert train.run(cfg) == []
  assert capsys.readouterr().out.splitlines()[-1] == (
      "SIGINT before the first step: nothing to save.")
  assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("ahead", [0, 1])
def test_a_signal_while_the_first_step_compiles_saves_nothing(data_dir, tmp_path, monkeypatch,
                                                              capsys, ahead):
  """Ctrl-C while the first step's program compiles (in the call, or ahead in a thread): the run
  ends as before its first step, with nothing saved (it ran and saved step 1)."""
  def compiled_then_signal(self, state, batch):  # pylint: disable=unused-argument
    os.kill(os.getpid(), signal.SIGINT)  # as if taken during the compile in this call
    return state, {}
  if ahead:
    wait = precompile.Compiler.wait

    def signal_then_wait(self, keys):
      os.kill(os.getpid(), signal.SIGINT)
      return wait(self, keys)
    monkeypatch.setattr(precompile.Compiler, "wait", signal_then_wait)
  else:  # nothing compiles: the state is none, the step a stand-in
    monkeypatch.setattr(Step, "init_state", lambda *_: {})
    monkeypatch.setattr(Step, "train_step", compiled_then_signal)
  cfg = _cfg(data_dir, tmp_path / "new" / "run")
  cfg.run.compile_ahead = ahead
  assert train.run(cfg) == []
  assert capsys.readouterr().out.splitlines()[-1].endswith(
      "SIGINT before the first step: nothing to save.")
  assert list(tmp_path.iterdir()) == []


def test_a_lora_run_stopped_before_its_first_step_leaves_not_its_base(data_dir, tmp_path,
                                                                     monkeypatch, capsys):
  """A LoRA run saves its frozen weights as a step 0 when it starts (the base its steps name):
  stopped before its first step, it leaves that no more than its workdir, metrics file or tb/."""
  named = checkpoint.name_base

  def name_then_signal(ckpt, *args):
    named(ckpt, *args)
    assert ckpt.base is not None  # the step 0 of the frozen weights is being saved
    os.kill(os.getpid(), signal.SIGTERM)
  monkeypatch.setattr(checkpoint, "name_base", name_then_signal)
  cfg = lora_config(data_dir)
  cfg.run.workdir, cfg.run.compile_ahead = str(tmp_path / "new" / "run"), 0  # nothing compiles
  assert train.run(cfg) == []
  assert capsys.readouterr().out.splitlines()[-1].endswith(
      "SIGTERM before the first step: nothing to save.")
  assert list(tmp_path.iterdir()) == []


def test_only_what_the_run_made_and_holds_nothing_is_removed(tmp_path):
  """Records or a checkpoints folder keep everything (but one this run made holding only a LoRA
  run's base, its step 0, without records); files that were there before stay."""
  def run_writes(path, records: str, saved: tuple = ()):
    made = workdir.Made(str(path))
    (path / "tb").mkdir(parents=True, exist_ok=True)
    (path / "tb" / "events.out.tfevents.1.host").write_bytes(b"header")
    (path / "metrics.jsonl").write_text(records)
    for step in saved:
      (path / "checkpoints" / step).mkdir(parents=True)
      (path / "checkpoints" / step / "meta").write_text("{}")
    lock = workdir.Lock(str(path)).acquire()
    made.remove_unused(lock)
    assert not (path / workdir.LOCK).exists()

  run_writes(tmp_path / "a", "")
  assert not (tmp_path / "a").exists()
  run_writes(tmp_path / "b", '{"step": 1}\n')
  assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["metrics.jsonl", "tb"]
  run_writes(tmp_path / "c", "", saved=("1",))
  assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["checkpoints", "metrics.jsonl",
                                                                "tb"]
  run_writes(tmp_path / "base", "", saved=("0",))  # a LoRA run's base alone: nothing of value
  assert not (tmp_path / "base").exists()
  for name, records, saved in (("base_records", '{"step": 1}\n', ("0",)),
                               ("base_steps", "", ("0", "2"))):
    run_writes(tmp_path / name, records, saved)
    assert sorted(p.name for p in (tmp_path / name / "checkpoints").iterdir()) == list(saved)
  # A step 0 from before (an import's, a run's base): not this run's to remove.
  imported = tmp_path / "imported"
  (imported / "checkpoints" / "0").mkdir(parents=True)
  run_writes(imported, "")
  assert [p.name for p in (imported / "checkpoints").iterdir()] == ["0"]
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


_TOOL_CASES = [  # (tool, argv with {tmp} for the test's folder, words of the one line)
    ("plan", ["--gpus=0", "--config=configs/vlm.py"], ["--gpus=0: must be at least 1."]),
    ("plan", ["--gpus=4", "--bridge_gbps=0"], ["--bridge_gbps=0: must be more than 0"]),
    ("plan", ["--gpus=x"], ["--gpus=x: not an integer."]),
    ("plan", ["--gpus=4", "--bogus"], ["unrecognized arguments: --bogus"]),
    ("plan", ["--gpus=4"], ["give --config or a --profile"]),
    ("plan", ["--gpus=4", "--config=configs/vlm.py", "--pp=x"], ["--pp=x: not stage counts"]),
    ("plan", ["--gpus=4", "--config=configs/vlm.py"], ["--profile is needed for predictions"]),
    ("plan", ["--gpus=4", "--profile={tmp}/missing.json"],
     ["--profile={tmp}/missing.json: No such file or directory"]),
    ("plan", ["--gpus=4", "--profile={tmp}/garbled.json"], ["garbled.json: not JSON"]),
    ("plan", ["--gpus=4", "--config=configs/vlm.py", "--layouts_only",
              "--measured={tmp}/rowless.json"], ["not a tools/bench.py --json file"]),
    ("plan", ["--gpus=1", "--profile={tmp}/no_data.json"], ["config.data.dir: {tmp}/none"]),
    ("plan", ["--gpus=4", "--config=configs/digits.py", "--pp=2", "--schedules=interleaved_1f1b"],
     ["--schedules=interleaved_1f1b: interleaved_1f1b chunks each stage into --virtual chunks; "
      "give --virtual 2 or more."]),
    # Every field is checked as launch checks it, before any layout is planned.
    ("plan", ["--gpus=4", "--config=configs/digits.py", "--layouts_only",
              "--set", "model.language.heads=3"],
     ["config.model.language.heads: 3 must divide dim 128."]),
    ("fp8_check", ["--seeds", "0,0"], ["--seeds=0,0: two or more different seeds"]),
    ("fp8_check", ["--set", "model.encoders.vision.fp8=false"],
     ["--set model.encoders.vision.fp8=false: this tool sets that field itself"]),
    ("fp8_check", ["--scaling", "delayed", "--set", "optim.freeze=vision", "--out", "{tmp}/out"],
     ["the fp8 runs: config.model.vision.fp8_scaling: delayed scaling"]),
    ("fp8_check", ["--out", "{tmp}/afile"], ["--out={tmp}/afile: a file, not a folder"]),
    ("restart_bench", ["--timeout", "0"], ["--timeout=0: must be more than 0."]),
    ("restart_bench", ["--restarts=-1"], ["--restarts=-1: must be at least 1."]),
    ("restart_bench", ["--set", "run.log_every=5"], ["--set run.log_every=5: this tool sets"]),
    ("restart_bench", ["--json", "{tmp}/no/figures.json"], ["{tmp}/no does not exist"]),
    ("restart_bench", ["--keep", "{tmp}/afile"], ["--keep={tmp}/afile: a file, not a folder"]),
    ("restart_bench", ["--config=configs/digits.py", "--set", "data.task=conversations",
                       "--set", "model.language.vocab_size=32", "--set", "data.image_token=3",
                       "--set", "data.dir={tmp}/none"],
     ["the cold run: config.data.dir: {tmp}/none not found"]),
]


@pytest.mark.parametrize("tool,argv,words", _TOOL_CASES,
                         ids=[f"{c[0]}-{' '.join(c[1])}" for c in _TOOL_CASES])
def test_a_tools_bad_input_is_one_line_before_any_work(tool, argv, words, tmp_path, capsys,
                                                       monkeypatch):
  """Flags, input files and each spawned run's config are checked first: one line `TOOL: error:
  ...`, exit status 2, no run started and no folder made."""
  (tmp_path / "afile").write_text("")
  (tmp_path / "garbled.json").write_text("{rows")
  (tmp_path / "rowless.json").write_text(json.dumps({"config": "configs/vlm.py", "set": []}))
  (tmp_path / "no_data.json").write_text(json.dumps({
      "config": "tests/configs/tiny_vlm.py", "set": ["data.task=conversations",
                                                     f"data.dir={tmp_path}/none"],
      "rows": [{"layout": "vision=0/1/1,language=0/1/1", "step_s": 1.0, "busy_vision_s": 0.3,
                "busy_language_s": 0.6}]}))
  before = sorted(tmp_path.iterdir())

  def spawned(*args, **kw):
    raise AssertionError(f"a run was started: {args}")
  monkeypatch.setattr(subprocess, "Popen", spawned)
  monkeypatch.setattr(subprocess, "run", spawned)
  with pytest.raises(SystemExit) as raised:
    importlib.import_module(f"tools.{tool}").main([a.format(tmp=tmp_path) for a in argv])
  assert raised.value.code == 2
  out, err = capsys.readouterr()
  lines = err.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith(f"{tool}: error: "), err
  assert "Traceback" not in err and lines[0].endswith("."), lines[0]
  for w in words:
    assert w.format(tmp=tmp_path) in lines[0], (w, lines[0])
  assert sorted(tmp_path.iterdir()) == before and not out, out
