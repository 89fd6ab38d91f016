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

Variant `audio`: speech and text, no vision tower: an audio encoder of Whisper's layout (two
blocks of width 64) and LLaVA's MLP projector beside the language model, rows of 1024 tokens, for `tools.convert`'s
audio records (its launch line gives the clips' fields: mel_bins, positions, pool, audio_token,
max_audios, max_windows) or `tools.hf import` of a small Qwen2-Audio or Whisper model.

  python -m mimo_jax.launch --config=configs/llava_cpu.py:audio --config.data.dir=data/speech ...
"""

from mimo_jax.config import Config, ConfigError, ModuleTopology
from mimo_jax.encoders.audio import AudioConfig
from mimo_jax.encoders.vision import VisionConfig


def get_config(arg: str | None = None) -> Config:
  if arg not in (None, "", "default", "audio"):
    raise ConfigError(f"configs/llava_cpu.py: no variant {arg!r}; use 'default' or 'audio'.")
  cfg = Config()
  if arg == "audio":
    cfg.add_encoder("audio", AudioConfig(dim=64, layers=2, heads=4, mlp_dim=256,
                                         projector_hidden=128), ModuleTopology())
  else:
    cfg.add_encoder("vision", VisionConfig())
  cfg.model.dtype = "float32"
  for t in cfg.topology.modules().values():
    t.offset = 0
  cfg.run.cpu_devices = 1
  d = cfg.data
  d.task = "conversations"
  d.global_batch, d.microbatches = 8, 1
  d.seq_len = 1024 if arg == "audio" else 256  # a 30 s window pooled by 2 is 750 tokens
  if arg != "audio":  # LLaVA's data: one image a record at most.
    cfg.model.vision.max_images = 1
  d.workers = 0
  cfg.optim.lr, cfg.optim.warmup_steps = 1e-3, 3
  cfg.train.steps = 30
  cfg.eval.samples, cfg.eval.batch = 8, 8
  cfg.run.workdir, cfg.run.log_every = f"runs/{'audio' if arg == 'audio' else 'llava'}_cpu", 1
  return cfg
