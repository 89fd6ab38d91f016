"""Faults injected into real runs (`python -m mimo_jax.launch` in a subprocess): damaged
checkpoints, a stale step folder, divergence, two runs on one workdir, SIGTERM mid-run and during
the final save, too few image slots, a damaged shard, a full disk and an unwritable workdir. Each
asserts that nothing is lost and that the run's last line is one sentence, without a traceback."""

import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time

from mimo_jax.checkpoint import complete_steps
from mimo_jax.config import Config
from mimo_jax.data import digits
from tests.helpers import run_main
from tools import ckpt

ROOT = pathlib.Path(__file__).resolve().parents[1]
SMALL = ["--config.data.train_samples=2000", "--config.data.eval_samples=200",
         "--config.eval.samples=16", "--config.eval.batch=16", "--config.model.language.layers=1",
         "--config.model.vision.layers=1", "--config.run.log_every=1",
         "--config.run.progress=lines"]


def _args(data_dir, workdir, *extra):
  return [sys.executable, "-m", "mimo_jax.launch", f"--config.run.workdir={workdir}",
          f"--config.data.dir={data_dir}", *SMALL, *extra]


def _run(args, **kw):
  return subprocess.run(args, cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"),
                        capture_output=True, text=True, timeout=600, **kw)


def _ckpt(*args):
  return run_main(ckpt.main, *args)  # `python -m tools.ckpt ARGS`, in this process


def _one_line_error(proc, status: int, *words: str) -> str:
  """The run failed with `status`, its last line is one error sentence with `words`, and nothing
  on standard error is a traceback."""
  assert proc.returncode == status, (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])
  assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
  last = proc.stderr.strip().splitlines()[-1]
  assert last.startswith("mimo_jax: error: ") and last.endswith("."), last
  for w in words:
    assert w in last, (w, last)
  return last


