"""mimo_jax/output.py: locked, staged outputs published whole; workdir.Lock's takeover."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time
from unittest import mock

import pytest

from mimo_jax import output, workdir

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_staged_publishes_whole_or_nothing(tmp_path):
  out = tmp_path / "o"
  with output.staged(out, what="thing", complete="done.json") as tmp:
    assert not out.exists() and tmp.is_dir()
    (tmp / "a").write_text("1"); (tmp / "done.json").write_text("{}")
  assert sorted(p.name for p in out.iterdir()) == [output.MARKER, "a", "done.json"]
  assert not list(tmp_path.glob(".o*"))
  with pytest.raises(output.OutputError, match="holds a thing already"):
    with output.staged(out, what="thing", complete="done.json"):
      pass
  with pytest.raises(RuntimeError):
    with output.staged(out, what="thing", complete="done.json", replace=True) as tmp:
      (tmp / "b").write_text("2"); raise RuntimeError("x")
  assert sorted(p.name for p in out.iterdir()) == [output.MARKER, "a", "done.json"]
  with output.staged(out, what="thing", complete="done.json", replace=True) as tmp:
    (tmp / "done.json").write_text("{}")
  assert sorted(p.name for p in out.iterdir()) == [output.MARKER, "done.json"]
  assert not list(tmp_path.glob(".o*"))

def test_published_files_are_readable_as_any_new_file(tmp_path):
  # safetensors creates its files owner-only; an output's files get the umask's permissions.
  from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  out = tmp_path / "o"
  with output.staged(out, what="thing") as tmp:
    save_file({"x": np.zeros(2, np.float32)}, str(tmp / "model.safetensors"))
  mask = os.umask(0)
  os.umask(mask)
  assert os.stat(out / "model.safetensors").st_mode & 0o777 == 0o666 & ~mask

def test_lock_and_targets(tmp_path):
  out = tmp_path / "o"
  held = output.lock(out)
  with pytest.raises(output.OutputError, match="being written by another process"):
    output.lock(out)
  held.release()
  (tmp_path / "f").write_text("x")
  with pytest.raises(output.OutputError, match="is a file"):
    output.check_target(tmp_path / "f", "thing")
  (tmp_path / "d").mkdir(); (tmp_path / "d" / "x").write_text("")
  with pytest.raises(output.OutputError, match="not empty"):
    output.check_target(tmp_path / "d", "thing", complete="done.json")
  with pytest.raises(output.OutputError, match="needs about 1000000.00 TB at .*, where .*B"):
    output.check_space(tmp_path / "out", 10**18, "a conversion")
  # An output is renamed into its place at the end: a mount point there is refused before.
  (tmp_path / "mnt").mkdir()
  real = os.path.ismount
  with mock.patch.object(os.path, "ismount", lambda p: str(p) == str(tmp_path / "mnt") or real(p)):
    with pytest.raises(output.OutputError, match=r"is a mount point: .* give a folder inside it "
                       r"\(--out=.*/mnt/NAME\)"):
      output.check_target(tmp_path / "mnt", "thing")


def test_a_signal_whose_exception_was_lost_stops_the_publish(tmp_path):
  out = tmp_path / "o"
  with output.interrupts_as_exceptions():
    with pytest.raises(output.Interrupted):
      with output.staged(out, what="thing") as tmp:
        (tmp / "a").write_text("1")
        try:  # as when the handler's exception is raised inside a callback that swallows it
          os.kill(os.getpid(), signal.SIGTERM)
        except output.Interrupted:
          pass
  assert not out.exists() and not list(tmp_path.glob(".o*"))


def test_ctrl_c_is_taken_as_the_others_and_an_ignored_signal_stays_ignored():
  kept = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as under nohup
  try:
    with pytest.raises(output.Interrupted) as e:
      with output.interrupts_as_exceptions():
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(1000):  # the handler runs between bytecodes
          pass
    assert e.value.signum == signal.SIGINT
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
  finally:
    signal.signal(signal.SIGHUP, kept)


def test_a_signal_whose_exception_was_lost_is_raised_again_as_the_block_ends():
  """With no output to publish (tools.generate prints its answers, tools.eval appends rows), the
  block's end raises it, once: the tool's work does not go on to exit 0."""
  with pytest.raises(output.Interrupted) as e:
    with output.interrupts_as_exceptions():
      with output.interrupts_as_exceptions():  # an inner block: the same record
        try:  # as when the handler's exception is raised inside a callback that swallows it
          os.kill(os.getpid(), signal.SIGTERM)
          for _ in range(1000):
            pass
        except output.Interrupted:
          pass
      assert False, "the inner block's end raises it"
  assert e.value.signum == signal.SIGTERM


def test_only_an_output_of_the_same_kind_is_replaced(tmp_path):
  run = tmp_path / "run"  # a folder that holds the marker file by chance: a run, not an export
  (run / "checkpoints").mkdir(parents=True)
  (run / "config.json").write_text("{}")
  with pytest.raises(output.OutputError, match="not replaced"):
    with output.staged(run, what="export", complete="config.json", replace=True):
      pass
  assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "config.json"]
  with output.staged(tmp_path / "w", what="workdir", complete="config.json") as tmp:
    (tmp / "config.json").write_text("{}")
  with pytest.raises(output.OutputError, match="not replaced"):
    with output.staged(tmp_path / "w", what="export", complete="config.json", replace=True):
      pass


def test_what_others_put_at_out_or_added_to_it_is_never_replaced(tmp_path):
  """Files that appear at `out` while an output is written (a run started there) stop the
  publish; an export a run has added to is not replaced; a link is refused; and a run is not
  started in a tool's output folder."""
  out = tmp_path / "o"
  with pytest.raises(output.OutputError, match=r"is not empty \(metrics\.jsonl\).*It changed "
                     r"while the export was written: nothing was published"):
    with output.staged(out, what="export", complete="config.json") as tmp:
      (tmp / "config.json").write_text("{}")
      out.mkdir()
      (out / "metrics.jsonl").write_text("a run's\n")
  assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl"]
  assert [p.name for p in tmp_path.iterdir()] == ["o"]  # no staging, no lock left
  export = tmp_path / "e"
  with output.staged(export, what="export", complete="config.json") as tmp:
    (tmp / "config.json").write_text("{}")
  (export / "checkpoints").mkdir()
  with pytest.raises(output.OutputError, match=r"holds what this tool did not write there "
                     r"\(checkpoints: a run's files\?\), so it is not replaced"):
    with output.staged(export, what="export", complete="config.json", replace=True):
      pass
  assert (export / "checkpoints").is_dir()
  with pytest.raises(workdir.WorkdirError, match=r"is a tool's output \(export; "):
    workdir.check(str(export))
  (export / "checkpoints").rmdir()
  with output.staged(export, what="export", complete="config.json", replace=True) as tmp:
    (tmp / "config.json").write_text("[]")
  assert (export / "config.json").read_text() == "[]"
  (tmp_path / "link").symlink_to(tmp_path / "o")
  with pytest.raises(output.OutputError, match=r"link'.* is a symbolic link \(to "):
    output.check_target(tmp_path / "link", "export")


