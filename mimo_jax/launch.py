"""Trains: `python -m mimo_jax.launch [--config=configs/NAME.py[:ARG]] [--config.a.b=value ...]`.

  --config=FILE[:ARG]  the config file (default configs/digits.py) and its variant, e.g.
                       --config=configs/vlm.py:tuned
  --config.a.b=VALUE   any field of the config, e.g. --config.train.steps=100; every field and
                       its default is in the README's tables (--helpfull lists them too)

A run in a run.workdir that holds checkpoints resumes from the newest: after an interruption the
same command goes on. The flags below are for several hosts (one machine's processes:
`python -m tools.launch_local -n N -- FLAGS`); a bad flag or value is one line and exit code 2.
"""

# Flags -> config -> validation -> `train.run`. The training modules (train, distributed,
# data.capacity) are imported inside `main` and `_explain`, once the config is valid and JAX's
# CPU device count is set: that setting must come before JAX's backend starts, and a bad flag
# answers without the seconds those imports take (validation imports JAX, not its backend).

from __future__ import annotations

import os
import signal
import sys
import traceback

from mimo_jax.stopping import StopFlag  # imports no JAX

# SIGINT and SIGTERM from launch's first line until the run's own handlers take over
# (`train.run`'s): the first is noted, not raised, so that it cannot surface as a traceback from
# inside an import (JAX's, orbax's take seconds) or be wrapped by a library's error; launch then
# ends the run before its first step (`_stop_if_signalled`), or hands the signal to `train.run`.
# A second SIGINT leaves at once (status 130), as during training.
_SIGNALS = StopFlag(multi=False)
if __name__ == "__main__":
  _SIGNALS.__enter__()  # before the imports below, which take seconds

# pylint: disable=wrong-import-position  (after the start-up's signal handlers)
from absl import app, flags, logging

from mimo_jax import configfile, interrupts, workdir
from mimo_jax.config import Config, ConfigError
from mimo_jax.metrics import NonFiniteError
from mimo_jax.validation import data_source, validate

_COORDINATOR = flags.DEFINE_string(
    "coordinator", None, "Multi-host: HOST:PORT of process 0's coordinator (with --num_processes "
    "and --process_id). Omit under SLURM or Open MPI: the cluster is detected.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Multi-host: number of processes.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "Multi-host: this process's index.")
_DEBUG = flags.DEFINE_bool(
    "debug", False, "Print the full traceback of an error as well as its one-line summary.")
_HEARTBEAT = flags.DEFINE_integer(
    "heartbeat_timeout", 60, "Multi-host: seconds without a heartbeat after which the other "
    "processes declare a process dead and stop with an error.")

DEFAULT_CONFIG = str(configfile.ROOT / "configs" / "digits.py")
_CONFIG_HELP = "Config file (configs/NAME.py[:ARG]); override any field with --config.a.b=value."
_CONFIG: list[Config] = []  # the run's config, read by `cli` before absl parses the other flags


def _fail(message: str) -> None:
  print(f"mimo_jax: error: {message}", file=sys.stderr)
  sys.exit(2)


def _guarded(fn, *args):
  """Runs flag parsing, turning its errors into one line and exit code 2."""
  try:
    return fn(*args)
  except Exception as e:  # pylint: disable=broad-except  # a bad flag or value
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    name = getattr(e, "flagname", None)  # absl's unknown flag: a config field misspelt, often
    name = None if lines and "Did you mean" in lines[0] else name  # absl's suggestion is enough
    hint = (f"; a config field is --config.{name.split('.', 1)[1]}=VALUE" if name and "." in name
            else "") + ("; --helpfull lists every flag and field" if name else "")
    _fail((lines[0] if lines else type(e).__name__) + hint)
  return None


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    _fail(f"unexpected arguments {argv[1:]}; flags look like --config.train.steps=10.")
  cfg = _CONFIG[0]
  _stop_if_signalled()  # a signal while the modules loaded or the flags were read
  try:
    data_source(cfg)  # the data first: the fields that depend on it come from its converter
    validate(cfg)  # device-independent checks, before JAX starts
  except ConfigError as e:
    _fail(str(e))
  logging.set_verbosity(logging.WARNING)
  if not _DEBUG.value:
    logging.get_absl_handler().addFilter(_no_tracebacks)
    sys.unraisablehook = _unraisable_once
  import jax  # pylint: disable=import-outside-toplevel
  jax.config.update("jax_num_cpu_devices", cfg.run.cpu_devices)  # before the backend starts
  # pylint: disable-next=import-outside-toplevel
  from mimo_jax import distributed, train  # after jax_num_cpu_devices (module docstring)
  _stop_if_signalled()
  try:
    distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value,
                           _HEARTBEAT.value)
  except ValueError as e:
    _fail(str(e))
  several = jax.distributed.is_initialized()
  if several:
    # SIGTERM is jax.distributed's preemption notice now (its handler took over; train.run's
    # installs none), and SIGINT is Python's again, as train.run leaves it.
    _SIGNALS.release(signal.SIGINT)
  try:
    # With one process, train.run's handlers take over from launch's: a signal noted until then
    # ends the run before its first step (nothing made), as one taken during its start-up does.
    # (Several stop together, at a step the preemption notice picks, never one alone.)
    train.run(cfg, pending=None if several else lambda: _SIGNALS.signal)
    distributed.shutdown()
    interrupts.ends_with(0)  # the run is done: a signal now leaves its status 0
  except Exception as e:  # pylint: disable=broad-except
    message, status = _explain(e)
    if message is None or _DEBUG.value:
      traceback.print_exc()
    if message is None:
      message = f"{type(e).__name__}: {e} (the traceback above shows where)"
    if jax.process_count() == 1:
      print(f"mimo_jax: error: {message}", file=sys.stderr, flush=True)
      distributed.silence_stderr()  # nothing may follow the error line
      # The run has closed what it wrote; a library's threads may not end (orbax's, waiting on
      # a save that failed), and the interpreter's exit would wait for them for ever.
      sys.stdout.flush()
      os._exit(status)  # pylint: disable=protected-access
    # Every process reports its own failure, tagged, so a multi-host log says who failed.
    print(f"mimo_jax: process {jax.process_index()}: error: {message}", file=sys.stderr,
          flush=True)
    if isinstance(e, distributed.Together):  # every process raised it: they leave together
      distributed.shutdown(status)
    os._exit(status)  # skip jax.distributed's shutdown barrier, which would wait for the others


