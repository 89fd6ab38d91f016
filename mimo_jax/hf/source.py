"""An HF model directory: config.json, where each tensor is, and reading one tensor (float32,
checked against the shape config.json implies). Every problem is one `HFError` naming the file
or tensor and the fix. Which modules a directory holds comes from the language model's types here
and each encoder's mapping (mapping.py)."""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib

import numpy as np

from mimo_jax.config import LANGUAGE, ConfigError
from mimo_jax.hf.mapping import Mapping, mappings
from mimo_jax.words import json_kind


LANGUAGE_TYPES = ("llama", "qwen2")
ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "gelu": "gelu",
               "quick_gelu": "quick_gelu"}  # config.json hidden_act -> ours
# The language model's name prefixes, most specific first (transformers 4.x and 5.x, each model
# class, alone or inside a combined checkpoint); an encoder's are its mapping's.
LANGUAGE_PREFIXES = ("model.language_model.model.", "model.language_model.",
                     "language_model.model.", "language_model.", "model.", "")
HEADS = ("lm_head.weight", "language_model.lm_head.weight", "model.lm_head.weight")


class HFError(ConfigError):
  """A Hugging Face directory that cannot be read; the message names the file or tensor."""


def _json(path: pathlib.Path) -> dict:
  try:
    out = json.loads(path.read_text())
  except FileNotFoundError:
    raise HFError(f"{path}: not found; an HF model directory has a config.json (as "
                  "save_pretrained writes it).") from None
  except (OSError, ValueError) as e:
    raise HFError(f"{path}: cannot be read as JSON ({e}).") from None
  if not isinstance(out, dict):
    raise HFError(f"{path}: holds {json_kind(out)}, not an object of fields; write it "
                  "again with save_pretrained.")
  return out


REQUIRED = object()  # `field`'s default: the field must be there
_KINDS = {int: "a positive integer", float: "a finite number", bool: "true or false",
          str: "a string", dict: "an object of fields", list: "a list"}


def field(cfg: dict, key: str, where: str, kind: type, default: object = REQUIRED,
          section: str = "", nullable: bool = False) -> object:
  """Field `key` of a config.json object (`section`: its path in the file, e.g. text_config) as
  `kind`: int (> 0), float (finite; an integer is one too), bool, str, dict or list. A missing
  field takes `default`, and so does null where transformers reads None as its default
  (`nullable`); a missing field without a default, a null or a value of another type is one
  HFError naming the field and the file."""
  name = f"{section}.{key}" if section else key
  value = cfg.get(key)
  if value is None:
    if key in cfg and not nullable:
      raise HFError(f"{where}: field {name} is null; set it to {_KINDS[kind]}.")
    if default is REQUIRED:
      raise HFError(f"{where}: field {name} is missing; set it to {_KINDS[kind]} (as "
                    "save_pretrained writes it).")
    return default
  if kind is float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    value = float(value) if ok else value
  elif kind is int:
    ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
  else:
    ok = isinstance(value, kind)
  if not ok:
    raise HFError(f"{where}: field {name} is {json.dumps(value)}; set it to {_KINDS[kind]}.")
  return value


