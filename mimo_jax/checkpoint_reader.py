"""Reading a run's checkpoints without the run: its committed steps, read-only, beside a live run.

`Reader(path)` opens a workdir (or its checkpoints/ folder) and reads a step's metadata
(`meta`, checked against its digest), its parameters (`params` flat as `module/path/to/param`,
`params_tree` nested, both checked against the fingerprints saved with them), their shapes and
dtypes (`params_metadata`) and a module's whole saved tree (`module`). `newest(reader, step,
fn)` runs `fn` on a step, or on the newest one again when a live run rotates it away mid-read.
Only committed steps are read (orbax's `commit_success.txt`); a step removed while being read
raises `StepGone`, a damaged one `Unreadable`, nothing left to read `TryAgain`: each a
`CkptError`, one line naming the fix. A file or folder of a step that this user may not read
raises checkpoint_steps.PermissionDenied instead, naming it: its permissions, not damage.
tools.ckpt, tools.hf export, tools.generate and tools.eval read checkpoints through it; orbax's
ERROR for a step's damaged _CHECKPOINT_METADATA is dropped, and `meta` says it as one note.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Callable, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath
import orbax.checkpoint as ocp

from mimo_jax import fingerprint, workdir as workdir_lib, xla_errors
from mimo_jax.checkpoint_arrays import params_restore_dtype
from mimo_jax.checkpoint_orbax import (collect, drop_lost_task_logs, quiet_failed_reads,
                                      read_failure, step_record_errors_dropped, step_record_note)
from mimo_jax.checkpoint_steps import (PermissionDenied, base_folder, complete_steps,
                                      digest_failure, meta_file, unreadable)
from mimo_jax.config import ConfigError
from mimo_jax.trees import path_str

T = TypeVar("T")
ROTATED = "the run rotates old steps: checkpoint.keep"
DAMAGED = ("its files are damaged; `python -m tools.ckpt check` names the steps that pass: give "
           "one with --step.")
# How long a failed read of a step waits for the step to vanish while a run is live (its rotation
# deletes a step's files one by one; a read can fail before the folder is gone).
SETTLE_S = 3.0


class CkptError(ConfigError):
  """A checkpoint that cannot be read as asked; the message names it and the fix."""


class StepGone(CkptError):
  """A step that was removed while being read (a live run's `keep` rotated it away)."""

  def __init__(self, step: int):
    super().__init__(f"step {step} was removed while being read ({ROTATED})")
    self.step = step
    # Reads of the abandoned restore still in flight fail later and asyncio logs them, with a
    # traceback, when their tasks are collected: the step is gone, which the tool has said.
    drop_lost_task_logs()


class TryAgain(CkptError):
  """Nothing could be read because a live run rotated every step away under the reads: not a
  verdict on the checkpoint. Tools exit with status 75 (EX_TEMPFAIL), apart from damage's 2."""


class Unreadable(CkptError):
  """A step that is there but cannot be read: its files are damaged."""

  def __init__(self, path: str, step: int, reason: str):
    super().__init__(f"step {step} of {path} cannot be read ({reason}): {DAMAGED}")
    self.step, self.reason = step, reason


class BadDigest(CkptError):
  """A step whose metadata does not match the digest it holds of itself, or holds none (every
  step saved holds one): edited or damaged. `meta` is the metadata as read (tools.ckpt check
  reports the digest beside the step's arrays)."""

  def __init__(self, path: str, step: int, wrong: str, meta):
    super().__init__(f"step {step} of {path} has metadata that {wrong} "
                     f"({meta_file(path, step)}): {DAMAGED}")
    self.step, self.wrong, self.meta = step, wrong, meta


def who(holder: dict) -> str:
  """The run holding a workdir, from its lock (`workdir.live_run`): host, pid, start time."""
  return (f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, started "
          f"{holder.get('started', '?')}")


class Reader:
  """A checkpoint folder's committed steps, read-only and beside a run that may be saving into
  it: a step removed under a read raises StepGone, a damaged one Unreadable."""

  def __init__(self, path: str):
    if os.path.isdir(os.path.join(path, "checkpoints")):
      path = os.path.join(path, "checkpoints")
    if not os.path.isdir(path):
      raise CkptError(f"{path} is not a directory; give a run's workdir or its checkpoints/ "
                      "folder.")
    self.path = os.path.abspath(path)
    self.workdir = os.path.dirname(self.path)
    self.live = workdir_lib.live_run(self.workdir)  # the live run's lock, or None
    # A lock that names no run (damaged): noted, and read as if no run held the workdir.
    self.bad_lock = None if self.live else workdir_lib.unreadable_lock(self.workdir)
    steps = self.steps()
    parent = os.path.dirname(self.path)
    if not steps and os.path.basename(self.path).isdigit() and os.path.basename(parent) == \
        "checkpoints":  # a step's own folder: the tools take the run and the step apart
      raise CkptError(f"{path} is one step's folder; give the run's workdir "
                      f"{os.path.dirname(parent)} (or its checkpoints/ folder) with --step "
                      f"{int(os.path.basename(self.path))}.")
    if not steps:
      raise CkptError(f"{self.path} holds no finished checkpoint" + (
          f" yet; a run ({who(self.live)}) is using {self.workdir}: wait for its first save."
          if self.live else "."))
    self.tool, self._said = None, set()  # who says a step's damaged record, the steps said
    step_record_errors_dropped()  # orbax's ERROR for each: `meta` says one note instead
    handlers = {n: (ocp.JsonCheckpointHandler() if n == "meta" else ocp.PyTreeCheckpointHandler())
                for n in self._items(steps)}
    options = ocp.CheckpointManagerOptions(read_only=True, create=False)
    self.mngr = ocp.CheckpointManager(self.path, options=options, item_handlers=handlers)

  def _items(self, steps: list[int]) -> list[str]:
    """The item names (modules and meta) of every step that is still there: a step that lost
    one of its items is damaged, and the steps beside it are still read whole."""
    names, found = set(), False
    for step in steps:
      folder = os.path.join(self.path, str(step))
      try:
        names.update(d for d in os.listdir(folder) if os.path.isdir(os.path.join(folder, d)))
        found = True
      except FileNotFoundError:
        continue
      except PermissionError:
        raise PermissionDenied(folder) from None
    if not found:
      raise TryAgain(f"every step of {self.path} was removed while being read ({ROTATED}); run "
                     "again.")
    return sorted(names)

  def steps(self) -> list[int]:
    """The committed steps, oldest first."""
    return complete_steps(self.path)

  def note(self, tool: str, records: bool = True) -> None:
    """Says on stderr that a live run holds the workdir, if one does, or that its lock is
    unreadable (and to delete it if no run uses the workdir). `records`: from now on `meta` says
    on stderr, once a step, that the step's _CHECKPOINT_METADATA is damaged or unreadable
    (`step_record_note`; orbax's ERROR about it is dropped)."""
    self.tool = tool if records else None
    if self.bad_lock:
      print(f"{tool}: note: {self.bad_lock}", file=sys.stderr, flush=True)
    if self.live:
      print(f"{tool}: note: a run ({who(self.live)}) is using {self.workdir}: reading its "
            f"committed steps ({', '.join(map(str, self.steps()))}); newer steps may appear and "
            "old ones be rotated away.", file=sys.stderr, flush=True)

  def pick(self, step: int | None) -> int:
    """`step`, or the newest committed step; an error naming the steps there are."""
    steps = self.steps()
    if not steps:
      raise CkptError(f"{self.path} holds no finished checkpoint any more"
                      + (f" ({ROTATED})." if self.live else "."))
    if step is None:
      return steps[-1]
    if step not in steps:
      raise CkptError(f"no step {step}; the checkpoint holds steps {', '.join(map(str, steps))}.")
    return step

  def gone(self, step: int) -> bool:
    """Whether `step` is no longer a committed step; while a run is live, a step still there is
    given a moment (its deletion may be under way)."""
    committed = lambda: os.path.exists(os.path.join(self.path, str(step), "commit_success.txt"))
    deadline = time.monotonic() + (SETTLE_S if self.live else 0)
    while committed():
      if time.monotonic() >= deadline:
        return False
      time.sleep(0.1)
    return True

  def read(self, step: int, fn: Callable[[], T]) -> T:
    """fn() reading `step`: StepGone if the step vanished under it, PermissionDenied if a file or
    folder of the step may not be read, else Unreadable if the step is still there (after one
    more try while a run is live)."""
    quiet_failed_reads()
    for _ in range(2 if self.live else 1):
      try:
        return fn()
      except Exception as e:  # pylint: disable=broad-except
        if xla_errors.out_of_memory(e):  # a device's memory, not the step's files
          raise
        reason = read_failure(e, os.path.join(self.path, str(step)))
      collect()  # those of the leftovers already garbage, while the reports are dropped
      if self.gone(step):
        raise StepGone(step)
      denied = unreadable(os.path.join(self.path, str(step)))
      if denied:
        raise PermissionDenied(denied)
    raise Unreadable(self.path, step, reason)

  def meta(self, step: int) -> dict:
    """The step's metadata (checkpoint.py's `meta` item: config, data position, fingerprints),
    checked against the digest it holds of itself as a run checks it: metadata that does not
    match it, or holds none, raises BadDigest. Said first, once a step, where `note` asked: a
    damaged or unreadable _CHECKPOINT_METADATA of the step."""
    said = self.tool and step not in self._said and step_record_note(
        os.path.join(self.path, str(step)))
    if said:
      self._said.add(step)
      print(f"{self.tool}: note: step {step}: {said}", file=sys.stderr, flush=True)
    meta = self.read(step, lambda: _meta(self.mngr, step))
    wrong = digest_failure(meta)
    if wrong:
      raise BadDigest(self.path, step, wrong, meta)
    return meta

  def tree(self, step: int, module: str) -> dict:
    """One module's saved metadata tree (shapes and dtypes as stored)."""
    return self.read(step, lambda: _metadata_tree(self.mngr, step, module))

  def params_metadata(self, step: int, modules: list[str]) -> dict:
    """The parameters of `modules` as stored (shape and dtype, nothing read), flat:
    `module/path/to/param`."""
    out = {}
    for m in modules:
      out.update(_flat(self.tree(step, m)["params"], f"{m}/"))
    return out

  def params_nbytes(self, step: int, modules: list[str]) -> int:
    """The bytes the parameters of `modules` take once read (float32 where stored compact)."""
    total = 0
    for x in self.params_metadata(step, modules).values():
      dtype = params_restore_dtype(x.dtype) or x.dtype
      total += int(np.prod(x.shape)) * np.dtype(dtype).itemsize
    return total

  def params(self, step: int, meta: dict) -> dict[str, np.ndarray]:
    """Every parameter of the step's modules, flat (`module/path/to/param`), as host arrays,
    checked against the fingerprints saved with them (CkptError naming the damaged ones)."""
    flat = self.read(step, lambda: _read_params(self.mngr, step, meta["modules"]))
    saved = meta.get("fingerprints") or {}
    bad = []
    for key, x in flat.items():
      module, path = key.split("/", 1)
      want = saved.get(module, {}).get(f"params/{path}")
      if want is not None and not matches(x, want):
        bad.append(key)
    if bad and not self.gone(step):
      raise CkptError(f"step {step} of {self.path} does not match the fingerprints saved with it "
                      f"({', '.join(bad[:3])}{f' and {len(bad) - 3} more' if len(bad) > 3 else ''}"
                      f"): {DAMAGED}")
    if bad:
      raise StepGone(step)
    base = meta.get("base")
    if base:  # a LoRA run's step: its frozen weights are in the step its base names
      flat.update(self._base(step, base, flat))
    return flat

  def _base(self, step: int, base: dict, have: dict) -> dict[str, np.ndarray]:
    """The frozen weights a step leaves to its base (checkpoint_steps.Base), read from there after
    checking that it holds the weights the run was trained on."""
    folder = base_folder(self.path, base["path"])
    named, where = f"{folder} step {base['step']}", f"step {step} of {self.path}"
    if base["step"] not in complete_steps(folder):
      raise CkptError(f"{where} holds the trained weights; its frozen base weights are in "
                      f"{named}, which is not there (moved or deleted): put it back.")
    reader = self if os.path.abspath(folder) == self.path else Reader(folder)
    try:
      meta = reader.meta(base["step"])
      changed = [f"{n} {k}" for n, fps in base["fingerprints"].items() for k, fp in fps.items()
                 if meta.get("fingerprints", {}).get(n, {}).get(k) != fp]
      if changed:
        raise CkptError(f"{where} was trained on the frozen base weights of {named}, which now "
                        f"holds other weights ({', '.join(changed[:3])} differ): put the base "
                        "it was trained on back.")
      flat = reader.params(base["step"], meta)
    finally:
      if reader is not self:
        reader.close()
    wanted = {f"{n}/{k[len('params/'):]}" for n, fps in base["fingerprints"].items() for k in fps}
    return {k: flat[k] for k in sorted(wanted - set(have))}

  def params_tree(self, step: int, meta: dict) -> dict:
    """The parameters by module, nested as the model holds them (checked as `params`)."""
    out: dict = {}
    for key, x in self.params(step, meta).items():
      module, *path = key.split("/")
      node = out.setdefault(module, {})
      for k in path[:-1]:
        node = node.setdefault(k, {})
      node[path[-1]] = x
    return out

  def module(self, step: int, module: str) -> dict:
    """One module's whole saved tree (parameters and optimizer state) as host arrays."""
    return self.read(step, lambda: _read_module(self.mngr, step, module))

  def close(self) -> None:
    self.mngr.close()


def newest(reader: Reader, step: int | None, fn: Callable[[int], T],
           tool: str = "tools.ckpt") -> tuple[int, T]:
  """(step, fn(step)) for `step`, or for the newest step: one that a live run's rotation removes
  under the read is followed by the newest again (with a note naming `tool`); a given `step`
  removed is an error naming the steps there are now."""
  for _ in range(5):
    s = reader.pick(step)
    try:
      return s, fn(s)
    except StepGone as e:
      if step is not None:
        now = reader.steps()
        raise CkptError(f"{e}; the checkpoint holds steps {', '.join(map(str, now)) or 'none'} "
                        "now: give one of them with --step.") from None
      print(f"{tool}: note: {e}; reading the newest step again.", file=sys.stderr, flush=True)
  raise TryAgain(f"the newest step of {reader.path} was removed under every read ({ROTATED}); "
                 "run again, or give an older --step.")


# The manager-level reads under the Reader.

def _meta(mngr, step: int) -> dict:
  return mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]


