"""What orbax does that mimo_jax's checkpoints work around: its errors' storage specs, the
"Event loop is closed" reports a failed read leaves behind, notices logged on every save or
read-only open, the errors it logs for a step's damaged record of its save, and a save that
writes a batch of arrays at a time."""

from __future__ import annotations

import gc
import json
import logging
import os
import re
import sys
import warnings

import jax
import orbax.checkpoint as ocp


def read_failure(e: BaseException, step_dir: str | None = None) -> str:
  """The first line of a failed read's error, without the storage spec tensorstore appends; where
  orbax wraps tensorstore's error ("Encountered error while reading array index ..."), the first
  line of that error, which names the array and the file ("OUT_OF_RANGE: Error reading ...").
  A damaged JSON file of step folder `step_dir` is named, as tensorstore names an array's file
  ("meta/metadata: Unterminated string ..."): orbax's error does not name it."""
  first = lambda x: str(x).splitlines()[0] if str(x) else repr(x)
  damaged = step_dir and _damaged_json(e, step_dir)
  if damaged:
    return damaged
  line, cause = first(e), e.__cause__ or e.__context__
  for _ in range(8):
    if cause is None:
      break
    if re.match(r"[A-Z][A-Z_]+: ", first(cause)):  # an absl status: tensorstore's own error
      line = first(cause)
      break
    cause = cause.__cause__ or cause.__context__
  line = re.sub(r" \[tensorstore_spec.*", "", line)
  return re.sub(r"\.? See full TensorStore details:.*", ".", line)


def _damaged_json(e: BaseException, step_dir: str) -> str | None:
  """"FILE: error" for the JSON file of `step_dir` (its metadata files: the step's, each item's)
  that fails to parse as `e` (or an error it wraps) says, FILE relative to `step_dir`; None if `e`
  is no failure to parse, or no file fails so (one rewritten since, or removed)."""
  for _ in range(8):
    if e is None or isinstance(e, (json.JSONDecodeError, UnicodeDecodeError)):
      break
    e = e.__cause__ or e.__context__
  if not isinstance(e, (json.JSONDecodeError, UnicodeDecodeError)):
    return None
  try:
    items = sorted(os.listdir(step_dir))
  except OSError:
    return None
  for name in ["_CHECKPOINT_METADATA"] + [os.path.join(i, f) for i in items
                                          for f in ("_METADATA", "metadata")]:
    try:
      with open(os.path.join(step_dir, name), "rb") as f:
        json.loads(f.read().decode("utf-8"))
    except (OSError, ValueError) as again:  # ValueError: JSONDecodeError, UnicodeDecodeError
      if not isinstance(again, OSError) and str(again) == str(e):
        return f"{name}: {e}"
  return None


STEP_RECORD = "_CHECKPOINT_METADATA"  # orbax's own record of a step's save


def step_record_failure(step_dir: str) -> str | None:
  """What is wrong with orbax's record of the save of step folder `step_dir` (its
  _CHECKPOINT_METADATA: item handlers, save times; no restore of mimo_jax's reads it): "damaged
  (error)" for a file that does not parse (its JSON error, as read_failure says it), "unreadable
  (error)" for one that cannot be read; None for one that parses or is not there. orbax logs an
  ERROR for either and restores the step without it."""
  try:
    with open(os.path.join(step_dir, STEP_RECORD), "rb") as f:
      json.loads(f.read().decode("utf-8"))
  except FileNotFoundError:
    return None
  except OSError as e:
    return f"unreadable ({e.strerror or e})"
  except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
    return f"damaged ({read_failure(e, step_dir).removeprefix(f'{STEP_RECORD}: ')})"
  return None


def step_record_note(step_dir: str) -> str | None:
  """What a damaged or unreadable _CHECKPOINT_METADATA of step folder `step_dir` means and its
  fix, as a resume and the tools say it (once, in place of orbax's ERROR); None where it is sound
  or not there."""
  failure = step_record_failure(step_dir)
  if failure is None:
    return None
  fix = ("delete the file (orbax then notes, as a warning, that it is missing)"
         if failure.startswith("damaged") else "fix its permissions")
  return (f"{os.path.join(step_dir, STEP_RECORD)} is {failure}: it is orbax's own record of the "
          "save (item handlers, save times), which restoring does not read, so nothing of the "
          f"step is lost with it; {fix}.")


