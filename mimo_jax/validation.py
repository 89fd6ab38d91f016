"""Config validation: every bad value becomes one `ConfigError` that names the field and the fix,
before anything is compiled. `validate` checks the config alone (and the HF directories it names);
`validate_data` checks it against the run's data, before anything is written."""

import dataclasses
import math
import os
import pathlib

from mimo_jax import encoders
from mimo_jax.models.vit import POSITION_RESIZE
from mimo_jax.config import (ACTIVATIONS, DIGITS_VOCAB, REMAT, ROPE_SCALINGS,
                             SHARD_MODES, TASKS, Config, ConfigError, parse_freeze, parse_lr_mult,
                             require, run_source)


def _positive(cfg: object, prefix: str, names: tuple[str, ...]) -> None:
  for name in names:
    value = getattr(cfg, name)
    require(value > 0, f"{prefix}.{name}", f"must be > 0, got {value}.")


# Bytes a row position takes on the host in every text array the loader builds (data/layout.py:
# tokens, targets, loss mask, positions, segment ids, token samples), and per encoder (pos_rl).
TEXT_BYTES, ENCODER_BYTES = 6 * 4, 4


def _finite(obj: object, prefix: str) -> None:
  """Every float field of a config section (nested sections and further encoders' included) is a
  finite number: NaN and infinity pass most range checks and surface as NaN losses."""
  for f in dataclasses.fields(obj):
    value = getattr(obj, f.name)
    if dataclasses.is_dataclass(value):
      _finite(value, f"{prefix}{f.name}.")
    elif isinstance(value, dict):  # model.extra, topology.extra: model.<name>, topology.<name>
      for name, section in value.items():
        if dataclasses.is_dataclass(section):
          _finite(section, f"{prefix}{name}.")
    elif isinstance(value, float):
      require(math.isfinite(value), f"{prefix}{f.name}", f"must be a finite number, got {value}.")


def host_memory() -> int | None:
  """Bytes of memory this machine has (its cgroup's limit where lower), or None if unknown."""
  try:
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  except (ValueError, OSError, AttributeError):
    return None
  try:
    limit = pathlib.Path("/sys/fs/cgroup/memory.max").read_text().strip()
  except OSError:
    limit = ""
  return min(total, int(limit)) if limit.isdigit() else total


