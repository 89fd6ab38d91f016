"""A small AVLM learns to name a digit it sees and a digit dialled as DTMF tones (README), on 8
devices: the audio-visual digits task (mimo_jax/data/av_digits.py).

Three disjoint meshes, both bridges changing dp: vision dp4 on devices 0-3 feeds language dp2 on
devices 4-5 (a 4 -> 2 fan-in), and audio dp1 x tp2 on devices 6-7 feeds the same language ranks
(a 1 -> 2 fan-out). The audio tower is Qwen2-Audio's layout at toy size: Whisper's features of 80
mel bins in 1 s windows (50 positions after the stride-2 convolution), padding masked and its
tokens dropped, pooled by 2.

  python -m mimo_jax.launch --config=configs/av_digits.py
  python -m mimo_jax.launch --config=configs/av_digits.py:single   # everything on one device
"""

from mimo_jax.config import Config, ConfigError
from mimo_jax.config_run import AV_DIGITS_VOCAB
from mimo_jax.data import av_digits
from mimo_jax.encoders.audio import AudioConfig
from mimo_jax.encoders.vision import VisionConfig


def get_config(arg: str | None = None) -> Config:
  cfg = Config()
  cfg.add_encoder("vision", VisionConfig(max_images=1))
  cfg.add_encoder("audio", AudioConfig(
      mel_bins=av_digits.MEL_BINS, positions=av_digits.WINDOW_S * 50, dim=32, layers=2, heads=2,
      mlp_dim=64, pool=av_digits.POOL, mask_padding=True, audio_token=av_digits.AUDIO_TOKEN))
  d = cfg.data
  d.task, d.image_probs, d.seq_len = "av_digits", "0,1", 33
  d.train_samples, d.eval_samples, d.global_batch = 2000, 500, 32
  cfg.model.language.vocab_size = AV_DIGITS_VOCAB
  cfg.train.steps, cfg.eval.samples, cfg.run.workdir = 300, 500, "runs/av_digits"
  t = cfg.topology
  if arg in (None, "", "default"):
    t.vision.offset, t.vision.dp = 0, 4
    t.language.offset, t.language.dp = 4, 2
    t.audio.offset, t.audio.dp, t.audio.tp = 6, 1, 2
  elif arg == "single":
    cfg.run.cpu_devices = 1
  else:
    raise ConfigError(f"configs/av_digits.py: unknown variant {arg!r}; use 'default' or 'single'.")
  return cfg
