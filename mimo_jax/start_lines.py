"""The lines a training run says as it starts: where it starts from (workdir, checkpoint or the
runs its modules start from), its topology, parameters, compilation cache and data."""

from __future__ import annotations

import os

from mimo_jax import checkpoint_steps, compile_cache


def start_lines(loop, lock_note: str | None, started: dict, paths: dict) -> list[str]:
  """`loop`: train._Loop once opened; `lock_note`: what taking the workdir's lock found;
  `started`: module -> (field, path, step) it starts from (init_from.sources)."""
  cfg, ckpt = loop.cfg, loop.ckpt
  lines = [lock_note] if lock_note else []
  lines += [f"moved {moved} aside ({checkpoint_steps.why_aside(moved)})"
            for moved in ckpt.set_aside]
  lines += [f"topology: {loop.trainer.topo.describe()}",
            f"parameters: {loop.trainer.plan.parameters()}", compile_cache.describe(),
            f"data: {cfg.data.task} from {os.path.dirname(os.path.abspath(paths['train']))}"]
  if loop.finished:
    lines.append(f"found {ckpt.path} step {loop.start}, the last step, with its final eval on "
                 "record: the state is not restored")
  elif loop.resumed:
    gib, took = loop.restored
    size = f"{gib:.2f} GiB" if gib >= 1 else f"{gib * 1024:.1f} MiB"
    lines.append(f"resumed from {ckpt.path} step {loop.start} ({size} of state restored in "
                 f"{took:.1f} s)")
  else:
    lines.append(f"a new run in {os.path.abspath(cfg.run.workdir)}")
  if loop.resumed and cfg.model.init_from:
    lines.append(f"model.init_from={cfg.model.init_from} is not read: this run resumes its own "
                 f"step {loop.start} (model.init_from starts a new run: give it a new "
                 "run.workdir)")
  lines += ckpt.notes
  for (field, path, step) in sorted(set(started.values())):
    names = [n for n, source in started.items() if source == (field, path, step)]
    lines.append(f"{', '.join(names)} started from {path} step {step} ({field}): parameters "
                 "only, a fresh optimizer at step 0")
  return lines
