"""Inspect, export and check mimo_jax checkpoints without the run that wrote them.

  python -m tools.ckpt inspect RUN_OR_CHECKPOINT_DIR [--step N] [--params]
  python -m tools.ckpt export  RUN_OR_CHECKPOINT_DIR [--step N] --out model.safetensors
  python -m tools.ckpt check   RUN_OR_CHECKPOINT_DIR [--step N]

`export` writes every module's parameters into one safetensors file (keys `module/path/to/param`,
the config in its metadata): loadable with `safetensors.numpy.load_file`, no mimo_jax needed. The
file is written beside `--out` under a temporary name and renamed into place when complete (a
lock `.<name>.lock` keeps a second export of the same file out); an existing `--out` is refused.
`inspect` and `export` refuse a step whose metadata does not match its digest, or holds none (every
step saved holds one), as a resume does: one line naming the file, and `export` writes nothing.
`inspect` of a LoRA run's step counts the parameters that step holds (its adapters and trained
groups) and names the step that holds its frozen weights (its base), with their count.
`check` reads every step back, each item on its own: the metadata against its digest, and every
array of every module (parameters and optimizer state) against the fingerprint saved with it and
for non-finite values. It exits non-zero naming each step and item that fails, and which step to
resume from.
A step's `_CHECKPOINT_METADATA` (orbax's own record of the save, which no restore reads) that is
damaged is one note naming it and the fix, not a failure, and orbax's ERROR about it is not shown.

All three only read, and work beside a run that is using the workdir (its `run.lock`): they read
committed steps only (orbax's `commit_success.txt`), say on stderr that a run holds the workdir
and that newer steps may appear, and treat a step removed while being read (the run rotating old
steps away: `checkpoint.keep`) as gone, not damaged (mimo_jax/checkpoint_reader.py's Reader,
which tools.hf export and tools.generate read through too). A file or folder of a step that the
user may not read stops each of them with one line naming it and the fix (its permissions), not
as damage: `check` then advises moving no step aside.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from mimo_jax import checkpoint_reader, fingerprint, output
from mimo_jax.checkpoint_orbax import step_record_note
from mimo_jax.checkpoint_reader import (ROTATED, BadDigest, CkptError, Reader, StepGone,
                                        TryAgain, Unreadable, newest, who)
from mimo_jax.checkpoint_steps import base_folder, complete_steps
from mimo_jax.config import ConfigError
from tools.common import Parser, number

TOOL = "tools.ckpt"


def inspect(args: argparse.Namespace) -> None:
  reader = Reader(args.dir)
  reader.note(TOOL)  # and a step's damaged _CHECKPOINT_METADATA, as its metadata is read

  def read(step: int) -> tuple[dict, dict]:
    meta = reader.meta(step)
    return meta, {m: reader.params_metadata(step, [m]) for m in meta["modules"]}
  step, (meta, modules) = newest(reader, args.step, read)
  print(f"checkpoint: {reader.path}")
  steps = reader.steps()
  print(f"steps: {', '.join(map(str, steps))}" + ("" if steps == [step] else f" (showing {step})"))
  data = meta["data"]
  print(f"data position: {data['steps_done']} steps done, {data['samples_consumed']} samples "
        f"consumed (data.seed={data['seed']}, global_batch={data['global_batch']})")
  print(f"rng: train.seed={meta['rng']['train_seed']} data.seed={meta['rng']['data_seed']}")
  total, topology = 0, meta["config"]["topology"]
  for module, params in modules.items():
    count = sum(int(np.prod(p.shape)) for p in params.values())
    total += count
    # An encoder's placement: topology.encoders.<name> (topology.<name> in older checkpoints).
    topo = topology.get(module) or topology.get("encoders", {})[module]
    print(f"module {module}: {count:,} parameters, {len(params)} arrays, saved with "
          f"{placement(topo)}")
    if args.params:
      for name, p in params.items():
        print(f"  {name:60s} {str(tuple(p.shape)):16s} {p.dtype}")
  if meta.get("base"):  # a LoRA run's step: its frozen weights are in the step its base names
    print(f"total: {total:,} parameters in this step (the weights it trained)")
    print(base_line(reader, meta["base"], total))
  else:
    print(f"total: {total:,} parameters")
  print("config: " + json.dumps(meta["config"], sort_keys=True))
  reader.close()


def base_line(reader: Reader, base: dict, held: int) -> str:
  """What a LoRA run's step leaves to its base (checkpoint_steps.Base, `meta["base"]`): the
  frozen parameters by module, read from the base step's tree metadata, and where that step is
  (`held`: the parameters the step holds itself). A base that is gone or cannot be read is said
  so, with the arrays the step names."""
  frozen = {n: [f"{n}/{k[len('params/'):]}" for k in fps] for n, fps in
            base["fingerprints"].items() if fps}
  n = sum(map(len, frozen.values()))
  arrays = f"{n} array{'s' * (n != 1)}"
  folder = base_folder(reader.path, base["path"])
  said = lambda what: (f"frozen base: {what}, not in this step but in its base, step "
                       f"{base['step']} of {folder} (a LoRA run saves its frozen weights once)")
  other = None
  try:
    if base["step"] not in complete_steps(folder):
      return (said(arrays) + ", which is not there (moved or deleted): put it back, or resume "
              "with --config.checkpoint.base=DIR naming where it is now.")
    if os.path.abspath(folder) != reader.path:
      other = Reader(folder)
    shapes = (other or reader).params_metadata(base["step"], list(frozen))
    counts = {n: sum(int(np.prod(shapes[k].shape)) for k in keys) for n, keys in frozen.items()}
  except (ConfigError, KeyError) as e:
    why = (e.reason if isinstance(e, Unreadable) else f"it holds no {e}"
           if isinstance(e, KeyError) else str(e).rstrip("."))
    return (said(arrays) + f", which cannot be read now ({why}); `python -m tools.ckpt check` "
            "checks it.")
  finally:
    if other is not None:
      other.close()
  count = sum(counts.values())
  by_module = ", ".join(f"{n} {c:,}" for n, c in counts.items())
  return (said(f"{count:,} parameters ({by_module}; {arrays})") +
          f"; with them the model has {held + count:,} parameters.")


def placement(topo: dict) -> str:
  """A module's saved topology in a few words: "dp=2 tp=1 offset=0", with its pipeline stages
  (pp, virtual chunks, schedule) and its sharding where it had them (a field an older
  checkpoint's config lacks is left out)."""
  staged = topo.get("pp", 1) > 1
  shown = {"dp": True, "tp": True, "pp": staged, "virtual": topo.get("virtual", 1) > 1,
           "schedule": staged, "shard": topo.get("shard", "none") != "none", "offset": True}
  return " ".join(f"{k}={topo[k]}" for k, show in shown.items() if show and k in topo)


def export(args: argparse.Namespace) -> None:
  from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel
  if not args.out.strip():
    raise CkptError("--out is empty; give a file name such as model.safetensors.")
  final = os.path.abspath(args.out)
  parent, name = os.path.dirname(final), os.path.basename(final)
  why = output.not_a_folder(parent)
  if why is not None:
    raise CkptError(f"--out: {why[0]}; {'create it or choose' if why[1] else 'choose'} another "
                    "--out.")
  try:
    output.refuse_place(args.out)
  except output.OutputError as e:
    raise CkptError(str(e)) from None

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
  reader.note(TOOL)  # and a step's damaged _CHECKPOINT_METADATA, as its metadata is read
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
    # A full disk or a file size limit: safetensors raises SafetensorError, no OSError.
    with output.write_errors(f"--out={args.out!r}"):
      save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, tmp,
                metadata={"step": str(step), "config": json.dumps(meta["config"])})
      output.readable_as_created(tmp)
      output.fsync(tmp)  # the bytes on disk before the name points at them
      output.raise_if_interrupted()  # a signal whose exception was lost stops the publish
      os.replace(tmp, final)
      output.fsync(os.path.dirname(final) or ".")
  except BaseException:
    output.remove(tmp)
    raise
  finally:
    held.release()
  size = sum(v.nbytes for v in tensors.values())
  print(f"wrote {len(tensors)} tensors ({size / 2**20:.1f} MiB) of step {step} to {args.out}")


