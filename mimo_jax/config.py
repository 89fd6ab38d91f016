"""Typed run configuration.

A config file (`configs/*.py`) returns a `Config`; command-line flags override single fields
(`--config.train.steps=10`). validation.py turns every bad value into one `ConfigError` that names
the field and the fix, before anything is compiled. This module holds the modules' sections
(`model`, `topology`: the language model's and each encoder's by name), the `Config` that joins
them with the run's other sections (config_run.py), a config read back from a dict, and the
helpers of its fields (parameter groups, init_from specs, layouts).
"""


import dataclasses
import os

from mimo_jax import registry
from mimo_jax.config_run import (CheckpointConfig, DataConfig, EvalConfig, OptimConfig,
                                 RunConfig, TrainConfig)

LANGUAGE = "language"  # the one module that is not an encoder (mimo_jax/encoders)
# Activation rematerialisation policies (pipeline.py).
REMAT = ("none", "full", "dots", "dots_attention")
SHARD_MODES = ("none", "optimizer", "full")  # state sharded over dp ranks (sharding.py)
ACTIVATIONS = ("gelu_tanh", "gelu", "quick_gelu")  # models/layers.py
ROPE_SCALINGS = ("none", "llama3")  # models/layers.py


class ConfigError(ValueError):
  """A bad configuration value; the message names the field and the fix."""


@dataclasses.dataclass
class LoraConfig:
  """`model.<module>.lora`: low-rank adapters on the module's linear layers (models/lora.py).
  With rank > 0 the module's own weights are frozen and only the adapters train (its projector,
  an encoder's `<name>_projector` group, still trains unless optim.freeze names it)."""
  rank: int = 0  # 0 = no adapters
  alpha: float = 16.0  # the adapters' output is scaled by alpha / rank (PEFT's lora_alpha)
  # Comma-separated regular expressions searched in each linear layer's path (e.g.
  # blocks/attn/q, blocks/mlp/down); every match gets an adapter. Each must match a layer.
  targets: str = r"attn/(q|k|v|o)$,mlp/(gate|up|down)$"
  # Dropout on the adapters' input in training, as PEFT's lora_dropout: a targeted layer computes
  # base(x) + B(A(dropout(x))) * alpha / rank (the base sees x whole). The blocks' layers of the
  # language model and of an encoder whose slots name their rows (Encoder.dropout_rows: one
  # image or clip a slot, not packed slots); 0 = none (the program is that of a run without it).
  dropout: float = 0.0
  # A PEFT adapter directory (adapter_config.json, adapter_model.safetensors; hf/peft.py) the
  # adapters, and a projector PEFT saved whole, start from on a fresh start: a run continues
  # training an adapter PEFT (or `tools.hf export --peft`) wrote, over the base its module starts
  # from. Modules naming one directory read it together (LLaVA's tower and language model). Not
  # read on resume.
  init_from: str = ""


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
  # FP8 scaling (models/fp8.py): "current" (each operand's scale from its own abs-max at the
  # call) or "delayed" (inputs' and incoming gradients' scales from abs-max histories of
  # fp8_history steps kept in the model's state).
  fp8_scaling: str = "current"
  fp8_history: int = 16
  lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)

  def rope_scaling_params(self) -> tuple[float, float, float, int] | None:
    """(factor, low_freq_factor, high_freq_factor, original_positions), or None."""
    if self.rope_scaling == "none":
      return None
    return (self.rope_factor, self.rope_low_freq_factor, self.rope_high_freq_factor,
            self.rope_original_positions)


class Modules:
  """`encoders` by name, also read and written as attributes (`model.<name>`, `topology.<name>`,
  as config files and command-line flags spell them)."""

  def __getattr__(self, name: str):
    if name.startswith("__") or name == "encoders":
      raise AttributeError(name)
    encoders = self.__dict__.get("encoders", {})
    if name in encoders:
      return encoders[name]
    raise AttributeError(f"{type(self).__name__} has no field or encoder {name!r} (encoders: "
                         f"{', '.join(encoders) or 'none'})")

  def __setattr__(self, name: str, value) -> None:
    if name in self.__dict__.get("encoders", {}):
      self.encoders[name] = value
    else:
      super().__setattr__(name, value)


