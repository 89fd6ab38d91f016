"""Config files and `--config.a.b=value` overrides: the one loader of launch and of every tool.

A config file (`configs/NAME.py`) defines `get_config(arg=None)` returning a `Config`;
`configs/NAME.py:ARG` passes it ARG. A path is read as given (from the current directory), else
from the repository's root, so a tool run from any directory finds `configs/...`.

An override sets one field from text, typed by the field's annotation: int, float, str, or bool
(true/false, t/f, 1/0; `--config.a.b` alone is true, `--noconfig.a.b` false). Overrides apply in
order after the file (the last value of a field wins). Each encoder's sections are
`model.<name>.field` and `topology.<name>.field` (`model.encoders.<name>.field` also works).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import pathlib
import re
import typing
from collections.abc import Sequence

from mimo_jax.config import Config, ConfigError
from mimo_jax.registry import MOVED_DATA_FIELDS

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_HINT = "configs/digits.py"
_OVERRIDE = re.compile(r"^--?(no)?config\.([A-Za-z_][A-Za-z0-9_.]*)(?:=(.*))?$", re.DOTALL)
_SPEC = re.compile(r"^--?config(?:=(.*))?$", re.DOTALL)
_TRUE, _FALSE = ("true", "t", "1"), ("false", "f", "0")


def find(path: str) -> pathlib.Path | None:
  """A config file: `path` from the current directory, else from the repository's root; None
  where neither is a file."""
  for candidate in (pathlib.Path(path), ROOT / path):
    if candidate.is_file():
      return candidate
  return None


def load_file(spec: str, hint: str = DEFAULT_HINT) -> Config:
  """The `Config` of `spec`, `FILE[:ARG]` (`get_config(ARG)`, or `get_config()` without `:`).
  ConfigError, one line, for a missing file (suggesting `hint`), a file that fails to run, or a
  `get_config` that returns something else; a ConfigError of the file's own passes as it is."""
  path, sep, arg = spec.partition(":")
  file = find(path)
  if file is None and any(p.is_dir() for p in (pathlib.Path(path), ROOT / path)):
    raise ConfigError(f"--config: {path!r} is a directory; name a config file in it, e.g. "
                      f"{hint}.")
  if file is None:
    raise ConfigError(f"--config: file {path!r} does not exist; try {hint}.")
  try:
    module_spec = importlib.util.spec_from_file_location("mimo_jax_config_file", file)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    if not callable(getattr(module, "get_config", None)):
      raise ConfigError(f"--config={spec}: {file} defines no get_config(arg=None) returning a "
                        f"Config; add one (as {hint} does).")
    cfg = module.get_config(arg) if sep else module.get_config()
  except ConfigError:
    raise
  except SystemExit as e:  # sys.exit() in the file: no config, not an end of the run
    raise ConfigError(f"--config={spec}: {file} called sys.exit({e.code!r}) while it was read; a "
                      "config file defines get_config and returns a Config.") from None
  except Exception as e:  # pylint: disable=broad-except  # a user's file: any error, one line
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    raise ConfigError(f"--config={spec}: {type(e).__name__}: {first}") from e
  if not isinstance(cfg, Config):
    raise ConfigError(f"--config={spec}: get_config returned {type(cfg).__name__}, not a Config.")
  try:
    check_values(cfg)
  except ConfigError as e:
    raise ConfigError(f"--config={spec}: {e}") from None
  return cfg


