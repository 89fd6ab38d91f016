"""The sections of a run's config beside its modules': `data` (the task, its batches and their
layout), `optim`, `train`, `eval`, `checkpoint` and `run`, and the built-in tasks' constants.
config.py joins them with the modules' sections (`model`, `topology`) into `Config`."""

import dataclasses

TASKS = ("digits", "av_digits", "synthetic", "conversations")
DIGITS_VOCAB = 17  # data/tokenizer.py
AV_DIGITS_VOCAB = 18  # data/av_digits.py: the digits' and <aud>
BUILTIN_IMAGE_TOKEN = 3  # the built-in tasks' <img> (data/tokenizer.IMG)


@dataclasses.dataclass
class DataConfig:
  # digits: the digits-captioning task (data/digits.py); av_digits: a digit's image and a dialled
  # digit's DTMF clip, named in order (data/av_digits.py; an image and an audio encoder);
  # synthetic: random VLM-shaped samples for benchmarks (data/synthetic.py), images of the image
  # encoder's image_size, text ids < vocab_size;
  # conversations: LLaVA-style data converted by tools.convert into data.dir
  # (data/conversations.py).
  task: str = "digits"
  seed: int = 0
  global_batch: int = 32
  microbatches: int = 2
  seq_len: int = 24
  # Probability of a sample having 0, 1, ..., max_images images (comma-separated; the image
  # encoder's max_images).
  image_probs: str = "0.1,0.3,0.3,0.3"
  train_samples: int = 20_000
  eval_samples: int = 1_000  # samples built from held-out images
  # Where the built-in task's ArrayRecord shards are built; "" = $XDG_CACHE_HOME/mimo_jax/<task>,
  # else ~/.cache/mimo_jax/<task>.
  dir: str = ""
  workers: int = 0  # grain read threads for the loader (0 = read in the main thread)
  # grain worker processes, each building whole steps (with `workers` threads); 0 = none. Past a
  # few threads the loader is bound by Python's GIL, which processes escape.
  worker_processes: int = 0
  # Intra-microbatch reorder: "none" (stream order) or "balance" (samples assigned to language dp
  # ranks by cost = image tokens * image_token_cost + text tokens * text_token_cost).
  reorder: str = "none"
  # Sequence packing: rows per microbatch (split over language dp ranks) into which each rank packs
  # its samples as segments; 0 = one sample a row (no packing).
  pack_rows: int = 0
  image_token_cost: float = 1.0
  text_token_cost: float = 1.0
  # Slots a microbatch sends to each encoder: 0 = all of its slots; k > 0 = only those its
  # ranks fill, rounded up to one of k evenly spaced sizes (one compiled encoder and language step
  # per size used). Less encoder work on padding; microbatches then differ in cost.
  slot_buckets: int = 0
  # Packed rows a microbatch sends to the language model (with pack_rows): 0 = all of pack_rows;
  # k > 0 = only those its ranks fill, rounded up to one of k evenly spaced sizes (one compiled
  # language step per size used). Less language work on padding rows.
  row_buckets: int = 0
  # Which samples of a step go in which microbatch: "stream" (consecutive samples), or "pack":
  # assigned so that the microbatches send fewer padded rows (row_buckets) and image slots
  # (slot_buckets), each microbatch's samples laid out longest first. Loss unchanged.
  microbatch_fill: str = "stream"
  # Order of a step's microbatches: "stream", or "pipeline" (inter-microbatch reorder, DistTrain
  # §5.3): Johnson's rule on each microbatch's encoder and language cost (the cost model above,
  # slots sent for the encoder), for the fewest bubbles between the modules. Loss unchanged.
  microbatch_order: str = "stream"
  # Synthetic task: median text tokens a sample and the log-normal spread of the text length.
  text_len: int = 128
  text_len_sigma: float = 0.5
  # Synthetic task: image sizes drawn uniformly per image, comma-separated "S" (S x S) or "HxW";
  # "" = the image encoder's image_size, square. Several sizes need its slot_patches > 0.
  image_sizes: str = ""
  # The token id of an image in the samples' token ids (conversations: the tokenizer's image
  # token, as tools.convert reports it); -1 = the built-in tasks' <img> (id 3), and for
  # conversations converted without an image token (no images), none.
  image_token: int = -1

  @property
  def placeholder(self) -> int:
    """The image placeholder's token id (-1, which no token is: conversations without one)."""
    if self.image_token >= 0:
      return self.image_token
    return -1 if self.task == "conversations" else BUILTIN_IMAGE_TOKEN

  @property
  def micro_batch(self) -> int:
    return self.global_batch // self.microbatches

  def probs(self) -> list[float]:
    return [float(p) for p in self.image_probs.split(",")]

  @property
  def draws_image_counts(self) -> bool:
    """Whether the task draws each sample's number of images from `image_probs`; converted
    records (conversations, av_digits) hold their own."""
    return self.task in ("synthetic", "digits")

  def sizes(self, default: int) -> list[tuple[int, int]]:
    """`image_sizes` as (h, w) pairs; [(default, default)] when empty."""
    if not self.image_sizes.strip():
      return [(default, default)]
    out = []
    for item in self.image_sizes.split(","):
      h, _, w = item.strip().lower().partition("x")
      out.append((int(h), int(w or h)))
    return out


