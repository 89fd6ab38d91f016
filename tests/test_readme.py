"""The README's config table lists exactly the fields of the config dataclasses."""

import dataclasses
import pathlib
import re

from configs import digits
from mimo_jax.encoders.audio import AudioConfig

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def _fields(obj, prefix: str = "") -> set[str]:
  out = set()
  for f in dataclasses.fields(obj):
    value = getattr(obj, f.name)
    if f.name == "encoders":  # model.<name>, topology.<name> of each encoder
      for name, section in value.items():
        out |= _fields(section, f"{prefix}{name}.")
    elif dataclasses.is_dataclass(value):
      out |= _fields(value, f"{prefix}{f.name}.")
    else:
      out.add(prefix + f.name)
  return out


def _documented() -> set[str]:
  text = README.read_text(encoding="utf-8")
  table = text[text.index("## Config reference"):]
  table = table[:table.index("\n## ")]
  out = set()
  for line in table.splitlines():
    if not line.startswith("| `"):
      continue
    names = re.findall(r"`([^`]+)`", line.split("|")[1])
    parent = names[0].rsplit(".", 1)[0]
    for name in names:
      full = parent + name if name.startswith(".") else name
      out |= ({full.replace("<module>", m) for m in ("vision", "audio", "language")}
              if "<module>" in full else {full})
  return out


def test_config_table_matches_the_dataclasses():
  cfg = digits.get_config()
  cfg.add_encoder("audio", AudioConfig())  # the audio encoder's rows too
  documented, fields = _documented(), _fields(cfg)
  assert not fields - documented, f"fields missing from the README: {sorted(fields - documented)}"
  assert not documented - fields, f"README rows of no field: {sorted(documented - fields)}"
