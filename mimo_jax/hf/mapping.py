"""An encoder's HF mapping: how `model.<name>` reads from and writes to Hugging Face checkpoints.

The generic code (source.py, fields.py, tensors.py, export.py) handles the language model itself
(Llama-3, Qwen2) and asks an encoder's `Mapping` for everything else: which checkpoints hold the
encoder (alone, or beside a language model), its config fields, its tensor table and the names
each HF class gives them. An encoder's mapping is `MAPPING` in hf/<name>.py; `mappings()` finds
them by module name, as registry.builtin finds the built-in encoders, so a new encoder adds its
file and nothing else.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import pathlib
import pkgutil
from typing import Any, Callable

from mimo_jax.config import ConfigError


def _equal(src, key: str, ours: Any, theirs: Any) -> bool:  # pylint: disable=unused-argument
  return ours == theirs


@dataclasses.dataclass(frozen=True)
class Mapping:
  """One encoder's mapping: all the generic code asks of it."""
  name: str  # the encoder: model.<name>, and this mapping's file hf/<name>.py
  types: dict[str, str]  # config.json model_type of a checkpoint of the encoder alone -> its kind
  combined: str  # model_type of a checkpoint of the encoder beside a language model
  prefixes: dict[str, tuple[str, ...]]  # tensor-name prefixes of each part, most specific first
  # The prefix export.py writes before each part's names: "alone" (the encoder's own class) and
  # "combined" (the parts of the language model too; a head's prefix is its whole name).
  names: dict[str, dict[str, str]]
  fields: Callable[[Any], dict]  # (Source) -> model.<name> fields from the directory
  # (model.<name>, projector_out) -> [Tensor]: our leaves and their HF tensors; projector_out is
  # the language width when the checkpoint holds the projector (a combined one), else None.
  tensors: Callable[[Any, int | None], list]
  # (model.<name>) -> {name: array}: tensors the HF class holds and our module does not, which
  # the export writes under the prefix of the part named like the encoder (e.g. an identity norm).
  extra_tensors: Callable[[Any], dict] = lambda section: {}
  # (Source, field, ours, theirs) -> whether our config's field agrees with the checkpoint's.
  agrees: Callable[[Any, str, Any, Any], bool] = _equal
  # PEFT's module paths before each part's names (transformers' module tree, by which PEFT names
  # adapters; hf/peft.py), "alone" and "combined" as in `names`. An export this leaves out has no
  # PEFT adapter: hf/peft.py refuses it, naming the exports that have one.
  peft: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)


@functools.cache
def mappings() -> dict[str, Mapping]:
  """Every encoder's mapping by name: `MAPPING` of each module of this package that has one
  (a module's name is its encoder's)."""
  out = {}
  for info in pkgutil.iter_modules([str(pathlib.Path(__file__).parent)]):
    mapping = getattr(importlib.import_module(f"{__package__}.{info.name}"), "MAPPING", None)
    if mapping is not None:
      if mapping.name != info.name:
        raise ValueError(f"{__package__}.{info.name}: MAPPING.name is {mapping.name!r}; an "
                         "encoder's mapping is the module named after it.")
      out[info.name] = mapping
  return out


def get(name: str) -> Mapping:
  """Encoder `name`'s mapping, or a ConfigError naming the encoder."""
  found = mappings()
  if name not in found:
    raise ConfigError(f"model.{name}: this encoder has no Hugging Face mapping "
                      f"(mimo_jax/hf/{name}.py); those with one: {', '.join(found) or 'none'}.")
  return found[name]
