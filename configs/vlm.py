"""A realistic VLM for GPU benchmarks, on synthetic data (data/synthetic.py).

Encoder: ViT-L/14 at 336 px (576 tokens an image, 24 layers of width 1024: 0.30 B parameters) and
LLaVA's two-layer MLP projector. Language model: a 1.1 B-parameter Llama-style decoder (16 layers of
width 2048, 32 heads of 64, 8 key-value heads, SwiGLU 8192, vocabulary 32000). Sequences of 2048
tokens, bfloat16 compute, float32 master weights.

Variants (the argument after the colon):
  default        1-3 images a sample (probabilities 0.4, 0.3, 0.3); the ViT's layers keep their
                 matmul outputs for the backward pass and recompute the rest (remat dots)
  encoder_heavy  4-11 images a sample, each compressed to 144 tokens by a 2x2 pixel shuffle before
                 the projector (InternVL-style): the encoder does about half of the model FLOPs,
                 against a fifth in the default; its layers keep only their inputs for the
                 backward pass (remat full), as 88 image slots a microbatch would not fit otherwise
  dynamic        dynamic resolution: each image 224², 336², 448², 224x448 or 448x224 (64-256
                 tokens after a 2x2 pixel shuffle), packed into 8 slots of 2048 patches a
                 microbatch (model.vision.slot_patches) instead of being resized to one size;
                 samples are balanced over language ranks by cost so that no rank's slots
                 overflow; the ViT's layers keep only their inputs for the backward pass (remat
                 full)
  tuned          the default's model and data with the settings that measured fastest on one H200
                 (docs/benchmarks.md, 46% MFU): 2 microbatches of 16 samples, samples assigned
                 to microbatches to send less padding (data.microbatch_fill=pack) in 16 packed
                 rows with 16 row buckets and 8 image-slot buckets, the ViT's layer loop unrolled
                 and its attention forward kept for the backward (remat dots_attention); about
                 79 GiB a GPU, more than an 80 GB H100 leaves free; a microbatch whose shape is
                 still compiling runs padded to a compiled one (run.while_compiling=pad),
                 six threads compile ahead with XLA's kernel heuristics (run.autotune=false)
  llm8b          an 8B-class Llama-3-shaped language model (32 layers of width 4096, 32 heads /
                 8 key-value heads, SwiGLU 14336, vocabulary 128256: 8.0 B parameters) with the
                 ViT-L, one image a sample; both modules shard their state over their dp ranks
                 (FSDP, topology.<module>.shard=full) and keep only each layer's input for the
                 backward pass, in rolled layer loops
  llm8b_lora     llm8b's model on one GPU as a LoRA fine-tune: adapters of rank 16 (alpha 32) on
                 the language model's attention and MLP projections, its own weights and the
                 tower frozen, the projector (hidden width 4096, LLaVA's) trained; the language
                 model's layers keep their matmul outputs for the backward pass (remat dots: 15%
                 faster a step on an H200 than keeping only each layer's input, 62.7 GiB against
                 24.6), the frozen tower runs forward only (tools/hf_lora_bench.py is HF
                 transformers + PEFT at the same sizes and batch)

  python -m mimo_jax.launch --config=configs/vlm.py
  python -m tools.bench --config=configs/vlm.py:encoder_heavy --layouts=...

Topology fields are left at one device; benchmarks and runs set them with flags.
"""

from mimo_jax.config import Config, ConfigError
from mimo_jax.encoders.vision import VisionConfig


