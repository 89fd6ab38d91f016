"""The run's working directory: checked before anything is built, and held by one run at a time.

`<workdir>/run.lock` holds the host, pid and start time of the run that uses the workdir (process
0 of a multi-process run). A second run on the same workdir stops with an error naming the first;
a lock left by a process that is gone (same host, pid no longer running) is taken over with a note.
A lock file that names no host and pid (empty, or damaged: no run writes one) is never taken over:
the run stops with one line naming it, to be deleted if no run uses the workdir.
A run that ends with nothing of value in it (it failed or was stopped before its first step)
removes what it made there (`Made`): its workdir, if it made it, is gone again.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import pathlib
import shutil
import socket
import time

from mimo_jax.config import ConfigError

LOCK = "run.lock"
# What a run writes beside its checkpoints (metrics.MetricsWriter): the records, the file they are
# rewritten through on resume, and TensorBoard's events.
METRICS, METRICS_TMP, TB = "metrics.jsonl", "metrics.jsonl.tmp", "tb"
CHECKPOINTS = "checkpoints"


class WorkdirError(ConfigError):
  """The workdir cannot be used; the message names it and the fix."""


def describe_os_error(e: OSError, what: str) -> str:
  """One sentence for a failed write or read of `what` (`run.workdir=...`, a tool's `--out=...`,
  or a file): its advice names the setting that chooses the place."""
  setting = what.split("=", 1)[0] if "=" in what and not what.startswith("writing ") else ""
  run = "run.workdir" in what
  if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
    return (f"{what}: the file system refused the write ({os.strerror(e.errno)}); free space "
            "(or raise the quota or file size limit) and run the same command again"
            f"{' to resume' if run else ''}.")
  if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
    return (f"{what}: {os.strerror(e.errno)}; choose a writable "
            f"{setting or ('run.workdir' if run else 'place')} or fix its permissions.")
  blocker = _file_in_the_way(e) if e.errno in (errno.EEXIST, errno.ENOTDIR) else None
  if blocker:
    return (f"{what}: {blocker} is a file, not a folder, so nothing can be made under it; "
            f"choose another {setting or ('run.workdir' if run else 'place')}.")
  return f"{what}: {os.strerror(e.errno) if e.errno else e}."


def _file_in_the_way(e: OSError) -> str | None:
  """The file on the path of a folder that `e` (a failed mkdir or open: EEXIST, ENOTDIR) could not
  make or enter: the path itself or the nearest of its folders that is a file, if any."""
  name = error_file(e)
  if name is None:
    return None
  path = pathlib.Path(os.path.abspath(name))
  for p in (path, *path.parents):
    if os.path.lexists(p):
      return None if p.is_dir() else str(p)
  return None


def error_file(e: OSError) -> str | None:
  """The file an OSError names, absolute where its traceback tells: shutil.rmtree (orbax's
  removal of an old step) names a file relative to the folder it walks (`_METADATA`), whose
  absolute path a frame of the walk holds. None when the error names no file."""
  if not isinstance(e.filename, (str, bytes)):
    return None
  name = os.fsdecode(e.filename)
  if os.path.isabs(name):
    return name
  frames, tb = [], e.__traceback__
  while tb is not None:
    frames.append(tb.tb_frame)
    tb = tb.tb_next
  for frame in reversed(frames):  # innermost first
    for value in frame.f_locals.values():
      if isinstance(value, str) and os.path.isabs(value) and value.endswith(os.sep + name):
        return value
  return name


# What a tool's output folder holds (mimo_jax/output.py): what kind of output it is.
OUTPUT_MARKER = ".mimo_jax_output.json"


def marked(path: str | os.PathLike) -> str | None:
  """What the tool's marker in folder `path` says the folder is ("workdir": an import's, a run's
  place; else a tool's output, such as "export"); None where it has none or it cannot be read."""
  try:
    return json.loads(pathlib.Path(path, OUTPUT_MARKER).read_text(encoding="utf-8"))["what"]
  except (OSError, ValueError, KeyError, TypeError):
    return None


