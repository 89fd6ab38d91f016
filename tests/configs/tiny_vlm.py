"""configs/vlm.py scaled down to compile in seconds on CPU (tests and smoke runs of tools/bench.py).

  python -m tools.bench --config=tests/configs/tiny_vlm.py:encoder_heavy --layouts=...
"""

from configs import vlm
from mimo_jax.config import Config


def get_config(arg: str | None = None) -> Config:
  cfg = vlm.get_config(arg)
  v, lm, d = cfg.model.vision, cfg.model.language, cfg.data
  v.image_size, v.patch_size, v.dim, v.layers, v.heads = 16, 4, 32, 2, 2
  v.mlp_dim, v.projector_hidden = 64, 64
  lm.dim, lm.layers, lm.heads, lm.kv_heads, lm.mlp_dim, lm.vocab_size = 64, 2, 4, 2, 128, 64
  d.seq_len, d.text_len, d.train_samples, d.eval_samples, d.workers = 96, 8, 200, 16, 0
  if arg == "dynamic":  # 1, 2 or 4 tokens an image, two of the largest a slot
    d.image_sizes, v.slot_patches = "8,16,8x16,16x8", 32
  cfg.model.dtype = "float32"
  cfg.eval.samples, cfg.eval.batch = 16, 8
  cfg.train.steps = 4
  cfg.run.progress = "lines"
  return cfg
