"""Config validation: every bad value becomes one `ConfigError` that names the field and the fix,
before anything is compiled. `validate` checks the config alone (and the HF directories it names);
`validation_data.validate_data` checks it against the run's data, before anything is written."""

import dataclasses
import math
import os
import pathlib

from mimo_jax import encoders, hf, scoring
from mimo_jax.config import (LANGUAGE, ROPE_SCALINGS, Config, ConfigError, lora_of, parse_freeze,
                             parse_lr_mult, positive, require, run_source,
                             step_not_a_number)
from mimo_jax.config_run import AV_DIGITS_VOCAB, DIGITS_VOCAB, MAX_CPU_DEVICES, TASKS
from mimo_jax.models import norm_kernels
from mimo_jax.models.vit import ViTConfig
from mimo_jax.validation_lora import validate_adapters
from mimo_jax.validation_topology import validate_topology
from mimo_jax.words import count


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
    elif isinstance(value, dict):  # model.encoders, topology.encoders
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


def _language(cfg: Config) -> None:
  """model.language: sizes, heads, and the architecture variants of Hugging Face models."""
  lm = cfg.model.language
  positive(lm, "model.language", ("dim", "layers", "heads", "kv_heads", "mlp_dim"))
  require(lm.dim % lm.heads == 0, "model.language.heads", f"{lm.heads} must divide dim {lm.dim}.")
  require((lm.dim // lm.heads) % 2 == 0, "model.language.dim",
          "dim / heads must be even for rotary embeddings.")
  require(lm.heads % lm.kv_heads == 0, "model.language.kv_heads",
          f"{lm.kv_heads} must divide heads {lm.heads}.")
  require(lm.norm_eps > 0, "model.language.norm_eps", f"must be > 0, got {lm.norm_eps}.")
  require(lm.rope_theta > 0, "model.language.rope_theta", f"must be > 0, got {lm.rope_theta}.")
  require(lm.rope_scaling in ROPE_SCALINGS, "model.language.rope_scaling",
          f"must be one of {', '.join(ROPE_SCALINGS)}, got {lm.rope_scaling!r}.")
  if lm.rope_scaling == "llama3":
    positive(lm, "model.language", ("rope_factor", "rope_low_freq_factor",
                                    "rope_high_freq_factor", "rope_original_positions"))
    require(lm.rope_high_freq_factor > lm.rope_low_freq_factor,
            "model.language.rope_high_freq_factor",
            f"must exceed rope_low_freq_factor ({lm.rope_low_freq_factor}).")


def _init_from(cfg: Config, name: str) -> None:
  """model.<name>.init_from: a readable HF directory whose config.json agrees with the config."""
  section = cfg.model.module(name)
  if not section.init_from or run_source(section.init_from):  # a run: init_from.params
    return
  field = f"model.{name}.init_from"
  require(step_not_a_number(section.init_from) is None, field,
          step_not_a_number(section.init_from) or "")
  require(os.path.isdir(section.init_from), field,
          f"{section.init_from}: not a directory; name an HF model directory (config.json and "
          "*.safetensors) or a mimo_jax run, WORKDIR[:STEP].")
  src = hf.Source.open(section.init_from)
  require(name in src.modules, f"model.{name}.init_from",
          f"{section.init_from} holds a {src.kind} model, which has no {name} module.")
  differ = hf.check_fields(src, name, hf.fields(src, name), section)
  require(not differ, f"model.{name}.init_from",
          f"{section.init_from} does not match the config: {'; '.join(differ)}. Set those "
          "fields as the checkpoint has them.")


def data_source(cfg: Config) -> None:
  """A run's converted data directory (data.task=conversations), checked before the rest of the
  config: the converter's launch line sets the fields that depend on it (launch calls this; the
  tools that do not read the run's data do not)."""
  d = cfg.data
  if d.task == "conversations" and d.dir:
    found = "is a file, not a directory" if os.path.exists(d.dir) else "not found"
    require(os.path.isdir(d.dir), "data.dir",
            f"{d.dir} {found}; data.task=conversations reads the directory that `python -m "
            "tools.convert --json FILE --out DIR` writes from a LLaVA-format JSON file.")


def validate(cfg: Config, num_devices: int | None = None) -> None:
  """Raises ConfigError for the first bad field. `num_devices` enables the device-range checks."""
  _finite(cfg, "")
  _model(cfg)
  _task(cfg)
  _encoders(cfg)
  _data(cfg)
  _optim(cfg)
  _schedule_and_run(cfg)
  # After every range check: data.seq_len's bounds divide by and multiply with the fields above
  # (eval.batch, eval.samples, the data's batch), which a bad value of would crash, not name.
  _seq_len(cfg)
  validate_topology(cfg, num_devices)


def _model(cfg: Config) -> None:
  """The model section: dtype, attention kernel, FP8, the language model."""
  require(cfg.model.dtype in ("float32", "bfloat16"), "model.dtype",
          f"must be float32 or bfloat16, got {cfg.model.dtype!r}.")
  require(cfg.model.attention in ("auto", "xla", "cudnn"), "model.attention",
          f"must be auto, xla or cudnn, got {cfg.model.attention!r}.")
  require(cfg.model.layer_norm in ("auto", "xla", "pallas"), "model.layer_norm",
          f"must be auto, xla or pallas, got {cfg.model.layer_norm!r}.")
  for name in [*cfg.model.encoders, LANGUAGE]:
    section = cfg.model.module(name)
    require(not getattr(section, "fp8", False) or cfg.model.dtype == "bfloat16",
            f"model.{name}.fp8",
            "FP8 matmuls stand in for bfloat16 ones; set model.dtype=bfloat16 as well.")
    _fp8_scaling(cfg, name)
  _language(cfg)


def _fp8_scaling(cfg: Config, name: str) -> None:
  """`model.<name>.fp8_scaling` and `fp8_history`, and what delayed scaling does not cover: its
  abs-max histories are recorded through the module's backward pass and combined by maximum in
  the step's accumulators, which a pipelined stack (it adds its stages' gradients over the
  microbatches itself) and a module whose blocks do not train (no backward through them) would
  not do. LoRA adapters run it: the backward goes through the frozen base to them."""
  section = cfg.model.module(name)
  if not hasattr(section, "fp8_scaling"):
    return
  field = f"model.{name}.fp8_scaling"
  require(section.fp8_scaling in ("current", "delayed"), field,
          f"must be current or delayed, got {section.fp8_scaling!r}.")
  require(isinstance(section.fp8_history, int) and section.fp8_history >= 1,
          f"model.{name}.fp8_history", f"must be an integer >= 1, got {section.fp8_history!r}.")
  if section.fp8_scaling != "delayed":
    return
  require(section.fp8, field, f"delayed scaling is for FP8 matmuls; set model.{name}.fp8=true "
          "as well, or leave fp8_scaling current.")
  pp = cfg.topology.module(name).pp
  require(pp == 1, field, f"delayed scaling does not run pipelined (topology.{name}.pp={pp}); "
          "use fp8_scaling=current there.")
  # The blocks' trained weights: the adapters with LoRA (the base is frozen then), else the
  # tower's own; frozen, no backward pass runs through the blocks to record anything.
  blocks = f"{name}_lora" if lora_of(cfg, name) else name
  require(blocks not in [g.strip() for g in cfg.optim.freeze.split(",")], field,
          f"delayed scaling records its abs-maxes in the backward pass of trained blocks, and "
          f"optim.freeze freezes {blocks}; use fp8_scaling=current there.")


def _task(cfg: Config) -> None:
  """data.task and what it needs of the vocabulary, the text and the data directory."""
  d, lm = cfg.data, cfg.model.language
  require(d.task in TASKS, "data.task", f"unknown task {d.task!r}; choose from {', '.join(TASKS)}.")
  if d.task == "digits":
    require(lm.vocab_size in (0, DIGITS_VOCAB), "model.language.vocab_size",
            f"the digits task has a vocabulary of {DIGITS_VOCAB}; leave it 0.")
  elif d.task == "av_digits":
    require(lm.vocab_size == AV_DIGITS_VOCAB, "model.language.vocab_size",
            f"the av_digits task has a vocabulary of {AV_DIGITS_VOCAB}; set it "
            f"(configs/av_digits.py does).")
  else:
    tokens = manifest_field(cfg, "vocab_size") if d.task == "conversations" else None
    require(lm.vocab_size > 0, "model.language.vocab_size",
            f"{d.task} data needs a vocabulary (> 0; 0 is the digits task's), " +
            (f"e.g. {tokens}: its tokenizer's ({d.dir}/conversations.json), as the launch line "
             "tools.convert printed sets it." if tokens else "e.g. 32000."))
    positive(d, "data", ("text_len",))
    require(d.text_len_sigma >= 0, "data.text_len_sigma", "must be >= 0.")
  if d.task == "conversations":
    require(bool(d.dir), "data.dir",
            "data.task=conversations reads the directory `python -m tools.convert` wrote; set "
            "data.dir to it.")
    marked = manifest_field(cfg, "image_token")
    if marked is not None and marked < 0:  # converted without an image token: no images
      require(d.image_token == -1, "data.image_token",
              f"{d.image_token}, but {d.dir} was converted without an image token (its "
              "conversations.json's image_token is -1: no record holds an image); leave "
              "data.image_token out.")
    else:
      require(d.image_token != -1, "data.image_token",
              "is not set; set the image token id that tools.convert reports (its launch line "
              f"and {d.dir}/conversations.json's image_token).")
      require(0 <= d.image_token < lm.vocab_size, "data.image_token",
              f"{d.image_token} is not a token of the vocabulary of {lm.vocab_size}; set "
              "the image token id that tools.convert reports.")
  else:
    require(d.image_token == -1, "data.image_token",
            f"applies to data.task=conversations only; the {d.task} task marks images "
            "with its own <img>.")


def _encoders(cfg: Config) -> None:
  """Every encoder has a config and a placement, and passes its own checks; every module's
  init_from names a readable source that agrees with the config."""
  for name in cfg.topology.encoders:
    require(name in cfg.model.encoders, f"model.{name}",
            f"topology.{name} is set but model.{name} is not; give the encoder a config.")
  for name in cfg.model.encoders:
    require(name in cfg.topology.encoders, f"topology.{name}",
            f"model.{name} is set but topology.{name} is not; place the encoder on devices.")
  for encoder in encoders.of(cfg).values():
    encoder.validate(cfg)
  for name in cfg.topology.modules():
    if getattr(cfg.model.module(name), "init_from", ""):
      _init_from(cfg, name)
    validate_adapters(cfg, name)


def _data(cfg: Config) -> None:
  """The data section's batch, loader, reorder and bucket settings."""
  d = cfg.data
  positive(d, "data", ("global_batch", "microbatches", "seq_len", "train_samples",
                       "eval_samples"))
  require(d.train_samples >= d.global_batch, "data.train_samples",
          f"{d.train_samples} samples cannot fill one global batch of {d.global_batch}; build "
          "more samples or lower data.global_batch.")
  require(d.global_batch % d.microbatches == 0, "data.microbatches",
          f"{d.microbatches} must divide global_batch {d.global_batch}.")
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
  for name in ("image_token_cost", "text_token_cost"):
    require(getattr(d, name) >= 0, f"data.{name}", f"must be >= 0, got {getattr(d, name)}.")


def _seq_len(cfg: Config) -> None:
  """data.seq_len holds a sample's most items with their answers (converted data: its longest
  sample, as its manifest records it, whose clips take only their audio's tokens), and fits host
  memory."""
  longest = manifest_field(cfg, "longest") if cfg.data.task == "conversations" else None
  if longest:
    require(cfg.data.seq_len >= longest, "data.seq_len",
            f"{cfg.data.seq_len}, but the longest sample of {cfg.data.dir} takes {longest} "
            f"positions (its conversations.json); use >= {longest}, as the launch line that "
            "tools.convert printed does.")
    _seq_len_fits(cfg)
    return
  # bos, each item's placeholders, ':', one answer word per item and eos; the last is never input.
  most = [(e.max_items(cfg), e.tokens_per_item(cfg), e.noun) for e in encoders.of(cfg).values()]
  min_len = max(sum(k * (t + 1) for k, t, _ in most) + 2, 5)
  items = ", ".join(f"{count(k, noun)} of {count(t, 'token')}" for k, t, noun in most) or "no items"
  require(cfg.data.seq_len >= min_len, "data.seq_len",
          f"{cfg.data.seq_len} cannot hold {items} plus their answer; use >= {min_len}.")
  _seq_len_fits(cfg)


def _optim(cfg: Config) -> None:
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


def _schedule_and_run(cfg: Config) -> None:
  """train, eval, checkpoint and run."""
  require(cfg.train.steps > 0, "train.steps", "must be > 0.")
  for field, seed in (("train.seed", cfg.train.seed), ("data.seed", cfg.data.seed)):
    require(0 <= seed < 2**32, field, f"{seed}: give 0 to 2**32 - 1 (seeds are 32 bits).")
  require(cfg.train.loss_chunk >= 0, "train.loss_chunk",
          f"must be >= 0 (positions a chunk; 0 = every position at once), got "
          f"{cfg.train.loss_chunk}.")
  require(cfg.eval.every >= 0, "eval.every", "must be >= 0 (0 = only at the end).")
  require(cfg.eval.batch > 0, "eval.batch", "must be > 0.")
  require(cfg.eval.samples > 0, "eval.samples", "must be > 0.")
  require(0 <= cfg.eval.generate <= cfg.eval.samples, "eval.generate",
          f"{cfg.eval.generate}: give 0 (none) up to eval.samples ({cfg.eval.samples}).")
  task = cfg.data.task
  require(cfg.eval.generate == 0 or task != "synthetic", "eval.generate",
          f"answers are scored as text, which data.task={task} has none of; leave it 0.")
  require(cfg.eval.metric in scoring.METRICS, "eval.metric",
          f"{cfg.eval.metric!r} is no metric; registered: {', '.join(sorted(scoring.METRICS))}.")
  require(cfg.eval.max_new_tokens > 0, "eval.max_new_tokens", "must be > 0.")
  # Converted data has the eval split tools.convert made (--eval), which validate_data checks.
  d = cfg.data
  require(d.task == "conversations" or cfg.eval.samples <= d.eval_samples, "eval.samples",
          f"{cfg.eval.samples} exceeds the {d.eval_samples} held-out samples built "
          f"(data.eval_samples); lower eval.samples or raise data.eval_samples.")
  require(cfg.checkpoint.every >= 0, "checkpoint.every", "must be >= 0 (0 = only at the end).")
  require(cfg.checkpoint.keep >= 1, "checkpoint.keep", "must be >= 1.")
  require(not cfg.checkpoint.base or os.path.isdir(cfg.checkpoint.base), "checkpoint.base",
          f"{cfg.checkpoint.base}: not a directory; name the workdir (or its checkpoints folder) "
          "that holds the base of this run's checkpoints now, or leave it empty.")
  require(cfg.checkpoint.restore_step >= 0, "checkpoint.restore_step",
          "must be >= 0 (0 = the newest step).")
  require(cfg.run.log_every > 0, "run.log_every", "must be > 0.")
  require(0 < cfg.run.cpu_devices <= MAX_CPU_DEVICES, "run.cpu_devices",
          f"must be in 1..{MAX_CPU_DEVICES} (each device costs memory and threads), got "
          f"{cfg.run.cpu_devices}.")
  require(cfg.run.compile_ahead >= 0, "run.compile_ahead", "must be >= 0 (0 = compile when met).")
  require(cfg.run.compile_threads > 0, "run.compile_threads", "must be > 0.")
  require(cfg.run.while_compiling in ("wait", "pad"), "run.while_compiling",
          f"must be wait or pad, got {cfg.run.while_compiling!r}.")
  require(cfg.run.device_memory_gb >= 0, "run.device_memory_gb",
          "must be >= 0 (0 = what the device reports).")
  require(cfg.run.progress in ("auto", "bar", "lines"), "run.progress",
          f"must be auto, bar or lines, got {cfg.run.progress!r}.")
  require(bool(cfg.run.workdir), "run.workdir", "must not be empty.")


def manifest_field(cfg: Config, key: str):
  """A field of the manifest of the converted data in data.dir, or None where there is none."""
  # pylint: disable-next=import-outside-toplevel
  from mimo_jax.data import conversations
  try:
    return conversations.manifest(cfg.data.dir).get(key) if cfg.data.dir else None
  except ConfigError:
    return None


def validate_backend(cfg: Config, backend: str, processes: int = 1) -> None:
  """What the platform cannot run: XLA's CPU backend aborts on a bfloat16 all-reduce, which the
  pipeline's stage-to-stage gradients need; padding while compiling on a GPU or over several
  processes (below)."""
  pipelined = [n for n, t in cfg.topology.modules().items() if t.pp > 1]
  require(not (backend == "cpu" and cfg.model.dtype == "bfloat16" and pipelined), "model.dtype",
           f"bfloat16 with pipeline stages ({', '.join(pipelined)} pp > 1) does not run on CPU "
           "(XLA's CPU backend cannot all-reduce bfloat16); use float32 on CPU, or a GPU.")
  # On a GPU the shapes that compile while padded steps run would time their kernels there,
  # behind the steps: minutes a shape on an H200 (docs/benchmarks.md), padded steps meanwhile.
  require(not (backend == "gpu" and cfg.run.while_compiling == "pad" and cfg.run.autotune),
          "run.while_compiling", "pad on a GPU needs run.autotune=false: with autotuning, the "
          "shapes compiling while the steps run time their kernels on the GPU behind the steps "
          "(minutes a shape instead of seconds); set run.autotune=false, or "
          "run.while_compiling=wait.")
  if cfg.model.layer_norm == "pallas":
    require(backend == "gpu", "model.layer_norm",
            f"pallas runs on GPUs (the backend here is {backend}); use auto or xla.")
    towers = {n: v for n, v in cfg.model.encoders.items() if isinstance(v, ViTConfig)}
    for n, v in towers.items():
      require(norm_kernels.supported(v.dim, backend), f"model.{n}.dim",
              f"model.layer_norm=pallas needs a width that is a power of two from 16 to 8192 "
              f"(Triton's blocks), and model.{n}.dim is {v.dim}; use auto or xla.")
    split = [f"{n} (dp={t.dp}, tp={t.tp}, pp={t.pp})" for n, t in cfg.topology.modules().items()
             if n in towers and t.dp * t.tp * t.pp > 1]
    require(not split, "model.layer_norm",
            f"pallas needs each tower on one device a replica, in one pipeline stage, and "
            f"{', '.join(split)} splits its rows or its layers over devices (XLA's partitioner "
            "would gather the rows for the kernels; jax 0.11.2 refuses a kernel inside a "
            "stage); use auto (XLA's norms there) or xla.")
  # Each process pads by what it has compiled: processes whose compiles end at other times
  # would run programs of other shapes in one step, and their collectives would not meet.
  require(not (processes > 1 and cfg.run.while_compiling == "pad"), "run.while_compiling",
          f"pad runs in one process only ({processes} processes here: each would pad by its own "
          "compiles, and their programs would differ within a step); set "
          "run.while_compiling=wait.")