def check(workdir: str) -> str:
  """The absolute workdir, created if missing; an error if it, or a checkpoints/ folder it
  holds already (where the run saves), is not a writable directory."""
  path = os.path.abspath(workdir)
  if os.path.exists(path) and not os.path.isdir(path):
    raise WorkdirError(f"run.workdir={workdir!r} is a file, not a directory; choose another "
                       "run.workdir.")
  what = marked(path) or "workdir"  # a tool's output (an HF export, a conversion): no run's place
  if what != "workdir":
    raise WorkdirError(f"run.workdir={workdir!r} is a tool's output ({what}; {OUTPUT_MARKER} "
                       "says so): a run's files would mix with it, and replacing it would remove "
                       "them; choose another run.workdir.")
  saves = os.path.join(path, "checkpoints")
  for folder, name in ((path, f"run.workdir={workdir!r}"),
                       (saves, f"the run's checkpoints folder {saves}")):
    if folder == saves and not os.path.isdir(saves):
      continue  # made in a writable workdir when the first step is saved
    try:
      os.makedirs(folder, exist_ok=True)
      probe = os.path.join(folder, f".write_test.{os.getpid()}")
      with open(probe, "w", encoding="utf-8") as f:
        f.write("ok")
      os.remove(probe)
    except OSError as e:
      raise WorkdirError(describe_os_error(e, name)) from None
  return path


class Made:
  """What a run is about to make in its workdir, noted before it makes anything, so that a run
  that ends with nothing of value there (it failed or was stopped before its first step: no
  checkpoints folder, or one holding only a LoRA run's base, and no record in its metrics) leaves
  nothing behind. Only what was not there before is removed, and a folder only when it is empty
  (but the base's)."""

  def __init__(self, workdir: str):
    self.path = os.path.abspath(workdir)
    # The workdir's folders that do not exist yet, innermost first (check makes its parents too).
    self.folders = []
    folder = self.path
    while not os.path.lexists(folder) and os.path.dirname(folder) != folder:
      self.folders.append(folder)
      folder = os.path.dirname(folder)
    self.files = {n for n in (METRICS, METRICS_TMP, TB, CHECKPOINTS)
                  if not os.path.lexists(os.path.join(self.path, n))}

  def remove_unused(self, lock: "Lock | None") -> None:
    """Removes the files the run made if they hold nothing (only under its `lock`: without it,
    they may be another run's), releases `lock`, then removes the folders it made if empty."""
    try:
      if lock is not None:
        self._remove_base()
      if lock is not None and not os.path.lexists(os.path.join(self.path, CHECKPOINTS)):
        self._remove_files()  # (a checkpoints folder: a step may be saved; everything stays)
    finally:
      if lock is not None:
        lock.release()
    for folder in self.folders:
      try:
        os.rmdir(folder)  # only if empty
      except OSError:
        return

  def _remove_base(self) -> None:
    """The checkpoints folder this run made, if it holds nothing but a step 0 and no record was
    logged: a LoRA run saves its frozen weights as a step 0 when it starts (checkpoint.name_base),
    before its first step, and that copy of its sources is of no value without a step after it.
    (A run's own steps start at 1; anything else in the folder keeps it all.)"""
    saves, metrics = os.path.join(self.path, CHECKPOINTS), os.path.join(self.path, METRICS)
    try:
      if (CHECKPOINTS not in self.files or os.listdir(saves) != ["0"]
          or (os.path.isfile(metrics) and os.path.getsize(metrics) > 0)):
        return
      shutil.rmtree(os.path.join(saves, "0"))
      os.rmdir(saves)
    except OSError:
      pass  # what cannot be removed stays; the run's own error is the one reported

  def _remove_files(self) -> None:
    """The metrics file this run made, if it holds no record, with its TensorBoard folder (whose
    events are the records'), and a rewrite of it left behind."""
    metrics = os.path.join(self.path, METRICS)
    try:
      if METRICS in self.files and os.path.isfile(metrics) and os.path.getsize(metrics) == 0:
        os.remove(metrics)
      rewrite = os.path.join(self.path, METRICS_TMP)
      if METRICS_TMP in self.files and os.path.isfile(rewrite):
        os.remove(rewrite)
      tb = os.path.join(self.path, TB)
      if TB in self.files and not os.path.lexists(metrics) and os.path.isdir(tb):
        for name in os.listdir(tb):
          if name.startswith("events.out.tfevents."):
            os.remove(os.path.join(tb, name))
        os.rmdir(tb)  # only if empty: nothing else was written there
    except OSError:
      pass  # a file that cannot be removed stays; the run's own error is the one reported


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  try:  # a process killed but not yet reaped by its parent (a zombie) holds nothing
    stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2:][:1] != "Z"
  except (OSError, ValueError):
    return True


@contextlib.contextmanager
def _directory_mutex(path: str):
  """An exclusive flock on directory `path` (released on exit): one process at a time takes
  over a stale lock in it."""
  fd = os.open(path or ".", os.O_RDONLY)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX)
    yield
  finally:
    os.close(fd)  # releases the flock


