"""Signals as a command's exceptions, and how a command ends.

- `interrupts_as_exceptions()` turns Ctrl-C, SIGTERM and SIGHUP into `Interrupted`, raised where
  the program is, so that a killed tool unwinds through its cleanup; one whose exception is lost
  (raised inside a garbage-collection callback) is recorded and raised again. A signal the tool
  was started ignoring (`nohup`'s SIGHUP, a background job's Ctrl-C) stays ignored.
- `run_main(main)` runs a tool's `main` as the program and exits with its status; once its work
  is done a signal no longer changes that status (`ends_with`).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
from typing import Iterator


class Interrupted(KeyboardInterrupt):
  """SIGINT, SIGTERM or SIGHUP, raised where the program was so that cleanup runs."""

  def __init__(self, signum: int):
    super().__init__(signal.Signals(signum).name)
    self.signum = signum


_PENDING: list[int] = []  # signals taken while interrupts are exceptions, newest last


def said(e: KeyboardInterrupt) -> tuple[int, str]:
  """The signal an interrupt stands for and how a tool's line names it: (2, "Ctrl-C") for
  Python's own KeyboardInterrupt and SIGINT's `Interrupted`, else (its number, its name)."""
  signum = getattr(e, "signum", signal.SIGINT)
  return signum, "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name


def raise_if_interrupted() -> None:
  """Raises `Interrupted` for a signal taken earlier whose exception was lost: one raised inside a
  garbage-collection callback or a finalizer is only printed, and the program would go on."""
  if _PENDING:  # raised once: whoever catches it has taken the signal
    signum = _PENDING[-1]
    _PENDING.clear()
    raise Interrupted(signum)


@contextlib.contextmanager
def quiet_lost_interrupts() -> Iterator[None]:
  """While the block runs, an `Interrupted` that cannot leave a garbage-collection callback or a
  finalizer is not printed: Python hands it to `sys.unraisablehook`, whose default prints
  'Exception ignored' and a traceback. Whoever raised it keeps a record and raises it again.
  A hook installed over it inside the block stays after it (the checkpoint reader's, which drops
  the reports a failed read leaves behind until the process ends), this one passing all through."""
  kept, active = sys.unraisablehook, [True]

  def hook(info):
    if not (active[0] and isinstance(info.exc_value, Interrupted)):
      kept(info)
  sys.unraisablehook = hook
  try:
    yield
  finally:
    active[0] = False
    if sys.unraisablehook is hook:
      sys.unraisablehook = kept


_DEPTH = [0]  # interrupts_as_exceptions blocks open: an inner one keeps the outer's record


@contextlib.contextmanager
def interrupts_as_exceptions(raise_at_end: bool = True) -> Iterator[None]:
  """SIGINT (Ctrl-C), SIGTERM and SIGHUP raise `Interrupted` in the main thread while the block
  runs, and are recorded, so that a signal whose exception was lost (raised inside a
  garbage-collection callback, where Python would print it and go on; silently here: see
  `quiet_lost_interrupts`) is raised again: by `staged`'s publish, and as the block ends (unless
  not `raise_at_end`: `run_main`'s, around a `main` that takes an interrupt itself and returns
  its status), or as an inner block starts or ends. A signal ignored when the block starts (a
  background job's SIGINT, `nohup`'s SIGHUP) stays ignored."""
  def handle(signum, frame):  # pylint: disable=unused-argument
    _PENDING.append(signum)
    raise Interrupted(signum)
  if not _DEPTH[0]:
    _PENDING.clear()
  kept = {}
  for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    try:
      if signal.getsignal(s) != signal.SIG_IGN:
        kept[s] = signal.signal(s, handle)
    except ValueError:  # not the main thread: signals stay as they are
      pass
  _DEPTH[0] += 1
  try:
    with quiet_lost_interrupts():
      raise_if_interrupted()  # taken by an outer block, its exception lost
      yield
      if raise_at_end:
        raise_if_interrupted()  # the block's work is not done
  finally:
    _DEPTH[0] -= 1
    for s, h in kept.items():
      signal.signal(s, h)
    _PENDING.clear()


def run_main(main, *args, at_once: bool = True) -> None:
  """Runs a tool's `main` as the program (`if __name__ == "__main__"`) and exits with its status.
  Signals are exceptions from the start (`interrupts_as_exceptions`): one that `main` does not
  take itself (before its own handling begins: its flags being read) is one line and exit status
  128 + its number. After an interrupt (a status above 128) the exit is immediate: the tool has
  cleaned up, and threads of JAX or orbax still running can crash the interpreter's shutdown (a
  segfault, status 139, instead of 130 or 143); not so where `at_once` is false (a tool whose
  process pools' resource tracker cleans up at a normal exit). A signal once `main` has returned
  leaves the status it returned (`ends_with`): the tool's work, or its cleanup, is done."""
  try:
    with interrupts_as_exceptions(raise_at_end=False):
      status = main(*args)
  except SystemExit as e:
    status = e.code
  except KeyboardInterrupt as e:
    signum, shown = said(e)
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    print(f"{spec.name if spec else 'python'}: interrupted ({shown}).", file=sys.stderr)
    status = 128 + signum
  if at_once and isinstance(status, int) and status > 128:
    _exit_now(status)
  ends_with(0 if status is None else status if isinstance(status, int) else 1)  # as sys.exit's
  sys.exit(status)


_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_ENDING = [0]  # the status a signal ends a command with once its work is done (`ends_with`)


def ends_with(code: int) -> None:
  """Once a command's work is done: a signal while Python joins its threads and runs its exit
  handlers ends it at once with `code`, and is ignored after them (`_ignore_late`); one that the
  command was started ignoring stays ignored."""
  _ENDING[0] = code
  for s in _SIGNALS:
    if signal.getsignal(s) != signal.SIG_IGN:
      signal.signal(s, _end)


def _end(signum, frame) -> None:  # pylint: disable=unused-argument
  _exit_now(_ENDING[0])


@atexit.register  # at import, before the libraries': among the last exit handlers to run
def _ignore_late() -> None:
  """As Python finalizes it gives its own handlers back to the default (death by the signal: 130,
  143), and XLA's teardown takes a second after that: a late signal is ignored there instead."""
  for s in _SIGNALS:
    if signal.getsignal(s) is _end:
      signal.signal(s, signal.SIG_IGN)


def _exit_now(status: int) -> None:
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(status)  # pylint: disable=protected-access
