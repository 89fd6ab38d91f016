"""Encoders as plug-ins: a registry of `Encoder`s by name.

An encoder turns a sample's items (images, or any other input) into tokens that replace the item's
placeholders in the text. Everything the rest of the code needs of it is declared here:

* its config (`model.<name>`: the module's fields and the data settings it owns, such as how many
  items a sample may hold and its slots a microbatch) and how it is validated,
* its module (models/mimo.Module: parameters, blocks, parameter groups) and a `load()` seam for
  external weights,
* its host slot layout (`SlotLayout`: how many tokens an item yields, how items are written into
  the slots of a microbatch, the device inputs of those slots),
* its sidecar fields (`item_sizes`: the size of each item, kept beside every shard so that the
  layout can place a record's items without reading it; data/meta.py),
* its device forward (`encode`), its FLOP model and its share of device memory (the activations
  its backward keeps; memory.py).

Topology (`topology.<name>`) and model config (`model.<name>`) are keyed by registered names; the
language model is the one module that is not an encoder. Importing this registry registers
nothing: each encoder's module ends with its own `register(...)` call, and the modules of this
package (the built-in encoders) are imported the first time a name is looked up that is not yet
registered (`builtin`). The tables live in mimo_jax/registry.py, below the config, which reads an
encoder's section through them. A test registers a second, toy encoder (tests/toy_encoder.py)
and trains the three modules on three meshes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from mimo_jax import config as config_lib
from mimo_jax import registry
from mimo_jax.config import Config, ConfigError
from mimo_jax.registry import builtin

REGISTRY: dict[str, "Encoder"] = registry.ENCODERS  # the registered encoders by name


@dataclasses.dataclass(frozen=True)
class SlotLayout:
  """An encoder's slots in one microbatch: n = `slots` in all, `slots // groups` a language rank,
  each yielding `slot_tokens` tokens and taking at most `slot_items` items (0 = as many as fit)."""
  noun = "item"  # what an item is called in errors ("image")
  slots_field = ""  # the config field that sets `slots` ("model.<name>.<field>"), for errors
  tokens_field = ""  # the config field that sets `slot_tokens`, if any, for errors
  name: str
  placeholder: int  # the token id of this encoder's placeholders in the text
  groups: int
  slots: int
  slot_tokens: int
  slot_items: int = 0
  # A slot's room in the units `item_room` counts, where an encoder packs items by a measure other
  # than their tokens (audio: positions, of which pooling keeps fewer tokens); 0 = slot_tokens.
  slot_room: int = 0

  @property
  def room(self) -> int:
    return self.slot_room or self.slot_tokens

  @property
  def slots_per_group(self) -> int:
    return self.slots // self.groups

  def sizes(self, sample: dict) -> list[tuple[int, ...]]:
    """Each item's size (its sidecar fields), from the sample or its metadata stub
    (data/meta.py)."""
    if "meta" in sample:
      return list(sample["meta"].sizes.get(self.name, ()))
    return get(self.name).item_sizes(sample)

  def items(self, sample: dict) -> list:
    raise NotImplementedError

  def item_tokens(self, size: tuple[int, ...], sid: int) -> int:
    """Tokens an item of `size` yields, or an error naming sample `sid` if it cannot be taken."""
    raise NotImplementedError

  def item_room(self, size: tuple[int, ...], tokens: int) -> int:
    """Room an item of `size` that yields `tokens` takes in a slot (of `room`): its tokens."""
    return tokens

  def empty(self) -> dict[str, np.ndarray]:
    """The device inputs of `slots` empty slots."""
    raise NotImplementedError

  def write(self, inputs: dict, slot: int, start: int, tokens: int, item: Any,
            size: tuple[int, ...], nth: int) -> None:
    """Writes an item into `slot` at token offset `start` (the `nth` item of that slot, from 1)."""
    raise NotImplementedError

  def work(self, sizes: list[tuple[int, ...]]) -> dict[str, int]:
    """What the FLOP model counts for these items (e.g. patches)."""
    raise NotImplementedError


class Encoder:
  """The plug-in: subclasses set `name`, `sample_key`, `seed_salt` and implement the methods."""
  name: str = ""
  noun: str = "item"  # what an item is called in errors ("image")
  config_class: type | None = None  # the dataclass of `model.<name>`
  sample_key: str = ""  # the field of a sample that lists its items
  placeholder: int = -1  # the token id that marks each item in a sample's text
  size_fields: int = 1  # integers that give an item's size (an image's: h, w)
  seed_salt: int = 0  # parameters depend on train.seed and this
  slots_field: str = ""  # the field of `model.<name>` setting its slots a microbatch, for errors
  # Fields of `model.<name>` that set the data and its slots, not the module's parameters: a
  # resume may change them (checkpoint_config.model_differences skips them).
  data_settings: tuple[str, ...] = ()
  # Those of them that change the sample order or the eval set: a checkpoint records them, and a
  # resume on other values is refused (checkpoint.py).
  data_fields: tuple[str, ...] = ()
  # Fields this encoder took over from `data` (`data.<field>` -> `model.<name>.<field>`): configs
  # written before still read (config.from_dict), and checkpoints keep recording them as before.
  moved_data_fields: tuple[str, ...] = ()

  def item_sizes(self, sample: dict) -> list[tuple[int, ...]]:
    """Each item's size (`size_fields` integers) of a full sample; kept in the shard's sidecar."""
    raise NotImplementedError

  def config(self, cfg: Config):
    return cfg.model.module(self.name)

  def validate(self, cfg: Config) -> None:
    """Raises ConfigError for a bad field of `model.<name>` (or a data field it reads)."""

  def validate_topology(self, cfg: Config) -> None:
    """Raises ConfigError where `topology.<name>` cannot split the module (e.g. tp over heads)."""

  def max_items(self, cfg: Config) -> int:
    """The most items a sample may hold."""
    raise NotImplementedError

  def tokens_per_item(self, cfg: Config) -> int:
    """The most tokens one item takes in a sample's text."""
    raise NotImplementedError

  def activation_bytes(self, cfg: Config, t: config_lib.ModuleTopology) -> int:
    """A lower bound on the bytes of activations one layer's backward keeps a device of `t` for
    one microbatch (memory.py multiplies by the layers a stage holds and its microbatches)."""
    raise NotImplementedError

  def module(self, cfg: Config):
    """The models/mimo.Module: parameters, blocks and parameter groups."""
    raise NotImplementedError

  def slot_layout(self, cfg: Config, groups: int, slots: int) -> SlotLayout:
    raise NotImplementedError

  def slots(self, cfg: Config, eval_batch: int = 0) -> int:
    """Slots a training microbatch has (every language rank an equal share), or an eval batch of
    `eval_batch` samples (room for every sample's most items)."""
    raise NotImplementedError

  def prepare(self, cfg: Config, inputs: dict) -> dict:
    """Device inputs as the model takes them (inside the jit; e.g. uint8 pixels -> float)."""
    return inputs

  def encode(self, model, run_blocks, inputs_m: dict):
    """Stacked microbatches of inputs [M, n, ...] -> tokens [M, n, t, language dim]."""
    raise NotImplementedError

  def dropout_rows(self, cfg: Config):
    """For LoRA dropout (models/lora.py): a function of one microbatch's inputs [n, ...] and
    owners `owner_nt` -> (sample ids, positions), each of the blocks' rows' shape [n, rows],
    naming the same row of the same item on every layout; None where the slot layout cannot
    (`model.<name>.lora.dropout` > 0 is then refused)."""
    return None

  def flops(self, cfg: Config, params, work: dict[str, int]) -> float:
    """Model FLOPs (forward and backward) of the items whose `work` is given."""
    raise NotImplementedError

  def load(self, path: str, cfg: Config):
    """Parameters from external weights at `path` (the seam for pretrained towers)."""
    raise ConfigError(f"model.{self.name}: this encoder cannot load weights from {path!r}.")


