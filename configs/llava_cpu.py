"""The LLaVA recipe at a size a laptop-class CPU trains in minutes: the base config for
`tools.hf import` of a small HF model, on one device in float32.

The model's fields come from the imported config.json; this file sets the rest: one CPU device,
float32, 8 samples a step in one microbatch, rows of 256 tokens holding one image at most, 30
steps logged every step, an eval of 8 samples at the end. configs/vlm.py (the import's default base) is sized for GPUs
(bfloat16, 2048-token rows, 32 samples a step) and takes minutes a step on a CPU.

  python -m tools.hf import --hf llava-tiny --out runs/llava0 --config=configs/llava_cpu.py
  python -m mimo_jax.launch --config=runs/llava0/config.py --config.data.dir=data/pretrain ...

Which groups train is given at launch (README, "The LLaVA recipe"): stage 1 the projector alone
(`--config.optim.freeze=vision,language`), stage 2 the projector and the language model
(`--config.optim.freeze=vision`).
"""

from mimo_jax.config import Config
from mimo_jax.encoders.vision import VisionConfig


def get_config(arg: str | None = None) -> Config:
  cfg = Config()
  cfg.add_encoder("vision", VisionConfig())
  cfg.model.dtype = "float32"
  cfg.topology.vision.offset = cfg.topology.language.offset = 0
  cfg.run.cpu_devices = 1
  d = cfg.data
  d.task = "conversations"
  d.global_batch, d.microbatches = 8, 1
  d.seq_len = 256
  # LLaVA's data: one image a record at most.
  cfg.model.vision.max_images, d.image_probs = 1, "0.5,0.5"
  d.workers = 0
  cfg.optim.lr, cfg.optim.warmup_steps = 1e-3, 3
  cfg.train.steps = 30
  cfg.eval.samples, cfg.eval.batch = 8, 8
  cfg.run.workdir, cfg.run.log_every = "runs/llava_cpu", 1
  if arg not in (None, "", "default"):
    raise ValueError(f"configs/llava_cpu.py: no variant {arg!r}; it has none.")
  return cfg
