"""Starting a run from another run's parameters: `model.init_from=WORKDIR[:STEP]` (every module)
or a module's own `init_from` naming a run. The new run has a fresh optimizer at step 0 and its
own data and schedule (a new training stage). A module's own `init_from` naming an HF directory
is read through the module's mapping: an encoder's `load()` (mimo_jax/encoders), the language
model's in mimo_jax/hf. `starts` gathers both for state.init_state. A module's
`lora.init_from` naming a PEFT adapter directory puts that adapter into the started parameters
(`adapters`)."""

from __future__ import annotations

import os

import jax
import numpy as np

from mimo_jax import encoders, fingerprint, hf, state
from mimo_jax.checkpoint import META, Checkpointer
from mimo_jax.checkpoint_arrays import fill, shape_differences
from mimo_jax.checkpoint_config import CheckpointError, gains_adapters, model_differences
from mimo_jax.checkpoint_steps import complete_steps
from mimo_jax.config import (LANGUAGE, Config, ConfigError, lora_of, parse_freeze, run_source,
                             start_spec, step_not_a_number)
from mimo_jax.hf import peft
from mimo_jax.models.lora import A, B, is_adapter
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
    field, spec = start_spec(cfg, name)
    source = run_source(spec)
    if source is None:
      if spec and step_not_a_number(spec):
        raise CheckpointError(f"config.{field}: {step_not_a_number(spec)}")
      if spec and field == "model.init_from":
        head, name = os.path.split(os.path.normpath(spec))
        step_dir = (name.isdigit() and os.path.basename(head) == "checkpoints" and
                    run_source(head) is not None)  # one step's folder: runs/a/checkpoints/3
        raise CheckpointError(
            f"config.model.init_from: {spec!r} is not a mimo_jax run; name a run's workdir (the "
            "folder holding checkpoints/) or its checkpoints/ folder, optionally with :STEP"
            + (f" ({os.path.dirname(head)}:{name} for this step)." if step_dir else "."))
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
  parameters have this run's shapes. A module this run gives LoRA adapters where the source's
  model gave it none (`gains_adapters`) reads its other weights and leaves its adapters abstract:
  state.init_state draws them from the seed (B = 0), whatever its lora config. A source with
  adapters needs this run's lora config and gives its adapters. With `read` false only the
  checks (before anything is written), `frozen_fresh`'s too."""
  runs = {}
  for name, source in sources(cfg, list(abstract)).items():
    runs.setdefault(source, []).append(name)
  out, sourced = {}, set()  # modules whose adapters come from their source
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
      fresh = gains_adapters(meta["config"]["model"], cfg, names)
      sourced.update(n for n in names if n not in fresh)
      diffs = model_differences(meta["config"]["model"], cfg, only, fresh)
      if diffs:
        raise CheckpointError(f"{where} was written for another model: {'; '.join(diffs)}. "
                              f"{_same_model(os.path.dirname(path), diffs)}")
      saved = ckpt.saved_arrays(step, names)
      wanted = {n: {f"params/{k}": a for k, a in fingerprint.paths(abstract[n]).items()
                    if n not in fresh or not is_adapter(k)} for n in names}
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
          out[n] = fill(abstract[n], {k[len("params/"):]: v for k, v in arrays[n].items()},
                        keep_others=n in fresh)
    finally:
      ckpt.close()
  if not read:
    frozen_fresh(cfg, list(abstract), sourced)
  return out


def frozen_fresh(cfg: Config, modules: list[str], sourced: set[str]) -> None:
  """Refuses `optim.freeze` naming a module's adapters (`<module>_lora`) that start fresh: no
  PEFT directory (`lora.init_from`) and no run whose adapters they read (`sourced`). Fresh, B is
  zero; frozen, it stays zero and the adapters change nothing."""
  frozen = parse_freeze(cfg)
  for name in modules:
    lora = lora_of(cfg, name)
    if lora is None or f"{name}_lora" not in frozen or lora.init_from or name in sourced:
      continue
    raise ConfigError(
        f"config.optim.freeze: names {name}_lora, whose adapters start fresh (B = 0) and, frozen, "
        f"would stay zero and change nothing. Leave {name}_lora out of optim.freeze, start them "
        f"from a PEFT directory (model.{name}.lora.init_from) or from a run that trained them "
        f"(model.init_from), or set model.{name}.lora.rank=0 for no adapters.")


def adapters(cfg: Config, plan, made: dict) -> dict:
  """`made` (module -> ModuleState of a fresh start) with the adapters of each module whose
  `model.<module>.lora.init_from` names a PEFT adapter directory read from it, and a projector
  PEFT saved whole (hf/peft.read: an adapter that does not fit the module's lora config is
  refused naming the file). Modules naming one directory read it together, the language model
  last (LLaVA's tower and language model). The optimizer state stays fresh."""
  groups = {}
  for name in made:
    lora = lora_of(cfg, name)
    if lora is not None and lora.init_from:
      groups.setdefault(lora.init_from, []).append(name)
  if not groups:
    return made
  canonical = state.canonical(plan, made)
  for path, names in groups.items():
    modules = tuple(sorted(names, key=lambda n: (n == LANGUAGE, n)))
    # Host stand-ins for the leaves an adapter replaces (zeros of their shapes: nothing is read
    # back from the devices); peft.read puts new arrays where it reads, the rest stays as is.
    held = {n: _stand_ins(canonical[n].params) for n in modules}
    read = peft.read(path, cfg, held, modules)
    for n in modules:
      params = jax.tree.map(lambda new, old, dev: dev if new is old else
                            jax.device_put(np.asarray(new, dev.dtype), dev.sharding),
                            read[n], held[n], canonical[n].params)
      canonical[n] = state.ModuleState(params, canonical[n].opt_state)
  return state.from_canonical(plan, canonical)


def _stand_ins(tree):
  """`tree` with each adapter leaf (and the projector, which PEFT may save whole) a host array of
  zeros of its shape; other leaves are the same objects."""
  def visit(node, projector):
    out = {}
    for k, v in node.items():
      if isinstance(v, dict):
        out[k] = visit(v, projector or k == "projector")
      else:
        out[k] = np.zeros(v.shape, np.float32) if projector or k in (A, B) else v
    return out
  return visit(tree, False)


def _same_model(workdir: str, diffs: list[str]) -> str:
  """How to start from `workdir`'s run with its model: its config file where it has one (an
  import's config.py), else every differing field as a flag, or the tool that shows them all."""
  if os.path.isfile(os.path.join(workdir, "config.py")):
    return f"Start from it with its config: --config={os.path.join(workdir, 'config.py')}."
  if len(diffs) > 8:
    return (f"Start from it with that run's model config: {len(diffs)} fields differ (python -m "
            f"tools.ckpt inspect {workdir} shows its config).")
  keep = " ".join(f"--config.{d.split('=')[0]}={d.split('=', 1)[1].split(' (this run')[0]}"
                  for d in diffs)
  return f"Start from it with that run's model config ({keep})."
