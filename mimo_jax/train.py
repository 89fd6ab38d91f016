"""The training loop: plain Python around `Step.train_step`.

Metrics of step N are fetched after step N+1 has been dispatched, so the host never makes the
devices wait (a fetch inside the step would serialise the module meshes). A workdir that holds
checkpoints resumes from the latest; SIGTERM or SIGINT saves the last finished step and stops.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import jax
import numpy as np
from jax.experimental import multihost_utils

from mimo_jax import checkpoint, distributed, init_from, memory, workdir
from mimo_jax.batch import Batch, total
from mimo_jax.config import Config
from mimo_jax.data import capacity, loader
from mimo_jax.evaluate import Evaluator
from mimo_jax.metrics import MetricsWriter, NonFiniteError
from mimo_jax.optim import schedule
from mimo_jax.step import Step
from mimo_jax.validation import validate, validate_backend, validate_data


class BridgeMismatchError(RuntimeError):
  """Image tokens reached the text of a different sample."""


class _StopFlag:
  """Turns the first SIGTERM/SIGINT into a request to checkpoint and stop; a second SIGINT aborts
  at once (exit status 130), without saving.

  Installed for the whole run, final save and eval included. With several processes, SIGTERM goes
  to jax.distributed's preemption sync instead, which picks one step at which every process stops
  (processes see a signal at different steps).
  """

  def __init__(self, pending: str | None = None):
    self.signal = pending  # a signal an earlier flag caught (during start-up)
    self._old = {}
    self._multi = jax.process_count() > 1

  def __enter__(self):
    for sig in () if self._multi else (signal.SIGTERM, signal.SIGINT):
      self._old[sig] = signal.signal(sig, self._handle)
    return self

  def requested(self) -> bool:
    return self.signal is not None

  def should_stop(self, step: int) -> bool:
    if self._multi:
      if multihost_utils.reached_preemption_sync_point(step):
        self.signal = "SIGTERM"
    return self.signal is not None

  def _handle(self, signum, frame):
    if self.signal is not None and signum == signal.SIGINT:
      # Raising here could land inside a JAX callback, which would swallow it: leave at once.
      os.write(2, b"mimo_jax: second interrupt: stopped without saving.\n")
      os._exit(130)
    self.signal = signal.Signals(signum).name

  def __exit__(self, *exc):
    for sig, handler in self._old.items():
      signal.signal(sig, handler)


class NonFiniteStepError(FloatingPointError):
  """A step's loss or gradient norm is NaN or Inf: its state is never saved."""


def _finite(metrics: dict) -> tuple[bool, str]:
  """Whether a step's loss and global gradient norm are finite (fetched), and what they are."""
  m = distributed.fetch({"loss": metrics["loss"], "grad_norm": metrics["grad_norm"]})
  loss, norm = float(m["loss"]), float(m["grad_norm"])
  return np.isfinite(loss) and np.isfinite(norm), f"loss {loss:.4g}, grad norm {norm:.4g}"


def _record(step: int, metrics: dict, info: dict, step_time: float, lr: float) -> dict:
  m = distributed.fetch(metrics)
  if int(m["mismatches"]):
    raise BridgeMismatchError(
        f"step {step}: {int(m['mismatches'])} image placeholders received tokens of another "
        "sample; the bridge or the slot layout is broken.")
  return {"step": step, "loss": float(m["loss"]), "grad_norm": float(m["grad_norm"]), "lr": lr,
          "tokens_per_s": info["tokens"] / step_time, "step_time_s": step_time,
          "target_tokens": info["target_tokens"], "images": info["images"],
          "cost_spread": info["cost_spread"], "cost_spread_in_order": info["cost_spread_in_order"],
          "loader_wait_s": info["loader_wait_s"], "records_read": info["records_read"]}


def _batch_info(batch: Batch) -> dict:
  """What a record logs of its step's batch."""
  return {"tokens": total(batch, lambda s: s.tokens),
          "target_tokens": total(batch, lambda s: s.target_tokens),
          "images": total(batch, lambda s: s.items.get("vision", 0)),
          "records_read": total(batch, lambda s: s.records_read),
          "cost_spread": float(batch.stats.cost_spread.mean()),
          "cost_spread_in_order": float(batch.stats.cost_spread_in_order.mean())}


