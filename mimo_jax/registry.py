"""The encoders' registry tables, below both the config (which reads each encoder's section by
name) and the encoders (which register into them), so that neither imports the other for them.

`ENCODERS` holds each registered encoder (encoders.Encoder) by name, `CONFIGS` the dataclass of its
`model.<name>` section and `MOVED_DATA_FIELDS` the fields of `data` it took over. The built-in
encoders are the modules of mimo_jax/encoders, plug-ins found by module name as hf/mapping.py finds
the HF mappings: `builtin` imports them when a name is looked up that is not yet registered, and
each ends with its own `encoders.register(...)`. This module imports no mimo_jax module itself.
"""

from __future__ import annotations

import importlib
import pathlib
import pkgutil
from typing import Any

PACKAGE = "mimo_jax.encoders"  # the built-in encoders' package
ENCODERS: dict[str, Any] = {}  # name -> encoders.Encoder
CONFIGS: dict[str, type] = {}  # name -> the config class of `model.<name>`
# name -> fields of `data` the encoder took over (`data.<field>` -> `model.<name>.<field>`):
# configs written before the move still read (config.from_dict).
MOVED_DATA_FIELDS: dict[str, tuple[str, ...]] = {}


def builtin() -> None:
  """Imports the built-in encoders (the modules of mimo_jax/encoders), each of which registers
  itself: plug-ins found by name, which import this module and not the reverse."""
  for info in pkgutil.iter_modules([str(pathlib.Path(__file__).parent / "encoders")]):
    importlib.import_module(f"{PACKAGE}.{info.name}")
