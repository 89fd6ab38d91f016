"""Command line: `python -m mimo_jax.launch [--config=configs/NAME.py[:ARG]] [--config.a.b=v ...]`.

Flags -> config -> validation -> `train.run`. Every config field is documented in the README.
"""

from __future__ import annotations

import sys

from absl import app, flags
from ml_collections import config_flags

from mimo_jax.config import ConfigError, validate

_CONFIG = config_flags.DEFINE_config_file(
    "config", "configs/digits.py", "Config file (configs/NAME.py[:ARG]); override any field with "
    "--config.a.b=value.", lock_config=True)


def _fail(message: str) -> None:
  print(f"mimo_jax: error: {message}", file=sys.stderr)
  sys.exit(2)


def _parse(argv: list[str]) -> list[str]:
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    _fail(str(e))
  except (KeyError, AttributeError, ValueError, TypeError) as e:  # unknown --config.a.b path
    _fail(f"bad config override: {e.args[0] if e.args else e}")
  return []


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    _fail(f"unexpected arguments {argv[1:]}; flags look like --config.train.steps=10.")
  cfg = _CONFIG.value
  try:
    validate(cfg)  # device-independent checks, before JAX starts
  except ConfigError as e:
    _fail(str(e))
  import jax  # pylint: disable=import-outside-toplevel
  jax.config.update("jax_num_cpu_devices", cfg.run.cpu_devices)  # before the backend starts
  from mimo_jax import train  # pylint: disable=import-outside-toplevel
  try:
    train.run(cfg)
  except ConfigError as e:
    _fail(str(e))


if __name__ == "__main__":
  app.run(main, flags_parser=_parse)