@dataclasses.dataclass
class OptimConfig:
  lr: float = 3e-3
  warmup_steps: int = 50
  min_lr_ratio: float = 0.05
  weight_decay: float = 0.01
  b1: float = 0.9
  b2: float = 0.98
  clip_norm: float = 1.0
  # Comma-separated parameter groups to freeze: each encoder's `<name>` (its tower) and
  # `<name>_projector`, and `language`.
  freeze: str = ""
  # Comma-separated group=multiplier pairs scaling the learning rate, e.g. "language=0.1".
  lr_mult: str = ""


@dataclasses.dataclass
class TrainConfig:
  steps: int = 600
  seed: int = 0
  # The language model's head and cross-entropy run only at positions whose target carries loss
  # (not an image's tokens, not a prompt's), this many positions at a time, each chunk's
  # gradients made with it (models/head_loss.py): less work and one chunk's logits in memory
  # instead of a microbatch's; the eval loss likewise. 0 = the logits of every position at once.
  # The last chunk is padded: smaller chunks pad less, at the cost of more iterations.
  loss_chunk: int = 1024
  # With loss_chunk, the language model's last block runs its output projection and MLP in the
  # same chunks, only at those positions (at the others their results feed nothing: only the
  # block's keys and values are read there, by its attention): the same loss, less work (in FP8
  # with current scaling, those matmuls' operand scales come from the chunk's positions). Where
  # the layout allows: blocks not pipelined, their loop unrolled (topology.language.unroll), no
  # FP8 delayed scaling, no LoRA dropout in training; elsewhere (and false) the block runs whole.
  last_block_in_loss: bool = True
  # A module's trained stacked kernels' gradients accumulate layer by layer, each layer's made in
  # float32 by its matmul, which takes the accumulator in (cuBLAS's C operand) instead of a pass
  # of its own after the backward (mimo_jax/fold.py). Where the layout allows: a compute dtype
  # below float32, the layers unrolled and not pipelined, remat none, no FSDP, gradients not kept
  # per dp rank, no FP8, no LoRA; elsewhere (and false) the accumulators are stacked.
  fold_grads: bool = True


@dataclasses.dataclass
class EvalConfig:
  every: int = 0
  batch: int = 128
  samples: int = 512  # held-out samples evaluated (loss; the digits tasks' per-digit accuracy)
  # Of those, the first `generate` answered greedily and scored by `metric` (mimo_jax/scoring.py)
  # at each eval, logged as eval_<metric> (not the synthetic task); 0 = none.
  generate: int = 0
  metric: str = "exact_match"
  max_new_tokens: int = 32


@dataclasses.dataclass
class CheckpointConfig:
  every: int = 0  # save interval in steps; 0 = only at the end
  keep: int = 3  # checkpoints kept (the newest)
  # Step to resume from: 0 = the newest complete one; an older step moves the newer ones aside.
  restore_step: int = 0
  # Resume although the data differs from the checkpoint's (data fields, or converted data's
  # content): on purpose, e.g. a new data mix; the data position (step x global_batch) carries on.
  allow_data_change: bool = False
  # Where the frozen base of a run with LoRA adapters is now, if the folder its checkpoints name
  # moved (a workdir or its checkpoints folder; checked against the fingerprints they recorded).
  base: str = ""


# The most host-platform devices a process makes (run.cpu_devices): each costs the CPU backend
# memory and threads in every program, and a typo of some thousands would take the host's memory.
MAX_CPU_DEVICES = 1024


@dataclasses.dataclass
class RunConfig:
  workdir: str = "runs/digits"
  log_every: int = 10
  cpu_devices: int = 8
  progress: str = "auto"  # auto (bar on a terminal), bar, lines
  # Memory of one device in GiB for the check before compiling (memory.py); 0 = what the device
  # reports (GPUs; none on CPU, where nothing is checked).
  device_memory_gb: float = 0.0
  # Persistent compilation cache (compile_cache.py): auto = $XDG_CACHE_HOME/mimo_jax/xla or
  # ~/.cache/mimo_jax/xla (or JAX_COMPILATION_CACHE_DIR if set); "" = off; else a directory.
  # $MIMO_JAX_COMPILE_CACHE overrides it.
  compile_cache: str = "auto"
  # Steps whose batches are read ahead so that their shapes' step programs compile in the
  # background before they are met (precompile.py; fused layouts); 0 = compile each when met.
  compile_ahead: int = 8
  compile_threads: int = 2  # threads compiling ahead
  # What a step does when a microbatch's shape is still compiling (fused layouts): wait for it,
  # or pad: run it padded to the smallest compiled shape that holds it (the full shape compiles
  # first, the others once the first step has ended); the same loss, rounded by another program
  # (precompile.py).
  while_compiling: str = "wait"
  # GPUs: XLA times candidate kernels for each matmul when it compiles a step program (the
  # fastest steps; the timing runs on the GPU, behind any step running there); false = its
  # heuristics choose (programs.HEURISTIC_KERNELS): a compile needs no GPU time.
  autotune: bool = True
  # GPUs: a loop whose trip count the data decides (the loss's chunks) runs inside XLA's command
  # buffers (CUDA graphs' conditional nodes, programs.DEVICE_LOOPS) instead of the host reading
  # its condition at every iteration while the device waits; not where a module is pipelined;
  # false = XLA's default.
  device_loops: bool = True