def _stop_if_signalled() -> None:
  """Ends the run, status 0, if a signal came during start-up: nothing is made yet."""
  if _SIGNALS.signal is not None:
    print(f"{_SIGNALS.signal} before the first step: nothing to save.", flush=True)
    sys.exit(0)


def _no_tracebacks(record) -> bool:
  """A log filter: library warnings and errors stay, as one line each; their tracebacks are shown
  with --debug (the error that ends the run is explained on its own last line)."""
  if record.exc_info or record.exc_text:
    record.exc_info, record.exc_text = None, None
    record.msg = f"{record.msg} (--debug shows its traceback)"
  return True


_UNRAISABLE_SEEN = set()


def _unraisable_once(unraisable) -> None:
  """Exceptions Python ignores (raised in finalizers or callbacks of a closed event loop, as
  orbax's leave after a failed save): one line per kind, tracebacks with --debug."""
  # pylint: disable=import-outside-toplevel  (after JAX is configured: module docstring)
  from mimo_jax.checkpoint_orbax import read_failure
  exc = unraisable.exc_value
  key = (type(exc).__name__, read_failure(exc))  # one line: no storage spec
  if key not in _UNRAISABLE_SEEN:
    _UNRAISABLE_SEEN.add(key)
    print(f"mimo_jax: note: ignored {key[0]}: {key[1]} (--debug shows its traceback)",
          file=sys.stderr, flush=True)


def _chain(e: BaseException):
  while e is not None:
    yield e
    e = e.__cause__ or e.__context__


def _explain(e: BaseException) -> tuple[str | None, int]:
  """One sentence and the exit status for errors a user can fix: 2 for input (config, data,
  checkpoint, workdir), 1 for a run that cannot go on (non-finite steps, a full disk, a device's
  memory); (None, 1) for anything else, which is a bug and keeps its traceback."""
  # pylint: disable=import-outside-toplevel  (after JAX is configured: module docstring)
  from mimo_jax import memory, step_records
  from mimo_jax.data import capacity
  for x in _chain(e):
    if isinstance(x, (ConfigError, capacity.CapacityError)):
      return str(x), 2
    if isinstance(x, (step_records.NonFiniteStepError, NonFiniteError, memory.OutOfMemoryError)):
      return str(x), 1
    if isinstance(x, OSError) and x.errno is not None:
      # The file in full: shutil.rmtree names one relative to the folder it was removing.
      return workdir.describe_os_error(x, workdir.error_file(x) or "run.workdir"), 1
  text = " ".join(str(x) for x in _chain(e))
  for needle, errno_ in (("No space left on device", 28), ("File too large", 27),
                         ("Read-only file system", 30), ("Permission denied", 13)):
    if needle in text:
      return workdir.describe_os_error(OSError(errno_, needle), "a write under run.workdir"), 1
  return None, 1


def _help_full(spec: str | None) -> None:
  """--helpfull: the flags, then every field of the config `spec` names (configs/digits.py
  without --config) with its default there; exits 0."""
  try:
    cfg = configfile.load_file(DEFAULT_CONFIG if spec is None else spec)
  except ConfigError as e:
    _fail(str(e))
  print(__doc__.strip() + "\n")
  print(f"  --config: {_CONFIG_HELP}\n    (default: {DEFAULT_CONFIG!r})")
  print(flags.FLAGS.main_module_help().split("\n", 2)[-1])
  print(f"\nconfig fields (defaults of {'configs/digits.py' if spec is None else spec}; another "
        "config file sets its own; the README's config table says what each does):")
  print("\n".join(configfile.field_flags(cfg)))
  sys.exit(0)


def _parse_flags(args: list[str]) -> list[str]:
  """absl parses the flags other than --config's (`_guarded`); its help flags (--help, -?,
  --helpshort, --helpxml) print their text and exit 0, not absl's 1: asking for help is no
  failure. (Parsing exits with 1 only there: a bad flag is `_guarded`'s exit code 2.)"""
  try:
    return _guarded(flags.FLAGS, args)
  except SystemExit as e:
    if e.code == 1:
      sys.exit(0)
    raise


def cli() -> None:
  """`--config` and its `--config.a.b=value` overrides are read here (mimo_jax/configfile.py, as
  every tool reads them); absl parses the other flags."""
  argv = _guarded(flags.FLAGS.read_flags_from_files, sys.argv, False)  # --flagfile=FILE
  spec, overrides, rest = configfile.split_args(argv)
  if "--helpfull" in argv[1:]:
    _help_full(spec)
  try:
    _CONFIG.append(configfile.load(DEFAULT_CONFIG if spec is None else spec, overrides))
  except ConfigError as e:
    _fail(str(e))
  app.run(main, argv=rest, flags_parser=_parse_flags)


if __name__ == "__main__":
  cli()