def register(encoder: Encoder) -> Encoder:
  """Makes `encoder` available by its name (config files, checkpoints and flags name it)."""
  if not encoder.name or encoder.name == config_lib.LANGUAGE:
    raise ValueError(f"an encoder needs a name other than 'language', got {encoder.name!r}")
  REGISTRY[encoder.name] = encoder
  if encoder.config_class is not None:
    registry.CONFIGS[encoder.name] = encoder.config_class
  if encoder.moved_data_fields:
    registry.MOVED_DATA_FIELDS[encoder.name] = encoder.moved_data_fields
  return encoder


def unregister(name: str) -> None:
  REGISTRY.pop(name, None)
  registry.CONFIGS.pop(name, None)
  registry.MOVED_DATA_FIELDS.pop(name, None)


def get(name: str) -> Encoder:
  if name not in REGISTRY:
    builtin()
  if name not in REGISTRY:
    raise ConfigError(f"topology.{name}: no encoder {name!r} is registered; registered: "
                      f"{', '.join(REGISTRY)}.")
  return REGISTRY[name]


def of(cfg: Config) -> dict[str, Encoder]:
  """The run's encoders, in dispatch order."""
  return {n: get(n) for n in cfg.topology.names()}


def max_items(cfg: Config) -> int:
  """The most items of all encoders a sample may hold."""
  return sum(e.max_items(cfg) for e in of(cfg).values())


def data_settings(cfg: Config) -> set[str]:
  """Every encoder's data settings as flags spell them (`model.<name>.<field>`)."""
  return {f"model.{n}.{f}" for n, e in of(cfg).items() for f in e.data_settings}


def data_values(cfg: Config) -> dict[str, tuple[str, Any]]:
  """Each encoder's data fields (`Encoder.data_fields`) as a checkpoint records them: key ->
  (the field's config path, its value). A field taken over from `data` keeps its old key, bare,
  so that checkpoints written before the move are still checked on it; others are
  `<name>.<field>`."""
  out = {}
  for name, e in of(cfg).items():
    section = e.config(cfg)
    for field in e.data_fields:
      key = field if field in e.moved_data_fields else f"{name}.{field}"
      out[key] = (f"model.{name}.{field}", getattr(section, field))
  return out
