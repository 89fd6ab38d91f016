"""The lines a training run says as it starts: where it starts from (workdir, checkpoint or the
runs its modules start from), its topology, parameters, compilation cache and data."""

from __future__ import annotations

import os

from mimo_jax import checkpoint_steps, compile_cache


def opening_lines(loop, lock_note: str | None, paths: dict, found: int | None) -> list[str]:
  """What a run says before its state is restored or initialised (which can take a while; on
  process 0 alone, so nothing here is a collective): `loop`: train._Loop being opened;
  `lock_note`: what taking the workdir's lock found; `found`: the step it restores, None for a
  new run."""
  cfg, ckpt = loop.cfg, loop.ckpt
  lines = [lock_note] if lock_note else []
  lines += [f"topology: {loop.trainer.topo.describe()}",
            f"parameters: {loop.trainer.plan.parameters()}", compile_cache.describe(),
            f"data: {cfg.data.task} from {os.path.dirname(os.path.abspath(paths['train']))}"]
  if found is None:
    lines.append(f"initialising the state (train.seed={cfg.train.seed}"
                 f"{'; init_from read' if _starts_from(cfg) else ''})")
  elif not loop.finished:
    lines.append(f"restoring {ckpt.path} step {found}")
  return lines


def _starts_from(cfg) -> bool:
  """Whether a new run reads a source (model.init_from, or a module's init_from or adapters)."""
  sections = [cfg.model] + [cfg.model.module(n) for n in cfg.topology.modules()]
  return any(getattr(s, "init_from", "") or getattr(getattr(s, "lora", None), "init_from", "")
             for s in sections)


def start_lines(loop, started: dict) -> list[str]:
  """What a run says once its state is restored or initialised and its outputs are open:
  `loop`: train._Loop once opened; `started`: module -> (field, path, step) it starts from
  (init_from.sources)."""
  cfg, ckpt = loop.cfg, loop.ckpt
  # The step folders a restore that succeeded leaves aside (`set_aside` tidies: a collective).
  lines = [f"moved {moved} aside ({checkpoint_steps.why_aside(moved)})"
           for moved in ckpt.set_aside]
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