def text_rows(cfg: Config) -> tuple[int, int]:
  """Rows of data.seq_len positions the loader holds at least: the eval set (built whole, in
  batches of eval.batch) and one training step (its microbatches' rows)."""
  d = cfg.data
  return (-(-cfg.eval.samples // cfg.eval.batch) * cfg.eval.batch,
          d.microbatches * (d.pack_rows or d.micro_batch))


def _seq_len_fits(cfg: Config) -> None:
  """data.seq_len against host memory: the loader's text arrays alone (a lower bound on what a
  run needs) must fit the machine, or the run dies of a MemoryError after its start-up."""
  memory = host_memory()
  if not memory:
    return
  per_position = TEXT_BYTES + ENCODER_BYTES * len(cfg.topology.names())
  eval_rows, step_rows = text_rows(cfg)
  need = (eval_rows + step_rows) * cfg.data.seq_len * per_position
  gib = 1024**3
  most = memory // ((eval_rows + step_rows) * per_position)
  require(need <= memory, "data.seq_len",
          f"{cfg.data.seq_len} positions a row make the loader's text arrays alone "
          f"{need / gib:,.0f} GiB ({eval_rows} eval rows, {step_rows} a step, {per_position} "
          f"bytes a position), more than this machine's {memory / gib:.0f} GiB; lower it to what "
          f"the longest sample needs (these arrays alone cap it at {most:,}).")


def _variants(cfg: Config) -> None:
  """The architecture variants of model.vision and model.language (Hugging Face towers)."""
  v, lm = cfg.model.vision, cfg.model.language
  for field in ("activation", "projector_activation"):
    require(getattr(v, field) in ACTIVATIONS, f"model.vision.{field}",
            f"must be one of {', '.join(ACTIVATIONS)}, got {getattr(v, field)!r}.")
  require(v.norm_eps > 0, "model.vision.norm_eps", f"must be > 0, got {v.norm_eps}.")
  require(v.position_resize in POSITION_RESIZE, "model.vision.position_resize",
          f"must be one of {', '.join(POSITION_RESIZE)}, got {v.position_resize!r}.")
  require(lm.norm_eps > 0, "model.language.norm_eps", f"must be > 0, got {lm.norm_eps}.")
  try:
    norm = v.pixel_norm()
  except ValueError:
    raise ConfigError(f"config.model.vision.pixel_mean: {v.pixel_mean!r} or pixel_std "
                      f"{v.pixel_std!r} is not a comma-separated list of numbers.") from None
  if norm is not None:
    mean, std = norm
    require(len(mean) == len(std) == v.channels, "model.vision.pixel_mean",
            f"pixel_mean ({v.pixel_mean!r}) and pixel_std ({v.pixel_std!r}) need one value per "
            f"channel ({v.channels}).")
    for field, values in (("pixel_mean", mean), ("pixel_std", std)):
      require(all(math.isfinite(x) for x in values), f"model.vision.{field}",
              f"{getattr(v, field)!r}: values must be finite numbers.")
    require(all(x > 0 for x in std), "model.vision.pixel_std", "values must be > 0.")
  rows = cfg.data.slot_patches or v.positions
  require(not (cfg.model.attention == "cudnn" and rows % 2), "model.attention",
          f"cuDNN's fused attention trains even sequence lengths only, and the vision tower's "
          f"are {rows}; use auto (XLA's attention for the tower, cuDNN's elsewhere) or xla.")
  require(not (v.class_token and cfg.data.slot_patches), "model.vision.class_token",
          "a class token needs one image a slot; set data.slot_patches=0.")
  require(lm.rope_scaling in ROPE_SCALINGS, "model.language.rope_scaling",
          f"must be one of {', '.join(ROPE_SCALINGS)}, got {lm.rope_scaling!r}.")
  for name in ("vision", "language"):
    _init_from(cfg, name)
  if lm.rope_scaling == "llama3":
    _positive(lm, "model.language", ("rope_factor", "rope_low_freq_factor",
                                     "rope_high_freq_factor", "rope_original_positions"))
    require(lm.rope_high_freq_factor > lm.rope_low_freq_factor,
            "model.language.rope_high_freq_factor",
            f"must exceed rope_low_freq_factor ({lm.rope_low_freq_factor}).")


def _init_from(cfg: Config, name: str) -> None:
  """model.<name>.init_from: a readable HF directory whose config.json agrees with the config."""
  section = cfg.model.module(name)
  if not section.init_from or run_source(section.init_from):  # a run: init_from.params
    return
  from mimo_jax import hf  # pylint: disable=import-outside-toplevel
  src = hf.Source.open(section.init_from)
  require(name in src.modules, f"model.{name}.init_from",
          f"{section.init_from} holds a {src.kind} model, which has no {name} module.")
  differ = hf.check_fields(src, name, hf.fields(src, name), section)
  require(not differ, f"model.{name}.init_from",
          f"{section.init_from} does not match the config: {'; '.join(differ)}. Set those "
          "fields as the checkpoint has them.")


def validate(cfg: Config, num_devices: int | None = None) -> None:
  """Raises ConfigError for the first bad field. `num_devices` enables the device-range checks."""
  _finite(cfg, "")
  require(cfg.model.dtype in ("float32", "bfloat16"), "model.dtype",
           f"must be float32 or bfloat16, got {cfg.model.dtype!r}.")
  require(cfg.model.attention in ("auto", "xla", "cudnn"), "model.attention",
           f"must be auto, xla or cudnn, got {cfg.model.attention!r}.")
  v, lm = cfg.model.vision, cfg.model.language
  for name, section in (("vision", v), ("language", lm)):
    require(not section.fp8 or cfg.model.dtype == "bfloat16", f"model.{name}.fp8",
             "FP8 matmuls stand in for bfloat16 ones; set model.dtype=bfloat16 as well.")
  _positive(v, "model.vision", ("image_size", "channels", "patch_size", "dim", "layers", "heads",
                                "mlp_dim", "projector_hidden"))
  _positive(lm, "model.language", ("dim", "layers", "heads", "kv_heads", "mlp_dim"))
  require(cfg.data.task in TASKS, "data.task",
           f"unknown task {cfg.data.task!r}; choose from {', '.join(TASKS)}.")
  if cfg.data.task == "digits":
    require((v.image_size, v.channels) == (8, 1), "model.vision.image_size",
             "the digits task has 8x8 single-channel images; keep image_size=8, channels=1 "
             "(or data.task=synthetic).")
    require(lm.vocab_size in (0, DIGITS_VOCAB), "model.language.vocab_size",
             f"the digits task has a vocabulary of {DIGITS_VOCAB}; leave it 0.")
  else:
    require(lm.vocab_size > DIGITS_VOCAB, "model.language.vocab_size",
             f"{cfg.data.task} data needs a vocabulary (> {DIGITS_VOCAB}), e.g. 32000.")
    _positive(cfg.data, "data", ("text_len",))
    require(cfg.data.text_len_sigma >= 0, "data.text_len_sigma", "must be >= 0.")
  if cfg.data.task == "conversations":
    require(bool(cfg.data.dir), "data.dir",
             "data.task=conversations reads the directory `python -m tools.convert` wrote; set "
             "data.dir to it.")
    require(cfg.data.image_token != -1, "data.image_token",
             "is not set; set the image token id that tools.convert reports (its launch line "
             f"and {cfg.data.dir}/conversations.json's image_token).")
    require(0 <= cfg.data.image_token < lm.vocab_size, "data.image_token",
             f"{cfg.data.image_token} is not a token of the vocabulary of {lm.vocab_size}; set "
             "the image token id that tools.convert reports.")
  else:
    require(cfg.data.image_token == -1, "data.image_token",
             f"applies to data.task=conversations only; the {cfg.data.task} task marks images "
             "with its own <img>.")
  require(v.image_size % v.patch_size == 0, "model.vision.patch_size",
           f"{v.patch_size} must divide image_size {v.image_size}.")
  require(v.downsample > 0 and (v.image_size // v.patch_size) % v.downsample == 0,
           "model.vision.downsample",
           f"{v.downsample} must divide the {v.image_size // v.patch_size} patches a side.")
  require(v.dim % v.heads == 0, "model.vision.heads", f"{v.heads} must divide dim {v.dim}.")
  require(lm.dim % lm.heads == 0, "model.language.heads", f"{lm.heads} must divide dim {lm.dim}.")
  require((lm.dim // lm.heads) % 2 == 0, "model.language.dim",
           "dim / heads must be even for rotary embeddings.")
  require(lm.heads % lm.kv_heads == 0, "model.language.kv_heads",
           f"{lm.kv_heads} must divide heads {lm.heads}.")
  _variants(cfg)

  d = cfg.data
  _positive(d, "data", ("global_batch", "microbatches", "seq_len", "train_samples",
                        "eval_samples"))
  require(d.train_samples >= d.global_batch, "data.train_samples",
           f"{d.train_samples} samples cannot fill one global batch of {d.global_batch}; build "
           "more samples or lower data.global_batch.")
  require(d.max_images >= 1, "data.max_images", "must be >= 1 (samples may still have 0 images).")
  require(d.global_batch % d.microbatches == 0, "data.microbatches",
           f"{d.microbatches} must divide global_batch {d.global_batch}.")
  require(d.image_slots >= 0, "data.image_slots", "must be >= 0 (0 = worst case).")
  require(d.workers >= 0, "data.workers", "must be >= 0.")
  require(d.worker_processes >= 0, "data.worker_processes", "must be >= 0.")
  require(d.reorder in ("none", "balance"), "data.reorder",
           f"must be none or balance, got {d.reorder!r}.")
  require(d.slot_buckets >= 0, "data.slot_buckets", "must be >= 0 (0 = send every slot).")
  require(d.row_buckets >= 0, "data.row_buckets", "must be >= 0 (0 = send every row).")
  require(d.row_buckets == 0 or d.pack_rows > 0, "data.row_buckets",
           "trims packed rows; set data.pack_rows too (without packing every row holds a sample).")
  require(d.microbatch_fill in ("stream", "pack"), "data.microbatch_fill",
           f"must be stream or pack, got {d.microbatch_fill!r}.")
  if d.microbatch_fill == "pack":
    require(d.row_buckets > 0 or d.slot_buckets > 0, "data.microbatch_fill",
            "pack lowers the rows and slots microbatches send, which only data.row_buckets (with "
            "data.pack_rows) and data.slot_buckets trim; set one of them.")
    require(all(t.pp == 1 for t in cfg.topology.modules().values()), "data.microbatch_fill",
            "pack: a pipelined module (pp > 1) takes every microbatch at the step's most rows "
            "and slots, which pack does not lower; use stream.")
  require(d.microbatch_order in ("stream", "pipeline"), "data.microbatch_order",
           f"must be stream or pipeline, got {d.microbatch_order!r}.")
  require(d.image_token_cost >= 0 and d.text_token_cost >= 0, "data.image_token_cost",
           "costs must be >= 0.")
  try:
    probs = d.probs()
  except ValueError:
    raise ConfigError(f"config.data.image_probs: {d.image_probs!r} is not a comma-separated "
                      "list of numbers.") from None
  require(len(probs) == d.max_images + 1, "data.image_probs",
           f"needs max_images + 1 = {d.max_images + 1} probabilities, got {len(probs)}.")
  require(all(p >= 0 for p in probs) and abs(sum(probs) - 1) < 1e-6, "data.image_probs",
           "probabilities must be >= 0 and sum to 1.")
  try:
    sizes = d.sizes(v.image_size)
  except ValueError:
    raise ConfigError(f"config.data.image_sizes: {d.image_sizes!r} is not a comma-separated list "
                      "of sizes S or HxW.") from None
  unit = v.patch_size * v.downsample
  for h, w in sizes:
    require(0 < h <= v.image_size and 0 < w <= v.image_size and h % unit == 0 and w % unit == 0,
             "data.image_sizes", f"{h}x{w}: sides must be multiples of patch_size * downsample = "
             f"{unit} and at most model.vision.image_size = {v.image_size}.")
  require(d.slot_patches or sizes == [(v.image_size, v.image_size)], "data.image_sizes",
           f"{d.image_sizes!r} differs from model.vision.image_size = {v.image_size}; set "
           f"data.slot_patches (e.g. {v.patches}) to pack images of several sizes.")
  require(not d.image_sizes or d.task == "synthetic", "data.image_sizes",
           "applies to data.task=synthetic only (digits are 8x8).")
  require(d.slot_patches >= 0, "data.slot_patches", "must be >= 0 (0 = one image a slot).")
  require(d.slot_patches == 0 or (d.slot_patches >= v.patches and
                                   d.slot_patches % v.downsample**2 == 0), "data.slot_patches",
           f"{d.slot_patches} must hold the largest image ({v.patches} patches) and be a multiple "
           f"of downsample² = {v.downsample**2}.")
  # bos, the image placeholders, ':', one answer word per image and eos; the last is never input.
  min_len = max(d.max_images * (v.tokens_per_image + 1) + 2, 5)
  require(d.seq_len >= min_len, "data.seq_len",
           f"{d.seq_len} cannot hold {d.max_images} images of {v.tokens_per_image} tokens plus "
           f"their answer; use >= {min_len}.")
  _seq_len_fits(cfg)

  o = cfg.optim
  require(o.lr > 0, "optim.lr", f"must be > 0, got {o.lr}.")
  require(o.warmup_steps >= 0, "optim.warmup_steps", "must be >= 0.")
  require(0 <= o.min_lr_ratio <= 1, "optim.min_lr_ratio", "must be in [0, 1].")
  for name in ("b1", "b2"):  # at 1 AdamW's bias correction 1 - b^t divides by zero
    require(0 <= getattr(o, name) < 1, f"optim.{name}",
            f"must be in [0, 1), got {getattr(o, name)} (AdamW's usual: b1=0.9, b2=0.95 to 0.999).")
  require(o.weight_decay >= 0, "optim.weight_decay", f"must be >= 0, got {o.weight_decay}.")
  require(o.clip_norm > 0, "optim.clip_norm", f"must be > 0, got {o.clip_norm}.")
  parse_freeze(cfg)
  for group, mult in parse_lr_mult(cfg).items():
    require(math.isfinite(mult), "optim.lr_mult", f"multiplier for {group} must be finite.")

  require(cfg.train.steps > 0, "train.steps", "must be > 0.")
  require(cfg.eval.every >= 0, "eval.every", "must be >= 0 (0 = only at the end).")
  require(cfg.eval.batch > 0, "eval.batch", "must be > 0.")
  require(cfg.eval.samples > 0, "eval.samples", "must be > 0.")
  # Converted data has the eval split tools.convert made (--eval), which validate_data checks.
  require(d.task == "conversations" or cfg.eval.samples <= d.eval_samples, "eval.samples",
           f"{cfg.eval.samples} exceeds the {d.eval_samples} held-out samples built "
           f"(data.eval_samples); lower eval.samples or raise data.eval_samples.")
  require(cfg.checkpoint.every >= 0, "checkpoint.every", "must be >= 0 (0 = only at the end).")
  require(cfg.checkpoint.keep >= 1, "checkpoint.keep", "must be >= 1.")
  require(cfg.checkpoint.restore_step >= 0, "checkpoint.restore_step",
          "must be >= 0 (0 = the newest step).")
  require(cfg.run.log_every > 0, "run.log_every", "must be > 0.")
  require(cfg.run.cpu_devices > 0, "run.cpu_devices", "must be > 0.")
  require(cfg.run.device_memory_gb >= 0, "run.device_memory_gb",
           "must be >= 0 (0 = what the device reports).")
  require(cfg.run.progress in ("auto", "bar", "lines"), "run.progress",
           f"must be auto, bar or lines, got {cfg.run.progress!r}.")
  require(bool(cfg.run.workdir), "run.workdir", "must not be empty.")
  for name in cfg.topology.encoders:
    require(name in cfg.model.encoders, f"model.{name}",
             f"topology.{name} is set but model.{name} is not; give the encoder a config.")
  for name in cfg.model.encoders:
    require(name in cfg.topology.encoders, f"topology.{name}",
             f"model.{name} is set but topology.{name} is not; place the encoder on devices.")
  for encoder in encoders.of(cfg).values():
    encoder.validate(cfg)
  validate_topology(cfg, num_devices)


def validate_data(cfg: Config) -> None:
  """The config against the run's data, before anything is written: converted data
  (data.task=conversations) must agree with its manifest (conversations.paths), hold an eval split
  of at least eval.samples, and hold no token id the model's vocabulary lacks (each shard's
  metadata sidecar records its records' largest id; data/meta.py). The built-in tasks make their
  data from the config (synthetic ids are drawn below vocab_size), which `validate` checks."""
  if cfg.data.task != "conversations":
    return
  # pylint: disable=import-outside-toplevel
  from mimo_jax.data import conversations, loader
  paths = conversations.paths(cfg)
  n = cfg.eval.samples
  held_out = len(loader.open_shard(paths["eval"]))
  require(held_out > 0, "data.dir",
          f"{paths['eval']} holds no held-out samples (converted with --eval 0) and a run "
          f"evaluates eval.samples={n} of them; convert the data again with --eval {n} (or "
          "more) to hold some out.")
  short = loader.eval_shortfall(cfg, paths["eval"], held_out)
  if short:
    raise ConfigError(short)
  vocab = cfg.model.language.vocab_size
  names = tuple(encoders.of(cfg))
  for path in paths.values():
    top = loader.Records(path, cfg.data.task, names).meta.max_token
    if top is None:  # a sidecar older than the column: conversations.paths checked the manifest
      continue
    worst = int(top.argmax())
    require(int(top[worst]) < vocab, "model.language.vocab_size",
            f"{vocab}, but record {worst} of {path} holds token id {int(top[worst])}, which the "
            f"model's embedding lacks (NaN losses); set it to {int(top[worst]) + 1} or more (the "
            "model's own), or convert the data with the model's tokenizer.")


def validate_backend(cfg: Config, backend: str) -> None:
  """What the platform cannot run: XLA's CPU backend aborts on a bfloat16 all-reduce, which the
  pipeline's stage-to-stage gradients need."""
  pipelined = [n for n, t in cfg.topology.modules().items() if t.pp > 1]
  require(not (backend == "cpu" and cfg.model.dtype == "bfloat16" and pipelined), "model.dtype",
           f"bfloat16 with pipeline stages ({', '.join(pipelined)} pp > 1) does not run on CPU "
           "(XLA's CPU backend cannot all-reduce bfloat16); use float32 on CPU, or a GPU.")


def validate_topology(cfg: Config, num_devices: int | None) -> None:
  """Device ranges and divisibility of every module (topology.py)."""
  d, lm = cfg.data, cfg.model.language
  ranges = {}
  for name, t in cfg.topology.modules().items():
    f = f"topology.{name}"
    require(t.offset >= 0, f"{f}.offset", "must be >= 0.")
    _positive(t, f, ("dp", "tp", "pp", "virtual"))
    require(t.remat in REMAT, f"{f}.remat",
             f"unknown policy {t.remat!r}; choose from {', '.join(REMAT)}.")
    require(t.shard in SHARD_MODES, f"{f}.shard",
             f"unknown mode {t.shard!r}; choose from {', '.join(SHARD_MODES)}.")
    require(t.virtual == 1 or t.pp > 1, f"{f}.virtual",
             f"{t.virtual} virtual stages need pipeline stages; set pp > 1 or virtual=1.")
    layers = cfg.model.module(name).layers
    require(layers % (t.pp * t.virtual) == 0, f"{f}.pp",
             f"model.{name}.layers={layers} must split evenly into pp*virtual = "
             f"{t.pp}*{t.virtual} = {t.pp * t.virtual} chunks.")
    require(t.pp == 1 or d.microbatches >= t.pp, "data.microbatches",
             f"{d.microbatches} microbatches cannot fill {name}'s {t.pp} pipeline stages; use "
             f"at least {t.pp} (more shrink the bubble (pp-1)/(microbatches*virtual+pp-1)).")
    require(d.micro_batch % t.dp == 0, f"{f}.dp",
             f"{t.dp} must divide the microbatch of {d.micro_batch} samples "
             f"(data.global_batch / data.microbatches).")
    require(cfg.eval.batch % t.dp == 0, "eval.batch",
             f"{cfg.eval.batch} must be divisible by {name} dp {t.dp}.")
    if num_devices is not None:
      require(t.offset + t.size <= num_devices, f"{f}.offset",
               f"devices [{t.offset}, {t.offset + t.size}) run past the {num_devices} devices "
               f"available; lower offset or dp*tp*pp.")
    ranges[name] = (t.offset, t.offset + t.size)
  names = list(ranges)
  for i, a in enumerate(names):
    for b in names[i + 1:]:
      (a0, a1), (b0, b1) = ranges[a], ranges[b]
      overlap = a0 < b1 and b0 < a1
      require(not overlap or (a0, a1) == (b0, b1), f"topology.{b}.offset",
               f"devices [{b0}, {b1}) partially overlap {a}'s [{a0}, {a1}); use identical "
               "ranges (colocated) or disjoint ones.")
  vt, lt = cfg.topology.vision, cfg.topology.language
  v = cfg.model.vision
  require(v.heads % vt.tp == 0, "topology.vision.tp",
           f"{vt.tp} must divide model.vision.heads {v.heads}.")
  require(v.mlp_dim % vt.tp == 0, "topology.vision.tp",
           f"{vt.tp} must divide model.vision.mlp_dim {v.mlp_dim}.")
  require(lm.kv_heads % lt.tp == 0, "topology.language.tp",
           f"{lt.tp} must divide model.language.kv_heads {lm.kv_heads}.")
  require(lm.mlp_dim % lt.tp == 0, "topology.language.tp",
           f"{lt.tp} must divide model.language.mlp_dim {lm.mlp_dim}.")
  require(d.pack_rows >= 0, "data.pack_rows", "must be >= 0 (0 = no packing).")
  require(d.pack_rows % lt.dp == 0, "data.pack_rows",
           f"{d.pack_rows} rows must split evenly over language dp {lt.dp}.")
  slots = d.slots()
  require(slots % lt.dp == 0, "data.image_slots",
           f"{slots} slots must split evenly over language dp {lt.dp}.")
  require(slots % vt.dp == 0, "data.image_slots",
           f"{slots} slots must split evenly over vision dp {vt.dp}.")