@dataclasses.dataclass
class ModelConfig(Modules):
  dtype: str = "float32"
  # Attention kernel: xla, cudnn (fused flash attention, GPUs, bfloat16), or auto (cudnn where it
  # runs, else xla). Packed rows (data.pack_rows, an encoder's packed slots) use cuDNN's packed
  # attention with cudnn (Hopper GPUs and later), XLA's masked attention with xla.
  attention: str = "auto"
  # LayerNorm of the vision tower's blocks: xla, pallas (one-pass Pallas kernels each way, the
  # residual stream's gradient added in the backward one: GPUs, the module on one device a
  # replica in one pipeline stage, topology dp = tp = pp = 1), or auto (pallas where it runs,
  # else xla).
  layer_norm: str = "auto"
  # Each encoder's config by registered name (mimo_jax/encoders), in dispatch order; `model.<name>`
  # is short for `model.encoders.<name>`. A config file adds them with `Config.add_encoder`.
  encoders: dict = dataclasses.field(default_factory=dict)
  language: LanguageConfig = dataclasses.field(default_factory=LanguageConfig)
  # A mimo_jax run to start from, WORKDIR[:STEP] (default its newest step): every module's
  # parameters, with a fresh optimizer at step 0 (a new training stage: its own data and
  # schedule). Its model config must match (but for the lora fields of a module it has no
  # adapters on: they start fresh). A module's own init_from naming a run takes
  # precedence; one naming an HF directory (as an import's config carries) gives way to it.
  init_from: str = ""

  def module(self, name: str):
    """`model.<name>`: a module's config section."""
    return self.language if name == LANGUAGE else self.encoders[name]


@dataclasses.dataclass
class ModuleTopology:
  offset: int = 0  # first device of jax.devices() this module uses
  dp: int = 1  # data-parallel ranks
  tp: int = 1  # tensor-parallel ranks (Megatron column/row split)
  pp: int = 1  # pipeline stages: the module's layers split over pp consecutive groups of dp*tp
  # Chunks of layers per pipeline stage: 1 = GPipe, > 1 = circular schedule (a bubble v times
  # smaller, v times more stage-to-stage sends).
  virtual: int = 1
  # The pipeline schedule (pp > 1): gpipe (virtual 1) or circular (virtual > 1), whose backward
  # autodiff makes (every microbatch's activations kept), or 1f1b (virtual 1) or
  # interleaved_1f1b (virtual > 1, microbatches a multiple of pp), which run each microbatch's
  # backward soon after its forward (a stage keeps its microbatches in flight, at most pp).
  # Empty: gpipe for virtual 1, circular otherwise.
  schedule: str = ""
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
class TopologyConfig(Modules):
  # Each encoder's placement by name, as model.encoders; `topology.<name>` is short for
  # `topology.encoders.<name>`.
  encoders: dict = dataclasses.field(default_factory=dict)
  language: ModuleTopology = dataclasses.field(default_factory=ModuleTopology)

  def names(self) -> list[str]:
    """The run's encoders in dispatch order (as added)."""
    return list(self.encoders)

  def modules(self) -> dict[str, ModuleTopology]:
    """Every module's topology: encoders first, the language model last."""
    return {name: self.module(name) for name in [*self.names(), LANGUAGE]}

  def module(self, name: str) -> ModuleTopology:
    return self.language if name == LANGUAGE else self.encoders[name]


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

  def add_encoder(self, name: str, config, topology: ModuleTopology | None = None) -> None:
    """Adds a registered encoder (mimo_jax/encoders) as `model.<name>` and `topology.<name>`
    (default: the language model's devices, dp 1), after those already added."""
    if name == LANGUAGE:
      raise ConfigError(f"config.model.{name}: the language model is not an encoder.")
    self.model.encoders[name] = config
    self.topology.encoders[name] = topology or ModuleTopology()


def row_segments(cfg: Config) -> int:
  """Most runs of equal segment ids in a packed language row: every sample of a microbatch and
  the padding; 0 without packing (data.pack_rows)."""
  return cfg.data.micro_batch + 1 if cfg.data.pack_rows else 0


def from_dict(values: dict, cls=None, prefix: str = "config."):
  """A config from `dataclasses.asdict` output (a checkpoint's metadata, a workdir's
  config.json); fields it lacks keep their defaults, fields the dataclasses lack are errors.
  Encoders are read back as their registered config classes (`registry.CONFIGS`)."""
  cls = cls or Config
  obj = cls()
  known = {f.name: f for f in dataclasses.fields(cls)}
  if cls is Config:
    values = _moved_data_fields(values)
  if issubclass(cls, Modules):
    values = _encoders_section(values, known)
  for name, value in values.items():
    if name not in known:
      raise ConfigError(f"{prefix}{name}: unknown field (written by another mimo_jax version?).")
    current = getattr(obj, name)
    if name == "encoders" and isinstance(obj, Modules):
      value = {n: _encoder_from_dict(cls, n, v, f"{prefix}{name}.{n}.") for n, v in value.items()}
    elif dataclasses.is_dataclass(current) and isinstance(value, dict):
      value = from_dict(value, type(current), f"{prefix}{name}.")
    setattr(obj, name, value)
  return obj


