"""Inspect, export and check mimo_jax checkpoints without the run that wrote them.

  python -m tools.ckpt inspect RUN_OR_CHECKPOINT_DIR [--step N] [--params]
  python -m tools.ckpt export  RUN_OR_CHECKPOINT_DIR [--step N] --out model.safetensors
  python -m tools.ckpt check   RUN_OR_CHECKPOINT_DIR [--step N]

`export` writes every module's parameters into one safetensors file (keys `module/path/to/param`,
the config in its metadata): loadable with `safetensors.numpy.load_file`, no mimo_jax needed. The
file is written beside `--out` under a temporary name and renamed into place when complete (a
lock `.<name>.lock` keeps a second export of the same file out); an existing `--out` is refused.
`check` reads every step back, each item on its own: the metadata against its digest, and every
array of every module (parameters and optimizer state) against the fingerprint saved with it and
for non-finite values. It exits non-zero naming each step and item that fails, and which step to
resume from.

All three only read, and work beside a run that is using the workdir (its `run.lock`): they read
committed steps only (orbax's `commit_success.txt`), say on stderr that a run holds the workdir
and that newer steps may appear, and treat a step removed while being read (the run rotating old
steps away: `checkpoint.keep`) as gone, not damaged.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from typing import Callable, TypeVar

import numpy as np

from mimo_jax import output, workdir as workdir_lib
from mimo_jax.checkpoint import (_reason, complete_steps, drop_closed_loop_reports,
                                 params_restore_dtype)
from mimo_jax.config import ConfigError

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
    logging.getLogger("asyncio").addFilter(_no_lost_task_reports)


def _no_lost_task_reports(record) -> bool:
  return "exception was never retrieved" not in record.getMessage()


class TryAgain(CkptError):
  """Nothing could be read because a live run rotated every step away under the reads: not a
  verdict on the checkpoint. Exit status 75 (EX_TEMPFAIL), apart from damage's 2."""


class Unreadable(CkptError):
  """A step that is there but cannot be read: its files are damaged."""

  def __init__(self, path: str, step: int, reason: str):
    super().__init__(f"step {step} of {path} cannot be read ({reason}): {DAMAGED}")
    self.step, self.reason = step, reason


_DROPPING = []


def _drop_closed_loop_reports_once() -> None:
  """After a failed read its leftovers report "Event loop is closed" on their way out: from then
  on those reports are dropped (the check goes on with the other items)."""
  if not _DROPPING:
    _DROPPING.append(drop_closed_loop_reports())


def _who(holder: dict) -> str:
  return (f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, started "
          f"{holder.get('started', '?')}")


