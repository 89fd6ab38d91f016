"""Ctrl-C while a command imports its modules (`python -m mimo_jax.launch`, `python -m tools.NAME`:
JAX's, flax's, orbax's imports take seconds) is one line on stderr and exit status 130, not a
KeyboardInterrupt's traceback from inside an import, nor one lost in a garbage-collection callback
(which prints its traceback, and the command goes on)."""

import os
import signal
import sys


def guard() -> None:
  """Run as a package's first line: makes SIGINT leave at once while the entry point imports.

  Only for `python -m`: runpy imports the packages above the module while `sys.argv[0]` is still
  "-m" (it becomes the module's file once its code runs), so `import mimo_jax` elsewhere (user
  code, tests, a worker process) changes nothing. A SIGINT that is ignored or handled stays so."""
  if sys.argv[:1] == ["-m"] and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    signal.signal(signal.SIGINT, _interrupted)


def _interrupted(signum, frame) -> None:
  entry = sys.modules["__main__"]
  if hasattr(entry, "main"):
    # Its imports are done (each entry point defines `main` after them): Python's handler from
    # now on, the command's own handling of Ctrl-C included (launch's replaces this one sooner).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.default_int_handler(signum, frame)
  spec = getattr(entry, "__spec__", None)  # None while runpy imports the packages above it
  args = sys.orig_argv
  name = spec.name if spec else args[args.index("-m") + 1] if "-m" in args[:-1] else "python"
  os.write(2, f"{name}: interrupted (Ctrl-C) while starting; nothing was written.\n".encode())
  os._exit(130)  # pylint: disable=protected-access  # nothing to clean up; JAX's threads may run