def _check_step(reader: Reader, step: int) -> tuple[list[str], int, int, int | None]:
  """What is wrong with one step (its metadata, and every array of every module against its
  fingerprint and for non-finite values; [] if nothing), the parameter and optimizer-state
  arrays read, and the step of this folder that holds its frozen weights (a LoRA run's base;
  None if another folder does, or none). StepGone if the step is removed under the check."""
  problems, counts = [], [0, 0]
  try:
    meta = reader.meta(step)
  except BadDigest as e:  # said with the step's other problems: its arrays are checked too
    meta = e.meta
    problems.append(f"meta: {e.wrong}")
  except Unreadable as e:
    return [f"meta: unreadable ({e.reason})"], 0, 0, None
  base = meta.get("base") or {}
  base_step = base.get("step") if base.get("path") == "." and base.get("step") != step else None
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
                   if want.get(k) != got.get(k) and not (
                       k in arrays and k in want and checkpoint_reader.matches(arrays[k],
                                                                               want[k]))]
    problems += [f"{module} {k}: non-finite values" for k, v in arrays.items()
                 if np.issubdtype(np.asarray(v).dtype, np.floating) and
                 not np.all(np.isfinite(v))]
  if problems and reader.gone(step):  # files deleted under the reads, not damaged ones
    raise StepGone(step)
  return problems, counts[0], counts[1], base_step