class Reader:
  """A checkpoint folder's committed steps, read-only and beside a run that may be saving into
  it: a step removed under a read raises StepGone, a damaged one Unreadable."""

  def __init__(self, path: str):
    import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
    if os.path.isdir(os.path.join(path, "checkpoints")):
      path = os.path.join(path, "checkpoints")
    if not os.path.isdir(path):
      raise CkptError(f"{path} is not a directory; give a run's workdir or its checkpoints/ "
                      "folder.")
    self.path = os.path.abspath(path)
    self.workdir = os.path.dirname(self.path)
    self.live = workdir_lib.live_run(self.workdir)
    steps = self.steps()
    if not steps:
      raise CkptError(f"{self.path} holds no finished checkpoint" + (
          f" yet; a run ({_who(self.live)}) is using {self.workdir}: wait for its first save."
          if self.live else "."))
    handlers = {n: (ocp.JsonCheckpointHandler() if n == "meta" else ocp.PyTreeCheckpointHandler())
                for n in self._items(steps)}
    options = ocp.CheckpointManagerOptions(read_only=True, create=False)
    self.mngr = ocp.CheckpointManager(self.path, options=options, item_handlers=handlers)

  def _items(self, steps: list[int]) -> list[str]:
    """The item names (modules and meta) of the newest step that is still there."""
    for step in reversed(steps):
      try:
        folder = os.path.join(self.path, str(step))
        return [d for d in os.listdir(folder) if os.path.isdir(os.path.join(folder, d))]
      except FileNotFoundError:
        continue
    raise TryAgain(f"every step of {self.path} was removed while being read ({ROTATED}); run "
                    "again.")

  def steps(self) -> list[int]:
    return complete_steps(self.path)

  def note(self, tool: str) -> None:
    """Says on stderr that a live run holds the workdir, if one does."""
    if self.live:
      print(f"{tool}: note: a run ({_who(self.live)}) is using {self.workdir}: reading its "
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
    """fn() reading `step`: StepGone if the step vanished under it, Unreadable if the step is
    still there (after one more try while a run is live)."""
    for _ in range(2 if self.live else 1):
      try:
        return fn()
      except Exception as e:  # pylint: disable=broad-except
        reason = _reason(e)
      _drop_closed_loop_reports_once()
      if self.gone(step):
        raise StepGone(step)
    raise Unreadable(self.path, step, reason)

  def meta(self, step: int) -> dict:
    return self.read(step, lambda: _meta(self.mngr, step))

  def tree(self, step: int, module: str) -> dict:
    """One module's params metadata tree (shapes and dtypes)."""
    def get():
      tree = self.mngr.item_metadata(step)[module]
      return getattr(tree, "tree", tree)
    return self.read(step, get)

  def params_nbytes(self, step: int, modules: list[str]) -> int:
    """The bytes the parameters of `modules` take once read (float32 where stored compact)."""
    import jax  # pylint: disable=import-outside-toplevel
    total = 0
    for m in modules:
      for x in jax.tree.leaves(self.tree(step, m)["params"]):
        dtype = params_restore_dtype(x.dtype) or x.dtype
        total += int(np.prod(x.shape)) * np.dtype(dtype).itemsize
    return total

  def params(self, step: int, meta: dict) -> dict[str, np.ndarray]:
    """Every parameter of the step's modules, flat (`module/path/to/param`), as host arrays,
    checked against the fingerprints saved with them (CkptError naming the damaged ones)."""
    from mimo_jax import fingerprint  # pylint: disable=import-outside-toplevel
    flat = self.read(step, lambda: _read_params(self.mngr, step, meta["modules"]))
    saved = meta.get("fingerprints") or {}
    bad = []
    for key, x in flat.items():
      module, path = key.split("/", 1)
      want = saved.get(module, {}).get(f"params/{path}")
      if want is not None and [int(v) for v in fingerprint.of(np.asarray(x))] != want:
        bad.append(key)
    if bad and not self.gone(step):
      raise CkptError(f"step {step} of {self.path} does not match the fingerprints saved with it "
                      f"({', '.join(bad[:3])}{f' and {len(bad) - 3} more' if len(bad) > 3 else ''}"
                      f"): {DAMAGED}")
    if bad:
      raise StepGone(step)
    return flat

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
    return self.read(step, lambda: _read_module(self.mngr, step, module))

  def close(self) -> None:
    self.mngr.close()


def newest(reader: Reader, step: int | None, fn: Callable[[int], T],
           tool: str = "tools.ckpt") -> tuple[int, T]:
  """(step, fn(step)) for `step`, or for the newest step: one that a live run's rotation removes
  under the read is followed by the newest again (with a note); a given `step` removed is an
  error naming the steps there are now."""
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

def _manager(path: str):
  """The checkpoint manager of `path` (CkptError, which each tool prints as its own error)."""
  reader = Reader(path)
  return reader.mngr, reader.path


def _meta(mngr, step: int) -> dict:
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  return mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]


def _flat(tree, prefix: str) -> dict[str, object]:
  import jax  # pylint: disable=import-outside-toplevel
  out = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    out[prefix + jax.tree_util.keystr(path, simple=True, separator="/")] = leaf
  return out


def _params_metadata(mngr, step: int, module: str) -> dict:
  tree = mngr.item_metadata(step)[module]
  tree = getattr(tree, "tree", tree)
  return _flat(tree["params"], f"{module}/")


def _read_params(mngr, step: int, modules: list[str]) -> dict[str, np.ndarray]:
  import jax  # pylint: disable=import-outside-toplevel
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  args = {}
  for m in modules:
    tree = getattr(mngr.item_metadata(step)[m], "tree", mngr.item_metadata(step)[m])
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
  import jax  # pylint: disable=import-outside-toplevel
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  tree = getattr(mngr.item_metadata(step)[module], "tree", mngr.item_metadata(step)[module])
  restore = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
  restore["params"] = jax.tree.map(lambda x: ocp.RestoreArgs(
      restore_type=np.ndarray, dtype=params_restore_dtype(x.dtype)), tree["params"])
  return mngr.restore(step, args=ocp.args.Composite(**{module: ocp.args.PyTreeRestore(
      item=tree, restore_args=restore)}))[module]


# The commands.

