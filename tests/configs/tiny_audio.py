"""tests/configs/tiny.py with the audio encoder beside vision (Qwen2-Audio's tower layout at toy
size), for tests and imports of the tiny audio fixtures.

  python -m tools.hf import --hf tests/fixtures/hf_audio/qwen2_audio_a --out runs/a \
      --config=tests/configs/tiny_audio.py:vision=0/1/1,audio=0/1/1,language=0/1/1

The argument sets each module's offset/dp/tp[/pp[/virtual]] as tiny.py's does.
"""

from mimo_jax.config import Config, ModuleTopology, set_layout
from mimo_jax.encoders.audio import AudioConfig
from tests.configs import tiny


def get_config(arg: str | None = None) -> Config:
  cfg = tiny.get_config()
  cfg.add_encoder("audio", AudioConfig(), ModuleTopology())
  cfg.data.seq_len = 32
  set_layout(cfg, arg or "")
  return cfg
