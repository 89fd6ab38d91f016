"""A config small enough to compile in seconds, for tests.

  python -m mimo_jax.launch --config=tests/configs/tiny.py:vision=0/4/1,language=4/2/2

The argument sets each module's offset/dp/tp[/pp[/virtual]]; without it both modules share
device 0.
"""

from mimo_jax.config import Config, set_layout
from mimo_jax.encoders.vision import VisionConfig


def get_config(arg: str | None = None) -> Config:
  cfg = Config()
  cfg.add_encoder("vision", VisionConfig())
  cfg.data.train_samples, cfg.data.eval_samples = 2_000, 200
  cfg.data.global_batch, cfg.data.microbatches = 32, 2
  cfg.model.vision.dim, cfg.model.vision.mlp_dim, cfg.model.vision.projector_hidden = 32, 64, 64
  cfg.model.language.dim, cfg.model.language.mlp_dim = 64, 128
  cfg.optim.warmup_steps = 2
  cfg.train.steps = 4
  cfg.eval.samples, cfg.eval.batch = 48, 16
  cfg.run.progress = "lines"
  set_layout(cfg, arg or "")
  return cfg
