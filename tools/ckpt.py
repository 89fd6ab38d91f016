"""Inspect, export and check mimo_jax checkpoints without the run that wrote them.

  python -m tools.ckpt inspect RUN_OR_CHECKPOINT_DIR [--step N] [--params]
  python -m tools.ckpt export  RUN_OR_CHECKPOINT_DIR [--step N] --out model.safetensors
  python -m tools.ckpt check   RUN_OR_CHECKPOINT_DIR [--step N]

`export` writes every module's parameters into one safetensors file (keys `module/path/to/param`,
the config in its metadata): loadable with `safetensors.numpy.load_file`, no mimo_jax needed.
`check` reads every step back, each item on its own: the metadata against its digest, and every
array of every module (parameters and optimizer state) against the fingerprint saved with it and
for non-finite values. It exits non-zero naming each step and item that fails.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from mimo_jax.checkpoint import drop_closed_loop_reports, complete_steps, params_restore_dtype


def _fail(message: str) -> None:
  """The error as the last line of stderr (reads that orbax leaves behind after a failed one may
  still report on their way out)."""
  from mimo_jax import distributed  # pylint: disable=import-outside-toplevel
  sys.stdout.flush()
  print(f"tools.ckpt: error: {message}", file=sys.stderr, flush=True)
  distributed.silence_stderr()
  sys.exit(2)


_DROPPING = []


def _drop_closed_loop_reports_once() -> None:
  """After a failed read its leftovers report "Event loop is closed" on their way out: from then
  on those reports are dropped (the check goes on with the other items)."""
  if not _DROPPING:
    _DROPPING.append(drop_closed_loop_reports())


def _manager(path: str):
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  if os.path.isdir(os.path.join(path, "checkpoints")):
    path = os.path.join(path, "checkpoints")
  if not os.path.isdir(path):
    _fail(f"{path} is not a directory.")
  path = os.path.abspath(path)
  steps = complete_steps(path)
  if not steps:
    _fail(f"{path} holds no finished checkpoint.")
  items = [d for d in os.listdir(os.path.join(path, str(steps[-1])))
           if os.path.isdir(os.path.join(path, str(steps[-1]), d))]
  handlers = {n: (ocp.JsonCheckpointHandler() if n == "meta" else ocp.PyTreeCheckpointHandler())
              for n in items}
  options = ocp.CheckpointManagerOptions(read_only=True, create=False)
  return ocp.CheckpointManager(path, options=options, item_handlers=handlers), path


def _pick_step(mngr, step: int | None) -> int:
  steps = complete_steps(str(mngr.directory))
  if step is None:
    return max(steps)
  if step not in steps:
    _fail(f"no step {step}; the checkpoint holds steps {', '.join(map(str, steps))}.")
  return step


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


def inspect(args) -> None:
  mngr, path = _manager(args.dir)
  step = _pick_step(mngr, args.step)
  meta = _meta(mngr, step)
  print(f"checkpoint: {path}")
  print(f"steps: {', '.join(map(str, complete_steps(path)))} (showing {step})")
  data = meta["data"]
  print(f"data position: {data['steps_done']} steps done, {data['samples_consumed']} samples "
        f"consumed (data.seed={data['seed']}, global_batch={data['global_batch']})")
  print(f"rng: train.seed={meta['rng']['train_seed']} data.seed={meta['rng']['data_seed']}")
  total = 0
  for module in meta["modules"]:
    params = _params_metadata(mngr, step, module)
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


def export(args) -> None:
  from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel
  mngr, _ = _manager(args.dir)
  step = _pick_step(mngr, args.step)
  meta = _meta(mngr, step)
  tensors = _read_params(mngr, step, meta["modules"])
  out_dir = os.path.dirname(os.path.abspath(args.out))
  if not os.path.isdir(out_dir):
    _fail(f"--out: folder {out_dir} does not exist.")
  save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, args.out,
            metadata={"step": str(step), "config": json.dumps(meta["config"])})
  size = sum(v.nbytes for v in tensors.values())
  print(f"wrote {len(tensors)} tensors ({size / 2**20:.1f} MiB) of step {step} to {args.out}")


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


def _check_step(mngr, step: int) -> tuple[list[str], int, int]:
  """What is wrong with one step (its metadata, and every array of every module against its
  fingerprint and for non-finite values; [] if nothing), and the parameter and optimizer-state
  arrays read."""
  from mimo_jax import fingerprint  # pylint: disable=import-outside-toplevel
  from mimo_jax.checkpoint import _digest  # pylint: disable=import-outside-toplevel
  try:
    meta = _meta(mngr, step)
  except Exception as e:  # pylint: disable=broad-except
    return [f"meta: unreadable ({str(e).splitlines()[0]})"], 0, 0
  problems, counts = [], [0, 0]
  if meta.get("digest", _digest(meta)) != _digest(meta):
    problems.append("meta: does not match its digest")
  saved = meta.get("fingerprints")
  if saved is None:
    problems.append("meta: no fingerprints (written before they were kept); values not verified")
  for module in meta.get("modules", []):
    try:
      tree = _read_module(mngr, step, module)
    except Exception as e:  # pylint: disable=broad-except
      problems.append(f"{module}: unreadable ({str(e).splitlines()[0]})")
      _drop_closed_loop_reports_once()
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
  return problems, counts[0], counts[1]


def check(args) -> None:
  mngr, path = _manager(args.dir)
  steps = [_pick_step(mngr, args.step)] if args.step is not None else complete_steps(path)
  bad = []
  for step in steps:
    problems, params, opt = _check_step(mngr, step)
    if problems:
      bad.append(step)
      shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5
                                         else "")
      print(f"step {step}: FAILED: {shown}")
    else:
      print(f"step {step}: {params} arrays restored, ok (and {opt} optimizer-state arrays; "
            "metadata digest, every array's fingerprint, all values finite)")
  mngr.close()
  if bad:
    _fail(f"step{'s' if len(bad) > 1 else ''} {', '.join(map(str, bad))} of {path} failed the "
          "check (above); resume from a step that passed with "
          "--config.checkpoint.restore_step=N.")


def main(argv: list[str] | None = None) -> None:
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
      p.add_argument("--out", required=True, help="output .safetensors file")
    p.set_defaults(fn=fn)
  args = parser.parse_args(argv)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  from absl import logging  # pylint: disable=import-outside-toplevel
  logging.set_verbosity(logging.ERROR)  # orbax warns about read-only managers
  args.fn(args)


if __name__ == "__main__":
  main()