def _not_a_step_record_said(record) -> bool:
  """A log filter: orbax's ERROR for a step's _CHECKPOINT_METADATA that fails to read or parse
  (`step_record_failure` says what is wrong with it)."""
  args = record.args if isinstance(record.args, tuple) else ()
  return not (str(record.msg).startswith(("Failed to json parse Metadata file",
                                          "Failed to read Metadata file")) and args and
              os.path.basename(str(args[0])) == STEP_RECORD and
              step_record_failure(os.path.dirname(str(args[0]))) is not None)


def step_record_errors_dropped() -> None:
  """From now on, for the rest of the process, orbax's ERROR log lines for a step's damaged or
  unreadable _CHECKPOINT_METADATA are dropped (and only those): for a run or tool that opens a
  checkpoints folder (orbax reads every step's record then) and notes the record of the step it
  restores (`step_record_note`)."""
  if _not_a_step_record_said not in logging.getLogger("absl").filters:
    logging.getLogger("absl").addFilter(_not_a_step_record_said)


def _is_closed_loop_report(unraisable) -> bool:
  """A report a failed restore's abandoned reads leave: orbax's closed event loop, or one of the
  reads' own failures, collected after the one that was raised."""
  exc = unraisable.exc_value
  return ((isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed") or
          str(exc).startswith("Encountered error while reading"))


def _no_lost_task_reports(record) -> bool:
  return "exception was never retrieved" not in record.getMessage()


def drop_lost_task_logs() -> None:
  """The abandoned reads of a failed restore fail later, and asyncio logs each, with a traceback,
  as its task is collected: those logs are dropped (the failed step is named once, by whoever
  read it)."""
  logging.getLogger("asyncio").addFilter(_no_lost_task_reports)


def collect() -> None:
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # "coroutine ... was never awaited"
    gc.collect()


def drop_closed_loop_reports(collect_now: bool = True):
  """A failed restore or save leaves orbax's other reads or writes behind, bound to an event loop
  that orbax has closed: as each ends, or is collected, Python reports "Event loop is closed" (a
  read also its own failure). From now on those reports, and only those, are dropped; returns
  the hook this one passes the rest to, for a caller that puts it back. `collect_now` collects
  the leftovers already garbage (false: installed before reading)."""
  previous = sys.unraisablehook

  def hook(unraisable):
    if not _is_closed_loop_report(unraisable):
      previous(unraisable)
  hook.drops_closed_loop_reports = True
  sys.unraisablehook = hook
  if collect_now:
    collect()
  return previous


def quiet_failed_reads() -> None:
  """From a read on, for the rest of the process, the reports a failed restore's abandoned reads
  leave (`drop_closed_loop_reports`, `drop_lost_task_logs`) are dropped: some come before its
  failure reaches the reader, which names the step once, and some after the reader is closed.
  Installed again where a hook installed over it was put back."""
  if not getattr(sys.unraisablehook, "drops_closed_loop_reports", False):
    drop_closed_loop_reports(collect_now=False)
  drop_lost_task_logs()


def _all_deferred(record) -> bool:
  """A log filter: orbax warns on every batched save that no array is prioritized, which is the
  point of it."""
  return "No prioritized params found" not in record.getMessage()


def not_read_only_notice(record) -> bool:
  """A log filter: orbax warns that a read-only manager is read-only, which is what was asked."""
  message = record.getMessage()
  return not ("read_only=True, setting" in message or "Given directory is read only" in message)


def batched_array_registry():
  """orbax's handlers for a save that copies arrays off the devices and writes them a batch at a
  time (at most `save_device_host_concurrent_gb` a batch), so that the host holds one batch, not
  the whole tree: orbax applies that limit only to arrays its transfer callback defers, and its
  default callback defers none. Only jax arrays (the parameters a save-only checkpointer writes).
  None where this orbax has no such callback."""
  try:
    # pylint: disable-next=import-outside-toplevel
    from orbax.checkpoint._src.serialization import types as serialization_types
    priority = serialization_types.TransferPriority.ASYNCHRONOUS_DEPRIORITIZED
    base = serialization_types.DefaultSerializationStatusCallback
  except (ImportError, AttributeError):
    return None

  class Deferred(base):
    def key_priority(self, _):
      return priority

  try:
    handler = ocp.type_handlers.ArrayHandler(callback=Deferred())
  except TypeError:
    return None
  if _all_deferred not in logging.getLogger("absl").filters:
    logging.getLogger("absl").addFilter(_all_deferred)
  return ocp.type_handlers.create_type_handler_registry((jax.Array, handler))
