"""Config validation of the topology (topology.py): every module's device range, its divisibility
by dp, tp and pipeline stages, and its pipeline schedule. Part of `validation.validate`, and what
topology.py and tools.plan check before they place modules."""

from mimo_jax import encoders
from mimo_jax.config import REMAT, SHARD_MODES, Config, positive, require
from mimo_jax.schedules import SCHEDULES


def _pipeline_schedule(cfg: Config, name: str, t) -> None:
  """`topology.<name>.schedule`: a known schedule, for pipeline stages, with the chunks a stage
  and the microbatches it runs."""
  f = f"topology.{name}.schedule"
  require(t.schedule in ("",) + tuple(SCHEDULES), f,
           f"unknown pipeline schedule {t.schedule!r}; choose from {', '.join(SCHEDULES)} (or "
           "leave it empty: gpipe for virtual 1, circular otherwise).")
  if not t.schedule:
    return
  require(t.pp > 1, f, f"schedule {t.schedule} needs pipeline stages; set pp > 1 or leave the "
           "schedule empty.")
  one_chunk = {"gpipe": "circular", "1f1b": "interleaved_1f1b"}
  require(t.schedule not in one_chunk or t.virtual == 1, f"topology.{name}.virtual",
           f"schedule {t.schedule} runs one chunk a stage, got virtual={t.virtual}; set "
           f"virtual=1 or schedule={one_chunk.get(t.schedule)}.")
  if t.schedule == "interleaved_1f1b":
    require(t.virtual > 1, f"topology.{name}.virtual",
             "schedule interleaved_1f1b runs several chunks a stage; set virtual > 1 or "
             "schedule=1f1b.")
    m = cfg.data.microbatches
    require(m % t.pp == 0, "data.microbatches",
             f"schedule interleaved_1f1b takes microbatches in groups of {name}'s {t.pp} "
             f"stages, got {m}; use a multiple of {t.pp}.")


def validate_topology(cfg: Config, num_devices: int | None) -> None:
  """Device ranges and divisibility of every module (topology.py)."""
  d, lm = cfg.data, cfg.model.language
  ranges = {}
  for name, t in cfg.topology.modules().items():
    f = f"topology.{name}"
    require(t.offset >= 0, f"{f}.offset", "must be >= 0.")
    positive(t, f, ("dp", "tp", "pp", "virtual"))
    require(t.remat in REMAT, f"{f}.remat",
             f"unknown policy {t.remat!r}; choose from {', '.join(REMAT)}.")
    require(t.shard in SHARD_MODES, f"{f}.shard",
             f"unknown mode {t.shard!r}; choose from {', '.join(SHARD_MODES)}.")
    require(t.virtual == 1 or t.pp > 1, f"{f}.virtual",
             f"{t.virtual} virtual stages need pipeline stages; set pp > 1 or virtual=1.")
    _pipeline_schedule(cfg, name, t)
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
  # Each module's own sizes before the ranges they make: a tp that divides no head count also
  # moves the next module's range, which would be named instead.
  for encoder in encoders.of(cfg).values():
    encoder.validate_topology(cfg)
  lt = cfg.topology.language
  require(lm.kv_heads % lt.tp == 0, "topology.language.tp",
          f"{lt.tp} must divide model.language.kv_heads {lm.kv_heads}.")
  require(lm.mlp_dim % lt.tp == 0, "topology.language.tp",
          f"{lt.tp} must divide model.language.mlp_dim {lm.mlp_dim}.")
  names = list(ranges)
  for i, a in enumerate(names):
    for b in names[i + 1:]:
      (a0, a1), (b0, b1) = ranges[a], ranges[b]
      overlap = a0 < b1 and b0 < a1
      require(not overlap or (a0, a1) == (b0, b1), f"topology.{b}.offset",
               f"devices [{b0}, {b1}) partially overlap {a}'s [{a0}, {a1}); use identical "
               "ranges (colocated) or disjoint ones.")
  require(d.pack_rows >= 0, "data.pack_rows", "must be >= 0 (0 = no packing).")
  require(d.pack_rows % lt.dp == 0, "data.pack_rows",
          f"{d.pack_rows} rows must split evenly over language dp {lt.dp}.")
  for name, encoder in encoders.of(cfg).items():
    slots, field = encoder.slots(cfg), encoder.slots_field or f"model.{name}"
    require(slots % lt.dp == 0, field,
            f"{slots} slots must split evenly over language dp {lt.dp}.")
    require(slots % cfg.topology.module(name).dp == 0, field,
            f"{slots} slots must split evenly over {name} dp {cfg.topology.module(name).dp}.")
