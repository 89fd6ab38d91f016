"""A run's stop requests: the first SIGTERM/SIGINT asks the training loop to save and stop
(`StopFlag`)."""

import os
import signal

import jax
from jax.experimental import multihost_utils


class StopFlag:
  """Turns the first SIGTERM/SIGINT into a request to checkpoint and stop; a second SIGINT aborts
  at once (exit status 130), without saving.

  Installed for the whole run, final save and eval included. With several processes, SIGTERM goes
  to jax.distributed's preemption sync instead, which picks one step at which every process stops
  (processes see a signal at different steps).
  """

  def __init__(self, pending: str | None = None):
    self.signal = pending  # a signal an earlier flag caught (during start-up)
    self._old = {}
    self._multi = jax.process_count() > 1

  def __enter__(self):
    for sig in () if self._multi else (signal.SIGTERM, signal.SIGINT):
      self._old[sig] = signal.signal(sig, self._handle)
    return self

  def requested(self) -> bool:
    return self.signal is not None

  def should_stop(self, step: int) -> bool:
    if self._multi:
      if multihost_utils.reached_preemption_sync_point(step):
        self.signal = "SIGTERM"
    return self.signal is not None

  def _handle(self, signum, frame):
    if self.signal is not None and signum == signal.SIGINT:
      # Raising here could land inside a JAX callback, which would swallow it: leave at once.
      os.write(2, b"mimo_jax: second interrupt: stopped without saving.\n")
      os._exit(130)
    self.signal = signal.Signals(signum).name

  def __exit__(self, *exc):
    for sig, handler in self._old.items():
      signal.signal(sig, handler)
