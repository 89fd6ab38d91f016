"""The training loop: plain Python around `Stepper.train_step`.

Metrics of step N are fetched after step N+1 has been dispatched, so the host never makes the
devices wait (a fetch inside the step would serialise the module meshes).
"""

from __future__ import annotations

import time

import jax
import numpy as np

from mimo_jax import topology
from mimo_jax.config import Config, validate
from mimo_jax.data import loader
from mimo_jax.data.tokenizer import PAD
from mimo_jax.evaluate import Evaluator
from mimo_jax.metrics import MetricsWriter
from mimo_jax.models.mimo import build_modules
from mimo_jax.optim import schedule
from mimo_jax.step import Stepper


class BridgeMismatchError(RuntimeError):
  """Image tokens reached the text of a different sample."""


def _record(step: int, metrics: dict, info: dict, step_time: float, lr: float) -> dict:
  m = jax.device_get(metrics)
  if int(m["mismatches"]):
    raise BridgeMismatchError(
        f"step {step}: {int(m['mismatches'])} image placeholders received tokens of another "
        "sample; the bridge or the slot layout is broken.")
  return {"step": step, "loss": float(m["loss"]), "grad_norm": float(m["grad_norm"]), "lr": lr,
          "tokens_per_s": info["tokens"] / step_time, "step_time_s": step_time,
          "target_tokens": info["target_tokens"], "images": info["images"]}


def run(cfg: Config) -> list[dict]:
  """Trains `cfg`; returns every record written to metrics.jsonl."""
  validate(cfg, len(jax.devices()))
  topo = topology.build(cfg)
  paths = loader.build_paths(cfg)
  modules = build_modules(cfg)
  stepper = Stepper(cfg, topo, modules)
  evaluator = Evaluator(stepper, cfg.data.max_images)
  eval_batches = loader.eval_batches(cfg, paths["eval"], topo.dp("language"))
  lr_at = schedule(cfg)
  writer = MetricsWriter(cfg.run.workdir, cfg.train.steps, cfg.run.progress)
  records = []

  def log(record: dict) -> None:
    records.append(record)
    writer.write(record)

  try:
    writer.say(f"topology: {topo.describe()}")
    state = stepper.init_state(cfg.train.seed)
    batches = loader.train_iterator(cfg, paths["train"], topo.dp("language"))
    pending, last = None, time.time()

    def flush() -> None:
      nonlocal pending, last
      step, metrics, info = pending
      jax.block_until_ready(metrics)
      now = time.time()
      if step % cfg.run.log_every == 0 or step == cfg.train.steps:
        log(_record(step, metrics, info, now - last, float(lr_at(step - 1))))
      writer.advance(1, loss=float(metrics["loss"]))
      pending, last = None, now

    for step in range(1, cfg.train.steps + 1):
      batch = next(batches)
      info = {"tokens": int(np.sum(batch["tokens_bl"] != PAD)),
              "target_tokens": int(batch["loss_mask_bl"].sum()),
              "images": int(batch["num_images_b"].sum())}
      state, metrics = stepper.train_step(state, batch)
      if pending is not None:
        flush()  # the previous step's metrics, now that this step is dispatched
      pending = (step, metrics, info)
      if cfg.eval.every and step % cfg.eval.every == 0 and step < cfg.train.steps:
        flush()
        log({"step": step, **evaluator(state, eval_batches)})
        last = time.time()
    flush()
    log({"step": cfg.train.steps, **evaluator(state, eval_batches)})
  finally:
    writer.close()
  return records