def matches(x, want: list[int]) -> bool:
  """Whether host array `x` has the saved fingerprint `want`: its own, or that of its bfloat16
  values where it holds bfloat16 values read as float32 (a frozen weight of a bfloat16 run is
  saved, and fingerprinted, in bfloat16)."""
  x = np.asarray(x)
  if [int(v) for v in fingerprint.of(x)] == want:
    return True
  if x.dtype != np.float32:
    return False
  with np.errstate(invalid="ignore", over="ignore"):  # damaged bytes: the answer is no, quietly
    y = x.astype(jnp.bfloat16)
  return (np.array_equal(y.astype(np.float32), x) and
          [int(v) for v in fingerprint.of(y)] == want)


def _metadata_tree(mngr, step: int, module: str) -> dict:
  """One module's saved tree metadata, read from its own item: the manager's `item_metadata`
  reads every item, so one damaged module's would fail the others' too."""
  tree = ocp.PyTreeCheckpointHandler().metadata(epath.Path(mngr.directory) / str(step) / module)
  return getattr(tree, "tree", tree)


def _flat(tree, prefix: str) -> dict[str, object]:
  out = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    out[prefix + path_str(path)] = leaf
  return out


def _read_params(mngr, step: int, modules: list[str]) -> dict[str, np.ndarray]:
  args = {}
  for m in modules:
    tree = _metadata_tree(mngr, step, m)
    restore = jax.tree.map(lambda x: ocp.RestoreArgs(
        restore_type=np.ndarray, dtype=params_restore_dtype(x.dtype)), tree["params"])
    args[m] = ocp.args.PyTreeRestore(item={"params": tree["params"]},
                                     restore_args={"params": restore}, partial_restore=True)
  restored = mngr.restore(step, args=ocp.args.Composite(**args))
  out = {}
  for m in modules:
    out.update(_flat(restored[m]["params"], f"{m}/"))
  return out


def _read_module(mngr, step: int, module: str) -> dict:
  """One module's whole saved tree (parameters and optimizer state) as host arrays."""
  tree = _metadata_tree(mngr, step, module)
  restore = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
  restore["params"] = jax.tree.map(lambda x: ocp.RestoreArgs(
      restore_type=np.ndarray, dtype=params_restore_dtype(x.dtype)), tree["params"])
  return mngr.restore(step, args=ocp.args.Composite(**{module: ocp.args.PyTreeRestore(
      item=tree, restore_args=restore)}))[module]