def _advice(reader: Reader, checked: list[int], passed: list[int], bad: list[int],
            whole: bool, bases: dict[int, int]) -> str:
  """What to do about failed steps: never to move good steps aside, never to delete a step
  another one reads its frozen weights from (`bases`: step -> its base step in this folder), and
  nothing while a run is live (it writes its next step itself; a resume would fight it)."""
  if reader.live:
    return (f"a run ({who(reader.live)}) is using {reader.workdir}: leave its steps as they are "
            "while it runs (it resumes from its newest step, and saves new ones); check again "
            "once it has stopped.")
  needed = sorted({bases[s] for s in passed if bases.get(s) in bad})
  if needed:
    readers = [s for s in passed if bases.get(s) in needed]
    return (f"step{'s' if len(readers) > 1 else ''} {', '.join(map(str, readers))} passed but "
            f"read{'' if len(readers) > 1 else 's'} the frozen weights of step "
            f"{', '.join(map(str, needed))}, which failed: do not delete it. Put back an intact "
            "copy of its folder, or make it again as it was made (the same tools.hf import, or "
            "the weights the run started from) in another workdir and name that with "
            "--config.checkpoint.base=DIR: the run checks its weights against their "
            "fingerprints.")
  if not whole:
    return "check every step (without --step) to find one to resume from."
  if passed and passed[-1] == checked[-1]:
    return (f"the newest step {passed[-1]} passed, and a resume reads it: nothing to do (the "
            "failed steps are never read; delete them or let checkpoint.keep rotate them away).")
  if passed:
    newer = [s for s in bad if s > passed[-1]]
    failed = f"step{'s' if len(newer) > 1 else ''} {', '.join(map(str, newer))}"
    if passed[-1] == 0:  # restore_step=0 names the newest step, not step 0
      return (f"only step 0 passed (the weights the run started from): move the failed {failed} "
              f"out of {reader.path} (e.g. `mv {reader.path}/{newer[-1]} "
              f"{reader.path}/{newer[-1]}.damaged`) and start the run again without "
              "checkpoint.restore_step: it resumes from step 0, the newest left (a LoRA run "
              "keeps it as its frozen base); restore_step=0 would name the newest step.")
    return (f"resume from step {passed[-1]}, the newest that passed, with "
            f"--config.checkpoint.restore_step={passed[-1]} (it moves the failed {failed} "
            "aside).")
  return "no step passed: start in a new run.workdir (or from the weights it started from)."


def check(args: argparse.Namespace) -> None:
  reader = Reader(args.dir)
  reader.note(TOOL, records=False)  # a step's damaged _CHECKPOINT_METADATA: in its own line
  steps = [reader.pick(args.step)] if args.step is not None else reader.steps()
  bad, passed, checked, bases = [], [], [], {}
  for step in steps:  # with --step, the step its frozen weights are read from joins the list
    try:
      problems, params, opt, bases[step] = _check_step(reader, step)
      if bases[step] is not None and bases[step] not in complete_steps(reader.path):
        problems.append(f"its frozen weights are in step {bases[step]} of this folder, which is "
                        "not there (moved or deleted): put it back, or name where it is now with "
                        "--config.checkpoint.base=DIR")
      elif bases[step] is not None and bases[step] not in steps:
        steps.append(bases[step])
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
    note = step_record_note(os.path.join(reader.path, str(step)))
    if note:
      print(f"step {step}: note: {note}")
  reader.close()
  if bad:
    raise CkptError(f"step{'s' if len(bad) > 1 else ''} {', '.join(map(str, bad))} of "
                    f"{reader.path} failed the check (above); "
                    + _advice(reader, checked, passed, bad, args.step is None, bases))
  if not checked:
    raise TryAgain(f"every step of {reader.path} was removed while being read ({ROTATED}); "
                   "check again.")


def main(argv: list[str] | None = None) -> int:
  parser = Parser(TOOL, prog=f"python -m {TOOL}", description=__doc__,
                  formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = parser.add_subparsers(dest="command", required=True)
  for name, fn in (("inspect", inspect), ("export", export), ("check", check)):
    p = sub.add_parser(name, tool=TOOL)  # each command's errors one line, as the tool's
    p.add_argument("dir", help="run.workdir or its checkpoints/ folder")
    p.add_argument("--step", type=number(int, least=0), default=None,
                   help="step (default: the latest)")
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
    print(f"{TOOL}: error: {e}", file=sys.stderr, flush=True)
    return 75 if isinstance(e, TryAgain) else 2
  except KeyboardInterrupt as e:
    sys.stdout.flush()
    out = getattr(args, "out", None)  # the subcommands that write: export's --out
    signum, shown = output.said(e)
    print(f"{TOOL}: interrupted ({shown}); " + (
        f"{out} was complete before it came: it is whole." if out and output.published(out)
        else "nothing was written."), file=sys.stderr, flush=True)
    return 128 + signum  # 130 for Ctrl-C, 143 for SIGTERM
  return 0


if __name__ == "__main__":
  code = main()
  if code:
    from mimo_jax import distributed  # pylint: disable=import-outside-toplevel
    distributed.silence_stderr()  # reads orbax left behind must not follow the error line
  output.run_main(lambda: code)