def get_config(arg: str | None = None) -> Config:
  cfg = Config()
  cfg.add_encoder("vision", VisionConfig())
  v, lm, d = cfg.model.vision, cfg.model.language, cfg.data
  cfg.model.dtype = "bfloat16"
  v.image_size, v.channels, v.patch_size = 336, 3, 14
  v.dim, v.layers, v.heads, v.mlp_dim, v.projector_hidden = 1024, 24, 16, 4096, 2048
  lm.dim, lm.layers, lm.heads, lm.kv_heads, lm.mlp_dim = 2048, 16, 32, 8, 8192
  lm.vocab_size, lm.rope_theta = 32_000, 500_000.0
  d.task = "synthetic"
  d.train_samples, d.eval_samples = 2_000, 64
  d.workers = 8
  d.seq_len = 2048
  v.max_images, d.image_probs = 3, "0,0.4,0.3,0.3"
  d.global_batch, d.microbatches = 32, 4  # 8 samples a microbatch
  d.text_len, d.text_len_sigma = 256, 0.6
  # The language model's cost per sample grows with its tokens, the encoder's with its images.
  d.image_token_cost, d.text_token_cost = 1.0, 1.0
  cfg.topology.vision.unroll = False  # faster rolled on an H200 (docs/benchmarks.md)
  # The ViT keeps its matmul outputs for the backward pass and recomputes the norms, GELUs and
  # attention: 3% faster a step on an H200 than keeping everything, and 32 GiB less memory.
  cfg.topology.vision.remat = "dots"
  cfg.optim.lr, cfg.optim.warmup_steps = 3e-4, 20
  cfg.train.steps = 100
  cfg.eval.samples, cfg.eval.batch = 64, 8
  cfg.run.workdir, cfg.run.log_every = "runs/vlm", 10
  if arg in (None, "", "default"):
    pass
  elif arg == "encoder_heavy":
    v.downsample = 2
    cfg.topology.vision.remat = "full"
    v.max_images = 11
    d.image_probs = ",".join(["0"] * 4 + ["0.125"] * 8)
  elif arg == "dynamic":
    v.image_size, v.downsample = 448, 2
    d.image_sizes = "224,336,448,224x448,448x224"
    v.slot_patches, v.image_slots, d.reorder = 2048, 8, "balance"
    cfg.topology.vision.remat = "full"  # masked attention over 2048-patch slots is memory-hungry
  elif arg == "tuned":
    d.microbatches = 2  # 16 samples a microbatch
    d.microbatch_fill, d.pack_rows, d.row_buckets, d.slot_buckets = "pack", 16, 16, 8
    cfg.topology.vision.unroll, cfg.topology.vision.remat = True, "dots_attention"
    # 16 x 8 buckets make dozens of shapes of ~40 s of compiling each: steps run padded to a
    # compiled shape while theirs compiles instead of waiting, and XLA's heuristics choose the
    # kernels, so that a compile needs no GPU time while steps run (README, compilation).
    cfg.run.while_compiling, cfg.run.autotune = "pad", False
    cfg.run.compile_ahead, cfg.run.compile_threads = 16, 6
  elif arg == "llm8b":
    lm.dim, lm.layers, lm.heads, lm.kv_heads, lm.mlp_dim = 4096, 32, 32, 8, 14336
    lm.vocab_size = 128_256
    d.image_probs = "0,1,0,0"
    d.microbatches = 8  # 4 samples a microbatch
    for t in (cfg.topology.vision, cfg.topology.language):
      t.remat, t.unroll, t.shard = "full", False, "full"
  elif arg == "llm8b_lora":
    lm.dim, lm.layers, lm.heads, lm.kv_heads, lm.mlp_dim = 4096, 32, 32, 8, 14336
    lm.vocab_size = 128_256
    v.projector_hidden = 4096
    d.image_probs = "0,1,0,0"
    d.microbatches = 8  # 4 samples a microbatch
    lm.lora.rank, lm.lora.alpha = 16, 32.0
    cfg.optim.freeze, cfg.optim.lr = "vision", 2e-4
    for t in (cfg.topology.vision, cfg.topology.language):
      t.remat, t.unroll = "full", False
    # The frozen base takes 2 bytes a parameter, which leaves room to keep matmul outputs.
    cfg.topology.language.remat = "dots"
  else:
    raise ConfigError(f"configs/vlm.py: unknown variant {arg!r}; use default, encoder_heavy, "
                     "dynamic, tuned, llm8b or llm8b_lora.")
  return cfg