def check_values(obj, where: str = "") -> None:
  """What a config file set, as an override would be checked: every attribute of a section one
  of its fields (a misspelt name would be ignored otherwise), every section a section, every int,
  float, str or bool field a value of that type (an int is taken for a float, as a float).
  ConfigError naming the first field that is not."""
  if isinstance(obj, dict):  # the encoders: each a section named as the flags name it
    for name, section in obj.items():
      check_values(section, ".".join(where.split(".")[:-1] + [name]))
    return
  known = {f.name for f in dataclasses.fields(obj)}
  for part in vars(obj):
    if part not in known:
      raise _unknown(obj, part, where)
  hints = typing.get_type_hints(type(obj))
  for name in known:
    value, path = getattr(obj, name), f"{where}.{name}" if where else name
    if dataclasses.is_dataclass(value) or (name == "encoders" and isinstance(value, dict)):
      check_values(value, path)
      continue
    kind = hints.get(name)
    if isinstance(kind, type) and dataclasses.is_dataclass(kind):
      raise ConfigError(f"config.{path} is a section ({kind.__name__}), not {value!r}; set its "
                        f"fields instead.")
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
      setattr(obj, name, float(value))
    elif kind in (int, float, str, bool) and (
        not isinstance(value, kind) or (kind is not bool and isinstance(value, bool))):
      raise ConfigError(f"config.{path}: {value!r} is not {'an' if kind is int else 'a'} "
                        f"{kind.__name__}.")


def parse_override(arg: str) -> tuple[str, str | None]:
  """(field path `a.b`, its text) of `--config.a.b=value`; `--noconfig.a.b` gives "false" and
  `--config.a.b` without a value None (true for a bool). ConfigError for anything else."""
  m = _OVERRIDE.match(arg)
  if not m:
    raise ConfigError(f"unexpected argument {arg!r}; overrides look like --config.a.b=value.")
  negated, name, text = m.groups()
  if negated:
    if text is not None:
      raise ConfigError(f"{arg}: a --noconfig flag takes no value.")
    return name, "false"
  return name, text


def apply(cfg: Config, overrides: Sequence[str]) -> Config:
  """Applies `--config.a.b=value` overrides to `cfg` in order; returns it. ConfigError naming the
  override and what is wrong with it."""
  for arg in overrides:
    name, text = parse_override(arg)
    try:
      set_field(cfg, name, text, negated=bool(_OVERRIDE.match(arg).group(1)))
    except ConfigError as e:
      raise ConfigError(f"{arg}: {e}") from None
  return cfg


def load(spec: str, overrides: Sequence[str] = (), hint: str = DEFAULT_HINT) -> Config:
  """A config file's `Config` (`load_file`) with `--config.a.b=value` overrides applied
  (`apply`)."""
  return apply(load_file(spec, hint), overrides)


def split_args(argv: Sequence[str]) -> tuple[str | None, list[str], list[str]]:
  """(the `--config` value or None, the `--config.a.b[=value]` overrides in order, every other
  argument) of a command line; `--config FILE` and `--config.a.b VALUE` may be two arguments
  (a value never starts with `-`; a bool's bare flag followed by another flag means true)."""
  spec, overrides, rest = None, [], []
  args = list(argv)
  i = 0
  while i < len(args):
    arg, following = args[i], args[i + 1] if i + 1 < len(args) else None
    m, o = _SPEC.match(arg), _OVERRIDE.match(arg)
    takes_next = following is not None and not following.startswith("-")
    if m:
      spec = m.group(1) if m.group(1) is not None else (following or "")
      i += m.group(1) is None
    elif o and o.group(1) is None and o.group(3) is None and takes_next:
      overrides.append(f"{arg}={following}")
      i += 1
    elif o:
      overrides.append(arg)
    else:
      rest.append(arg)
    i += 1
  return spec, overrides, rest


