"""The language model's LoRA adapters (models/lora.py) as a PEFT adapter directory, and back.

`write` gives what `peft.PeftModel.from_pretrained(base, dir)` loads over the HF export of the
base (a LlamaForCausalLM / Qwen2ForCausalLM): `adapter_config.json` (LORA, r, lora_alpha, the
target modules by their HF names) and `adapter_model.safetensors` with PEFT's names,
`base_model.model.<the base tensor's name without .weight>.lora_A.weight` [rank, in] and
`.lora_B.weight` [out, rank] (our A [in, rank] and B [rank, out], transposed). `read` puts such
an adapter's tensors into our parameters, exactly (a run continues from it); an adapter whose
rank, alpha, variant or tensors do not fit `model.language.lora` is refused naming the file.
"""

from __future__ import annotations

import json
import pathlib
from typing import Iterator

import numpy as np

from mimo_jax import output
from mimo_jax.config import LANGUAGE, Config, lora_of
from mimo_jax.hf.export import LANGUAGE_NAMES, export_name
from mimo_jax.hf.source import HFError
from mimo_jax.hf.tensors import Tensor, language_tensors
from mimo_jax.models.lora import A, B

PREFIX = "base_model.model."  # PeftModel's own prefix before the base model's names
CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def _adapted(cfg: Config, params: dict) -> Iterator[tuple[Tensor, dict]]:
  """Each kernel of the language table that carries adapters, with its layer's parameters."""
  for t in language_tensors(cfg.model.language):
    if t.path[-1] != "kernel" or t.how != "T":
      continue
    node = params
    for k in t.path[:-1]:
      node = node[k]
    if A in node:
      yield t, node


def _names(t: Tensor, name: str) -> tuple[str, str]:
  base = export_name(LANGUAGE_NAMES, t, name).removesuffix(".weight")
  return f"{PREFIX}{base}.lora_A.weight", f"{PREFIX}{base}.lora_B.weight"


def adapter_tensors(cfg: Config, params: dict) -> Iterator[tuple[str, np.ndarray]]:
  """(PEFT name, float32 array) of every adapter of the language parameters `params` (host)."""
  for t, node in _adapted(cfg, params):
    a, b = np.asarray(node[A], np.float32), np.asarray(node[B], np.float32)
    for i, name in enumerate(t.names()):
      name_a, name_b = _names(t, name)
      yield name_a, np.ascontiguousarray(a[i].T)
      yield name_b, np.ascontiguousarray(b[i].T)


def adapter_config(cfg: Config, params: dict, base: str = "") -> dict:
  """adapter_config.json's fields for the adapters of `params`."""
  lora = lora_of(cfg, LANGUAGE)
  targets = sorted({t.name.rsplit(".", 2)[-2] for t, _ in _adapted(cfg, params)})
  return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank,
          "lora_alpha": lora.alpha, "lora_dropout": 0.0, "target_modules": targets,
          "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
          "init_lora_weights": True, "modules_to_save": None, "base_model_name_or_path": base}


def write(out: str | pathlib.Path, cfg: Config, params: dict, base: str = "",
          replace: bool = False) -> None:
  """The adapter directory `out` (written whole or not at all; output.staged)."""
  from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel
  if lora_of(cfg, LANGUAGE) is None:
    raise HFError("model.language.lora.rank is 0: the language model has no adapters to export.")
  with output.staged(out, "a PEFT adapter", complete=WEIGHTS, replace=replace) as tmp:
    save_file(dict(adapter_tensors(cfg, params)), str(tmp / WEIGHTS), metadata={"format": "pt"})
    (tmp / CONFIG).write_text(json.dumps(adapter_config(cfg, params, base), indent=2) + "\n",
                              encoding="utf-8")


def read(path: str | pathlib.Path, cfg: Config, params: dict) -> dict:
  """`params` (language, host) with its adapters replaced by those of the PEFT directory."""
  from safetensors.numpy import load_file  # pylint: disable=import-outside-toplevel
  path = pathlib.Path(path)
  lora = lora_of(cfg, LANGUAGE)
  if lora is None:
    raise HFError(f"{path}: a PEFT adapter needs model.language.lora.rank > 0 (its r).")
  try:
    config = json.loads((path / CONFIG).read_text(encoding="utf-8"))
    tensors = load_file(str(path / WEIGHTS))
  except (OSError, ValueError) as e:
    raise HFError(f"{path}: not a PEFT adapter directory ({CONFIG} and {WEIGHTS}): {e}") from None
  want = {"peft_type": "LORA", "r": lora.rank, "lora_alpha": lora.alpha, "use_dora": False,
          "use_rslora": False, "fan_in_fan_out": False}
  for key, value in want.items():
    if config.get(key, value) != value:
      raise HFError(f"{path / CONFIG}: {key} is {config.get(key)!r} where this run needs "
                    f"{value!r} (model.language.lora); set the field to match or use another "
                    "adapter.")
  out = _copy(params)
  used = set()
  for t, node in _adapted(cfg, out):
    a, b = [np.array(node[A], np.float32)], [np.array(node[B], np.float32)]
    for i, name in enumerate(t.names()):
      for key, ours in zip(_names(t, name), (a[0], b[0])):
        if key not in tensors:
          raise HFError(f"{path / WEIGHTS}: no tensor {key}; the adapter does not cover "
                        f"model.language.lora.targets ({', '.join(t.path)}).")
        x = tensors[key].T
        if x.shape != ours.shape[1:]:
          raise HFError(f"{path / WEIGHTS}: {key} has shape {tensors[key].shape} where the model "
                        f"needs {ours.shape[1:][::-1]}.")
        ours[i] = x
        used.add(key)
    node[A], node[B] = a[0], b[0]
  extra = sorted(set(tensors) - used)
  if extra:
    raise HFError(f"{path / WEIGHTS}: tensors this model has no adapter for: {', '.join(extra[:4])}"
                  f"{' ...' if len(extra) > 4 else ''}; widen model.language.lora.targets.")
  return out


def _copy(tree):
  return {k: _copy(v) for k, v in tree.items()} if isinstance(tree, dict) else tree