def _encoders_section(values: dict, known: dict) -> dict:
  """Configs written before `encoders` existed kept each registered encoder as a field of its own
  (`model.<name>`, `topology.<name>`) and the rest under `extra`: moved into `encoders`."""
  values, moved = dict(values), dict(values.get("encoders", {}))
  for name in [n for n in values if n not in known and n in registry.CONFIGS]:
    moved[name] = values.pop(name)
  moved.update(values.pop("extra", None) or {})
  return {**values, "encoders": moved} if moved else values


def _moved_data_fields(values: dict) -> dict:
  """Configs written before an encoder took over fields of `data` (`registry.MOVED_DATA_FIELDS`)
  hold them there: moved into that encoder's section, `model.encoders.<name>`."""
  data = values.get("data")
  known = {f.name for f in dataclasses.fields(DataConfig)}
  if not isinstance(data, dict) or all(k in known for k in data):
    return values
  registry.builtin()  # the built-in encoders declare what they took over when they register
  model = _encoders_section(dict(values.get("model", {})),
                            {f.name for f in dataclasses.fields(ModelConfig)})
  data, sections = dict(data), dict(model.get("encoders", {}))
  for name, section in sections.items():
    moved = {f: data.pop(f) for f in registry.MOVED_DATA_FIELDS.get(name, ()) if f in data}
    sections[name] = {**section, **moved}
  return {**values, "data": data, "model": {**model, "encoders": sections}}


def _encoder_from_dict(cls, name: str, values: dict, prefix: str):
  if cls is TopologyConfig:
    return from_dict(values, ModuleTopology, prefix)
  if name not in registry.CONFIGS:
    registry.builtin()  # a built-in encoder not imported yet
  if name not in registry.CONFIGS:
    raise ConfigError(f"{prefix[:-1]}: no encoder {name!r} is registered (mimo_jax/encoders); "
                      f"registered: {', '.join(registry.CONFIGS) or 'none'}.")
  return from_dict(values, registry.CONFIGS[name], prefix)


def require(ok: bool, field: str, message: str) -> None:
  """Raises ConfigError naming `field` (config.<field>) unless `ok`."""
  if not ok:
    raise ConfigError(f"config.{field}: {message}")


def positive(section: object, prefix: str, names: tuple[str, ...]) -> None:
  """Raises ConfigError naming the first of the fields `names` of `section` that is not > 0."""
  for name in names:
    value = getattr(section, name)
    require(value > 0, f"{prefix}.{name}", f"must be > 0, got {value}.")


def lora_of(cfg: Config, name: str) -> LoraConfig | None:
  """Module `name`'s `model.<name>.lora` when it has adapters (rank > 0), else None."""
  lora = getattr(cfg.model.module(name), "lora", None)
  if lora is None:
    return None
  require(lora.rank >= 0, f"model.{name}.lora.rank", f"must be >= 0 (0 = no adapters), got "
          f"{lora.rank}.")
  require(lora.alpha > 0, f"model.{name}.lora.alpha", f"must be > 0, got {lora.alpha}.")
  require(0 <= lora.dropout < 1, f"model.{name}.lora.dropout",
          f"must be in [0, 1) (a probability), got {lora.dropout}.")
  return lora if lora.rank > 0 else None


def param_groups(cfg: Config) -> tuple[str, ...]:
  """The run's parameter groups (optim.freeze, optim.lr_mult): each encoder's tower and its
  projector (`<name>`, `<name>_projector`), then `language`; a module with LoRA adapters adds
  `<name>_lora`."""
  names = list(cfg.topology.names()) + [LANGUAGE]
  base = tuple(g for n in names[:-1] for g in (n, f"{n}_projector")) + (LANGUAGE,)
  return base + tuple(f"{n}_lora" for n in names if lora_of(cfg, n))


def parse_freeze(cfg: Config) -> tuple[str, ...]:
  """`optim.freeze` as parameter groups."""
  known = param_groups(cfg)
  groups = tuple(g.strip() for g in cfg.optim.freeze.split(",") if g.strip())
  for g in groups:
    require(g in known, "optim.freeze",
             f"unknown parameter group {g!r}; choose from {', '.join(known)}.")
  # A module with adapters trains them, not its own weights (models/mimo.Module.group).
  bases = {n for n in list(cfg.topology.names()) + [LANGUAGE] if lora_of(cfg, n)}
  require(any(g not in groups and g not in bases for g in known), "optim.freeze",
          f"{cfg.optim.freeze!r} leaves nothing to train (the groups: {', '.join(known)}); "
          "leave a group out (python -m tools.eval scores a run without training it).")
  return groups


