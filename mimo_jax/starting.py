"""Ctrl-C, SIGTERM or SIGHUP while a command imports its modules (`python -m mimo_jax.launch`,
`python -m tools.NAME`: JAX's, flax's, orbax's imports take seconds) is one line on stderr and
exit status 128 + the signal's number (130, 143, 129), not a KeyboardInterrupt's traceback from
inside an import, nor one lost in a garbage-collection callback (which prints its traceback, and
the command goes on), nor a silent death."""

import os
import signal
import sys

# Each signal guarded, with the handler it has by default, given back once the imports are done.
_DEFAULT = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL,
            signal.SIGHUP: signal.SIG_DFL}


def guard() -> None:
  """Run as a package's first line: makes SIGINT, SIGTERM and SIGHUP leave at once, in one line,
  while the entry point imports.

  Only for `python -m`: runpy imports the packages above the module while `sys.argv[0]` is still
  "-m" (it becomes the module's file once its code runs), so `import mimo_jax` elsewhere (user
  code, tests, a worker process) changes nothing. A signal that is ignored or handled stays so."""
  if sys.argv[:1] == ["-m"]:
    for sig, default in _DEFAULT.items():
      if signal.getsignal(sig) == default:
        signal.signal(sig, _interrupted)


def _interrupted(signum, frame) -> None:
  entry = sys.modules["__main__"]
  if hasattr(entry, "main"):
    # Its imports are done (each entry point defines `main` after them): the default handling
    # from now on, the command's own included (launch's replaces this one sooner, the tools'
    # take SIGTERM and SIGHUP in main): Python's KeyboardInterrupt, or the signal delivered again
    # to a default action (the process ends, killed by it, as without this guard).
    signal.signal(signum, _DEFAULT[signum])
    if signum == signal.SIGINT:
      signal.default_int_handler(signum, frame)
    os.kill(os.getpid(), signum)
    return
  spec = getattr(entry, "__spec__", None)  # None while runpy imports the packages above it
  args = sys.orig_argv
  name = spec.name if spec else args[args.index("-m") + 1] if "-m" in args[:-1] else "python"
  what = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
  os.write(2, f"{name}: interrupted ({what}) while starting; nothing was written.\n".encode())
  # Nothing to clean up; JAX's threads may run.
  os._exit(128 + signum)  # pylint: disable=protected-access
