"""Starting a run from another run's parameters: `model.init_from=WORKDIR[:STEP]` (every module)
or a module's own `init_from` naming a run. The new run has a fresh optimizer at step 0 and its
own data and schedule (a new training stage). A module's own `init_from` naming an HF directory
is read through the module's mapping: an encoder's `load()` (mimo_jax/encoders), the language
model's in mimo_jax/hf. `starts` gathers both for state.init_state."""

from __future__ import annotations

import os

from mimo_jax import encoders, fingerprint, hf
from mimo_jax.checkpoint import (META, Checkpointer, CheckpointError, complete_steps, fill,
                                 model_differences, shape_differences)
from mimo_jax.config import LANGUAGE, Config, run_source
from mimo_jax.state import HFStart


def starts(cfg: Config, abstract: dict) -> dict:
  """What each module starts from instead of the seed, for state.init_state: canonical
  parameters of a mimo_jax run (`params`), or an `HFStart` for a module whose own `init_from`
  names an HF directory (and no run takes precedence); modules starting from the seed are not
  in the result. `abstract`: module -> canonical abstract parameters with this run's
  shardings."""
  out = params(cfg, abstract)
  for name in abstract:
    own = getattr(cfg.model.module(name), "init_from", "")
    if name in out or not own:
      continue
    if name == LANGUAGE:
      out[name] = HFStart(own, list(hf.leaves(hf.Source.open(own), name, cfg)))
    else:
      out[name] = HFStart(own, list(encoders.get(name).load(own, cfg)))
  return out


def sources(cfg: Config, modules: list[str]) -> dict[str, tuple[str, str, int]]:
  """The modules a new run starts from a mimo_jax run (`model.init_from`, or the module's own
  `init_from` naming `WORKDIR[:STEP]`; an HF directory is state.py's): module -> (config field,
  checkpoints folder, step)."""
  out = {}
  for name in modules:
    # A module's own run wins over model.init_from, which wins over the module's own HF
    # directory: a run's config carries the HF directories it was imported from (an import's
    # config.py does), and a stage started from that run must start from its trained weights.
    own = getattr(cfg.model.module(name), "init_from", "")
    field, spec = ((f"model.{name}.init_from", own)
                   if own and (run_source(own) is not None or not cfg.model.init_from)
                   else ("model.init_from", cfg.model.init_from))
    source = run_source(spec)
    if source is None:
      if spec and field == "model.init_from":
        raise CheckpointError(
            f"config.model.init_from: {spec!r} is not a mimo_jax run; name a run's workdir (the "
            "folder holding checkpoints/) or its checkpoints/ folder, optionally with :STEP.")
      continue
    path, step = source
    steps = complete_steps(path)
    if step is None and steps:
      step = steps[-1]
    if step not in steps:
      raise CheckpointError(
          f"config.{field}: {path} holds no complete step{f' {step}' if step is not None else ''}"
          f"; it holds {', '.join(map(str, steps)) or 'none'}. Name one as "
          f"{os.path.dirname(path)}:STEP.")
    out[name] = (field, path, step)
  return out


def params(cfg: Config, abstract: dict, read: bool = True) -> dict:
  """The parameters modules start from when the config names a mimo_jax run to start from
  (`sources`), for `abstract` (module -> canonical abstract parameters with this run's
  shardings): the step's parameters only (a step saved with parameters only works too), read
  straight into those shardings; modules without such a source are not in the result. Each
  source is checked first: it holds the module, was written for the same model (every model
  field for model.init_from, the module's own for its init_from; runtime fields aside) and its
  parameters have this run's shapes. With `read` false only the checks (before anything is
  written)."""
  runs = {}
  for name, source in sources(cfg, list(abstract)).items():
    runs.setdefault(source, []).append(name)
  out = {}
  for (field, path, step), names in runs.items():
    # Every module the step holds has a handler (orbax warns of items it cannot restore).
    held = [d for d in sorted(os.listdir(os.path.join(path, str(step))))
            if d != META and os.path.isdir(os.path.join(path, str(step), d))]
    ckpt = Checkpointer(path, sorted(set(held) | set(names)), read_only=True)
    ckpt.source = field
    try:
      meta = ckpt.read_meta(step)
      where = f"config.{field}: {path} step {step}"
      missing = [n for n in names if n not in meta.get("modules", [])]
      if missing:
        raise CheckpointError(f"{where} has no module {', '.join(missing)}; it holds "
                              f"{', '.join(meta.get('modules', []))}.")
      only = "model." if field == "model.init_from" else f"model.{names[0]}."
      diffs = model_differences(meta["config"]["model"], cfg, only)
      if diffs:
        keep = " ".join(f"--config.{d.split('=')[0]}={d.split('=', 1)[1].split(' (this run')[0]}"
                        for d in diffs[:3])
        raise CheckpointError(f"{where} was written for another model: {'; '.join(diffs)}. "
                              f"Start from it with that run's model config ({keep}).")
      saved = ckpt.saved_arrays(step, names)
      wanted = {n: {f"params/{k}": a for k, a in fingerprint.paths(abstract[n]).items()}
                for n in names}
      from_base = ckpt.left_to_base(meta, saved, wanted)  # a LoRA run's frozen weights
      wanted = {n: {k: a for k, a in w.items() if k not in from_base[n]} for n, w in wanted.items()}
      differ = [d for n in names for d in shape_differences(saved[n], wanted[n], n)]
      if differ:
        raise CheckpointError(f"{where} holds parameters of other shapes than this run's model "
                              f"({'; '.join(differ[:3])}); start from a run of this model.")
      if read:
        arrays = ckpt.read(step, wanted, meta)
        for n, got in ckpt.read_base(step, meta, from_base).items():
          arrays[n].update(got)
        for n in names:
          out[n] = fill(abstract[n], {k[len("params/"):]: v for k, v in arrays[n].items()})
    finally:
      ckpt.close()
  return out