def test_a_killed_writer_not_yet_reaped_holds_no_lock():
  proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
  try:
    assert workdir._alive(proc.pid)  # pylint: disable=protected-access
    proc.kill()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and workdir._alive(proc.pid):  # pylint: disable=W0212
      time.sleep(0.05)
    assert not workdir._alive(proc.pid)  # a zombie: its parent has not waited for it yet
    assert proc.poll() is not None  # reaped now
  finally:
    proc.kill()
    proc.wait()


def test_an_output_moved_aside_by_a_killed_writer_is_put_back(tmp_path):
  out = tmp_path / "o"
  with output.staged(out, what="thing", complete="done.json") as tmp:
    (tmp / "done.json").write_text("old")
  os.rename(out, tmp_path / f".o{output.OLD}12345")  # killed between the two renames
  (tmp_path / f".o{output.PARTIAL}12345").mkdir()  # its replacement, never published
  with pytest.raises(output.OutputError, match="holds a thing already"):
    with output.staged(out, what="thing", complete="done.json"):
      pass
  assert (out / "done.json").read_text() == "old"
  assert sorted(p.name for p in tmp_path.iterdir()) == ["o"]



@pytest.mark.parametrize("stop", [RuntimeError("x"), KeyboardInterrupt(),
                                  output.Interrupted(signal.SIGTERM)],
                         ids=["error", "ctrl-c", "sigterm"])
