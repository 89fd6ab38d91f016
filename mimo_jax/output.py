"""How every tool that writes an output directory writes it: locked, staged, published at once.

  with output.staged(args.out, what="conversion", flag="--out") as tmp:
    ...  # write everything into `tmp`, the marker file (manifest, config.json) last
  # `args.out` now holds the complete output; on any failure nothing of it was left behind

- **Lock**: `<parent>/.<name>.lock` (host, pid, start time), taken with O_EXCL before anything
  is written; a second writer of the same output stops with an error naming the first. A lock
  whose process is gone (same host) is taken over.
- **Staging**: the output is written into `<parent>/.<name>.partial-<pid>`, a fresh directory
  beside the final one (same file system), and renamed onto the final name when complete: the
  output appears whole or not at all. Partial directories left by killed writers are removed by
  the next writer (it holds the lock, so none of them is in use).
- **What it is**: every published output holds `.mimo_jax_output.json` naming its kind; only an
  output of the same kind is replaced (with the tool's flag to do so), never a folder that merely
  looks like one. A complete output being replaced is moved aside first and put back by the next
  writer if the replacing one dies between the two renames.
- **Cleanup that cannot fail**: on any exception or signal the staging directory is removed with
  errors ignored, and the original exception propagates. The folders above the output that the
  write made (`runs/new/out`'s `runs/new`) go too, once the lock file in them is gone: innermost
  first, each only if empty, never one that was there before (`workdir.Made`). A published
  output keeps them.
- **Free space**: `check_space(path, nbytes, what)` before long work whose size is known.
- **Failed writes**: inside `write_errors(what)` a write that fails (a full disk, a file size
  limit) is one line naming the output and the reason, whichever library wrote: safetensors'
  SafetensorError and orbax's tensorstore errors are no OSError, but name the one beneath them.
- **Signals** (mimo_jax/interrupts.py, its names here too): `interrupts_as_exceptions()` turns
  Ctrl-C, SIGTERM and SIGHUP into `Interrupted`, so a killed tool unwinds through its cleanup,
  and one whose exception is lost still stops the publish.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import pathlib
import re
import shutil
import socket
import sys
import time
from typing import Iterator

from mimo_jax import workdir as workdir_lib
from mimo_jax.config import ConfigError
from mimo_jax.interrupts import (  # noqa: F401  (output.X, as every tool calls them)
    _PENDING, Interrupted, ends_with, interrupts_as_exceptions, quiet_lost_interrupts,
    raise_if_interrupted, run_main, said)

PARTIAL = ".partial-"
OLD = ".replaced-"  # a complete output moved aside while its replacement is renamed into place
# Every published output holds this file, naming what wrote it: only an output of the same kind
# is ever replaced (a training workdir that happens to hold a config.json is not an export).
MARKER = workdir_lib.OUTPUT_MARKER
# The OSError beneath a library's write error, as its text names it: safetensors' "(os error 27)",
# tensorstore's "[os_error_code='27']".
_OS_ERROR_CODE = re.compile(r"os[ _]error(?: |_code=')(\d+)")


class OutputError(ConfigError):
  """An output cannot be written; the message names it and the fix."""


def _paths(out: str | os.PathLike) -> tuple[pathlib.Path, pathlib.Path, str]:
  final = pathlib.Path(os.path.abspath(out))
  return final, final.parent, final.name


def lock(out: str | os.PathLike, flag: str = "--out") -> workdir_lib.Lock:
  """The lock of output `out`, acquired (an error naming its holder if another process has it).
  The lock file is `<parent>/.<name>.lock`; the folders above `out` are made for it, and removed
  again (those it made, if empty) when the lock cannot be taken."""
  final, parent, name = _paths(out)
  # The names beside `out` (lock, staging, the old output moved aside) are longer than its own.
  size = len(name.encode())  # staging, moved aside, and the lock's own temporary file:
  extra = max(len(f".{max(PARTIAL, OLD, key=len)}{2**22}".encode()),
              len(f"..lock.{socket.gethostname()}.{2**22}.tmp".encode()))
  if size + extra > 255 >= size:  # 255: NAME_MAX of the usual file systems
    raise OutputError(f"{flag}={str(out)!r}: its name is {size} bytes, and the names written "
                      f"beside it while it is written are {extra} longer, past the file "
                      f"system's 255; give a name of at most {255 - extra} bytes.")
  made = workdir_lib.Made(str(parent))  # the folders above `out` that are about to be made
  try:
    try:
      parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
      raise OutputError(workdir_lib.describe_os_error(e, f"{flag}={str(out)!r}")) from None
    try:
      return workdir_lib.Lock(str(parent), name=f".{name}.lock",
                              busy=f"{flag}={str(out)!r} is being written by another process"
                              ).acquire()
    except workdir_lib.WorkdirError as e:
      raise OutputError(str(e)) from None
    except OSError as e:  # the lock file cannot be created: an unwritable place
      raise OutputError(workdir_lib.describe_os_error(e, f"{flag}={str(out)!r}")) from None
  except BaseException:
    made.remove_unused(None)
    raise


def remove(path: str | os.PathLike, settle: float = 1.0) -> None:
  """Removes a file or directory tree; never raises (cleanup must not hide the real error). A
  tree that is not gone after one pass is removed again for up to `settle` seconds: a library's
  writer thread that a signal stopped (orbax's, tensorstore's) may add a file as it ends."""
  if not os.path.isdir(path) or os.path.islink(path):
    try:
      os.unlink(path)
    except OSError:
      pass
    return
  deadline = time.monotonic() + settle
  shutil.rmtree(path, ignore_errors=True)
  while os.path.lexists(path) and time.monotonic() < deadline:
    time.sleep(0.05)
    shutil.rmtree(path, ignore_errors=True)


def partials(out: str | os.PathLike) -> list[pathlib.Path]:
  """Staging directories of `out` left by writers that did not finish."""
  _, parent, name = _paths(out)
  try:
    return sorted(p for p in parent.iterdir() if p.name.startswith(f".{name}{PARTIAL}"))
  except OSError:
    return []


def in_a_run(path: str | os.PathLike) -> str | None:
  """Why `path` is no place for a tool's output: a run's lock, or a place inside a run's
  checkpoints folder (a workdir's `checkpoints/`, beside its `run.lock` or `metrics.jsonl`, or
  an import's, its marker saying "workdir"), where the run would take it for a step or a lock;
  None where it is not."""
  final = pathlib.Path(os.path.abspath(path))
  run = lambda folder: (any((folder / f).exists() for f in ("run.lock", "metrics.jsonl"))
                        or workdir_lib.marked(folder) == "workdir")
  if final.name == "run.lock" and (run(final.parent) or (final.parent / "checkpoints").is_dir()):
    return f"{final.parent}'s lock"
  if final.name == "checkpoints" and run(final.parent):
    return f"the checkpoints folder of the run in {final.parent}"
  for folder in final.parents:
    if folder.name == "checkpoints" and run(folder.parent):
      return f"inside the checkpoints folder of the run in {folder.parent}"
  return None


def refuse_place(path: str | os.PathLike, flag: str = "--out") -> None:
  """OutputError where `path` is in a run's place (`in_a_run`) or on a file system that stores no
  files (/proc, /sys), naming it and the fix."""
  where = in_a_run(path)
  if where is not None:
    raise OutputError(f"{flag}={str(path)!r} is {where}: the run would take it for its own "
                      f"(a step, its lock); choose a {flag} outside the run's checkpoints/.")
  probe, usage = _usage(path)
  if usage is not None and usage.total == 0:
    raise OutputError(f"{flag}={str(path)!r} is on a file system that stores no files ({probe}); "
                      f"choose another {flag}.")


def check_target(out: str | os.PathLike, what: str, flag: str = "--out",
                 complete: str | None = None, replace: bool = False,
                 replace_flag: str | None = None) -> None:
  """An error unless `out` is absent or an empty directory (or, with `replace`, a complete output:
  one holding the marker file `complete`); `replace_flag`: the tool's flag that replaces one."""
  final = pathlib.Path(out)
  refuse_place(final, flag)
  if not os.path.lexists(final):
    return
  if final.is_symlink():  # the publish renames onto `out`: a link would be replaced, not followed
    raise OutputError(f"{flag}={str(out)!r} is a symbolic link (to {os.readlink(final)!r}); give "
                      f"the folder itself, or a new {flag}.")
  if not final.is_dir():
    raise OutputError(f"{flag}={str(out)!r} is a file, not a directory; choose another {flag}.")
  if os.path.ismount(final):
    raise OutputError(f"{flag}={str(out)!r} is a mount point: an output is written beside its "
                      f"place and renamed into it, which a mount point refuses; give a folder "
                      f"inside it ({flag}={os.path.join(str(out), 'NAME')}).")
  try:
    entries = sorted(p.name for p in final.iterdir())
  except OSError as e:
    raise OutputError(workdir_lib.describe_os_error(e, f"{flag}={str(out)!r}")) from None
  if not entries:
    return
  if complete is not None and complete in entries:
    marker = _marker(final)
    added = _added(final, entries, marker)
    if replace and marker.get("what") == what and not added:
      return
    if replace and added:
      raise OutputError(f"{flag}={str(out)!r} holds what this tool did not write there "
                        f"({', '.join(added[:3])}{' and more' if len(added) > 3 else ''}: a "
                        f"run's files?), so it is not replaced; move them out, or choose "
                        f"another {flag}.")
    if replace:
      raise OutputError(f"{flag}={str(out)!r} holds a {complete} but was not written as a {what} "
                        f"by this tool ({MARKER} says otherwise or is missing), so it is not "
                        f"replaced; choose another {flag} or remove it yourself.")
    again = f", pass {replace_flag} to replace it" if replace_flag else ""
    raise OutputError(f"{flag}={str(out)!r} holds a {what} already ({complete}); choose another "
                      f"{flag}{again} or delete it.")
  shown = ", ".join(entries[:3]) + (f" and {len(entries) - 3} more" if len(entries) > 3 else "")
  raise OutputError(f"{flag}={str(out)!r} is not empty ({shown}) and is not a complete {what}; "
                    f"choose a new {flag} or remove it.")


def _marker(path: pathlib.Path) -> dict:
  """Output `path`'s MARKER: `what` it was published as, the `entries` its writer wrote (older
  markers list none); {} where it has none."""
  try:
    held = json.loads((path / MARKER).read_text(encoding="utf-8"))
  except (OSError, ValueError):
    return {}
  return held if isinstance(held, dict) else {}


def _added(path: pathlib.Path, entries: list[str], marker: dict | None = None) -> list[str]:
  """The entries of output `path` its writer did not write (none where its marker lists none)."""
  wrote = (_marker(path) if marker is None else marker).get("entries")
  return [e for e in entries if e != MARKER and e not in wrote] if isinstance(wrote, list) else []


def _recover(final: pathlib.Path, parent: pathlib.Path, name: str) -> None:
  """Under the lock: a complete output moved aside by a writer killed before its replacement
  took its place goes back; any other leftover of an earlier writer is removed."""
  try:
    old = sorted(p for p in parent.iterdir() if p.name.startswith(f".{name}{OLD}"))
  except OSError:
    old = []
  if old and not os.path.lexists(final):
    os.rename(old.pop(), final)
  for p in old + partials(final):
    remove(p)


def not_a_folder(folder: str | os.PathLike) -> tuple[str, bool] | None:
  """Why a new file cannot go into `folder`, and whether making the folder would mend it:
  ("X is a file, not a folder, so nothing can be made under it", False) (X: `folder` or the
  nearest place above it that exists), or ("folder X does not exist", True); None where it is a
  folder."""
  folder = pathlib.Path(os.path.abspath(folder))
  if folder.is_dir():
    return None
  existing = folder
  while not os.path.lexists(existing) and existing != existing.parent:
    existing = existing.parent
  if not existing.is_dir():
    return f"{existing} is a file, not a folder, so nothing can be made under it", False
  return f"folder {folder} does not exist", True


def _usage(path: str | os.PathLike):
  """(the place above `path` that exists, its file system's usage or None where unknown): an
  output's file system is its parent's (outputs are staged beside their place)."""
  probe = pathlib.Path(os.path.abspath(path)).parent
  while not probe.exists() and probe != probe.parent:
    probe = probe.parent
  try:
    return probe, shutil.disk_usage(probe)
  except OSError:
    return probe, None


def check_space(path: str | os.PathLike, nbytes: int, what: str) -> None:
  """An error if the file system that `path` is written on (its parent's: outputs are staged
  beside their place) has less than `nbytes` (plus 1%) free."""
  probe, usage = _usage(path)
  if usage is None:
    return  # no figure to check against; the write itself will say
  if usage.total == 0:  # /proc, /sys: nothing can be stored there
    raise OutputError(f"{path} is on a file system that stores no files ({probe}); choose "
                      "another place.")
  free = usage.free
  if free < nbytes * 1.01:
    raise OutputError(f"{what} needs about {_amount(nbytes)} at {path}, where {_amount(free)} "
                      f"{'is' if free < 2 else 'are'} free ({probe}); free space or choose another "
                      "place.")


def _amount(nbytes: float) -> str:
  """Bytes in the decimal unit that fits them: 1.25 GB, 300.0 MB, 12.0 kB, 5 bytes."""
  for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
    if nbytes >= size:
      return f"{nbytes / size:.{2 if unit in ('TB', 'GB') else 1}f} {unit}"
  return f"{int(nbytes)} byte{'' if int(nbytes) == 1 else 's'}"


def write_failure(e: BaseException, what: str) -> str | None:
  """One sentence for a failed write of `what` (`--out=...`): an OSError, or a library's error
  naming the OSError beneath it; None for anything else (a bug, whose traceback is wanted)."""
  seen = e
  while seen is not None:
    if isinstance(seen, OSError):
      return workdir_lib.describe_os_error(seen, what)
    seen = seen.__cause__ or seen.__context__
  found = _OS_ERROR_CODE.search(str(e))
  if found is None:
    return None
  code = int(found.group(1))
  return workdir_lib.describe_os_error(OSError(code, os.strerror(code)), what)


@contextlib.contextmanager
def write_errors(what: str) -> Iterator[None]:
  """A write failing inside the block (`write_failure`) raises OutputError: one line naming
  `what` (`--out=...`) and the reason. Other exceptions, and errors that are already one line
  (ConfigError), pass unchanged."""
  try:
    yield
  except ConfigError:
    raise
  except Exception as e:  # pylint: disable=broad-except
    message = write_failure(e, what)
    if message is None:
      raise
    raise OutputError(message) from None


@contextlib.contextmanager
def staged(out: str | os.PathLike, what: str, flag: str = "--out", complete: str | None = None,
           replace: bool = False, replace_flag: str | None = None) -> Iterator[pathlib.Path]:
  """Yields an empty staging directory for output `out` and publishes it as `out` when the block
  ends without an exception; removes it otherwise, with the folders above `out` it made (those
  that were not there before, innermost first, each only if empty). `complete` names the file
  whose presence marks a complete output (refused unless `replace`, then replaced in one
  rename)."""
  final, parent, name = _paths(out)
  while final in _PUBLISHED:  # an earlier output of this process at `out`: not this one
    _PUBLISHED.remove(final)
  check_target(final, what, flag, complete, replace, replace_flag)
  made = workdir_lib.Made(str(parent))  # the folders above `out` that `lock` is about to make
  held = lock(final, flag)
  tmp = parent / f".{name}{PARTIAL}{os.getpid()}"
  try:
    _recover(final, parent, name)
    check_target(final, what, flag, complete, replace, replace_flag)  # again, under the lock
    try:
      tmp.mkdir()
    except OSError as e:
      raise OutputError(workdir_lib.describe_os_error(e, f"{flag}={str(out)!r}")) from None
    yield tmp
    for f in tmp.rglob("*"):  # safetensors writes owner-only files: readable as any new file
      if f.is_file() and not f.is_symlink():
        readable_as_created(f)
    # What it is, and what it holds: a replace leaves alone a folder others have added to.
    wrote = sorted(p.name for p in tmp.iterdir())
    (tmp / MARKER).write_text(json.dumps({"what": what, "entries": wrote}) + "\n",
                              encoding="utf-8")
    raise_if_interrupted()  # a signal whose exception was lost still stops the publish
    try:  # once more: what another process put at `out` meanwhile (a run's files) is not replaced
      check_target(final, what, flag, complete, replace, replace_flag)
    except OutputError as e:
      raise OutputError(f"{e} (It changed while the {what} was written: nothing was published.)"
                        ) from None
    _publish(tmp, final, parent, name)
    _PUBLISHED.append(final)
  except BaseException:
    remove(tmp)
    held.release()  # its file is in `parent`: gone first, so that a folder made for it is empty
    made.remove_unused(None)  # (a folder another writer uses meanwhile is not empty: it stays)
    raise
  finally:
    held.release()


_PUBLISHED: list[pathlib.Path] = []  # the outputs `staged` put in place in this process


def published(out: str | os.PathLike) -> bool:
  """Whether `staged`'s last output at `out` in this process was put in place: a tool
  interrupted after that says the output is whole, not that nothing was written."""
  return _paths(out)[0] in _PUBLISHED


def _publish(tmp: pathlib.Path, final: pathlib.Path, parent: pathlib.Path, name: str) -> None:
  """Renames `tmp` onto `final`: an empty directory is replaced, a complete older output is moved
  aside first and removed after (so some complete output is always at `final` or beside it)."""
  old = None
  if os.path.lexists(final):
    try:
      final.rmdir()  # empty
    except OSError as e:
      if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
        raise
      old = parent / f".{name}{OLD}{os.getpid()}"  # put back by the next writer if we die here
      os.rename(final, old)
      added = _added(old, sorted(p.name for p in old.iterdir()))
      if added:  # written into it since the last check: put back, not removed
        os.rename(old, final)
        raise OutputError(f"{final} was added to while it was replaced ({', '.join(added[:3])}): "
                          "it is left as it is and nothing was published.")
  os.rename(tmp, final)
  _fsync_dir(parent)
  if old is not None:
    remove(old)


def write_whole(path: str | os.PathLike, value: dict) -> None:
  """`path` holds `value` as JSON whole or not at all (a temporary file renamed over it)."""
  path = pathlib.Path(path)
  tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
  try:
    tmp.write_text(json.dumps(value, indent=2) + "\n", encoding="utf-8")
    fsync(tmp)
    os.replace(tmp, path)
  finally:
    if tmp.exists():
      tmp.unlink()


def readable_as_created(path: str | os.PathLike) -> None:
  """Gives a written file the permissions a new file gets (0666 less the umask): safetensors
  creates its files owner-only (0600)."""
  mask = os.umask(0)
  os.umask(mask)
  os.chmod(path, 0o666 & ~mask)


def fsync(path: str | os.PathLike) -> None:
  """Flushes a file's or a directory's entries to disk; a file system that cannot is let be."""
  _fsync_dir(pathlib.Path(path))


def _fsync_dir(path: pathlib.Path) -> None:
  try:
    fd = os.open(path, os.O_RDONLY)
  except OSError:
    return
  try:
    os.fsync(fd)
  except OSError:
    pass
  finally:
    os.close(fd)


def fail(tool: str, message: str, code: int = 2) -> None:
  """The one line a tool prints for a bad input, then its exit."""
  print(f"{tool}: error: {message}", file=sys.stderr)
  sys.exit(code)
