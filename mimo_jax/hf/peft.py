"""A run's LoRA adapters (models/lora.py) as a PEFT adapter directory, and back.

`write` gives what `peft.PeftModel.from_pretrained(base, dir)` loads over the HF export of the same
modules (tools.hf export without --peft): a language model alone (LlamaForCausalLM /
Qwen2ForCausalLM), an encoder alone, or an encoder and the language model (LLaVA).
`adapter_config.json` holds LORA, r, lora_alpha (a module of another rank or alpha in `rank_pattern`
/ `alpha_pattern`) and the adapted layers (their HF names; a regular expression of their module
paths where the export has several modules), and `adapter_model.safetensors` PEFT's names,
`base_model.model.<module path>.lora_A.weight` [rank, in] and `.lora_B.weight` [out, rank] (our A
[in, rank] and B [rank, out], transposed). The module paths are transformers' (`peft_names`: the
language model's here, an encoder's from its HF mapping's `peft`, e.g. LLaVA's parts under
`model.`); an encoder whose mapping gives none has no PEFT adapter. A trained projector beside
adapters is saved whole as PEFT's `modules_to_save`. A module that trains its own weights (no
adapters, not frozen) has no place in an adapter: the export is refused, naming it. `read` puts such
an adapter's tensors into our parameters exactly (a run continues from it); an adapter whose rank,
alpha, variant or tensors do not fit `model.<module>.lora` is refused naming the file.
`lora_dropout` is the `lora.dropout` of the module `r` is (PEFT has no per-module pattern for it);
`dropout` reads it back.
"""

from __future__ import annotations

import json
import pathlib
import re
from typing import Iterator

import numpy as np

from mimo_jax import output
from mimo_jax.config import LANGUAGE, Config, lora_of, parse_freeze
from mimo_jax.hf import mapping
from mimo_jax.hf.source import HFError
from mimo_jax.hf.tensors import Tensor, language_tensors
from mimo_jax.models.lora import A, B

PREFIX = "base_model.model."  # PeftModel's own prefix before the base model's names
CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
WHAT = "PEFT adapter"  # the kind its output marker records (mimo_jax/output.py)
# The module path transformers gives the language model alone (LlamaForCausalLM /
# Qwen2ForCausalLM's decoder, as save_pretrained names it).
LANGUAGE_NAMES = {LANGUAGE: "model."}
SAVED_WHOLE = {"projector": "multi_modal_projector"}  # trained parts PEFT saves whole
KINDS = {1: "alone", 2: "combined"}  # an encoder's export by its modules: (name,), (name, language)


def _exports() -> list[str]:
  """The exports that have PEFT names, as their modules are joined in errors."""
  out = [LANGUAGE]
  for name, m in mapping.mappings().items():
    out += [" and ".join((name, LANGUAGE)[:n]) for n, kind in KINDS.items() if kind in m.peft]
  return out


def peft_names(modules: tuple[str, ...]) -> dict[str, str]:
  """The module path transformers gives each part of an export of `modules` (PEFT names adapters
  by them): the language model's alone, else the encoder's mapping's `peft` for it alone or
  beside the language model. HFError for an export without PEFT names."""
  if modules == (LANGUAGE,):
    return LANGUAGE_NAMES
  kind = KINDS.get(len(modules)) if modules[1:] in ((), (LANGUAGE,)) else None
  found = mapping.mappings().get(modules[0]) if kind else None
  names = found.peft.get(kind) if found is not None else None
  if not names:
    raise HFError(f"a PEFT adapter of {' and '.join(modules)}: PEFT names exist for "
                  f"{', '.join(_exports())} (an encoder's come from its HF mapping's `peft`); "
                  "export that module merged instead (tools.hf export without --peft).")
  return names


def _check_modules(cfg: Config, modules: tuple[str, ...]) -> None:
  peft_names(modules)
  if not any(lora_of(cfg, n) for n in modules):
    raise HFError(f"no adapters to export: model.<module>.lora.rank is 0 for "
                  f"{', '.join(modules)}.")


def _tables(cfg: Config, modules: tuple[str, ...]) -> Iterator[tuple[str, Tensor]]:
  """(module, Tensor) of every tensor of an export of `modules` (hf/export.export_tensors')."""
  combined = len(modules) > 1
  for n in modules:
    if n == LANGUAGE:
      yield from ((n, t) for t in language_tensors(cfg.model.language))
    else:
      m = mapping.get(n)
      yield from ((n, t) for t in m.tensors(cfg.model.module(n),
                                            cfg.model.language.dim if combined else None))


def _node(params: dict, path: tuple) -> dict:
  for k in path:
    params = params[k]
  return params


def _adapted(cfg: Config, params: dict, modules: tuple[str, ...]):
  """(module, Tensor, its layer's parameters) of each kernel that carries adapters."""
  for n, t in _tables(cfg, modules):
    if t.path[-1] == "kernel" and t.how == "T":
      node = _node(params[n], t.path[:-1])
      if A in node:
        yield n, t, node


