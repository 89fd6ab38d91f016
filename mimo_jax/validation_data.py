"""The config against the run's data (`validate_data`), before anything is written: what
validation.py's `validate` cannot see in the config alone."""

import os

from mimo_jax import encoders
from mimo_jax.config import Config, ConfigError, require


def validate_data(cfg: Config) -> None:
  """The config against the run's data, before anything is written: converted data
  (data.task=conversations) must agree with its manifest (conversations.paths), fit its longest
  sample in a row, hold an eval split of at least eval.samples, and hold no token id the model's
  vocabulary lacks (each shard's metadata sidecar records its records' largest id;
  data/meta.py). The built-in tasks make their data from the config (synthetic ids are drawn
  below vocab_size), which `validate` checks, in a data.dir that holds no converted data."""
  from mimo_jax.data import conversations  # pylint: disable=import-outside-toplevel
  if cfg.data.task != "conversations":
    converted = os.path.join(cfg.data.dir, conversations.MANIFEST) if cfg.data.dir else ""
    require(not (converted and os.path.exists(converted)), "data.task",
            f"{cfg.data.task}, but data.dir {cfg.data.dir} holds converted data ({converted}), "
            f"where the {cfg.data.task} task would build data of its own; set "
            "--config.data.task=conversations and the other fields of the launch line that "
            f"tools.convert printed, or give {cfg.data.task} another data.dir.")
    return
  # pylint: disable-next=import-outside-toplevel  (it imports JAX and grain; launch validates
  from mimo_jax.data import loader  # the flags before JAX is configured)
  paths = conversations.paths(cfg)
  longest = conversations.manifest(cfg.data.dir).get("longest") or 0
  require(cfg.data.seq_len >= longest, "data.seq_len",
          f"{cfg.data.seq_len}, but the longest sample of {cfg.data.dir} takes {longest} positions "
          f"(its conversations.json); use >= {longest}, as the launch line that tools.convert "
          "printed does.")
  n = cfg.eval.samples
  held_out = len(loader.open_shard(paths["eval"], "conversations"))
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