def parse_lr_mult(cfg: Config) -> dict[str, float]:
  """`optim.lr_mult` as {parameter group: multiplier}."""
  known, spec = param_groups(cfg), cfg.optim.lr_mult
  out = {}
  for item in (s.strip() for s in spec.split(",") if s.strip()):
    group, sep, value = item.partition("=")
    require(bool(sep), "optim.lr_mult", f"{item!r} is not group=multiplier, e.g. language=0.1.")
    require(group in known, "optim.lr_mult",
             f"unknown parameter group {group!r}; choose from {', '.join(known)}.")
    try:
      out[group] = float(value)
    except ValueError:
      raise ConfigError(f"config.optim.lr_mult: {value!r} for {group} is not a number.") from None
    require(out[group] >= 0, "optim.lr_mult", f"multiplier for {group} must be >= 0.")
  return out


def split_spec(spec: str) -> tuple[str, int | None]:
  """An init_from `PATH[:STEP]` as (PATH, STEP or None)."""
  head, sep, tail = spec.rpartition(":")
  return (head, int(tail)) if sep and head and tail.isdigit() else (spec, None)


def step_not_a_number(spec: str) -> str | None:
  """What is wrong with an init_from `WORKDIR:STEP` whose WORKDIR is a run and STEP no number
  (`runs/stage2:last`); None for anything else."""
  head, sep, tail = spec.rpartition(":")
  if sep and head and tail and not tail.isdigit() and run_source(head) is not None:
    what = "a step number (0 or more)" if tail.lstrip("-").isdigit() else "a number"
    return (f"{spec!r}: the step {tail!r} is not {what}; give WORKDIR:STEP with a saved step, "
            "or WORKDIR for its newest.")
  return None


def run_source(spec: str) -> tuple[str, int | None] | None:
  """An `init_from` that names a mimo_jax run, `WORKDIR[:STEP]` (a workdir or its checkpoints/
  folder): (that checkpoints folder, STEP or None for the newest); None for anything else (an HF
  directory, or "")."""
  if not spec:
    return None
  path, step = split_spec(spec)
  path = os.path.abspath(os.path.expanduser(path))
  if os.path.isdir(os.path.join(path, "checkpoints")):
    return os.path.join(path, "checkpoints"), step
  if os.path.basename(path) == "checkpoints" and os.path.isdir(path):
    return path, step
  return None


def start_spec(cfg: Config, name: str, resolve=lambda spec: spec) -> tuple[str, str]:
  """(config field, spec) of what module `name` starts from on a fresh start: its own
  `init_from` where that names a run or `model.init_from` is empty, else `model.init_from`. A
  module's own HF directory gives way to `model.init_from`: a run's config carries the HF
  directories it was imported from (an import's config.py does), and a stage started from that
  run starts from its trained weights. `resolve` makes a relative path absolute first."""
  own = resolve(getattr(cfg.model.module(name), "init_from", "") or "")
  if own and (run_source(own) is not None or not cfg.model.init_from):
    return f"model.{name}.init_from", own
  return "model.init_from", resolve(cfg.model.init_from)


def set_layout(cfg: Config, layout: str) -> None:
  """Sets topology fields from `module=offset/dp/tp[/pp[/virtual]][@schedule],...` (as tests and
  benchmark tools write layouts), e.g. `language=4/2/2` or `language=0/1/2/4@1f1b` (any module by
  name; without @schedule the module's schedule is left as it is)."""
  for item in (s.strip() for s in layout.split(",") if s.strip()):
    name, eq, spec = item.partition("=")
    spec, at, schedule = spec.partition("@")
    modules = cfg.topology.modules()
    require(bool(eq), "topology", f"{item!r} is not module=offset/dp/tp[/pp[/virtual]]"
            f"[@schedule] (e.g. {next(iter(modules), 'language')}=0/1/1); modules: "
            f"{', '.join(modules)}.")
    require(name in modules, "topology",
             f"{item!r}: unknown module {name!r}; modules: {', '.join(modules)}.")
    try:
      values = [int(v) for v in spec.split("/")]
    except ValueError:
      values = []
    require(3 <= len(values) <= 5 and (schedule or not at), f"topology.{name}",
             f"{item!r} is not offset/dp/tp[/pp[/virtual]][@schedule].")
    t = cfg.topology.module(name)
    t.offset, t.dp, t.tp = values[:3]
    t.pp, t.virtual = (values[3:] + [1, 1])[:2]
    if schedule:
      t.schedule = schedule