def _module_path(modules: tuple[str, ...], t: Tensor, name: str) -> str:
  return peft_names(modules)[t.part] + name.removesuffix(".weight")


def _names(modules: tuple[str, ...], t: Tensor, name: str) -> tuple[str, str]:
  base = _module_path(modules, t, name)
  return f"{PREFIX}{base}.lora_A.weight", f"{PREFIX}{base}.lora_B.weight"


def _group(cfg: Config, name: str, path: tuple) -> str | None:
  """The parameter group of a module's tensor (models/mimo.Module.group's rule): its projector's,
  else the module's own, which a module with adapters freezes (None)."""
  if name != LANGUAGE and path[0] == "projector":
    return f"{name}_projector"
  return None if lora_of(cfg, name) else name


def _whole(cfg: Config, modules: tuple[str, ...]) -> list[tuple[str, Tensor]]:
  """The tensors PEFT saves whole (`modules_to_save`): a trained projector beside adapters. A
  trained part that is neither is an error naming it."""
  frozen = parse_freeze(cfg)
  out = []
  for n, t in _tables(cfg, modules):
    group = _group(cfg, n, t.path)
    if group is None or group in frozen:
      continue
    if t.part in SAVED_WHOLE and t.part in peft_names(modules):
      out.append((n, t))
      continue
    raise HFError(f"model.{n} trains {'/'.join(t.path)} (parameter group {group}): a PEFT "
                  "adapter holds adapters and whole projectors only; export the merged model "
                  "(tools.hf export without --peft), or freeze the group (optim.freeze).")
  return out


def adapter_tensors(cfg: Config, params: dict,
                    modules: tuple[str, ...] = (LANGUAGE,)) -> Iterator[tuple[str, np.ndarray]]:
  """(PEFT name, float32 array) of every adapter of `params` (module -> host parameters) and
  every tensor PEFT saves whole, for an export of `modules`."""
  _check_modules(cfg, modules)
  for _, t, node in _adapted(cfg, params, modules):
    a, b = np.asarray(node[A], np.float32), np.asarray(node[B], np.float32)
    for i, name in enumerate(t.names()):
      name_a, name_b = _names(modules, t, name)
      yield name_a, np.ascontiguousarray(a[i].T)
      yield name_b, np.ascontiguousarray(b[i].T)
  for n, t in _whole(cfg, modules):
    x = np.asarray(_node(params[n], t.path), np.float32)
    yield PREFIX + peft_names(modules)[t.part] + t.name, np.ascontiguousarray(t.to_theirs(x))


def _pattern(modules: tuple[str, ...], t: Tensor) -> str:
  """A regular expression of the module paths of `t`'s layers (those our model has: LLaVA's
  tower has a last layer whose output it never reads, and no adapter there)."""
  layers = "(" + "|".join(str(i) for i in range(t.layers)) + ")"
  return re.escape(_module_path(modules, t, t.name)).replace(re.escape("{i}"), layers)


def adapter_config(cfg: Config, params: dict, modules: tuple[str, ...] = (LANGUAGE,),
                   base: str = "") -> dict:
  """adapter_config.json's fields for the adapters of `params` (module -> parameters)."""
  _check_modules(cfg, modules)
  adapted = list(_adapted(cfg, params, modules))
  loras = {n: lora_of(cfg, n) for n in modules if lora_of(cfg, n)}
  main = loras.get(LANGUAGE) or next(iter(loras.values()))
  if len(modules) == 1:
    targets = sorted({t.name.rsplit(".", 2)[-2] for _, t, _ in adapted})
  else:
    targets = "|".join(sorted({_pattern(modules, t) for _, t, _ in adapted}))
  ranks, alphas = {}, {}
  for n, lora in loras.items():
    key = re.escape(peft_names(modules)[n]) + ".*"
    if lora.rank != main.rank:
      ranks[key] = lora.rank
    if lora.alpha != main.alpha:
      alphas[key] = lora.alpha
  whole = sorted({SAVED_WHOLE[t.part] for _, t in _whole(cfg, modules)})
  return {"peft_type": "LORA", "task_type": "CAUSAL_LM" if modules == (LANGUAGE,) else None,
          "r": main.rank, "lora_alpha": main.alpha, "rank_pattern": ranks,
          "alpha_pattern": alphas, "lora_dropout": main.dropout, "target_modules": targets,
          "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
          "init_lora_weights": True, "modules_to_save": whole or None,
          "base_model_name_or_path": base}


