"""A realistic AVLM for GPU benchmarks, on synthetic data (data/synthetic.py): configs/vlm.py's
ViT-L/14-336 and 1.1 B-parameter language model, with an audio encoder of Whisper-large-v3's shape
(32 layers of width 1280, 20 heads, MLP 5120, 128 mel bins, 30 s windows of 3000 frames) laid out
as Qwen2-Audio's tower (padded positions masked, pooled by 2: 750 tokens a full window) and
LLaVA's two-layer MLP projector. Each sample has one image (576 tokens) and one clip of 7.5-30 s
(188-750 tokens: padding's tokens are dropped), and about 256 tokens of text; bfloat16 compute,
float32 master weights; every module on the same device(s) unless the layout says otherwise.

  python -m tools.bench --config=configs/avlm.py \\
      --layouts="vision=0/1/1,audio=0/1/1,language=0/1/1" --steps=8 --record

Variants: default; fp8 (every module's block matmuls in FP8); audio (no vision: Qwen2-Audio's
own layout at these sizes, a linear projector and a Qwen2 decoder with q/k/v biases, one clip a
sample: what tools/hf_qwen2_audio_bench.py runs in PyTorch).

  python -m tools.bench --config=configs/avlm.py:audio --layouts="audio=0/1/1,language=0/1/1"
"""

from configs import vlm
from mimo_jax.config import Config, ConfigError, ModuleTopology
from mimo_jax.encoders.audio import AudioConfig
from mimo_jax.models.whisper import shaped


def get_config(arg: str | None = None) -> Config:
  cfg = vlm.get_config()
  tower = shaped("large-v3", pool=2, mask_padding=True, projector="mlp", projector_hidden=2048)
  audio = AudioConfig(**vars(tower), max_audios=1, max_windows=1)
  cfg.add_encoder("audio", audio, ModuleTopology(remat="dots", unroll=False))
  cfg.model.vision.max_images, cfg.data.image_probs = 1, "0,1"
  if arg == "audio":
    del cfg.model.encoders["vision"], cfg.topology.encoders["vision"]
    audio.projector, cfg.model.language.qkv_bias = "linear", True
  cfg.run.workdir = "runs/avlm"
  if arg in (None, "", "default"):
    pass
  elif arg == "audio":
    pass
  elif arg == "fp8":
    for name in ("vision", "audio", "language"):
      cfg.model.module(name).fp8 = True
  else:
    raise ConfigError(f"configs/avlm.py: unknown variant {arg!r}; use default, fp8 or audio.")
  return cfg
