"""Stop requests: the first SIGTERM/SIGINT (and whatever other signals a caller names) is noted
for the training loop, or a tool, to act on at its next safe point (`StopFlag`)."""

import os
import signal


class StopFlag:
  """Turns the first of `signals` into a request to stop (the training loop checkpoints first); a
  second SIGINT leaves at once (exit status 130), writing `second` to stderr.

  Training installs one for the whole run, final save and eval included. With several processes,
  SIGTERM goes to jax.distributed's preemption sync instead, which picks one step at which every
  process stops (processes see a signal at different steps). Off the main thread no handler can
  be installed, and the signals stay as they are. JAX is imported only to ask how many processes
  there are (`multi` None): launch installs one before its imports, `multi=False`.
  """

  def __init__(self, pending: str | None = None,
               signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT),
               second: str = "mimo_jax: second interrupt: stopped without saving.",
               multi: bool | None = None):
    self.signal = pending  # the signal's name: one an earlier flag caught (during start-up)
    self.signum: int | None = None  # the signal this flag caught
    self._signals, self._second = signals, second
    self._old = {}
    if multi is None:
      import jax  # pylint: disable=import-outside-toplevel
      multi = jax.process_count() > 1
    self._multi = multi

  def __enter__(self) -> "StopFlag":
    for sig in () if self._multi else self._signals:
      try:
        if signal.getsignal(sig) != signal.SIG_IGN:  # one started ignored (nohup's) stays so
          self._old[sig] = signal.signal(sig, self._handle)
      except ValueError:  # not the main thread
        pass
    return self

  def requested(self) -> bool:
    return self.signal is not None

  def should_stop(self, step: int) -> bool:
    if self._multi:
      # pylint: disable-next=import-outside-toplevel
      from jax.experimental import multihost_utils
      if multihost_utils.reached_preemption_sync_point(step):
        self.signal = "SIGTERM"
    return self.signal is not None

  def _handle(self, signum, frame):  # pylint: disable=unused-argument
    if self.signal is not None and signum == signal.SIGINT:
      # Raising here could land inside a JAX callback, which would swallow it: leave at once.
      os.write(2, f"{self._second}\n".encode())
      os._exit(130)  # pylint: disable=protected-access
    self.signal, self.signum = signal.Signals(signum).name, signum

  def release(self, signum: int) -> None:
    """Gives `signum` back to the handler it had before `__enter__`."""
    if signum in self._old:
      signal.signal(signum, self._old.pop(signum))

  def before_first_step(self, main: bool) -> list:
    """The end of a run that a signal stopped before its first step, with nothing made: its one
    line (from the main process) and no records."""
    if main:
      print(f"{self.signal} before the first step: nothing to save.", flush=True)
    return []

  def unless_stopped(self, work):
    """`work()` (a built-in task's data built on first use: seconds), which a signal stops at once
    (`output.Interrupted` raised where it runs, so that its cleanup runs) rather than when it
    ends; None where a signal came before or during it (`signal` names it). With several
    processes `work()` runs as it is: they stop together, at a step."""
    if self.signal is not None:
      return None
    if self._multi:
      return work()
    from mimo_jax import output  # pylint: disable=import-outside-toplevel
    try:
      with output.interrupts_as_exceptions():
        return work()
    except output.Interrupted as e:
      self.signal, self.signum = signal.Signals(e.signum).name, e.signum
      return None

  def __exit__(self, *exc):
    for sig, handler in self._old.items():
      signal.signal(sig, handler)
