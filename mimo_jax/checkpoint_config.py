"""What a checkpoint's config must share with the run that restores it: the model fields (a
resume changes none but the runtime ones, `init_from` and `lora.dropout`), the modules, and the
data fields that decide the sample order and the eval set (unless
`checkpoint.allow_data_change`). A step that disagrees is one `CheckpointError` naming every
field that differs and how to go on."""

from __future__ import annotations

import dataclasses
import os

from mimo_jax import encoders
from mimo_jax.config import Config, ConfigError, ModelConfig, from_dict, lora_of
from mimo_jax.data import identity

# Data fields that must match for a resumed run to continue the same trajectory: each changes the
# sample order or the eval set (checkpoints written before a field was listed are not checked on
# it); each encoder's own are beside them (`Encoder.data_fields`, `data_values`).
DATA_FIELDS = ("task", "seed", "global_batch", "train_samples", "eval_samples", "image_probs",
               "text_len", "text_len_sigma", "image_sizes")
# Model fields that change how the step computes, not the parameters: free to differ on resume.
# Where a run started from (init_from, of the model or a module) does not matter once a
# checkpoint exists.
# and every `init_from` and `lora.dropout` (how a run trains, not what it trains)
RUNTIME_MODEL_FIELDS = ("model.dtype", "model.attention", "model.layer_norm")
ALLOW_DATA = "--config.checkpoint.allow_data_change=true"


class CheckpointError(ConfigError):
  """A checkpoint that cannot be restored into this run; the message says what differs."""


def flatten(d: dict, prefix: str = "") -> dict:
  out = {}
  for k, v in d.items():
    if isinstance(v, dict):
      out.update(flatten(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


def model_fields(model: dict) -> dict:
  """A model config as `dataclasses.asdict` nests it, flattened and keyed as flags spell the
  fields (`model.<encoder>.<field>`, `model.language.<field>`, `model.dtype`)."""
  model = dict(model)
  out = flatten({k: v for k, v in model.items() if k != "encoders"}, "model.")
  for name, section in (model.get("encoders") or {}).items():
    out.update(flatten(section, f"model.{name}."))
  return out


def _model_values(saved_model: dict, cfg: Config) -> tuple[dict, dict]:
  """A step's model config and this run's as `model_fields` keys them. A field newer than the
  checkpoint had its default's behaviour when it was written; a config written before encoders
  had their own section reads as it is now (config.from_dict)."""
  try:
    saved_model = dataclasses.asdict(from_dict(saved_model, ModelConfig, "model."))
  except ConfigError:  # a field this version lacks: compared as written
    pass
  saved = model_fields(saved_model)
  current = model_fields(dataclasses.asdict(cfg.model))
  default = model_fields(dataclasses.asdict(type(cfg.model)()))
  return {k: saved.get(k, default.get(k)) for k in current}, current


def model_differences(saved_model: dict, cfg: Config, only: str = "model.",
                      fresh: tuple[str, ...] = ()) -> list[str]:
  """`field=saved (this run: value)` for every model field under `only` that differs, runtime
  fields and encoders' data settings aside, and the lora fields of the modules in `fresh`
  (`gains_adapters`: their adapters do not come from the step) and of those with none."""
  saved, current = _model_values(saved_model, cfg)
  settings = encoders.data_settings(cfg)  # data, not the model (data_values checks some)
  # The lora fields of a module without adapters on either side (rank 0) shape nothing.
  idle = tuple(k[:-len("rank")] for k in current if k.endswith(".lora.rank") and
               not current[k] and not saved.get(k))
  aside = tuple(f"model.{n}.lora." for n in fresh) + idle
  return [f"{k}={saved[k]!r} (this run: {current[k]!r})" for k in sorted(current)
          if k.startswith(only) and k not in RUNTIME_MODEL_FIELDS and k not in settings and
          not k.endswith((".init_from", ".lora.dropout")) and not k.startswith(aside) and
          saved[k] != current[k]]


def gains_adapters(saved_model: dict, cfg: Config, names: list[str]) -> tuple[str, ...]:
  """The modules of `names` this run gives LoRA adapters where the step's model (`saved_model`)
  gave them none: each starts from the step's weights with fresh adapters (B = 0, so at the
  step's outputs exactly)."""
  saved, _ = _model_values(saved_model, cfg)
  return tuple(n for n in names if lora_of(cfg, n) and not saved.get(f"model.{n}.lora.rank"))


def data_values(cfg: Config) -> dict[str, tuple[str, object]]:
  """The data fields a checkpoint records, as its meta keys them -> (config path, value):
  image_probs only for a task that draws its samples' image counts from it."""
  return {**{k: (f"data.{k}", getattr(cfg.data, k)) for k in DATA_FIELDS
             if k != "image_probs" or cfg.data.draws_image_counts},
          **encoders.data_values(cfg)}


def check_compatible(meta: dict, cfg: Config, path: str, step: int) -> list[str]:
  """One error naming every model field, module or data field that differs; a step saved with
  parameters only pins no data. Returns notes for the run's log (data changes allowed by
  checkpoint.allow_data_change)."""
  where = f"checkpoint {path} step {step}"
  missing = sorted(set(cfg.topology.modules()) - set(meta.get("modules", [])))
  if missing:
    held = [m for m in meta.get("modules", []) if m in cfg.topology.modules()]
    start = " ".join(f"--config.model.{m}.init_from={os.path.dirname(path)}"
                     for m in held) or "--config.run.workdir=NEW_DIR"
    raise CheckpointError(
        f"{where} has no module {', '.join(missing)}; it holds "
        f"{', '.join(meta.get('modules', []))}. Resume with a config of the modules it holds, or "
        f"start a new stage in a new run.workdir with {start} ({', '.join(missing)} from "
        "the seed or its own init_from).")
  diffs = model_differences(meta["config"]["model"], cfg)
  if diffs:
    keep = " ".join(f"--config.{d.split('=')[0]}={d.split('=', 1)[1].split(' (this run')[0]}"
                    for d in diffs[:3])
    raise CheckpointError(f"{where} was written for another model: {'; '.join(diffs)}. Keep "
                          f"{keep} to resume it, or start a new run.workdir (the model config "
                          "of a run started from it with --config.model.init_from must match "
                          "too).")
  if meta.get("params_only"):
    return []  # an import's weights: no data was trained on
  data, values = meta.get("data", {}), data_values(cfg)
  fields = [k for k, (_, v) in values.items() if k in data and data[k] != v]
  content = identity.differences(data.get("fingerprint"), identity.fingerprint(cfg))
  if not fields and not content:
    return []
  changes = [f"{values[k][0]}={data[k]!r} (this run: {values[k][1]!r})" for k in fields]
  changes += content
  if cfg.checkpoint.allow_data_change:
    return [f"resuming {where} on other data (checkpoint.allow_data_change): "
            f"{'; '.join(changes)}; the data position carries on at step {step}."]
  keep = " ".join(f"--config.{values[k][0]}={data[k]!r}" for k in fields)
  stage = ("start the new stage in a new run.workdir (model.init_from, given, is read by new "
           "runs only)" if cfg.model.init_from else
           "start a new stage in a new run.workdir with --config.model.init_from=<this workdir>")
  raise CheckpointError(
      f"{where} was trained on other data: {'; '.join(changes)}. Resuming would change the "
      f"sample order or the eval set. Keep {keep or 'the data it was trained on'}, {stage}, or "
      f"go on with this data on purpose with {ALLOW_DATA}.")
