"""Typed run configuration.

A config file (`configs/*.py`) returns a `Config`; command-line flags override single fields
(`--config.train.steps=10`). validation.py turns every bad value into one `ConfigError` that names
the field and the fix, before anything is compiled.
"""


import dataclasses
import os

LANGUAGE = "language"  # the one module that is not an encoder (mimo_jax/encoders)
# Activation rematerialisation policies (pipeline.py).
REMAT = ("none", "full", "dots", "dots_attention")
SHARD_MODES = ("none", "optimizer", "full")  # state sharded over dp ranks (sharding.py)
ACTIVATIONS = ("gelu_tanh", "gelu", "quick_gelu")  # models/layers.py
POSITION_RESIZE = ("crop", "bicubic")  # patches.py
ROPE_SCALINGS = ("none", "llama3")  # models/layers.py
TASKS = ("digits", "synthetic", "conversations")
DIGITS_VOCAB = 17  # data/tokenizer.py


class ConfigError(ValueError):
  """A bad configuration value; the message names the field and the fix."""


@dataclasses.dataclass
class VisionConfig:
  image_size: int = 8
  channels: int = 1
  patch_size: int = 4
  dim: int = 64
  layers: int = 2
  heads: int = 4
  mlp_dim: int = 128
  projector_hidden: int = 128
  # Pixel shuffle before the projector: each s x s block of patches becomes one image token of
  # s*s*dim features (InternVL's token compression); 1 = one token a patch.
  downsample: int = 1
  # Tower variants (tools.hf import sets them from an HF config.json). The defaults are SigLIP's
  # layout; CLIP has a class token, no patch-embedding bias, a LayerNorm before the blocks and
  # quick_gelu. The class token is dropped from the features the projector sees.
  class_token: bool = False
  patch_bias: bool = True
  pre_norm: bool = False
  # LayerNorm on the last block's output (SigLIP's post_layernorm); LLaVA reads hidden states
  # without it.
  final_norm: bool = True
  norm_eps: float = 1e-6
  activation: str = "gelu_tanh"  # of the ViT's MLP: gelu_tanh, gelu (exact) or quick_gelu
  projector_activation: str = "gelu_tanh"  # of the projector's MLP (LLaVA: gelu)
  # Per-channel mean and std the [0, 1] pixels are normalised with on device, comma-separated
  # ("" = none); e.g. SigLIP's "0.5,0.5,0.5".
  pixel_mean: str = ""
  pixel_std: str = ""
  # Positions of an image whose patch grid differs from the table's (image_size / patch_size a
  # side; dynamic resolution): "crop" takes the table's top-left part, "bicubic" resizes the table
  # to the image's grid as Hugging Face's towers do with interpolate_pos_encoding (patches.py).
  position_resize: str = "crop"
  # An HF directory (a SigLIP or CLIP tower, or a LLaVA checkpoint: tower and projector) whose
  # weights a run starts from instead of the seed's, or a mimo_jax run, WORKDIR[:STEP] (this
  # module's parameters of that step); not read on resume. The fields above must match its
  # config.json (mimo_jax/hf/fields.py derives them; a contradiction is an error) or the run's.
  init_from: str = ""
  # The blocks' linear layers (attention and MLP) as FP8 matmuls with current scaling
  # (mimo_jax/models/fp8.py); needs model.dtype=bfloat16.
  fp8: bool = False

  @property
  def patches(self) -> int:
    return (self.image_size // self.patch_size) ** 2

  @property
  def positions(self) -> int:
    """Rows of the position table: the patches and the class token's."""
    return self.patches + int(self.class_token)

  def pixel_norm(self) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
    """(mean, std) per channel, or None."""
    if not self.pixel_mean and not self.pixel_std:
      return None
    return (tuple(float(x) for x in self.pixel_mean.split(",")),
            tuple(float(x) for x in self.pixel_std.split(",")))

  @property
  def tokens_per_image(self) -> int:
    """Image tokens the language model receives per image (after `downsample`)."""
    return self.patches // self.downsample**2


@dataclasses.dataclass
class LanguageConfig:
  dim: int = 128
  layers: int = 2
  heads: int = 4
  kv_heads: int = 2
  mlp_dim: int = 256
  rope_theta: float = 10_000.0
  vocab_size: int = 0  # 0 = the task's tokenizer (17 for digits); synthetic data needs it set
  # Architecture variants (tools.hf import sets them from an HF config.json).
  norm_eps: float = 1e-6  # RMSNorm epsilon (Llama-3 and Qwen2: 1e-5 or 1e-6 as configured)
  qkv_bias: bool = False  # biases on the q, k, v projections, none on o (Qwen2)
  tie_embeddings: bool = False  # the output head is the embedding table, transposed
  # RoPE frequency scaling: none, or llama3 (Llama-3.1 and later) with the four fields below.
  rope_scaling: str = "none"
  rope_factor: float = 8.0
  rope_low_freq_factor: float = 1.0
  rope_high_freq_factor: float = 4.0
  rope_original_positions: int = 8192
  # An HF directory (Llama-3.x or Qwen2 language model, or a LLaVA checkpoint) whose weights a run
  # starts from instead of the seed's, or a mimo_jax run, WORKDIR[:STEP]; not read on resume. The
  # fields above must match its config.json or the run's.
  init_from: str = ""
  # The blocks' linear layers (attention and MLP) as FP8 matmuls (mimo_jax/models/fp8.py); needs
  # model.dtype=bfloat16.
  fp8: bool = False

  def rope_scaling_params(self) -> tuple[float, float, float, int] | None:
    """(factor, low_freq_factor, high_freq_factor, original_positions), or None."""
    if self.rope_scaling == "none":
      return None
    return (self.rope_factor, self.rope_low_freq_factor, self.rope_high_freq_factor,
            self.rope_original_positions)


@dataclasses.dataclass
class ModelConfig:
  dtype: str = "float32"
  # Attention kernel: xla, cudnn (fused flash attention, GPUs, bfloat16), or auto (cudnn where it
  # runs, else xla). Packed rows (data.pack_rows, data.slot_patches) use cuDNN's packed attention
  # with cudnn (Hopper GPUs and later), XLA's masked attention with xla.
  attention: str = "auto"
  vision: VisionConfig = dataclasses.field(default_factory=VisionConfig)
  language: LanguageConfig = dataclasses.field(default_factory=LanguageConfig)
  # Configs of further registered encoders by name (mimo_jax/encoders), beside `vision`.
  extra: dict = dataclasses.field(default_factory=dict)
  # A mimo_jax run to start from, WORKDIR[:STEP] (default its newest step): every module's
  # parameters, with a fresh optimizer at step 0 (a new training stage: its own data and
  # schedule). Its model config must match. A module's own init_from naming a run takes
  # precedence; one naming an HF directory (as an import's config carries) gives way to it.
  init_from: str = ""

  def module(self, name: str):
    """`model.<name>`: a module's config section."""
    return self.extra[name] if name in self.extra else getattr(self, name)


@dataclasses.dataclass
class ModuleTopology:
  offset: int = 0  # first device of jax.devices() this module uses
  dp: int = 1  # data-parallel ranks
  tp: int = 1  # tensor-parallel ranks (Megatron column/row split)
  pp: int = 1  # pipeline stages: the module's layers split over pp consecutive groups of dp*tp
  # Chunks of layers per pipeline stage: 1 = GPipe, > 1 = circular schedule (a bubble v times
  # smaller, v times more stage-to-stage sends).
  virtual: int = 1
  # What each layer's backward keeps: none (everything), full (its input only, recompute the
  # rest), dots (matmul outputs), dots_attention (matmul outputs and cuDNN attention's outputs).
  remat: str = "none"
  # State sharded over the module's dp ranks: none (replicated), optimizer (ZeRO-1: optimizer
  # state and summed gradients), full (FSDP: parameters too, each layer gathered when it runs).
  shard: str = "none"
  # The layer loop as straight-line code (true) or a rolled loop (false): unrolled saves the copies
  # a rolled loop makes to stack each layer's residuals and gradients, but XLA schedules it
  # differently; on an H200 it sped up the 1.1 B decoder and slowed ViT-L (docs/benchmarks.md).
  unroll: bool = True

  @property
  def size(self) -> int:
    return self.dp * self.tp * self.pp


@dataclasses.dataclass
class TopologyConfig:
  vision: ModuleTopology = dataclasses.field(default_factory=ModuleTopology)
  language: ModuleTopology = dataclasses.field(default_factory=ModuleTopology)
  # Further registered encoders by name (mimo_jax/encoders), each with its own mesh.
  extra: dict = dataclasses.field(default_factory=dict)

  def encoders(self) -> list[str]:
    """The run's encoders in dispatch order: `vision`, then the others as added."""
    return ["vision", *self.extra]

  def modules(self) -> dict[str, ModuleTopology]:
    """Every module's topology: encoders first, the language model last."""
    return {name: self.module(name) for name in [*self.encoders(), LANGUAGE]}

  def module(self, name: str) -> ModuleTopology:
    return self.extra[name] if name in self.extra else getattr(self, name)


@dataclasses.dataclass
class DataConfig:
  # digits: the digits-captioning task (data/digits.py); synthetic: random VLM-shaped samples for
  # benchmarks (data/synthetic.py), images of model.vision.image_size, text ids < vocab_size;
  # conversations: LLaVA-style data converted by tools.convert into data.dir
  # (data/conversations.py).
  task: str = "digits"
  seed: int = 0
  global_batch: int = 32
  microbatches: int = 2
  seq_len: int = 24
  max_images: int = 3
  # Image slots per microbatch, split evenly over the language dp ranks; 0 = global_batch /
  # microbatches * max_images (never overflows). Fewer slots waste less encoder compute, but a
  # microbatch whose images do not fit its rank's slots is an error.
  image_slots: int = 0
  # Probability of a sample having 0, 1, ..., max_images images (comma-separated).
  image_probs: str = "0.1,0.3,0.3,0.3"
  train_samples: int = 20_000
  eval_samples: int = 1_000  # samples built from held-out images
  dir: str = ""  # where the digits ArrayRecord shards are built; "" = ~/.cache/mimo_jax/digits
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
  # Image slots a microbatch sends to the encoder: 0 = all of image_slots; k > 0 = only those its
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
  # "" = model.vision.image_size square. Several sizes need data.slot_patches > 0.
  image_sizes: str = ""
  # Dynamic resolution: each image slot is a row of this many ViT patches into which images of any
  # size (sides multiples of patch_size * downsample, at most image_size) are packed, attending
  # only within their image (cuDNN's packed attention on GPUs with model.attention=cudnn, else
  # XLA's masked attention); 0 = one image of image_size a slot.
  slot_patches: int = 0
  # The token id of an image in the samples' token ids (conversations: the tokenizer's image
  # token, as tools.convert reports it); -1 = the built-in tasks' <img> (id 3).
  image_token: int = -1

  @property
  def placeholder(self) -> int:
    """The image placeholder's token id."""
    return self.image_token if self.image_token >= 0 else 3

  @property
  def micro_batch(self) -> int:
    return self.global_batch // self.microbatches

  def slots(self) -> int:
    return self.image_slots or self.micro_batch * self.max_images

  def probs(self) -> list[float]:
    return [float(p) for p in self.image_probs.split(",")]

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
  # Comma-separated parameter groups to freeze: vision, vision_projector, language.
  freeze: str = ""
  # Comma-separated group=multiplier pairs scaling the learning rate, e.g. "vision=0.1".
  lr_mult: str = ""


@dataclasses.dataclass
class TrainConfig:
  steps: int = 600
  seed: int = 0


@dataclasses.dataclass
class EvalConfig:
  every: int = 0
  batch: int = 128
  samples: int = 512  # held-out samples evaluated (loss and greedy per-digit accuracy)


@dataclasses.dataclass
class CheckpointConfig:
  every: int = 0  # save interval in steps; 0 = only at the end
  keep: int = 3  # checkpoints kept (the newest)
  # Step to resume from: 0 = the newest complete one; an older step moves the newer ones aside.
  restore_step: int = 0
  # Resume although the data differs from the checkpoint's (data fields, or converted data's
  # content): on purpose, e.g. a new data mix; the data position (step x global_batch) carries on.
  allow_data_change: bool = False


@dataclasses.dataclass
class RunConfig:
  workdir: str = "runs/digits"
  log_every: int = 10
  cpu_devices: int = 8
  progress: str = "auto"  # auto (bar on a terminal), bar, lines
  # Memory of one device in GiB for the check before compiling (memory.py); 0 = what the device
  # reports (GPUs; none on CPU, where nothing is checked).
  device_memory_gb: float = 0.0


@dataclasses.dataclass
class Config:
  model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
  topology: TopologyConfig = dataclasses.field(default_factory=TopologyConfig)
  data: DataConfig = dataclasses.field(default_factory=DataConfig)
  optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
  train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
  eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
  checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
  run: RunConfig = dataclasses.field(default_factory=RunConfig)


def slot_tokens(cfg: Config) -> int:
  """Image tokens an image slot yields: one image's, or a packed slot's (data.slot_patches)."""
  v = cfg.model.vision
  return cfg.data.slot_patches // v.downsample**2 if cfg.data.slot_patches else v.tokens_per_image


def slot_images(cfg: Config) -> int:
  """Most images a packed image slot holds (data.slot_patches): as many of the smallest of
  data.image_sizes as fit; 0 without packed slots. The layout never packs more, so attention can
  be sized for it (models/layers.packed_attention)."""
  d, v = cfg.data, cfg.model.vision
  if not d.slot_patches:
    return 0
  smallest = min(h * w for h, w in d.sizes(v.image_size)) // v.patch_size**2
  return max(d.slot_patches // smallest, 1)


def row_segments(cfg: Config) -> int:
  """Most runs of equal segment ids in a packed language row: every sample of a microbatch and
  the padding; 0 without packing (data.pack_rows)."""
  return cfg.data.micro_batch + 1 if cfg.data.pack_rows else 0


PARAM_GROUPS = ("vision", "vision_projector", "language")


def from_dict(values: dict, cls=None, prefix: str = "config."):
  """A config from `dataclasses.asdict` output (a checkpoint's metadata, a workdir's
  config.json); fields it lacks keep their defaults, fields the dataclasses lack are errors."""
  cls = cls or Config
  obj = cls()
  known = {f.name: f for f in dataclasses.fields(cls)}
  for name, value in values.items():
    if name not in known:
      raise ConfigError(f"{prefix}{name}: unknown field (written by another mimo_jax version?).")
    current = getattr(obj, name)
    if dataclasses.is_dataclass(current) and isinstance(value, dict):
      value = from_dict(value, type(current), f"{prefix}{name}.")
    elif isinstance(current, dict) and value:
      raise ConfigError(f"{prefix}{name}: further encoders cannot be read back from a dict; set "
                        "them in a config file.")
    setattr(obj, name, value)
  return obj


def require(ok: bool, field: str, message: str) -> None:
  """Raises ConfigError naming `field` (config.<field>) unless `ok`."""
  if not ok:
    raise ConfigError(f"config.{field}: {message}")


def parse_freeze(spec: str) -> tuple[str, ...]:
  groups = tuple(g.strip() for g in spec.split(",") if g.strip())
  for g in groups:
    require(g in PARAM_GROUPS, "optim.freeze",
             f"unknown parameter group {g!r}; choose from {', '.join(PARAM_GROUPS)}.")
  return groups


def parse_lr_mult(spec: str) -> dict[str, float]:
  out = {}
  for item in (s.strip() for s in spec.split(",") if s.strip()):
    group, sep, value = item.partition("=")
    require(bool(sep), "optim.lr_mult", f"{item!r} is not group=multiplier, e.g. vision=0.1.")
    require(group in PARAM_GROUPS, "optim.lr_mult",
             f"unknown parameter group {group!r}; choose from {', '.join(PARAM_GROUPS)}.")
    try:
      out[group] = float(value)
    except ValueError:
      raise ConfigError(f"config.optim.lr_mult: {value!r} for {group} is not a number.") from None
    require(out[group] >= 0, "optim.lr_mult", f"multiplier for {group} must be >= 0.")
  return out


def run_source(spec: str) -> tuple[str, int | None] | None:
  """An `init_from` that names a mimo_jax run, `WORKDIR[:STEP]` (a workdir or its checkpoints/
  folder): (that checkpoints folder, STEP or None for the newest); None for anything else (an HF
  directory, or "")."""
  if not spec:
    return None
  path, step = spec, None
  head, sep, tail = spec.rpartition(":")
  if sep and head and tail.isdigit():
    path, step = head, int(tail)
  path = os.path.abspath(os.path.expanduser(path))
  if os.path.isdir(os.path.join(path, "checkpoints")):
    return os.path.join(path, "checkpoints"), step
  if os.path.basename(path) == "checkpoints" and os.path.isdir(path):
    return path, step
  return None


def set_layout(cfg: Config, layout: str) -> None:
  """Sets topology fields from `module=offset/dp/tp[/pp[/virtual]],...` (as tests and benchmark
  tools write layouts), e.g. `vision=0/4/1,language=4/2/2`."""
  for item in (s.strip() for s in layout.split(",") if s.strip()):
    name, _, spec = item.partition("=")
    modules = cfg.topology.modules()
    require(name in modules, "topology",
             f"{item!r}: unknown module {name!r}; modules: {', '.join(modules)}.")
    try:
      values = [int(v) for v in spec.split("/")]
    except ValueError:
      values = []
    require(3 <= len(values) <= 5, f"topology.{name}",
             f"{item!r} is not offset/dp/tp[/pp[/virtual]].")
    t = cfg.topology.module(name)
    t.offset, t.dp, t.tp = values[:3]
    t.pp, t.virtual = (values[3:] + [1, 1])[:2]
