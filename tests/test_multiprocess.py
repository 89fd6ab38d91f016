"""Two local processes x 4 CPU devices, as two hosts: vision on one, language on the other."""

import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from mimo_jax import train
from mimo_jax.data import loader
from mimo_jax.checkpoint_steps import complete_steps
from tests.helpers import tiny_config, topology_arg

ROOT = pathlib.Path(__file__).resolve().parents[1]
SINGLE = {"vision": (0, 1, 1), "language": (0, 1, 1)}
FAN_IN = {"vision": (0, 4, 1), "language": (4, 2, 2)}  # process 0 -> process 1, 4 -> 2
FAN_OUT = {"vision": (0, 1, 1), "language": (4, 4, 1)}  # 1 -> 4
SPANNING = {"vision": (0, 2, 1), "language": (2, 2, 2)}  # language on devices of both processes
ONE_MESH = {"vision": (0, 8, 1), "language": (0, 8, 1)}  # one program a microbatch, both processes


def _args(data_dir, workdir, topo, *extra) -> list[str]:
  return [sys.executable, "-m", "tools.launch_local", "-n", "2", "--devices_per_process", "4",
          "--", f"--config=tests/configs/tiny.py:{topology_arg(**topo)}",
          f"--config.data.dir={data_dir}", f"--config.run.workdir={workdir}",
          "--config.run.log_every=1", *extra]


def _launch(*args) -> subprocess.CompletedProcess:
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run(list(args), cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=600)


def _train_records(workdir) -> dict[int, tuple[float, float]]:
  text = (pathlib.Path(workdir) / "metrics.jsonl").read_text()
  lines = text[:text.rfind("\n") + 1].splitlines()  # whole lines (a running run writes more)
  return {r["step"]: (r["loss"], r["grad_norm"]) for r in map(json.loads, lines) if "loss" in r}


@pytest.fixture(scope="module")
def reference(single_reference):
  return {i + 1: (m["loss"], m["grad_norm"]) for i, m in enumerate(single_reference)}