def run(cfg: Config) -> list[dict]:
  """Trains `cfg` (resuming from the workdir's latest checkpoint); returns the records it wrote."""
  validate(cfg, len(jax.devices()))
  validate_backend(cfg, jax.default_backend())
  # What the layout needs of each device's memory, before anything is written or compiled.
  memory.check(cfg, warn=lambda line: print(line, file=sys.stderr) if distributed.is_main()
               else None)
  validate_data(cfg)  # converted data that agrees with the run (manifest, eval split, token ids)
  trainer = Step.build(cfg)
  if not checkpoint.complete_steps(checkpoint.directory(cfg.run.workdir)):
    # A new run that starts from another (init_from): the source checked before anything is
    # written.
    init_from.params(cfg, {n: a["params"] for n, a in
                                 trainer.abstract_state(canonical=True).items()}, read=False)
  lock = None
  if distributed.is_main():
    workdir.check(cfg.run.workdir)
    lock = workdir.Lock(cfg.run.workdir).acquire()
  try:
    return _run(cfg, trainer, lock)
  finally:
    if lock is not None:
      lock.release()


def _run(cfg: Config, trainer: Step, lock) -> list[dict]:
  # A signal during start-up (data, compilation, the capacity check) ends the run before its
  # first step, with nothing to save; the loop's own flag takes over from this one.
  early = _StopFlag().__enter__()
  try:
    return _run_flagged(cfg, trainer, lock, early)
  finally:
    early.__exit__()