def write(out: str | pathlib.Path, cfg: Config, params: dict, base: str = "",
          replace: bool = False, modules: tuple[str, ...] = (LANGUAGE,)) -> None:
  """The adapter directory `out` of `modules` (written whole or not at all; output.staged; a
  failed write, a full disk, is one OutputError naming `out`); `params`: module -> host
  parameters."""
  from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel
  tensors = dict(adapter_tensors(cfg, params, modules))
  config = adapter_config(cfg, params, modules, base)
  with output.write_errors(f"--out={str(out)!r}"), \
      output.staged(out, WHAT, complete=WEIGHTS, replace=replace,
                    replace_flag="--overwrite") as tmp:
    save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
    (tmp / CONFIG).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def _fits(path: pathlib.Path, config: dict, cfg: Config, modules: tuple[str, ...]) -> None:
  """Refuses an adapter whose variant, rank or alpha is not each module's lora."""
  for key, value in {"peft_type": "LORA", "use_dora": False, "use_rslora": False,
                     "fan_in_fan_out": False}.items():
    if config.get(key, value) != value:
      raise HFError(f"{path / CONFIG}: {key} is {config.get(key)!r} where this run needs "
                    f"{value!r}; use another adapter.")
  for n in modules:
    lora = lora_of(cfg, n)
    if lora is None:
      continue
    key = re.escape(peft_names(modules)[n]) + ".*"
    for field, ours, pattern in (("r", lora.rank, "rank_pattern"),
                                 ("lora_alpha", lora.alpha, "alpha_pattern")):
      theirs = (config.get(pattern) or {}).get(key, config.get(field))
      if theirs != ours:
        raise HFError(f"{path / CONFIG}: {field} is {theirs!r} where this run needs {ours!r} "
                      f"(model.{n}.lora); set the field to match or use another adapter.")


def _dropout(path: pathlib.Path, config: dict) -> float:
  p = config.get("lora_dropout", 0.0)
  if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p < 1:
    raise HFError(f"{path / CONFIG}: lora_dropout is {p!r}, not a probability in [0, 1); "
                  f"use another adapter.")
  return float(p)


def dropout(path: str | pathlib.Path) -> float:
  """The adapter's lora_dropout: the `model.language.lora.dropout` it was trained with."""
  path = pathlib.Path(path)
  try:
    config = json.loads((path / CONFIG).read_text(encoding="utf-8"))
  except (OSError, ValueError) as e:
    raise HFError(f"{path}: not a PEFT adapter directory ({CONFIG}): {e}") from None
  return _dropout(path, config)


def read(path: str | pathlib.Path, cfg: Config, params: dict,
         modules: tuple[str, ...] = (LANGUAGE,)) -> dict:
  """`params` (module -> host parameters) with the adapters of `modules`, and what PEFT saved
  whole, replaced by those of the PEFT directory."""
  from safetensors.numpy import load_file  # pylint: disable=import-outside-toplevel
  path = pathlib.Path(path)
  if not any(lora_of(cfg, n) for n in modules):
    raise HFError(f"{path}: a PEFT adapter needs model.<module>.lora.rank > 0 (its r) for "
                  f"{' or '.join(modules)}.")
  _check_modules(cfg, modules)
  try:
    config = json.loads((path / CONFIG).read_text(encoding="utf-8"))
    tensors = load_file(str(path / WEIGHTS))
  except (OSError, ValueError) as e:
    raise HFError(f"{path}: not a PEFT adapter directory ({CONFIG} and {WEIGHTS}): {e}") from None
  _fits(path, config, cfg, modules)
  _dropout(path, config)
  out = {n: _copy(p) for n, p in params.items()}
  used = set()

  def take(key: str, shape: tuple, field: str) -> np.ndarray:
    if key not in tensors:
      raise HFError(f"{path / WEIGHTS}: no tensor {key}; the adapter does not cover {field}.")
    if tuple(tensors[key].shape) != tuple(shape):
      raise HFError(f"{path / WEIGHTS}: {key} has shape {tensors[key].shape} where the model "
                    f"needs {tuple(shape)}.")
    used.add(key)
    return tensors[key]

  for n, t, node in _adapted(cfg, out, modules):
    a, b = np.array(node[A], np.float32), np.array(node[B], np.float32)
    for i, name in enumerate(t.names()):
      name_a, name_b = _names(modules, t, name)
      field = f"model.{n}.lora.targets ({'/'.join(t.path)})"
      a[i] = take(name_a, a.shape[1:][::-1], field).T
      b[i] = take(name_b, b.shape[1:][::-1], field).T
    node[A], node[B] = a, b
  if config.get("modules_to_save"):
    for n, t in _whole(cfg, modules):
      node = _node(out[n], t.path[:-1])
      x = take(PREFIX + peft_names(modules)[t.part] + t.name, t.shape, f"model.{n}'s {t.part}")
      node[t.path[-1]] = np.asarray(t.to_ours(x), np.float32)
  extra = sorted(set(tensors) - used)
  if extra:
    raise HFError(f"{path / WEIGHTS}: tensors this model has no adapter for: {', '.join(extra[:4])}"
                  f"{' ...' if len(extra) > 4 else ''}; widen model.<module>.lora.targets.")
  return out


def _copy(tree):
  return {k: _copy(v) for k, v in tree.items()} if isinstance(tree, dict) else tree