class Lock:
  """The workdir's lock, held from `acquire()` to `release()`."""

  def __init__(self, path: str, name: str = LOCK, busy: str | None = None):
    """The lock file `name` in directory `path`; `busy` starts the error when another process
    holds it (default: the workdir is in use by another run)."""
    self.file = os.path.join(path, name)
    self.busy = busy
    self.note = None  # set when a stale lock was taken over
    self._held = False

  def acquire(self) -> "Lock":
    me = {"host": socket.gethostname(), "pid": os.getpid(),
          "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    for _ in range(2):
      try:
        self._create(me)
      except FileExistsError:
        holder = self._holder()
        if holder is None:
          if not os.path.lexists(self.file):
            continue  # released since: taken on the next pass
          raise WorkdirError(self.unreadable()) from None
        if holder["host"] == me["host"] and not _alive(holder["pid"]):
          self.note = (f"took over {self.file} from process {holder['pid']} (started "
                       f"{holder.get('started', '?')}), which is no longer running")
          with _directory_mutex(os.path.dirname(self.file)):
            # Another process may have taken it over since it was read: remove only the lock
            # of the process that is gone, never the new holder's.
            if self._holder() == holder:
              os.remove(self.file)
          continue
        who = (f"host {holder['host']}, pid {holder['pid']}, started "
               f"{holder.get('started', '?')}")
        if self.busy is not None:
          raise WorkdirError(f"{self.busy} ({who}); wait for it or choose another output. If "
                             f"that process is gone, delete {self.file}.") from None
        raise WorkdirError(
            f"{os.path.dirname(self.file)} is in use by another run ({who}); stop it or choose "
            f"another run.workdir. If that run is gone, delete {self.file}.") from None
      self._held = True
      return self
    raise WorkdirError(f"could not take {self.file}; delete it if no run uses this workdir.")

  def unreadable(self) -> str:
    """The line for a lock file that holds no holder record (`_holder` is None)."""
    user = "other process writes that output" if self.busy is not None else "run uses this workdir"
    return f"{self.file} is unreadable (not a lock naming a host and pid); delete it if no {user}."

  def _create(self, me: dict) -> None:
    """Creates the lock file holding `me`, or raises FileExistsError. The file appears with its
    contents (written aside, then hard-linked into place), so another process never reads an
    empty lock and names no holder; where the filesystem has no hard links, it is created empty
    and then written."""
    aside = f"{self.file}.{me['host']}.{me['pid']}.tmp"
    with open(aside, "w", encoding="utf-8") as f:
      json.dump(me, f)
    try:
      os.link(aside, self.file)
      return
    except FileExistsError:
      raise
    except OSError:
      pass  # no hard links here
    finally:
      os.remove(aside)
    fd = os.open(self.file, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
      json.dump(me, f)

  def _holder(self) -> dict | None:
    """The record the lock file holds (a JSON object with the `host` string and `pid` integer
    `_create` writes); None when it cannot be read or holds anything else (an empty or damaged
    file: never taken over, and never taken for a holder)."""
    try:
      with open(self.file, encoding="utf-8") as f:
        holder = json.load(f)
    except (OSError, ValueError):
      return None
    pid = holder.get("pid") if isinstance(holder, dict) else None
    if (not isinstance(holder, dict) or not isinstance(holder.get("host"), str)
        or not isinstance(pid, int) or isinstance(pid, bool) or pid < 1):
      return None
    return holder

  def release(self) -> None:
    if self._held:
      self._held = False
      try:
        os.remove(self.file)
      except OSError:
        pass


def live_run(path: str) -> dict | None:
  """The holder (host, pid, started) of `path`'s run lock while a run may be using the workdir;
  None when no lock is there, its process (on this host) is gone, or it is unreadable (no run
  writes one: `unreadable_lock` names it). Read-only tools use it to read only committed steps
  and to say that steps may come and go under them."""
  lock = Lock(path)
  if not os.path.exists(lock.file):
    return None
  holder = lock._holder()  # pylint: disable=protected-access
  if holder is None or (holder["host"] == socket.gethostname() and not _alive(holder["pid"])):
    return None
  return holder


def unreadable_lock(path: str) -> str | None:
  """The line for `path`'s run lock when it is there but holds no holder record (`Lock._holder`),
  else None: read-only tools note it and read as if no run held the workdir."""
  lock = Lock(path)
  if os.path.exists(lock.file) and lock._holder() is None:  # pylint: disable=protected-access
    return lock.unreadable()
  return None
