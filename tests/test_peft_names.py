"""PEFT's module paths of an export (hf/peft.py) come from the exported encoder's HF mapping
(`Mapping.peft`), so an adapter of any encoder whose mapping gives them is named; no JAX work."""

import dataclasses

import pytest

from mimo_jax.hf import mapping, peft
from mimo_jax.hf.source import HFError


def test_an_encoder_s_peft_names_are_its_mapping_s(monkeypatch):
  assert peft.peft_names(("language",)) == {"language": "model."}
  found = mapping.mappings()
  with_names = {n: m for n, m in found.items() if m.peft}
  assert with_names, "a built-in mapping gives PEFT names"
  for name, m in with_names.items():
    assert peft.peft_names((name,)) == m.peft["alone"]
    assert peft.peft_names((name, "language")) == m.peft["combined"]
  # A new encoder's mapping with its names: its adapters are named by them, nothing else changes.
  some = next(iter(found.values()))
  signal = dataclasses.replace(some, name="signal",
                               peft={"alone": {"signal": "encoder."},
                                     "combined": {"signal": "model.signal_tower.",
                                                  "language": "model.language_model."}})
  monkeypatch.setattr(mapping, "mappings", lambda: {**found, "signal": signal})
  assert peft.peft_names(("signal",)) == {"signal": "encoder."}
  assert peft.peft_names(("signal", "language"))["signal"] == "model.signal_tower."
  # A mapping without them, an unknown module or another order: refused, naming what exports.
  monkeypatch.setattr(mapping, "mappings",
                      lambda: {**found, "signal": dataclasses.replace(signal, peft={})})
  for modules in (("signal",), ("signal", "language"), ("language", "signal"), ("nothing",)):
    with pytest.raises(HFError, match=r"PEFT names exist for language, .*export that module "
                       r"merged instead"):
      peft.peft_names(modules)