@dataclasses.dataclass
class Source:
  """An HF model directory: its config.json, and where each tensor is."""
  path: pathlib.Path
  config: dict
  files: dict[str, pathlib.Path]  # tensor name -> safetensors file
  _dtypes: dict[str, str] | None = dataclasses.field(default=None, repr=False)

  @classmethod
  def open(cls, path: str | pathlib.Path) -> "Source":
    path = pathlib.Path(path)
    if not path.is_dir():
      raise HFError(f"{path}: not a directory; pass an HF model directory (config.json and "
                    "*.safetensors).")
    config = _json(path / "config.json")
    index = path / "model.safetensors.index.json"
    if index.exists():
      weight_map = _json(index).get("weight_map")
      if not isinstance(weight_map, dict) or not all(
          isinstance(v, str) for v in weight_map.values()):
        raise HFError(f"{index}: has no weight_map of tensor names to file names; rewrite it "
                      "with save_pretrained.")
      files = {k: path / v for k, v in weight_map.items()}
      for f in sorted(set(files.values())):
        if not f.is_file():
          raise HFError(f"{f}: missing; {index.name} lists it (tensors "
                        f"{', '.join(sorted(k for k, v in files.items() if v == f)[:3])}...). "
                        "Copy the whole model directory.")
    else:
      found = sorted(path.glob("*.safetensors"))
      if not found:
        raise HFError(f"{path}: no *.safetensors files (PyTorch .bin checkpoints are not read; "
                      "convert them with save_pretrained(..., safe_serialization=True)).")
      files = {}
      for f in found:
        for k in _keys(f):
          files[k] = f
    return cls(path, config, files)

  @property
  def kind(self) -> str:
    """A language model's model_type (llama, qwen2), a combined checkpoint's (an encoder's
    mapping's `combined`, e.g. llava), or the kind of a checkpoint of an encoder alone (its
    mapping's `types`, e.g. siglip, clip)."""
    t = field(self.config, "model_type", str(self.path / "config.json"), str, "")
    if t in LANGUAGE_TYPES:
      return t
    for m in mappings().values():
      if t == m.combined:
        return t
      if t in m.types:
        return m.types[t]
    kinds = ([m.combined for m in mappings().values()] + list(LANGUAGE_TYPES) +
             [k for m in mappings().values() for k in dict.fromkeys(m.types.values())])
    raise HFError(f"{self.path / 'config.json'}: model_type {t!r} is not supported; supported: "
                  f"{', '.join(kinds)}.")

  @property
  def mapping(self) -> Mapping | None:
    """The mapping of the encoder the directory holds, if any (None for a language model)."""
    kind = self.kind
    return next((m for m in mappings().values()
                 if kind == m.combined or kind in m.types.values()), None)

  @property
  def combined(self) -> bool:
    """Whether the directory holds an encoder beside a language model (config.json's sections:
    text_config and the encoder's)."""
    m = self.mapping
    return m is not None and self.kind == m.combined

  @property
  def modules(self) -> tuple[str, ...]:
    """The modules the directory holds: an encoder, the language model or both."""
    m = self.mapping
    if m is None:
      return (LANGUAGE,)
    return (m.name, LANGUAGE) if self.combined else (m.name,)

  def has(self, name: str) -> bool:
    return name in self.files

  def dtype(self, name: str) -> str:
    """Tensor `name`'s dtype as its file's header names it (F32, BF16, ...; "" if absent), read
    from the headers alone."""
    if self._dtypes is None:
      self._dtypes = {}
      for f in sorted(set(self.files.values())):
        self._dtypes.update({k: v.get("dtype", "") for k, v in _header(f).items()
                             if isinstance(v, dict) and k != "__metadata__"})
    return self._dtypes.get(name, "")

  def read(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Tensor `name` as float32, checked against the `shape` config.json implies."""
    if name not in self.files:
      raise HFError(f"{self.path}: tensor {name} is missing (config.json says it exists); the "
                    "checkpoint is incomplete or of another architecture.")
    f = self.files[name]
    from safetensors import safe_open  # pylint: disable=import-outside-toplevel
    try:
      with safe_open(str(f), "np") as st:
        x = st.get_tensor(name)
    except Exception as e:  # pylint: disable=broad-except
      if "bf16" in str(e).lower() or "bfloat16" in str(e).lower():
        x = _read_bf16(f, name)
      else:
        raise HFError(f"{f}: tensor {name} cannot be read ({e}); the file is damaged or not "
                      "safetensors.") from None
    if x.dtype.kind != "f" and str(x.dtype) != "bfloat16":
      raise HFError(f"{f}: tensor {name} has dtype {x.dtype}, expected a floating point type.")
    if tuple(x.shape) != tuple(shape):
      raise HFError(f"{f}: tensor {name} has shape {tuple(x.shape)}, but config.json implies "
                    f"{tuple(shape)}.")
    x = np.asarray(x, np.float32)
    bad = _nonfinite(x)
    if bad:
      raise HFError(f"{f}: tensor {name} holds NaN or infinite values ({bad}); the checkpoint is "
                    "damaged or was saved from a diverged run: download it again or use another.")
    return x


FINITE_CHUNK = 1 << 22  # elements checked at a time: a 4 MB mask, however large the tensor


def _nonfinite(x: np.ndarray) -> str:
  """"" if every value of `x` is finite, else where the first NaN or infinity is (found chunk by
  chunk while the tensor is in memory anyway: no second read, no mask the tensor's size)."""
  flat = x.reshape(-1)
  for start in range(0, flat.size, FINITE_CHUNK):
    ok = np.isfinite(flat[start:start + FINITE_CHUNK])
    if not ok.all():
      i = start + int(np.argmin(ok))
      return f"{flat[i]} at index {tuple(int(j) for j in np.unravel_index(i, x.shape))}"
  return ""


def _keys(f: pathlib.Path) -> list[str]:
  from safetensors import safe_open  # pylint: disable=import-outside-toplevel
  try:
    with safe_open(str(f), "np") as st:
      return list(st.keys())
  except Exception as e:  # pylint: disable=broad-except
    raise HFError(f"{f}: cannot be read as safetensors ({e}).") from None


def _header(f: pathlib.Path) -> dict:
  """A safetensors file's header: each tensor's dtype, shape and data offsets."""
  try:
    with open(f, "rb") as fh:
      header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
  except (OSError, ValueError, MemoryError) as e:
    raise HFError(f"{f}: cannot be read as safetensors ({e}).") from None
  if not isinstance(header, dict):
    raise HFError(f"{f}: cannot be read as safetensors (its header is not an object).")
  return header


def _read_bf16(f: pathlib.Path, name: str) -> np.ndarray:
  """numpy has no bfloat16: read the raw bits (safetensors' header gives the layout)."""
  import ml_dtypes  # pylint: disable=import-outside-toplevel
  with open(f, "rb") as fh:
    n = int.from_bytes(fh.read(8), "little")
    header = json.loads(fh.read(n))
    info = header[name]
    start, end = info["data_offsets"]
    fh.seek(8 + n + start)
    raw = fh.read(end - start)
  return np.frombuffer(raw, ml_dtypes.bfloat16).reshape(info["shape"])


def _find(src: Source, prefixes: tuple[str, ...], suffix: str) -> str:
  """The full name of `suffix` under the first of `prefixes` that has it."""
  for p in prefixes:
    if src.has(p + suffix):
      return p + suffix
  return prefixes[0] + suffix  # missing: read() names it


def _int(cfg: dict, key: str, where: str, section: str = "") -> int:
  return field(cfg, key, where, int, section=section)
