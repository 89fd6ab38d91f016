"""Default config: a small VLM learns to name handwritten digits (README), on 8 devices.

The vision encoder and the language model run on separate meshes with different dp: vision dp4 on
devices 0-3 feeds language dp2 x tp2 on devices 4-7 (a 4 -> 2 fan-in through the bridge).

  python -m mimo_jax.launch                              # 8 CPU devices (fake) or 8 GPUs
  python -m mimo_jax.launch --config=configs/digits.py:single   # everything on one device
"""

from mimo_jax.config import Config, ConfigError
from mimo_jax.encoders.vision import VisionConfig


def get_config(arg: str | None = None) -> Config:
  cfg = Config()
  cfg.add_encoder("vision", VisionConfig())
  t = cfg.topology
  if arg in (None, "", "default"):
    t.vision.offset, t.vision.dp = 0, 4
    t.language.offset, t.language.dp, t.language.tp = 4, 2, 2
  elif arg == "single":
    cfg.run.cpu_devices = 1
  else:
    raise ConfigError(f"configs/digits.py: unknown variant {arg!r}; use 'default' or 'single'.")
  return cfg