def test_a_failed_write_leaves_no_folders_it_made(tmp_path, stop):
  """A write that fails or is interrupted removes the folders above --out it made (as
  tools.convert and launch do), once its lock file in them is gone; never a folder that was
  there before, and a published output keeps them."""
  out = tmp_path / "a" / "b" / "out"
  with pytest.raises(type(stop)):
    with output.staged(out, what="thing") as tmp:
      (tmp / "x").write_text("1")
      assert (tmp_path / "a" / "b" / ".out.lock").exists()
      raise stop
  assert not list(tmp_path.iterdir())
  (tmp_path / "a").mkdir()  # there before: stays, and so does what it holds
  (tmp_path / "a" / "keep").write_text("")
  with pytest.raises(type(stop)):
    with output.staged(out, what="thing"):
      raise stop
  assert sorted(p.name for p in tmp_path.rglob("*")) == ["a", "keep"]
  (tmp_path / "a" / "b").mkdir()  # an empty folder there before is not removed either
  with pytest.raises(type(stop)):
    with output.staged(out, what="thing"):
      raise stop
  assert sorted(p.name for p in tmp_path.rglob("*")) == ["a", "b", "keep"]
  deep = tmp_path / "c" / "d" / "out"
  with output.staged(deep, what="thing") as tmp:
    (tmp / "x").write_text("1")
  assert sorted(p.name for p in (tmp_path / "c" / "d").iterdir()) == ["out"]
  assert sorted(p.name for p in deep.iterdir()) == [output.MARKER, "x"]


def test_a_lock_not_taken_leaves_no_folders_it_made(tmp_path, monkeypatch):
  from mimo_jax import workdir  # pylint: disable=import-outside-toplevel

  def refused(self):
    raise PermissionError(13, "Permission denied", self.file)
  monkeypatch.setattr(workdir.Lock, "acquire", refused)
  with pytest.raises(output.OutputError, match="Permission denied|permission"):
    output.lock(tmp_path / "a" / "b" / "out")
  assert not list(tmp_path.iterdir())

def test_errors_name_the_setting_that_chooses_the_place():
  import errno  # pylint: disable=import-outside-toplevel
  from mimo_jax.workdir import describe_os_error  # pylint: disable=import-outside-toplevel
  assert describe_os_error(OSError(errno.EACCES, "x"), "--out='/sys/x'").endswith(
      "choose a writable --out or fix its permissions.")
  assert describe_os_error(OSError(errno.EACCES, "x"), "run.workdir='/x'").endswith(
      "choose a writable run.workdir or fix its permissions.")
  assert describe_os_error(OSError(errno.ENOSPC, "x"), "writing /o/.t.tmp").endswith(
      "run the same command again.")  # a conversion restarts; only a run resumes
  if os.path.isdir("/proc"):
    with pytest.raises(output.OutputError, match="stores no files"):
      output.check_space("/proc/nope", 1, "an export")


def test_an_out_under_a_file_names_that_file(tmp_path):
  """A file where a folder of the output's path should be (a JSON given as a folder): the error
  names it, not a bare "File exists" or "Not a directory", and nothing is made."""
  (tmp_path / "data.json").write_text("[]")
  for out in (tmp_path / "data.json" / "x", tmp_path / "data.json" / "x" / "y"):
    with pytest.raises(output.OutputError) as e:
      output.lock(out)
    assert str(e.value) == (f"--out={str(out)!r}: {tmp_path / 'data.json'} is a file, not a "
                            "folder, so nothing can be made under it; choose another --out.")
  assert sorted(p.name for p in tmp_path.iterdir()) == ["data.json"]