def _check_two_process_run(stdout, workdir, reference, topo, data_dir, finished=True) -> None:
  """A two-process run's first 4 steps equal the single-process reference (a longer run's too:
  the learning rate of its first 3 updates is the 4-step run's, still warming up); only process
  0 logs."""
  got = _train_records(workdir)
  if finished:
    assert sorted(got) == [1, 2, 3, 4]
  else:
    assert sorted(got) == list(range(1, max(got) + 1)) and max(got) >= 4, sorted(got)
  for step, want in reference.items():
    np.testing.assert_allclose(got[step], want, rtol=1e-4, err_msg=f"step {step}")
  assert "[1] " not in "".join(ln for ln in stdout.splitlines(True) if "step " in ln)
  if topo is FAN_IN:
    # Scalable reads: process 0 (which writes the metrics) holds only the encoder, so it reads
    # only the samples that have images.
    cfg = tiny_config(data_dir, **topo)
    ds = loader.train_dataset(cfg, loader.build_paths(cfg)["train"], 2)
    lines = (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()
    read = {r["step"]: r["records_read"] for r in map(json.loads, lines) if "loss" in r}
    want = {step: int(np.sum(ds[step - 1].samples.items_b > 0)) for step in range(1, 5)}
    assert read == want and sum(want.values()) < 4 * cfg.data.global_batch


@pytest.mark.parametrize("topo,extra", [
    pytest.param(FAN_IN, (), id="gathered"),  # modules on one process each: saved through both
    # The language model's mesh on devices of both processes, its arrays split over them (FSDP):
    # each process writes its own shards. (Fan-out, 1 -> 4, and one program a microbatch over
    # both processes are the long runs of the kill and SIGTERM tests.)
    pytest.param(SPANNING, ("--config.topology.language.shard=full",), id="sharded"),
])
def test_two_process_checkpoint_save_and_restore(data_dir, tmp_path, reference, topo, extra):
  """A two-process run saving mid-run equals the single-process run; its checkpoint resumes in
  one process, and, where each process wrote its own shards, in the same two processes."""
  first = tmp_path / "first"
  proc = _launch(*_args(data_dir, first, topo, "--config.checkpoint.every=2", *extra))
  assert proc.returncode == 0, proc.stdout[-3000:]
  assert not re.search("Connection refused|CANCELLED|WatchTasks", proc.stdout), proc.stdout[-3000:]
  _check_two_process_run(proc.stdout, first, reference, topo, data_dir)
  full = _train_records(first)
  # How each module was saved: as it is on its own mesh, each process writing its shards, or
  # moved to the global layout: split by rows over every device ("all") where the rows divide
  # evenly, else on one device of each process ("process").
  for module in ("vision", "language"):
    saved = json.loads((first / "checkpoints" / "2" / module / "_sharding").read_text())
    saved = [json.loads(v) for v in saved.values()]
    axes = {tuple(s["axis_names"]) for s in saved}
    if module == "language" and topo is SPANNING:
      assert axes == {("pp", "dp", "tp")}, axes
    else:
      assert axes == {("all",), ("process",)}, (module, axes)
      assert all(s["partition_spec"] == ["all"] for s in saved if s["axis_names"] == ["all"])
  if topo is SPANNING:
    # Devices are counted as the topology fields count them, with the processes that hold them.
    assert ("topology: vision: dp=2 tp=1 devices 0..1 (process 0); language: dp=2 tp=2 devices "
            "2..5 (processes 0, 1)") in proc.stdout, proc.stdout[-3000:]
    # Resume from step 2 with the same two processes, each reading its own shards: bitwise the
    # same steps 3 and 4.
    again = tmp_path / "again"
    shutil.copytree(first / "checkpoints", again / "checkpoints")
    shutil.rmtree(again / "checkpoints" / "4")
    proc = _launch(*_args(data_dir, again, topo, "--config.checkpoint.every=2", *extra))
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert f"resumed from {again / 'checkpoints'} step 2" in proc.stdout
    resumed = _train_records(again)
    assert sorted(resumed) == [3, 4]  # trained only what the checkpoint did not cover
    assert {s: resumed[s] for s in (3, 4)} == {s: full[s] for s in (3, 4)}
    # The finished run again: nothing to train and its final eval on record, for both processes
    # (process 0 alone reads the metrics), which end at once.
    records = (again / "metrics.jsonl").read_text()
    proc = _launch(*_args(data_dir, again, topo, "--config.checkpoint.every=2", *extra))
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "step 4 >= train.steps=4: nothing to train" in proc.stdout
    assert "its final eval on record: the state is not restored" in proc.stdout
    assert (again / "metrics.jsonl").read_text() == records
  # The same two-process checkpoint restored in one process on one device.
  single = tmp_path / "single"
  shutil.copytree(first / "checkpoints", single / "checkpoints")
  shutil.rmtree(single / "checkpoints" / "4")
  cfg = tiny_config(data_dir, **SINGLE)
  cfg.run.workdir, cfg.run.log_every, cfg.checkpoint.every = str(single), 1, 2
  records = {r["step"]: (r["loss"], r["grad_norm"]) for r in train.run(cfg) if "loss" in r}
  assert sorted(records) == [3, 4]
  for step in (3, 4):
    np.testing.assert_allclose(records[step], full[step], rtol=1e-4, err_msg=f"step {step}")


def _start(data_dir, workdir, topo):
  """A long two-process run, past its 4th step; returns the launcher, its output lines and the
  two pids."""
  args = _args(data_dir, workdir, topo, "--config.train.steps=2000")
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  launcher = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
  lines = []
  threading.Thread(target=lambda: lines.extend(iter(launcher.stdout.readline, "")),
                   daemon=True).start()
  metrics = pathlib.Path(workdir) / "metrics.jsonl"
  deadline = time.time() + 300
  while time.time() < deadline and (not metrics.exists() or 4 not in _train_records(workdir)):
    time.sleep(0.2)
  assert metrics.exists(), "".join(lines)[-3000:]
  pids = dict(re.findall(r"\[launch_local\] process (\d+): pid (\d+)", "".join(lines)))
  return launcher, lines, {int(k): int(v) for k, v in pids.items()}


def test_killed_process_ends_the_launcher(data_dir, tmp_path, reference):
  """Vision on process 0 feeding the language model on process 1 (fan-out, 1 -> 4): its first
  steps are the single-process ones; process 1 killed mid-run ends process 0 and the launcher."""
  launcher, lines, pids = _start(data_dir, tmp_path, FAN_OUT)
  _check_two_process_run("".join(lines), tmp_path, reference, FAN_OUT, data_dir, finished=False)
  os.kill(pids[1], signal.SIGKILL)
  killed = time.time()
  rc = launcher.wait(timeout=120)
  elapsed = time.time() - killed
  assert rc != 0
  assert elapsed < 60, elapsed
  with pytest.raises(ProcessLookupError):  # the surviving process was ended too
    os.kill(pids[0], 0)


def test_sigterm_to_one_process_stops_all_at_one_step(data_dir, tmp_path, reference):
  """Both modules on one mesh of both processes' devices (one program a microbatch): its first
  steps are the single-process ones; a SIGTERM to process 1 stops both at one step, saved."""
  launcher, lines, pids = _start(data_dir, tmp_path, ONE_MESH)
  os.kill(pids[1], signal.SIGTERM)  # a preemption notice reaching one host
  assert launcher.wait(timeout=120) == 0, "".join(lines)[-3000:]
  out = "".join(lines)
  _check_two_process_run(out, tmp_path, reference, ONE_MESH, data_dir, finished=False)
  saved = int(re.search(r"SIGTERM: saved step (\d+)", out).group(1))
  assert complete_steps(str(tmp_path / "checkpoints")) == [saved]
  assert max(_train_records(tmp_path)) == saved


@pytest.mark.parametrize("argv,said", [
    (["-n", "0"], "argument -n/--num_processes: 0: must be at least 1"),
    (["-n", "2", "--devices_per_process", "0"], "argument --devices_per_process: 0: must be in "
     "1..1024"),
    (["-n", "2", "--bogus"], "unrecognized arguments: --bogus"),
])
def test_the_launchers_bad_flags_are_one_line_before_any_process_starts(argv, said, capsys):
  from tools import launch_local  # pylint: disable=import-outside-toplevel
  with pytest.raises(SystemExit) as e:
    launch_local.main(argv)
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert err == f"python -m tools.launch_local: error: {said} (--help lists the flags).\n"


def test_the_launcher_names_a_killed_process_over_the_one_its_death_failed(tmp_path, monkeypatch,
                                                                           capsys):
  # Process 1 is killed; process 0, seeing it gone, exits 1 at once: both usually end between
  # two of the launcher's looks, and the killed one is named, with its status (128 + 9).
  from tools import launch_local  # pylint: disable=import-outside-toplevel
  gone = tmp_path / "gone"
  script = {0: f"import os, sys, time\nwhile not os.path.exists({str(gone)!r}): time.sleep(0.01)\n"
               "sys.exit(1)",
            1: f"import os\nopen({str(gone)!r}, 'w').close()\nos.kill(os.getpid(), 9)"}
  real = subprocess.Popen

  def popen(cmd, **kw):
    i = int(next(a for a in cmd if a.startswith("--process_id=")).split("=")[1])
    return real([sys.executable, "-c", script[i]], **kw)

  monkeypatch.setattr(launch_local.subprocess, "Popen", popen)
  assert launch_local.main(["-n", "2", "--"]) == 137
  err = capsys.readouterr().err
  assert "[launch_local] process 1 was killed by SIGKILL (status 137)" in err
  assert "process 0 exited" not in err


def test_a_workdir_only_process_0_takes_fails_every_process_cleanly(data_dir, tmp_path):
  """Process 0 alone checks and locks the workdir: in use by another run, it fails there, and
  every process ends with its own error line, together (no process aborted by the coordination
  service when another exits first), the workdir as it was."""
  work = tmp_path / "work"
  work.mkdir()
  lock = work / "run.lock"  # held by a live process on this host: this test's
  lock.write_text(json.dumps({"host": os.uname().nodename, "pid": os.getpid(),
                              "started": "2026-01-01 00:00:00"}))
  held = lock.read_text()
  proc = _launch(*_args(data_dir, work, FAN_OUT))
  out = proc.stdout + proc.stderr
  assert proc.returncode == 2, out[-3000:]
  assert f"[0] mimo_jax: process 0: error: {work} is in use by another run" in out, out[-3000:]
  assert (f"[1] mimo_jax: process 1: error: process 0 could not use run.workdir={str(work)!r} "
          "(its error line says why); nothing was written") in out, out[-3000:]
  for crash in ("Traceback", "Check failure", "Fatal Python error", "Terminating process"):
    assert crash not in out, out[-3000:]
  assert os.listdir(work) == ["run.lock"] and lock.read_text() == held
