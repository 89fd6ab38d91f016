"""Typed run configuration and its validation.

A config file (`configs/*.py`) returns a `Config`; command-line flags override single fields
(`--config.train.steps=10`). `validate()` turns every bad value into one `ConfigError` that names
the field and the fix, before anything is compiled.
"""


import dataclasses

MODULE_KINDS = ("vision", "language")  # encoders first, the language model last
REMAT = ("none", "full", "dots")
TASKS = ("digits", "synthetic")
DIGITS_VOCAB = 17  # data/tokenizer.py  # activation rematerialisation policies (pipeline.py)


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

  @property
  def patches(self) -> int:
    return (self.image_size // self.patch_size) ** 2

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


@dataclasses.dataclass
class ModelConfig:
  dtype: str = "float32"
  # Attention kernel: xla, cudnn (fused flash attention, GPUs, bfloat16), or auto (cudnn where it
  # runs, else xla). Packed rows (data.pack_rows, data.slot_patches) use cuDNN's packed attention
  # with cudnn (Hopper GPUs and later), XLA's masked attention with xla.
  attention: str = "auto"
  vision: VisionConfig = dataclasses.field(default_factory=VisionConfig)
  language: LanguageConfig = dataclasses.field(default_factory=LanguageConfig)


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
  # rest), dots (matmul outputs).
  remat: str = "none"
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

  def modules(self) -> dict[str, ModuleTopology]:
    return {name: getattr(self, name) for name in MODULE_KINDS}


@dataclasses.dataclass
class DataConfig:
  # digits: the digits-captioning task (DESIGN §4); synthetic: random VLM-shaped samples for
  # benchmarks (data/synthetic.py), images of model.vision.image_size, text ids < vocab_size.
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

  @property
  def pixel_max(self) -> float:
    """The largest pixel value (images travel as uint8 and are scaled to [0, 1] on device)."""
    return 16.0 if self.task == "digits" else 255.0

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


@dataclasses.dataclass
class RunConfig:
  workdir: str = "runs/digits"
  log_every: int = 10
  cpu_devices: int = 8
  progress: str = "auto"  # auto (bar on a terminal), bar, lines


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


def _require(ok: bool, field: str, message: str) -> None:
  if not ok:
    raise ConfigError(f"config.{field}: {message}")


def _positive(cfg: object, prefix: str, names: tuple[str, ...]) -> None:
  for name in names:
    value = getattr(cfg, name)
    _require(value > 0, f"{prefix}.{name}", f"must be > 0, got {value}.")


def parse_freeze(spec: str) -> tuple[str, ...]:
  groups = tuple(g.strip() for g in spec.split(",") if g.strip())
  for g in groups:
    _require(g in PARAM_GROUPS, "optim.freeze",
             f"unknown parameter group {g!r}; choose from {', '.join(PARAM_GROUPS)}.")
  return groups


def parse_lr_mult(spec: str) -> dict[str, float]:
  out = {}
  for item in (s.strip() for s in spec.split(",") if s.strip()):
    group, sep, value = item.partition("=")
    _require(bool(sep), "optim.lr_mult", f"{item!r} is not group=multiplier, e.g. vision=0.1.")
    _require(group in PARAM_GROUPS, "optim.lr_mult",
             f"unknown parameter group {group!r}; choose from {', '.join(PARAM_GROUPS)}.")
    try:
      out[group] = float(value)
    except ValueError:
      raise ConfigError(f"config.optim.lr_mult: {value!r} for {group} is not a number.") from None
    _require(out[group] >= 0, "optim.lr_mult", f"multiplier for {group} must be >= 0.")
  return out


def set_layout(cfg: Config, layout: str) -> None:
  """Sets topology fields from `module=offset/dp/tp[/pp[/virtual]],...` (as tests and benchmark
  tools write layouts), e.g. `vision=0/4/1,language=4/2/2`."""
  for item in (s.strip() for s in layout.split(",") if s.strip()):
    name, _, spec = item.partition("=")
    _require(name in MODULE_KINDS, "topology", f"{item!r}: unknown module {name!r}.")
    try:
      values = [int(v) for v in spec.split("/")]
    except ValueError:
      values = []
    _require(3 <= len(values) <= 5, f"topology.{name}",
             f"{item!r} is not offset/dp/tp[/pp[/virtual]].")
    t = getattr(cfg.topology, name)
    t.offset, t.dp, t.tp = values[:3]
    t.pp, t.virtual = (values[3:] + [1, 1])[:2]


def validate(cfg: Config, num_devices: int | None = None) -> None:
  """Raises ConfigError for the first bad field. `num_devices` enables the device-range checks."""
  _require(cfg.model.dtype in ("float32", "bfloat16"), "model.dtype",
           f"must be float32 or bfloat16, got {cfg.model.dtype!r}.")
  _require(cfg.model.attention in ("auto", "xla", "cudnn"), "model.attention",
           f"must be auto, xla or cudnn, got {cfg.model.attention!r}.")
  v, lm = cfg.model.vision, cfg.model.language
  _positive(v, "model.vision", ("image_size", "channels", "patch_size", "dim", "layers", "heads",
                                "mlp_dim", "projector_hidden"))
  _positive(lm, "model.language", ("dim", "layers", "heads", "kv_heads", "mlp_dim"))
  _require(cfg.data.task in TASKS, "data.task",
           f"unknown task {cfg.data.task!r}; choose from {', '.join(TASKS)}.")
  if cfg.data.task == "digits":
    _require((v.image_size, v.channels) == (8, 1), "model.vision.image_size",
             "the digits task has 8x8 single-channel images; keep image_size=8, channels=1 "
             "(or data.task=synthetic).")
    _require(lm.vocab_size in (0, DIGITS_VOCAB), "model.language.vocab_size",
             f"the digits task has a vocabulary of {DIGITS_VOCAB}; leave it 0.")
  else:
    _require(lm.vocab_size > DIGITS_VOCAB, "model.language.vocab_size",
             f"synthetic data needs a vocabulary (> {DIGITS_VOCAB}), e.g. 32000.")
    _positive(cfg.data, "data", ("text_len",))
    _require(cfg.data.text_len_sigma >= 0, "data.text_len_sigma", "must be >= 0.")
  _require(v.image_size % v.patch_size == 0, "model.vision.patch_size",
           f"{v.patch_size} must divide image_size {v.image_size}.")
  _require(v.downsample > 0 and (v.image_size // v.patch_size) % v.downsample == 0,
           "model.vision.downsample",
           f"{v.downsample} must divide the {v.image_size // v.patch_size} patches a side.")
  _require(v.dim % v.heads == 0, "model.vision.heads", f"{v.heads} must divide dim {v.dim}.")
  _require(lm.dim % lm.heads == 0, "model.language.heads", f"{lm.heads} must divide dim {lm.dim}.")
  _require((lm.dim // lm.heads) % 2 == 0, "model.language.dim",
           "dim / heads must be even for rotary embeddings.")
  _require(lm.heads % lm.kv_heads == 0, "model.language.kv_heads",
           f"{lm.kv_heads} must divide heads {lm.heads}.")

  d = cfg.data
  _positive(d, "data", ("global_batch", "microbatches", "seq_len", "train_samples",
                        "eval_samples"))
  _require(d.train_samples >= d.global_batch, "data.train_samples",
           f"{d.train_samples} samples cannot fill one global batch of {d.global_batch}; build "
           "more samples or lower data.global_batch.")
  _require(d.max_images >= 1, "data.max_images", "must be >= 1 (samples may still have 0 images).")
  _require(d.global_batch % d.microbatches == 0, "data.microbatches",
           f"{d.microbatches} must divide global_batch {d.global_batch}.")
  _require(d.image_slots >= 0, "data.image_slots", "must be >= 0 (0 = worst case).")
  _require(d.workers >= 0, "data.workers", "must be >= 0.")
  _require(d.worker_processes >= 0, "data.worker_processes", "must be >= 0.")
  _require(d.reorder in ("none", "balance"), "data.reorder",
           f"must be none or balance, got {d.reorder!r}.")
  _require(d.slot_buckets >= 0, "data.slot_buckets", "must be >= 0 (0 = send every slot).")
  _require(d.row_buckets >= 0, "data.row_buckets", "must be >= 0 (0 = send every row).")
  _require(d.row_buckets == 0 or d.pack_rows > 0, "data.row_buckets",
           "trims packed rows; set data.pack_rows too (without packing every row holds a sample).")
  _require(d.microbatch_order in ("stream", "pipeline"), "data.microbatch_order",
           f"must be stream or pipeline, got {d.microbatch_order!r}.")
  _require(d.image_token_cost >= 0 and d.text_token_cost >= 0, "data.image_token_cost",
           "costs must be >= 0.")
  try:
    probs = d.probs()
  except ValueError:
    raise ConfigError(f"config.data.image_probs: {d.image_probs!r} is not a comma-separated "
                      "list of numbers.") from None
  _require(len(probs) == d.max_images + 1, "data.image_probs",
           f"needs max_images + 1 = {d.max_images + 1} probabilities, got {len(probs)}.")
  _require(all(p >= 0 for p in probs) and abs(sum(probs) - 1) < 1e-6, "data.image_probs",
           "probabilities must be >= 0 and sum to 1.")
  try:
    sizes = d.sizes(v.image_size)
  except ValueError:
    raise ConfigError(f"config.data.image_sizes: {d.image_sizes!r} is not a comma-separated list "
                      "of sizes S or HxW.") from None
  unit = v.patch_size * v.downsample
  for h, w in sizes:
    _require(0 < h <= v.image_size and 0 < w <= v.image_size and h % unit == 0 and w % unit == 0,
             "data.image_sizes", f"{h}x{w}: sides must be multiples of patch_size * downsample = "
             f"{unit} and at most model.vision.image_size = {v.image_size}.")
  _require(d.slot_patches or sizes == [(v.image_size, v.image_size)], "data.image_sizes",
           f"{d.image_sizes!r} differs from model.vision.image_size = {v.image_size}; set "
           f"data.slot_patches (e.g. {v.patches}) to pack images of several sizes.")
  _require(not d.image_sizes or d.task == "synthetic", "data.image_sizes",
           "applies to data.task=synthetic only (digits are 8x8).")
  _require(d.slot_patches >= 0, "data.slot_patches", "must be >= 0 (0 = one image a slot).")
  _require(d.slot_patches == 0 or (d.slot_patches >= v.patches and
                                   d.slot_patches % v.downsample**2 == 0), "data.slot_patches",
           f"{d.slot_patches} must hold the largest image ({v.patches} patches) and be a multiple "
           f"of downsample² = {v.downsample**2}.")
  # bos, the image placeholders, ':', one answer word per image and eos; the last is never input.
  min_len = max(d.max_images * (v.tokens_per_image + 1) + 2, 5)
  _require(d.seq_len >= min_len, "data.seq_len",
           f"{d.seq_len} cannot hold {d.max_images} images of {v.tokens_per_image} tokens plus "
           f"their answer; use >= {min_len}.")

  o = cfg.optim
  _require(o.lr > 0, "optim.lr", "must be > 0.")
  _require(o.warmup_steps >= 0, "optim.warmup_steps", "must be >= 0.")
  _require(0 <= o.min_lr_ratio <= 1, "optim.min_lr_ratio", "must be in [0, 1].")
  _require(o.clip_norm > 0, "optim.clip_norm", "must be > 0.")
  parse_freeze(o.freeze)
  parse_lr_mult(o.lr_mult)

  _require(cfg.train.steps > 0, "train.steps", "must be > 0.")
  _require(cfg.eval.every >= 0, "eval.every", "must be >= 0 (0 = only at the end).")
  _require(cfg.eval.batch > 0, "eval.batch", "must be > 0.")
  _require(cfg.eval.samples > 0, "eval.samples", "must be > 0.")
  _require(cfg.eval.samples <= d.eval_samples, "eval.samples",
           f"{cfg.eval.samples} exceeds the {d.eval_samples} held-out samples built "
           "(data.eval_samples).")
  _require(cfg.checkpoint.every >= 0, "checkpoint.every", "must be >= 0 (0 = only at the end).")
  _require(cfg.checkpoint.keep >= 1, "checkpoint.keep", "must be >= 1.")
  _require(cfg.run.log_every > 0, "run.log_every", "must be > 0.")
  _require(cfg.run.cpu_devices > 0, "run.cpu_devices", "must be > 0.")
  _require(cfg.run.progress in ("auto", "bar", "lines"), "run.progress",
           f"must be auto, bar or lines, got {cfg.run.progress!r}.")
  _require(bool(cfg.run.workdir), "run.workdir", "must not be empty.")
  validate_topology(cfg, num_devices)


def validate_backend(cfg: Config, backend: str) -> None:
  """What the platform cannot run: XLA's CPU backend aborts on a bfloat16 all-reduce, which the
  pipeline's stage-to-stage gradients need."""
  pipelined = [n for n, t in cfg.topology.modules().items() if t.pp > 1]
  _require(not (backend == "cpu" and cfg.model.dtype == "bfloat16" and pipelined), "model.dtype",
           f"bfloat16 with pipeline stages ({', '.join(pipelined)} pp > 1) does not run on CPU "
           "(XLA's CPU backend cannot all-reduce bfloat16); use float32 on CPU, or a GPU.")


def validate_topology(cfg: Config, num_devices: int | None) -> None:
  """Device ranges and divisibility of every module; see DESIGN §2.2."""
  d, lm = cfg.data, cfg.model.language
  ranges = {}
  for name, t in cfg.topology.modules().items():
    f = f"topology.{name}"
    _require(t.offset >= 0, f"{f}.offset", "must be >= 0.")
    _positive(t, f, ("dp", "tp", "pp", "virtual"))
    _require(t.remat in REMAT, f"{f}.remat",
             f"unknown policy {t.remat!r}; choose from {', '.join(REMAT)}.")
    _require(t.virtual == 1 or t.pp > 1, f"{f}.virtual",
             f"{t.virtual} virtual stages need pipeline stages; set pp > 1 or virtual=1.")
    layers = getattr(cfg.model, name).layers
    _require(layers % (t.pp * t.virtual) == 0, f"{f}.pp",
             f"model.{name}.layers={layers} must split evenly into pp*virtual = "
             f"{t.pp}*{t.virtual} = {t.pp * t.virtual} chunks.")
    _require(t.pp == 1 or d.microbatches >= t.pp, "data.microbatches",
             f"{d.microbatches} microbatches cannot fill {name}'s {t.pp} pipeline stages; use "
             f"at least {t.pp} (more shrink the bubble (pp-1)/(microbatches*virtual+pp-1)).")
    _require(d.micro_batch % t.dp == 0, f"{f}.dp",
             f"{t.dp} must divide the microbatch of {d.micro_batch} samples "
             f"(data.global_batch / data.microbatches).")
    _require(cfg.eval.batch % t.dp == 0, "eval.batch",
             f"{cfg.eval.batch} must be divisible by {name} dp {t.dp}.")
    if num_devices is not None:
      _require(t.offset + t.size <= num_devices, f"{f}.offset",
               f"devices [{t.offset}, {t.offset + t.size}) run past the {num_devices} devices "
               f"available; lower offset or dp*tp*pp.")
    ranges[name] = (t.offset, t.offset + t.size)
  names = list(ranges)
  for i, a in enumerate(names):
    for b in names[i + 1:]:
      (a0, a1), (b0, b1) = ranges[a], ranges[b]
      overlap = a0 < b1 and b0 < a1
      _require(not overlap or (a0, a1) == (b0, b1), f"topology.{b}.offset",
               f"devices [{b0}, {b1}) partially overlap {a}'s [{a0}, {a1}); use identical "
               "ranges (colocated) or disjoint ones.")
  vt, lt = cfg.topology.vision, cfg.topology.language
  v = cfg.model.vision
  _require(v.heads % vt.tp == 0, "topology.vision.tp",
           f"{vt.tp} must divide model.vision.heads {v.heads}.")
  _require(v.mlp_dim % vt.tp == 0, "topology.vision.tp",
           f"{vt.tp} must divide model.vision.mlp_dim {v.mlp_dim}.")
  _require(lm.kv_heads % lt.tp == 0, "topology.language.tp",
           f"{lt.tp} must divide model.language.kv_heads {lm.kv_heads}.")
  _require(lm.mlp_dim % lt.tp == 0, "topology.language.tp",
           f"{lt.tp} must divide model.language.mlp_dim {lm.mlp_dim}.")
  _require(d.pack_rows >= 0, "data.pack_rows", "must be >= 0 (0 = no packing).")
  _require(d.pack_rows % lt.dp == 0, "data.pack_rows",
           f"{d.pack_rows} rows must split evenly over language dp {lt.dp}.")
  slots = d.slots()
  _require(slots % lt.dp == 0, "data.image_slots",
           f"{slots} slots must split evenly over language dp {lt.dp}.")
  _require(slots % vt.dp == 0, "data.image_slots",
           f"{slots} slots must split evenly over vision dp {vt.dp}.")