def test_a_stale_lock_is_taken_over_once(tmp_path, monkeypatch):
  """Two writers that both read a dead process's lock: the second, coming after the first took
  it over, finds the first's lock and stops (it removed the new holder's lock before)."""
  from mimo_jax import workdir  # pylint: disable=import-outside-toplevel
  lock = tmp_path / ".o.lock"
  dead = {"host": workdir.socket.gethostname(), "pid": 2**22 + 12345, "started": "then"}
  lock.write_text(json.dumps(dead))
  first = workdir.Lock(str(tmp_path), name=".o.lock")
  holder = first._holder  # pylint: disable=protected-access
  calls = []

  def stale_then_taken(self):  # the second writer read the stale holder, then lost the race
    calls.append(1)
    if len(calls) == 1:
      first.acquire()
      return dead
    return holder()
  second = workdir.Lock(str(tmp_path), name=".o.lock")
  monkeypatch.setattr(workdir.Lock, "_holder", stale_then_taken)
  with pytest.raises(workdir.WorkdirError, match="in use by another run"):
    second.acquire()
  assert json.loads(lock.read_text())["pid"] == os.getpid()


@pytest.mark.parametrize("links", [True, False])
def test_a_lock_appears_with_its_holder_named(tmp_path, monkeypatch, links):
  """The lock file is never seen empty (a second writer would name no holder): it is written
  aside and hard-linked into place; without hard links it is created, then written."""
  from mimo_jax import workdir  # pylint: disable=import-outside-toplevel
  lock = tmp_path / ".o.lock"
  link, seen = os.link, []

  def watched(src, dst):  # what a reader finds the moment the lock appears
    if not links:
      raise PermissionError(1, "hard links not supported", dst)
    link(src, dst)
    seen.append(json.loads(lock.read_text()))
  monkeypatch.setattr(workdir.os, "link", watched)
  held = workdir.Lock(str(tmp_path), name=".o.lock").acquire()
  assert json.loads(lock.read_text())["pid"] == os.getpid()
  assert [s["pid"] for s in seen] == ([os.getpid()] if links else [])
  assert sorted(p.name for p in tmp_path.iterdir()) == [".o.lock"]  # nothing left aside
  with pytest.raises(workdir.WorkdirError, match=f"pid {os.getpid()}"):
    workdir.Lock(str(tmp_path), name=".o.lock").acquire()
  assert sorted(p.name for p in tmp_path.iterdir()) == [".o.lock"]
  held.release()
  assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("status,sig", [(0, "SIGINT"), (3, "SIGTERM"), (None, "SIGHUP")])
def test_a_signal_during_the_shutdown_after_a_tool_ends_its_status_without_a_traceback(status,
                                                                                        sig):
  """A signal while the interpreter shuts down after a tool's `main` returned (here from an exit
  handler) ends the process with the tool's status and nothing on stderr."""
  code = ("import atexit, os, signal, time\n"
          "from mimo_jax import output\n"
          f"atexit.register(lambda: (os.kill(os.getpid(), signal.{sig}), time.sleep(5)))\n"
          f"output.run_main(lambda: {status})\n")
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                        env=dict(os.environ, PYTHONPATH=str(ROOT)), check=False)
  assert (proc.returncode, proc.stderr) == (status or 0, ""), proc.stderr


def test_a_signal_the_tool_does_not_take_itself_is_one_line():
  """A signal before the tool's own handling begins (its flags being read) ends it with one line
  and 128 + the signal's number, not a traceback or a silent death."""
  code = ("import os, signal, time\n"
          "from mimo_jax import output\n"
          "output.run_main(lambda: (os.kill(os.getpid(), signal.SIGTERM), time.sleep(5)))\n")
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                        env=dict(os.environ, PYTHONPATH=str(ROOT)), check=False)
  assert (proc.returncode, proc.stderr) == (143, "python: interrupted (SIGTERM).\n")


def test_after_the_exit_handlers_a_signal_is_ignored_and_one_ignored_from_the_start_stays_so():
  """Python gives its own handlers back to the default as it finalizes (a late SIGTERM would end
  a finished tool with 143), and XLA's teardown takes a second after that: the last exit handler
  leaves the signals ignored. A signal the command was started ignoring is never taken, by the
  tools' handlers or by training's stop flag."""
  from mimo_jax import interrupts
  from mimo_jax.stopping import StopFlag
  kept = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
  try:
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # nohup's
    interrupts.ends_with(3)
    assert signal.getsignal(signal.SIGTERM) is interrupts._end
    assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    interrupts._ignore_late()
    assert [signal.getsignal(s) for s in kept] == [signal.SIG_IGN] * 3
    with StopFlag(signals=(signal.SIGINT, signal.SIGHUP), multi=False) as stop:
      assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
      os.kill(os.getpid(), signal.SIGINT)
      assert not stop.requested()
  finally:
    for s, h in kept.items():
      signal.signal(s, h)