def set_field(cfg: Config, name: str, text: str | None, negated: bool = False) -> object:
  """Sets field `name` (`a.b.c`) of `cfg` from `text`, typed by the field (None: a bool's bare
  flag, true; `negated`: a `--noconfig` flag, which only a bool field takes); returns the value.
  ConfigError saying what is wrong, without the flag."""
  *parents, last = name.split(".")
  obj = cfg
  for i, part in enumerate(parents):
    obj = _child(obj, part, ".".join(parents[:i]))
  kind = _field_type(obj, last, ".".join(parents))
  if negated and kind is not bool:
    raise ConfigError(f"--noconfig sets a bool field false, and config.{name} is "
                      f"{'an' if kind is int else 'a'} {kind.__name__}: give "
                      f"--config.{name}=VALUE.")
  if kind is bool:
    if text is None or text.lower() in _TRUE + _FALSE:
      value = text is None or text.lower() in _TRUE
    else:
      raise ConfigError("not a bool (true or false).")
  elif text is None:
    raise ConfigError(f"needs a value: --config.{name}=VALUE.")
  else:
    try:
      value = _int(text) if kind is int else kind(text)
    except ValueError:
      raise ConfigError(f"not {'an' if kind is int else 'a'} {kind.__name__}.") from None
  setattr(obj, last, value)
  return value


def _int(text: str) -> int:
  """An int as absl's flags read one: decimal, or 0x / 0o prefixed."""
  base = {"0x": 16, "0o": 8}.get(text.strip()[:2].lower(), 10)
  return int(text, base)


def _fields(obj) -> list[str]:
  """What a section holds: a dict's keys; a dataclass's fields, and its encoders by name."""
  if isinstance(obj, dict):
    return list(obj)
  return [f.name for f in dataclasses.fields(obj)] + list(getattr(obj, "encoders", {}))


def _unknown(obj, part: str, where: str) -> ConfigError:
  section = f"config.{where}" if where else "config"
  for name, fields in MOVED_DATA_FIELDS.items():
    if where == "data" and part in fields:  # a field an encoder took over from data
      return ConfigError(f"config.data.{part} is now model.{name}.{part} (the {name} encoder's "
                         f"setting): set --config.model.{name}.{part}.")
  return ConfigError(f"unknown config field {part!r}; {section} has {', '.join(_fields(obj))}.")


def _child(obj, part: str, where: str):
  """The section `part` of `obj` (a dataclass, or the `encoders` dict)."""
  if isinstance(obj, dict):
    if part not in obj:
      raise _unknown(obj, part, where)
    return obj[part]
  if part not in _fields(obj):
    raise _unknown(obj, part, where)
  child = getattr(obj, part)
  if not (dataclasses.is_dataclass(child) or isinstance(child, dict)):
    raise ConfigError(f"config.{where + '.' if where else ''}{part} is a field, not a section.")
  return child


def _field_type(obj, last: str, where: str) -> type:
  """The type of field `last` of section `obj`: its annotation (where it names a plain type),
  else its value's."""
  if isinstance(obj, dict) or last not in _fields(obj):
    raise _unknown(obj, last, where)
  value = getattr(obj, last)
  path = f"config.{where + '.' if where else ''}{last}"
  if dataclasses.is_dataclass(value) or isinstance(value, dict):
    raise ConfigError(f"{path} is a section; set one of its fields, --{path}.FIELD=value.")
  try:
    kind = typing.get_type_hints(type(obj)).get(last, type(value))
  except Exception:  # pylint: disable=broad-except  # an annotation that does not resolve
    kind = type(value)
  if kind not in (int, float, str, bool):
    kind = type(value)
  if kind not in (int, float, str, bool):
    raise ConfigError(f"{path} holds a {kind.__name__}, which no flag sets.")
  return kind


def field_flags(cfg: Config, prefix: str = "config.") -> list[str]:
  """`--config.a.b=default  (type)` for every field of `cfg`, each encoder's as `model.<name>.x`
  and `topology.<name>.x`."""
  lines = []
  for f in dataclasses.fields(cfg):
    value = getattr(cfg, f.name)
    if f.name == "encoders":
      for name, section in value.items():
        lines += field_flags(section, f"{prefix}{name}.")
    elif dataclasses.is_dataclass(value):
      lines += field_flags(value, f"{prefix}{f.name}.")
    elif not isinstance(value, dict):
      lines.append(f"  --{prefix}{f.name}={value!r}  ({type(value).__name__})")
  return lines