def _run_flagged(cfg: Config, trainer: Step, lock, early: _StopFlag) -> list[dict]:
  paths = loader.build_paths(cfg, progress=print if distributed.is_main() else None)
  topo = trainer.topo
  ckpt = checkpoint.Checkpointer(checkpoint.directory(cfg.run.workdir), list(trainer.modules),
                                 keep=cfg.checkpoint.keep)
  writer = None
  records = []
  batches = None
  try:
    found = ckpt.resume_step(cfg.checkpoint.restore_step)
    start = found or 0
    if found is not None:
      state, _ = ckpt.restore(found, trainer.abstract_state(canonical=True), cfg,
                              trainer.fresh_opt_state)
      state = trainer.from_canonical(state)
    else:
      state = trainer.init_state(cfg.train.seed)
    started = {} if found is not None else init_from.sources(cfg, list(trainer.modules))
    # Every microbatch's slots and packed rows, from the metadata, before anything compiles.
    capacity.check_capacity(cfg, paths["train"], topo.dp("language"), start, cfg.train.steps,
                            progress=print if distributed.is_main() else None,
                            stop=early.requested)
    evaluator = Evaluator(trainer, cfg.data.max_images, accuracy=cfg.data.task == "digits")
    eval_batches = loader.eval_batches(cfg, paths["eval"], topo.dp("language"))
    # The whole LR table once: evaluating the schedule per step would queue behind the step's
    # work on device 0 and make the host wait there.
    lr_at = np.asarray(jax.device_get(jax.jit(jax.vmap(schedule(cfg)))(
        np.arange(cfg.train.steps))))
    writer = MetricsWriter(cfg.run.workdir, cfg.train.steps, cfg.run.progress,
                           resume_after=start, enabled=distributed.is_main())

    def log(record: dict) -> None:
      records.append(record)
      writer.write(record)

    if lock is not None and lock.note:
      writer.say(lock.note)
    for moved in ckpt.set_aside:
      writer.say(f"moved {moved} aside (not a complete step of this run)")
    writer.say(f"topology: {topo.describe()}")
    if found is not None:
      writer.say(f"resumed from {ckpt.path} step {start}")
    for note in ckpt.notes:
      writer.say(note)
    for (field, path, step) in sorted(set(started.values())):
      names = [n for n, source in started.items() if source == (field, path, step)]
      writer.say(f"{', '.join(names)} started from {path} step {step} ({field}): parameters "
                 "only, a fresh optimizer at step 0")
    where = loader.locality(topo, loader.slot_counts(cfg))
    if not where.everything:
      writer.say("scalable data parallelism: this process reads only the records of its devices")
    batches = loader.train_iterator(cfg, paths["train"], topo.dp("language"), start_step=start,
                                    where=where)
    pending = None
    # Steps since the last record. The run's first step compiles its programs: it is in no
    # average (the first window starts when it completes); logged alone, its whole time is.
    window = {"start": None, "steps": 0, "tokens": 0}
    saved = start  # the newest step on disk (finite by construction)

    def flush() -> None:
      nonlocal pending
      step, metrics, info, dispatched = pending
      jax.block_until_ready(metrics)
      now = time.time()
      if window["start"] is None:
        window["start"] = now
      else:
        window["steps"] += 1
        window["tokens"] += info["tokens"]
      if step % cfg.run.log_every == 0 or step == cfg.train.steps:
        # Averaged over the steps since the last record: a single interval between completions
        # is noisy when metrics are fetched one step late. The last step has no successor whose
        # dispatch hides its start, so it is also timed from its own dispatch.
        if window["steps"]:
          took = (now - window["start"]) / window["steps"]
          info = dict(info, tokens=window["tokens"] / window["steps"])
        else:  # the first step logged alone: from its dispatch, compilation included
          took = now - dispatched
        if step == cfg.train.steps:
          took = max(took, now - dispatched)
        log(_record(step, metrics, info, took, float(lr_at[step - 1])))
        window.update(start=now, steps=0, tokens=0)
      writer.advance(1)
      pending = None

    def save(step: int, metrics, force: bool = False) -> None:
      """Saves `state` (of `step`) if its loss and gradient norm are finite; else stops."""
      nonlocal saved
      ok, values = _finite(metrics)
      if not ok:
        ckpt.wait()
        if saved == step - 1 and saved > start:
          # The saved state of the step before led to this one: it is not kept as a step.
          ckpt.set_aside_step(saved, "diverged")
          saved = ckpt.latest_step() or 0
        raise NonFiniteStepError(
            f"step {step} is not finite ({values}); it was not saved. The newest checkpoint "
            f"is step {saved} ({ckpt.path}); lower optim.lr (now {cfg.optim.lr}) and run again "
            "to resume from it." if saved else
            f"step {step} is not finite ({values}); nothing was saved; lower optim.lr (now "
            f"{cfg.optim.lr}) and run again.")
      ckpt.save(step, trainer.canonical(state), cfg, force=force)
      saved = step

    last = None  # (step, metrics) of the newest dispatched step
    with _StopFlag(pending=early.signal) as stop:
      try:
        for step in range(start + 1, cfg.train.steps + 1):
          if stop.requested() and last is None:
            break  # a signal before this run's first step: nothing new to save
          waited = time.time()
          batch = next(batches)
          info = {"loader_wait_s": time.time() - waited, **_batch_info(batch)}
          dispatched = time.time()
          state, metrics = trainer.train_step(state, batch)
          last = (step, metrics)
          if pending is not None:
            flush()  # the previous step's metrics, now that this step is dispatched
          pending = (step, metrics, info, dispatched)
          if stop.should_stop(step):
            flush()
            save(step, metrics, force=True)
            ckpt.wait()
            writer.say(f"{stop.signal}: saved step {step} to {ckpt.path}; run the same command "
                       "to resume.")
            return records
          if cfg.checkpoint.every and step % cfg.checkpoint.every == 0:
            save(step, metrics)
          if cfg.eval.every and step % cfg.eval.every == 0 and step < cfg.train.steps:
            flush()
            log({"step": step, **evaluator(state, eval_batches)})
            window.update(start=time.time(), steps=0, tokens=0)  # eval time is not step time
        if pending is not None:
          flush()
      except (NonFiniteStepError, NonFiniteError, BridgeMismatchError, KeyboardInterrupt):
        raise
      except Exception as e:
        _emergency_save(e, last, saved, save, ckpt, writer)
        raise
      if stop.requested() and last is None:
        writer.say(f"{stop.signal} before the first step: the newest checkpoint is step "
                   f"{saved}; run the same command to resume." if found is not None else
                   f"{stop.signal} before the first step: nothing to save.")
        return records
      if start >= cfg.train.steps:
        writer.say(f"checkpoint step {start} >= train.steps={cfg.train.steps}: nothing to train.")
      elif saved != cfg.train.steps:
        save(cfg.train.steps, last[1], force=True)
      if stop.requested():
        ckpt.wait()
        writer.say(f"{stop.signal}: saved step {cfg.train.steps} to {ckpt.path}; the final eval "
                   "was skipped.")
        return records
      if cfg.train.steps in writer.evaluated:
        return records  # this step's eval is on record already
      result = evaluator(state, eval_batches,
                         stop=None if jax.process_count() > 1 else stop.requested)
      if result is None:
        ckpt.wait()
        writer.say(f"{stop.signal}: step {cfg.train.steps} is saved in {ckpt.path}; the final "
                   "eval was cut short.")
        return records
      log({"step": cfg.train.steps, **result})
  finally:
    if batches is not None:
      batches.close()  # stops grain's worker processes and threads
    ckpt.close()
    if writer is not None:
      writer.close()
  return records


def _emergency_save(error: Exception, last, saved: int, save, ckpt, writer) -> None:
  """After an exception in the loop, saves the newest dispatched step if it finished and is
  finite, so that a rerun loses nothing; says what it did."""
  if last is None or last[0] <= saved:
    return
  step, metrics = last
  try:
    save(step, metrics, force=True)
    ckpt.wait()
  except Exception as e:  # pylint: disable=broad-except
    writer.say(f"after {type(error).__name__}: could not save step {step} ({type(e).__name__}: "
               f"{e}); the newest checkpoint is step {saved}.")
    return
  writer.say(f"after {type(error).__name__}: saved step {step} to {ckpt.path}.")