def test_no_output_goes_inside_a_runs_checkpoints_or_at_its_lock(tmp_path):
  run = tmp_path / "run"
  (run / "checkpoints" / "2").mkdir(parents=True)
  (run / "metrics.jsonl").write_text("")
  for out in (run / "checkpoints" / "3", run / "checkpoints" / "2" / "x.safetensors"):
    with pytest.raises(output.OutputError, match=rf"^--out='{out}' is inside the checkpoints "
                       rf"folder of the run in {run}: the run would take it for its own"):
      output.check_target(out, "export")
  (run / "run.lock").write_text("")
  assert output.in_a_run(run / "run.lock") == f"{run}'s lock"
  assert output.in_a_run(run / "eval" / "rows.jsonl") is None
  assert output.in_a_run(tmp_path / "checkpoints" / "3") is None  # no run beside it
  new = tmp_path / "new"  # a run that has not saved yet: its lock alone
  new.mkdir()
  (new / "run.lock").write_text("")
  assert output.in_a_run(new / "checkpoints") == f"the checkpoints folder of the run in {new}"
  assert output.in_a_run(new / "run.lock") == f"{new}'s lock"
  imported = tmp_path / "import"  # tools.hf import's workdir: no lock or metrics yet, its marker
  (imported / "checkpoints" / "0").mkdir(parents=True)
  (imported / workdir.OUTPUT_MARKER).write_text(json.dumps({"what": "workdir", "entries": []}))
  assert (output.in_a_run(imported / "checkpoints" / "5") ==
          f"inside the checkpoints folder of the run in {imported}")
  (imported / workdir.OUTPUT_MARKER).write_text(json.dumps({"what": "export", "entries": []}))
  assert output.in_a_run(imported / "checkpoints" / "5") is None  # an export's folder


def test_what_is_added_to_an_output_after_the_last_check_is_put_back(tmp_path, monkeypatch):
  out = tmp_path / "e"
  with output.staged(out, what="export", complete="config.json") as tmp:
    (tmp / "config.json").write_text("{}")
  checks = []

  def check_then_add(final, *args):
    checks.append(final)
    if len(checks) == 3:  # the check at publish passes; a run writes there just after it
      (out / "metrics.jsonl").write_text("a run's\n")
  monkeypatch.setattr(output, "check_target", check_then_add)
  with pytest.raises(output.OutputError, match=r"was added to while it was replaced "
                     r"\(metrics\.jsonl\): it is left as it is and nothing was published\.$"):
    with output.staged(out, what="export", complete="config.json", replace=True) as tmp:
      (tmp / "config.json").write_text("[]")
  assert sorted(p.name for p in out.iterdir()) == [".mimo_jax_output.json", "config.json",
                                                   "metrics.jsonl"]
  assert (out / "config.json").read_text() == "{}"
  assert [p.name for p in tmp_path.iterdir()] == ["e"]


def test_a_name_too_long_for_the_names_beside_it_says_how_long_it_may_be(tmp_path):
  out = tmp_path / ("x" * 248)  # a legal name; its lock's and staging folder's are not
  with pytest.raises(output.OutputError, match=r"its name is 248 bytes, and the names written "
                     r"beside it while it is written are \d+ longer, past the file system's 255; "
                     r"give a name of at most \d+ bytes\.$") as e:
    with output.staged(out, what="export"):
      pass
  assert list(tmp_path.iterdir()) == []
  most = int(str(e.value).split("at most ")[1].split()[0])
  with output.staged(tmp_path / ("x" * most), what="export"):  # the longest it names is written
    pass
  assert [p.name for p in tmp_path.iterdir()] == ["x" * most]