def inspect(args: argparse.Namespace) -> None:
  reader = Reader(args.dir)
  reader.note("tools.ckpt")

  def read(step: int) -> tuple[dict, dict]:
    meta = reader.meta(step)
    return meta, {m: _flat(reader.tree(step, m)["params"], f"{m}/") for m in meta["modules"]}
  step, (meta, modules) = newest(reader, args.step, read)
  print(f"checkpoint: {reader.path}")
  print(f"steps: {', '.join(map(str, reader.steps()))} (showing {step})")
  data = meta["data"]
  print(f"data position: {data['steps_done']} steps done, {data['samples_consumed']} samples "
        f"consumed (data.seed={data['seed']}, global_batch={data['global_batch']})")
  print(f"rng: train.seed={meta['rng']['train_seed']} data.seed={meta['rng']['data_seed']}")
  total = 0
  for module, params in modules.items():
    count = sum(int(np.prod(p.shape)) for p in params.values())
    total += count
    topo = meta["config"]["topology"][module]
    print(f"module {module}: {count:,} parameters, {len(params)} arrays, saved with "
          f"dp={topo['dp']} tp={topo['tp']} offset={topo['offset']}")
    if args.params:
      for name, p in params.items():
        print(f"  {name:60s} {str(tuple(p.shape)):16s} {p.dtype}")
  print(f"total: {total:,} parameters")
  print("config: " + json.dumps(meta["config"], sort_keys=True))
  reader.close()


def export(args: argparse.Namespace) -> None:
  from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel
  final = os.path.abspath(args.out)
  parent, name = os.path.dirname(final), os.path.basename(final)
  if not os.path.isdir(parent):
    raise CkptError(f"--out: folder {parent} does not exist; create it or choose another --out.")

  def refuse_existing() -> None:
    if os.path.isdir(final):
      raise CkptError(f"--out={args.out!r} is a directory; give a file name such as "
                      "model.safetensors.")
    if os.path.lexists(final):
      raise CkptError(f"--out={args.out!r} exists; choose another --out or delete it.")
  reader = Reader(args.dir)
  if args.step is not None:
    reader.pick(args.step)  # a step that is not there first: the inputs in the order given
  refuse_existing()
  reader.note("tools.ckpt")
  held = output.lock(final, "--out")
  tmp = os.path.join(parent, f".{name}{output.PARTIAL}{os.getpid()}")
  try:
    for p in output.partials(final):  # of writers killed before they finished
      output.remove(p)
    refuse_existing()  # again, under the lock

    def read(step: int) -> tuple[dict, dict]:
      meta = reader.meta(step)
      size = reader.params_nbytes(step, meta["modules"])
      output.check_space(final, size, f"exporting step {step}")
      return meta, reader.params(step, meta)
    step, (meta, tensors) = newest(reader, args.step, read)
    reader.close()
    try:
      save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, tmp,
                metadata={"step": str(step), "config": json.dumps(meta["config"])})
      output.fsync(tmp)  # the bytes on disk before the name points at them
      os.replace(tmp, final)
      output.fsync(os.path.dirname(final) or ".")
    except OSError as e:
      raise output.OutputError(workdir_lib.describe_os_error(e, f"--out={args.out!r}")) from None
  except BaseException:
    output.remove(tmp)
    raise
  finally:
    held.release()
  size = sum(v.nbytes for v in tensors.values())
  print(f"wrote {len(tensors)} tensors ({size / 2**20:.1f} MiB) of step {step} to {args.out}")


def _check_step(reader: Reader, step: int) -> tuple[list[str], int, int]:
  """What is wrong with one step (its metadata, and every array of every module against its
  fingerprint and for non-finite values; [] if nothing), and the parameter and optimizer-state
  arrays read. StepGone if the step is removed under the check."""
  from mimo_jax import fingerprint  # pylint: disable=import-outside-toplevel
  from mimo_jax.checkpoint import _digest  # pylint: disable=import-outside-toplevel
  try:
    meta = reader.meta(step)
  except Unreadable as e:
    return [f"meta: unreadable ({e.reason})"], 0, 0
  problems, counts = [], [0, 0]
  if meta.get("digest", _digest(meta)) != _digest(meta):
    problems.append("meta: does not match its digest")
  saved = meta.get("fingerprints")
  if saved is None:
    problems.append("meta: no fingerprints (written before they were kept); values not verified")
  for module in meta.get("modules", []):
    try:
      tree = reader.module(step, module)
    except Unreadable as e:
      problems.append(f"{module}: unreadable ({e.reason})")
      continue
    arrays = fingerprint.paths(tree)
    params = len(fingerprint.paths(tree.get("params", {})))
    counts[0] += params
    counts[1] += len(arrays) - params
    if saved is not None:
      got = fingerprint.on_host(tree)
      want = saved.get(module, {})
      problems += [f"{module} {k}: does not match its fingerprint" for k in sorted(set(want) |
                                                                                    set(got))
                   if want.get(k) != got.get(k)]
    problems += [f"{module} {k}: non-finite values" for k, v in arrays.items()
                 if np.issubdtype(np.asarray(v).dtype, np.floating) and
                 not np.all(np.isfinite(v))]
  if problems and reader.gone(step):  # files deleted under the reads, not damaged ones
    raise StepGone(step)
  return problems, counts[0], counts[1]