def _flip(path: pathlib.Path, count: int = 64) -> None:
  data = bytearray(path.read_bytes())
  for i in range(count):
    data[len(data) // 3 + 5 * i] ^= 0xA5
  path.write_bytes(bytes(data))


def _records(workdir) -> list[dict]:
  return [json.loads(ln) for ln in (pathlib.Path(workdir) / "metrics.jsonl").read_text()
          .splitlines()]


def test_damaged_checkpoints_and_a_stale_step_folder(data_dir, tmp_path):
  work = tmp_path / "run"
  proc = _run(_args(data_dir, work, "--config.train.steps=4", "--config.checkpoint.every=2"))
  assert proc.returncode == 0, proc.stderr[-3000:]
  ckpts = work / "checkpoints"
  assert _ckpt("check", work).returncode == 0
  # Flipped bytes in the array files of both modules of step 4 (parameters and optimizer state
  # live in them).
  for module in ("vision", "language"):
    files = sorted((ckpts / "4" / module).rglob("d/*"), key=lambda p: p.stat().st_size)
    _flip(files[-1])
  check = _ckpt("check", work)
  assert check.returncode != 0
  assert "step 2: " in check.stdout and "arrays restored, ok" in check.stdout
  assert "step 4: FAILED" in check.stdout
  assert "vision" in check.stdout and "language" in check.stdout
  # The newest step failed: resume from the newest that passed (moving only step 4 aside).
  advice = check.stderr.strip().splitlines()[-1]
  assert "step 4" in advice and "--config.checkpoint.restore_step=2" in advice, advice
  # A resume refuses step 4 and names the flag that takes step 2.
  again = _run(_args(data_dir, work, "--config.train.steps=6"))
  _one_line_error(again, 2, "step 4", "--config.checkpoint.restore_step=2",
                  f"python -m tools.ckpt check {work}")  # step 2 may be damaged too
  assert complete_steps(ckpts) == [2, 4]  # nothing written, nothing lost
  # A stale step folder (a save cut short: no commit_success.txt) is moved aside, never counted.
  shutil.copytree(ckpts / "2", ckpts / "6")
  (ckpts / "6" / "commit_success.txt").unlink()
  resumed = _run(_args(data_dir, work, "--config.train.steps=6",
                       "--config.checkpoint.restore_step=2"))
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert "resumed from" in resumed.stdout and "step 2" in resumed.stdout
  assert complete_steps(ckpts) == [2, 6]  # step 6 saved although a folder of that name was there
  assert (ckpts / "6.uncommitted").is_dir() and (ckpts / "4.replaced").is_dir()
  assert _ckpt("check", work).returncode == 0
  steps = [r["step"] for r in _records(work) if "loss" in r]
  assert steps == sorted(set(steps)) and steps[-1] == 6  # no step twice after the resume


def test_divergence_never_saves_a_non_finite_step(data_dir, tmp_path):
  work = tmp_path / "run"
  proc = _run(_args(data_dir, work, "--config.train.steps=8", "--config.checkpoint.every=1",
                    "--config.checkpoint.keep=2", "--config.optim.lr=1e6",
                    "--config.optim.warmup_steps=4"))
  last = _one_line_error(proc, 1, "not finite", "optim.lr")
  # Step 1 (learning rate 0 at the start of the warmup) is finite; a later one is not, and the
  # step that led to it is set aside.
  kept = complete_steps(work / "checkpoints")
  assert kept and list((work / "checkpoints").glob("*.diverged"))
  check = _ckpt("check", work)
  assert check.returncode == 0, check.stdout + check.stderr
  assert f"step {kept[-1]}" in last
  # A sane learning rate resumes from the newest finite step and trains on.
  again = _run(_args(data_dir, work, "--config.train.steps=10"))
  assert again.returncode == 0, again.stderr[-3000:]
  assert f"step {kept[-1]}" in again.stdout.split("resumed from")[1].splitlines()[0]
  assert _ckpt("check", work).returncode == 0


def test_two_runs_on_one_workdir_and_sigterm_mid_run(data_dir, tmp_path):
  work = tmp_path / "run"
  metrics = work / "metrics.jsonl"
  first = subprocess.Popen(_args(data_dir, work, "--config.train.steps=2000",
                                 "--config.run.log_every=2"), cwd=ROOT,
                           env=dict(os.environ, JAX_PLATFORMS="cpu"), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
  try:
    deadline = time.time() + 300
    while time.time() < deadline and not metrics.exists():
      time.sleep(0.2)
    second = _run(_args(data_dir, work, "--config.train.steps=3"))
    _one_line_error(second, 2, "in use by another run", f"pid {first.pid}")
    # SIGTERM mid-training (a preemption notice), not before the first step.
    while time.time() < deadline and len(metrics.read_text().splitlines()) < 3:
      time.sleep(0.2)
  finally:
    first.send_signal(signal.SIGTERM)
    out, _ = first.communicate(timeout=300)
  assert first.returncode == 0, out[-3000:]
  # The newest finished step is saved and logged, and it is the newest checkpoint.
  last = int(out.split("SIGTERM: saved step ")[1].split()[0])
  assert complete_steps(work / "checkpoints")[-1] == last
  lines = _records(work)  # strict JSON lines, none torn or interleaved
  assert all("step" in r for r in lines)
  assert lines[-1]["step"] == last  # the step saved is logged, a step of log_every or not
  # A lock left by a process that is gone is taken over, with a note; the rerun resumes from the
  # step the SIGTERM saved.
  (work / "run.lock").write_text(json.dumps({"host": os.uname().nodename, "pid": 2**22 + 7,
                                             "started": "earlier"}))
  again = _run(_args(data_dir, work, f"--config.train.steps={last + 2}"))
  assert again.returncode == 0, again.stderr[-3000:]
  assert "took over" in again.stdout and not (work / "run.lock").exists()
  resumed = again.stdout.split(f"resumed from {work / 'checkpoints'} step {last} (")[1]
  size, took = re.match(r"(\d+\.\d) MiB of state restored in (\d+\.\d) s\)", resumed).groups()
  assert float(size) > 0 and float(took) > 0
  assert f"step {last + 2} | loss" in again.stdout
  steps = [r["step"] for r in _records(work) if "loss" in r]  # the saved step logged once
  assert steps == sorted(set(steps)) and steps[-3:] == [last, last + 1, last + 2], steps


def test_sigterm_during_the_final_save_and_eval(data_dir, tmp_path):
  work = tmp_path / "run"
  proc = subprocess.Popen(_args(data_dir, work, "--config.train.steps=6",
                                "--config.eval.samples=200", "--config.eval.batch=8"),
                          cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  lines = []
  for line in proc.stdout:
    lines.append(line)
    if "step 6 | loss" in line:  # the last step is logged: the final save and eval follow
      proc.send_signal(signal.SIGTERM)
      break
  out = "".join(lines) + proc.communicate(timeout=300)[0]
  assert proc.returncode == 0, out[-3000:]
  assert "SIGTERM" in out.strip().splitlines()[-1]
  assert complete_steps(work / "checkpoints") == [6]
  assert _ckpt("check", work).returncode == 0
  # The rerun has nothing to train; it evaluates once, and only if the first run did not.
  for _ in range(2):
    again = _run(_args(data_dir, work, "--config.train.steps=6", "--config.eval.samples=200",
                       "--config.eval.batch=8"))
    assert again.returncode == 0 and "nothing to train" in again.stdout, again.stderr[-3000:]
  evals = [r for r in _records(work) if "eval_loss" in r]
  assert len(evals) == 1 and evals[0]["step"] == 6
  # The second rerun found the final eval on record: it restored nothing.
  assert "its final eval on record: the state is not restored" in again.stdout, again.stdout
  assert "resumed from" not in again.stdout
  # train.steps lowered below the saved step: step 6's state is step 6's, whose eval is on
  # record; nothing is logged under step 4.
  lower = _run(_args(data_dir, work, "--config.train.steps=4", "--config.eval.samples=200",
                     "--config.eval.batch=8"))
  assert lower.returncode == 0 and "step 6 >= train.steps=4: nothing to train" in lower.stdout
  assert [r for r in _records(work) if "eval_loss" in r] == evals


def test_input_problems_are_one_line_errors_before_training(data_dir, tmp_path):
  # Too few image slots: refused before compiling, with the value that works.
  work = tmp_path / "slots"
  proc = _run(_args(data_dir, work, "--config.train.steps=600",
                    "--config.model.vision.image_slots=8"))
  _one_line_error(proc, 2, "model.vision.image_slots=8 is too small",
                  "set model.vision.image_slots=")
  assert "step 1 |" not in proc.stdout
  assert not work.exists()  # nothing it made: no empty workdir or checkpoints folder
  # A damaged shard names itself and how to rebuild it.
  broken = tmp_path / "data"
  shutil.copytree(data_dir, broken)
  probs = [float(x) for x in Config().data.image_probs.split(",")]  # the one this run reads
  shard = digits.directory(str(broken), 2000, 200, probs) / "train.array_record"
  shard.write_bytes(shard.read_bytes()[:len(shard.read_bytes()) // 2])
  proc = _run(_args(broken, tmp_path / "shard", "--config.train.steps=3"))
  _one_line_error(proc, 2, str(shard), "delete it")
  assert not (tmp_path / "shard").exists()
  # A workdir that is a file, and one that cannot be written.
  afile = tmp_path / "afile"
  afile.write_text("not a directory")
  _one_line_error(_run(_args(data_dir, afile, "--config.train.steps=3")), 2, "is a file")
  assert afile.read_text() == "not a directory"
  if os.geteuid() == 0:
    readonly = pathlib.Path("/sys/mimo_jax_workdir")  # root may write anywhere chmod allows
  else:
    readonly = tmp_path / "readonly"
    readonly.mkdir()
    readonly.chmod(0o555)
  _one_line_error(_run(_args(data_dir, readonly, "--config.train.steps=3")), 2, "run.workdir")


# A save that fails after leaving a thread that never ends, as orbax's signalling threads wait for
# ever on a save whose directory could not be made.
STUCK_SAVE = ("import runpy, sys, threading; from mimo_jax import checkpoint\n"
              "def save(self, step, *a, **k):\n"
              "  if step > 2:\n"
              "    threading.Thread(target=threading.Event().wait).start()\n"
              "    raise PermissionError(13, 'Permission denied', f'{self.path}/{step}.tmp')\n"
              "  return real(self, step, *a, **k)\n"
              "real, checkpoint.Checkpointer.save = checkpoint.Checkpointer.save, save\n"
              "sys.argv = ['mimo_jax.launch'] + sys.argv[1:]\n"
              "runpy.run_module('mimo_jax.launch', run_name='__main__')")


def test_a_save_that_fails_leaving_a_thread_behind_ends_the_run(data_dir, tmp_path):
  """The error line, then the exit: a library thread left waiting by a failed save does not
  keep the process alive; the note names the newest step committed."""
  work = tmp_path / "run"
  args = _args(data_dir, work, "--config.train.steps=6", "--config.checkpoint.every=2")
  proc = subprocess.run([sys.executable, "-c", STUCK_SAVE, *args[3:]],  # the flags after -m ...
                        cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True,
                        text=True, timeout=180)  # a hang fails in minutes, not the suite's time
  _one_line_error(proc, 1, f"{work}/checkpoints/4.tmp", "Permission denied")
  assert "); the newest checkpoint is step 2." in proc.stdout + proc.stderr, proc.stdout[-2000:]
  assert complete_steps(work / "checkpoints") == [2]


# Orbax cannot remove the old steps 1 and 2 (checkpoint.keep's rotation): one file of each
# refuses to go, as an immutable file does (`chattr +i`).
STUCK_FILE = ("import os, runpy, sys\n"
              "def unlink(name, *, dir_fd=None, real=os.unlink):\n"
              "  where = os.readlink(f'/proc/self/fd/{dir_fd}') if dir_fd is not None else ''\n"
              "  if name == '_METADATA' and any(f'/checkpoints/{s}/' in where + '/' for s in (1, 2)):\n"
              "    raise PermissionError(1, 'Operation not permitted', name)\n"
              "  return real(name, dir_fd=dir_fd)\n"
              "os.unlink = unlink\n"
              "sys.argv = ['mimo_jax.launch'] + sys.argv[1:]\n"
              "runpy.run_module('mimo_jax.launch', run_name='__main__')")


def test_an_old_step_that_cannot_be_removed_is_a_warning(data_dir, tmp_path):
  """Rotation that fails (after the new step committed, in orbax's thread) warns with the old
  step's folder and the run finishes, every step's record and the final eval written."""
  work = tmp_path / "run"
  args = _args(data_dir, work, "--config.train.steps=5", "--config.checkpoint.every=1",
               "--config.checkpoint.keep=2")
  proc = subprocess.run([sys.executable, "-c", STUCK_FILE, *args[3:]], cwd=ROOT,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True,
                        timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  # Step 1's removal fails after step 3 committed (met when step 4 is saved); orbax then drops
  # step 3 from its list of steps, and removes step 2 after the last save (met as the run closes).
  for step in (1, 2):
    assert (f"warning: could not remove {work}/checkpoints/{step} (checkpoint.keep=2 keeps the "
            f"newest 2 steps): {work}/checkpoints/{step}/") in proc.stdout, proc.stdout[-3000:]
  records = _records(work)
  assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4, 5]
  assert records[-1]["step"] == 5 and "eval_loss" in records[-1]
  assert {4, 5} <= set(complete_steps(work / "checkpoints"))


def test_a_file_named_relative_to_a_folder_being_removed_is_named_in_full(tmp_path, monkeypatch):
  """shutil.rmtree names a file it could not remove relative to the folder it walks: launch's
  error line names it in full (in this process: no run)."""
  from mimo_jax import launch  # pylint: disable=import-outside-toplevel  (defines absl's flags)
  folder = tmp_path / "checkpoints" / "10" / "vision"
  folder.mkdir(parents=True)
  (folder / "_METADATA").write_text("{}")

  def unlink(name, *, dir_fd=None, real=os.unlink):
    if name == "_METADATA":  # as an immutable file (`chattr +i`)
      raise PermissionError(1, "Operation not permitted", name)
    return real(name, dir_fd=dir_fd)
  monkeypatch.setattr(os, "unlink", unlink)
  try:
    shutil.rmtree(str(tmp_path / "checkpoints" / "10"))
  except PermissionError as e:
    assert launch._explain(e) == (  # pylint: disable=protected-access
        f"{folder}/_METADATA: Operation not permitted; choose a writable place or fix its "
        "permissions.", 1)
  else:
    raise AssertionError("rmtree removed an undeletable file")


# Step 3's save fails once: the step saved after the error (the emergency save) is on record.
FAILS_ONCE = ("import runpy, sys; from mimo_jax import checkpoint\n"
              "def save(self, step, *a, **k):\n"
              "  if step == 3 and not failed:\n"
              "    failed.append(step)\n"
              "    raise PermissionError(13, 'Permission denied', f'{self.path}/{step}.tmp')\n"
              "  return real(self, step, *a, **k)\n"
              "failed, real, checkpoint.Checkpointer.save = [], checkpoint.Checkpointer.save, save\n"
              "sys.argv = ['mimo_jax.launch'] + sys.argv[1:]\n"
              "runpy.run_module('mimo_jax.launch', run_name='__main__')")


def test_the_step_saved_after_an_error_is_on_record(data_dir, tmp_path):
  """Step 3, neither a step of run.log_every nor the last, is logged as the step saved after the
  error."""
  work = tmp_path / "run"
  args = _args(data_dir, work, "--config.train.steps=4", "--config.checkpoint.every=1",
               "--config.run.log_every=2")
  proc = subprocess.run([sys.executable, "-c", FAILS_ONCE, *args[3:]], cwd=ROOT,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True,
                        timeout=600)
  _one_line_error(proc, 1, f"{work}/checkpoints/3.tmp", "Permission denied")
  assert f"after PermissionError: saved step 3 to {work}/checkpoints." in proc.stdout
  assert "] step 3 | loss " in proc.stdout
  assert [r["step"] for r in _records(work) if "loss" in r] == [2, 3]
  assert complete_steps(work / "checkpoints")[-1] == 3


LIMITED = ("import os, resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
           "n = int(sys.argv[1]); resource.setrlimit(resource.RLIMIT_FSIZE, (n, n)); "
           "os.execv(sys.executable, [sys.executable] + sys.argv[2:])")


def test_a_full_disk_is_one_line(data_dir, tmp_path):
  work = tmp_path / "run"
  args = _args(data_dir, work, "--config.train.steps=2")
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  # The run starts under a file size limit: a write past it fails (EFBIG), as on a full disk.
  # (A compilation cache entry that meets the limit is not written: JAX warns and goes on.)
  proc = subprocess.run([sys.executable, "-c", LIMITED, str(300 * 1000), *args[1:]], cwd=ROOT,
                        env=env, capture_output=True, text=True, timeout=600)
  _one_line_error(proc, 1, "the file system refused the write")
  assert not complete_steps(work / "checkpoints")  # no partial step counts as saved