def _advice(reader: Reader, checked: list[int], passed: list[int], bad: list[int],
            whole: bool) -> str:
  """What to do about failed steps: never to move good steps aside, and nothing while a run is
  live (it writes its next step itself; a resume would fight it)."""
  if reader.live:
    return (f"a run ({_who(reader.live)}) is using {reader.workdir}: leave its steps as they are "
            "while it runs (it resumes from its newest step, and saves new ones); check again "
            "once it has stopped.")
  if not whole:
    return "check every step (without --step) to find one to resume from."
  if passed and passed[-1] == checked[-1]:
    return (f"the newest step {passed[-1]} passed, and a resume reads it: nothing to do (the "
            "failed steps are never read; delete them or let checkpoint.keep rotate them away).")
  if passed:
    newer = [s for s in bad if s > passed[-1]]
    return (f"resume from step {passed[-1]}, the newest that passed, with "
            f"--config.checkpoint.restore_step={passed[-1]} (it moves the failed step"
            f"{'s' if len(newer) > 1 else ''} {', '.join(map(str, newer))} aside).")
  return "no step passed: start in a new run.workdir (or from the weights it started from)."


def check(args: argparse.Namespace) -> None:
  reader = Reader(args.dir)
  reader.note("tools.ckpt")
  steps = [reader.pick(args.step)] if args.step is not None else reader.steps()
  bad, passed, checked = [], [], []
  for step in steps:
    try:
      problems, params, opt = _check_step(reader, step)
    except StepGone as e:
      print(f"{e}: gone, not damaged")
      continue
    checked.append(step)
    if problems:
      bad.append(step)
      shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5
                                         else "")
      print(f"step {step}: FAILED: {shown}")
    else:
      passed.append(step)
      print(f"step {step}: {params} arrays restored, ok (and {opt} optimizer-state arrays; "
            "metadata digest, every array's fingerprint, all values finite)")
  reader.close()
  if bad:
    raise CkptError(f"step{'s' if len(bad) > 1 else ''} {', '.join(map(str, bad))} of "
                    f"{reader.path} failed the check (above); "
                    + _advice(reader, checked, passed, bad, args.step is None))
  if not checked:
    raise TryAgain(f"every step of {reader.path} was removed while being read ({ROTATED}); "
                   "check again.")


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m tools.ckpt", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = parser.add_subparsers(dest="command", required=True)
  for name, fn in (("inspect", inspect), ("export", export), ("check", check)):
    p = sub.add_parser(name)
    p.add_argument("dir", help="run.workdir or its checkpoints/ folder")
    p.add_argument("--step", type=int, default=None, help="step (default: the latest)")
    if name == "inspect":
      p.add_argument("--params", action="store_true", help="list every parameter")
    if name == "export":
      p.add_argument("--out", required=True,
                     help="output .safetensors file (must not exist; written whole or not at all)")
    p.set_defaults(fn=fn)
  args = parser.parse_args(argv)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  from absl import logging  # pylint: disable=import-outside-toplevel
  logging.set_verbosity(logging.ERROR)  # orbax warns about read-only managers
  try:
    with output.interrupts_as_exceptions():
      args.fn(args)
  except ConfigError as e:
    sys.stdout.flush()
    print(f"tools.ckpt: error: {e}", file=sys.stderr, flush=True)
    return 75 if isinstance(e, TryAgain) else 2
  except KeyboardInterrupt as e:
    sys.stdout.flush()
    print(f"tools.ckpt: interrupted ({e or 'Ctrl-C'}); nothing was written.", file=sys.stderr,
          flush=True)
    return 128 + getattr(e, "signum", 2)  # 130 for Ctrl-C, 143 for SIGTERM
  return 0


if __name__ == "__main__":
  code = main()
  if code:
    from mimo_jax import distributed  # pylint: disable=import-outside-toplevel
    distributed.silence_stderr()  # reads orbax left behind must not follow the error line
  output.run_main(lambda: code)
