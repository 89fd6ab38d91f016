"""The training loop: plain Python around `Step.train_step`.

Metrics of step N are fetched after step N+1 has been dispatched, so the host never makes the
devices wait (a fetch inside the step would serialise the module meshes). A workdir that holds
checkpoints resumes from the latest; SIGTERM or SIGINT saves the last finished step and stops.
"""

from __future__ import annotations

import sys
import time

import jax
import numpy as np

from mimo_jax import (checkpoint, checkpoint_steps, compile_cache, distributed, eval_set,
                      init_from, memory, precompile, step_records, workdir, xla_errors)
from mimo_jax import state as state_lib
from mimo_jax.config import Config, lora_of
from mimo_jax.data import capacity, loader
from mimo_jax.evaluate import Evaluator
from mimo_jax.metrics import (MetricsWriter, NonFiniteError, SaidLater, StepWindow,
                              evaluated_through, stamped)
from mimo_jax.optim import schedule
from mimo_jax.start_lines import opening_lines, start_lines
from mimo_jax.step import Step
from mimo_jax.step_records import BridgeMismatchError, NonFiniteStepError
from mimo_jax.stopping import StopFlag
from mimo_jax.validation import validate, validate_backend
from mimo_jax.validation_data import validate_data
from mimo_jax.words import count


def run(cfg: Config, pending=None) -> list[dict]:
  """Trains `cfg` (resuming from the workdir's latest checkpoint); returns the records it wrote.
  `pending()`: the name of a signal its caller took before (launch's start-up), or None."""
  started = time.time()
  compile_cache.enable(cfg.run.compile_cache)  # before anything compiles
  # A signal during start-up (the checks, building the step, data, compilation, the capacity
  # check) ends the run before its first step, nothing saved; the loop's flag takes over.
  taken = pending or (lambda: None)
  with StopFlag(pending=taken()) as early:
    early.signal = early.signal or taken()  # one the caller took while this flag was installed
    validate(cfg, len(jax.devices()))
    validate_backend(cfg, jax.default_backend(), jax.process_count())
    # What the layout needs of each device's memory, before anything is written or compiled.
    memory.check(cfg, warn=lambda line: print(line, file=sys.stderr) if distributed.is_main()
                 else None)
    validate_data(cfg)  # converted data that agrees with the run (manifest, eval split, token ids)
    trainer = Step.build(cfg)
    if not checkpoint_steps.complete_steps(checkpoint_steps.directory(cfg.run.workdir)):
      # A new run that starts from another (init_from): the source checked before anything is
      # written.
      init_from.params(cfg, {n: a["params"] for n, a in
                                   trainer.abstract_state(canonical=True).items()}, read=False)
    if early.requested():  # before anything is made
      return early.before_first_step(distributed.is_main())
    # What the workdir holds before the run writes there: a run that ends before its first step
    # (an error, a signal) removes what it made, its workdir too, and leaves nothing behind.
    made = workdir.Made(cfg.run.workdir) if distributed.is_main() else None
    lock = error = None
    try:
      if made is not None:
        try:
          workdir.check(cfg.run.workdir)
          lock = workdir.Lock(cfg.run.workdir).acquire()
        except (workdir.WorkdirError, OSError) as e:  # the others learn of it below
          error = e
      distributed.main_check("workdir", error, f"run.workdir={cfg.run.workdir!r}")
      return _run(cfg, trainer, lock, started, early)
    finally:
      if made is not None:
        made.remove_unused(lock)  # releases the lock


def _run(cfg: Config, trainer: Step, lock: workdir.Lock | None, started: float,
         early: StopFlag) -> list[dict]:
  say = print if distributed.is_main() else None
  paths = early.unless_stopped(lambda: loader.build_paths(cfg, progress=say))
  if paths is None:  # a signal before or while the built-in task's data was built: none of it
    return early.before_first_step(distributed.is_main())
  loop = _Loop(cfg, trainer, started)
  try:
    loop.open(paths, lock, early)
    return loop.run(early.signal)
  except Exception as e:
    said = memory.out_of_memory(e, cfg, loop.doing)  # a device's memory: one line, its fixes
    if said is None:
      raise
    raise said from e
  finally:
    loop.close()


class _Loop:
  """One run's training loop: its state, the step whose metrics are still on the devices, what
  is saved and what is logged. `open`, then `run`; `close` always."""

  def __init__(self, cfg: Config, trainer: Step, started: float):
    self.cfg, self.trainer = cfg, trainer
    self.lora = any(lora_of(cfg, n) for n in trainer.modules)  # frozen weights stay in a base
    self.started = started  # when `run` was called: time to first step counts from here
    self.compiler: precompile.Compiler | None = None
    self.compile_wait = 0.0  # seconds the loop waited for programs compiled ahead
    self.padded = 0  # microbatches run padded to a compiled shape since the last record
    self.first_at, self.first_step = None, 0  # when this run's first step ended, and which
    self.ckpt = checkpoint.Checkpointer(checkpoint_steps.directory(cfg.run.workdir),
                                        list(trainer.modules), keep=cfg.checkpoint.keep,
                                        keep_steps=(0,) if self.lora else ())
    self.ckpt.moved_base = cfg.checkpoint.base
    self.writer: MetricsWriter | None = None
    self.batches = None  # the training data's iterator, from the step after `start`
    self.records: list[dict] = []
    # Set by `open`:
    self.resumed = False  # whether the run resumed from a checkpoint of its workdir
    self.restored = (0.0, 0.0)  # GiB of state restored, and the seconds it took
    self.finished = False  # its checkpoint is the last step, whose final eval is on record
    self.start = 0  # the step the run starts after (its checkpoint's, or 0)
    self.saved = 0  # the newest step on disk (finite by construction)
    self.writing = None  # the step of the newest save asked for (committed or in flight)
    self.state = None  # module -> the state of the newest dispatched step
    self.evaluator: Evaluator | None = None
    self.eval_batches = None
    self.lr_at = None  # the learning rate of every step (index step - 1)
    # The loop's progress:
    self.pending = None  # (step, metrics, info, dispatched) of a step not fetched yet
    self.unlogged = None  # (step, metrics, info, dispatched, ended) of a fetched step not logged
    self.last = None  # (step, metrics) of the newest dispatched step
    self.window = StepWindow()
    self.doing = memory.STATE  # what runs (memory.STEP, memory.EVAL), for an error's line

  def open(self, paths: dict, lock: workdir.Lock | None, early: StopFlag) -> None:
    """Checks capacity, opens the data (the first step's programs start compiling ahead), restores
    (or initialises) the state meanwhile, and opens the outputs."""
    cfg, trainer, ckpt = self.cfg, self.trainer, self.ckpt
    found = ckpt.resume_step(cfg.checkpoint.restore_step)
    self.resumed = found is not None
    self.start = self.saved = found or 0
    # The checkpoint agrees with the config (model, modules, data) before anything else runs.
    meta = ckpt.checked_meta(found, cfg) if found is not None else {}
    dp = trainer.topo.dp("language")
    # Every microbatch's slots and packed rows, from the metadata, before anything compiles.
    capacity.check_capacity(cfg, paths["train"], dp, self.start, cfg.train.steps,
                            progress=print if distributed.is_main() else None,
                            stop=early.requested)
    where = loader.locality(trainer.topo, loader.slot_counts(cfg))
    said = SaidLater()  # the compile threads' lines, said once the outputs are open
    if cfg.run.compile_ahead and trainer.ctx.mode.fused:  # else each shape compiles when met
      self.compiler = precompile.Compiler(trainer, cfg.run.compile_threads, said,
                                          pad=cfg.run.while_compiling == "pad")
    self.batches = precompile.Ahead(
        loader.train_iterator(cfg, paths["train"], dp, start_step=self.start, where=where),
        self.compiler, cfg.run.compile_ahead if self.compiler else 0,
        limit=cfg.train.steps - self.start)
    if self.compiler is not None and not early.requested():
      self.batches.prime()  # its programs compile while the state is restored
    # A finished run whose final eval is on record has nothing to do: its state is not restored.
    self.finished = found is not None and self._finished(found)
    if distributed.is_main():  # before the restore or initialisation, which can take a while
      for line in opening_lines(self, lock.note if lock is not None else None, paths, found):
        print(stamped(self.started, line), flush=True)
    if found is not None and not self.finished:
      began = time.time()
      state, meta = ckpt.restore(found, trainer.abstract_state(canonical=True), cfg,
                                 trainer.fresh_opt_state, meta=meta)
      self.state = trainer.from_canonical(state)
      arrays = jax.tree.leaves([(s.params, s.opt_state) for s in self.state.values()])
      self.restored = (sum(a.nbytes for a in arrays) / 2**30, time.time() - began)
    elif found is None:
      self.state = trainer.init_state(cfg.train.seed)
    jax.block_until_ready(self.state)  # a device out of memory for it says so here (`doing`)
    checkpoint.name_base(ckpt, cfg, found, meta, lambda: trainer.canonical(self.state),
                         state_lib.frozen_paths(trainer.plan, self.lora))
    started = {} if found is not None else init_from.sources(cfg, list(trainer.modules))
    self.evaluator = Evaluator(trainer, eval_set.generated(cfg, paths["eval"], dp))
    self.eval_batches = loader.eval_batches(cfg, paths["eval"], dp)
    # The whole LR table once: evaluating the schedule per step would queue behind the step's
    # work on device 0 and make the host wait there.
    self.lr_at = np.asarray(jax.device_get(jax.jit(jax.vmap(schedule(cfg)))(
        np.arange(cfg.train.steps))))
    self.writer = MetricsWriter(cfg.run.workdir, cfg.train.steps, cfg.run.progress,
                                resume_after=self.start, enabled=distributed.is_main(),
                                started=self.started)  # its clock: the time to first step's
    for line in start_lines(self, started):
      self.writer.say(line)
    if not where.everything:
      self.writer.say("scalable data parallelism: this process reads only the records of its "
                      "devices")
    if cfg.run.while_compiling == "pad" and self.compiler is None:
      self.writer.say("run.while_compiling=pad does not apply: this layout compiles each shape "
                      "when met (padding to a compiled shape needs run.compile_ahead > 0 and "
                      "every module on one dp-only mesh)")
    said.to(self.writer.say)

  def _finished(self, found: int) -> bool:
    """Whether the checkpoint `found` is the last step and its final eval is on record (process
    0 reads the records; every process takes its answer): a run of it has nothing to do."""
    steps = self.cfg.train.steps
    return found >= steps and distributed.main_says(
        "finished_at_open", distributed.is_main() and
        steps in evaluated_through(self.cfg.run.workdir, found))

  def run(self, pending_signal: str | None) -> list[dict]:
    """Trains to train.steps, saves the last step and evaluates it, under SIGTERM/SIGINT
    handlers; returns the records written."""
    with StopFlag(pending=pending_signal) as stop:
      try:
        if self._train(stop):
          return self.records
      except (NonFiniteStepError, NonFiniteError, BridgeMismatchError, KeyboardInterrupt):
        raise
      except Exception as e:
        self._emergency_save(e)
        raise
      self._finish(stop)
    return self.records

  def _train(self, stop: StopFlag) -> bool:
    """The steps, with their saves and evals; True when a signal stopped them (step saved)."""
    cfg = self.cfg
    self.doing = memory.STEP
    for step in range(self.start + 1, cfg.train.steps + 1):
      if stop.requested() and self.last is None:
        break  # a signal before this run's first step: nothing new to save
      metrics = self._dispatch(step, stop)
      if metrics is None:
        break  # a signal while this run's first step compiled: nothing new to save
      if stop.should_stop(step):
        self._flush(stopping=True)
        self._save(step, metrics, force=True)
        self._wait()
        self.writer.say(f"{stop.signal}: saved step {step} to {self.ckpt.path}; run the same "
                        "command to resume.")
        return True
      if cfg.checkpoint.every and step % cfg.checkpoint.every == 0:
        self._save(step, metrics)
      if cfg.eval.every and step % cfg.eval.every == 0 and step < cfg.train.steps:
        self._flush()
        self._log({"step": step, **self._evaluate()})
        self.window.restart(time.time())  # eval time is not step time
    if self.pending is not None:
      self._flush()
    return False

  def _dispatch(self, step: int, stop: StopFlag | None = None):
    """Dispatches `step`, then fetches the previous step's metrics; returns this step's. None,
    with nothing dispatched or its result not kept, for a signal taken while this run's first
    step compiled (one process: several agree on the step they stop at, stop.should_stop): the
    run stops as before its first step, without the wait of a save."""
    first = stop is not None and self.last is None and jax.process_count() == 1
    waited = time.time()
    batch, keys = next(self.batches)
    info = {"loader_wait_s": time.time() - waited, **step_records.batch_info(batch, self.cfg)}
    if self.compiler is not None:
      batch, keys, padded = self.compiler.fit(batch, keys)
      if self.compiler.pad:
        info["compile_padded"] = padded
      if self.pending is not None and not self.compiler.ready(keys):
        self._flush()  # the previous step ends (and logs) while this one's programs compile
      if self.last is None and not self.compiler.ready(keys):  # a wait that can take a minute
        self.writer.say(f"step {step} waits for its step program to compile")
      self.compile_wait += self.compiler.wait(keys)
      if first and stop.requested():
        return None
    dispatched = time.time()
    self.state, metrics = self.trainer.train_step(self.state, batch)
    if first and stop.requested():  # taken while the step program compiled in this call
      return None
    self.last = (step, metrics)
    if self.pending is not None:
      self._flush()  # the previous step's metrics, now that this step is dispatched
    self.pending = (step, metrics, info, dispatched)
    return metrics

  def _flush(self, stopping: bool = False) -> None:
    """Waits for the pending step; logs its record if it is a step to log: a step of
    run.log_every, the last step, or (`stopping`) the step saved as the run stops, if finite."""
    step, metrics, info, dispatched = self.pending
    jax.block_until_ready(metrics)
    now = time.time()
    if self.window.start is None:
      self._first_step(step, now)
    self.window.completed(now, info["tokens"])
    self.padded += info.get("compile_padded", 0)
    steps = self.cfg.train.steps
    self.unlogged = (step, metrics, info, dispatched, now)
    if (step % self.cfg.run.log_every == 0 or step == steps or
        (stopping and step_records.finite(metrics)[0])):
      self._log_step()
    if step == steps and self.first_at is not None:
      # The run's wall against its steady steps: every compile of a new shape is inside it.
      after = (f", {now - self.first_at:.1f} s after the first step ended (steps "
               f"{self.first_step + 1}-{step})" if step > self.first_step else
               " (the run's one step)")
      self.writer.say(f"step {step} ended {now - self.started:.1f} s after the start{after}")
    self.writer.advance(1)
    self.pending = None

  def _log_step(self) -> None:
    """Logs the newest fetched step's record (its step time: the mean since the last record)."""
    (step, metrics, info, dispatched, now), self.unlogged = self.unlogged, None
    if "compile_padded" in info:  # the microbatches of the record's steps that ran padded
      info, self.padded = dict(info, compile_padded=self.padded), 0
    took, info = self.window.timing(now, dispatched, info)
    self._log(step_records.record(step, metrics, info, took, float(self.lr_at[step - 1])))
    self.window.restart(now)

  def _first_step(self, step: int, now: float) -> None:
    """Says how long the run took to its first step (start-up and compiling included)."""
    self.first_at, self.first_step = now, step
    if self.compiler is not None:
      self.compiler.first_step_ended()
    how = (f"waited {self.compile_wait:.1f} s for its programs, compiled ahead; "
           f"{count(self.compiler.shapes, 'step program shape')} read so far" if self.compiler else
           "its programs compiled when met")
    self.writer.say(f"time to first step: {now - self.started:.1f} s (step {step}; {how})")

  def _log(self, record: dict) -> None:
    self.records.append(record)
    self.writer.write(record)

  def _save(self, step: int, metrics, force: bool = False) -> None:
    """Saves the state (of `step`) if its loss and gradient norm are finite; else stops."""
    ok, values = step_records.finite(metrics)
    if not ok:
      self._wait()
      if self.saved == step - 1 and self.saved > self.start:
        # The saved state of the step before led to this one: it is not kept as a step.
        self.ckpt.set_aside_step(self.saved, "diverged")
        self.saved = self.ckpt.latest_step() or 0
      raise step_records.not_saved(step, values, self.saved, self.ckpt.path, self.cfg.optim.lr)
    self._wait()  # the save before: orbax's own wait would raise an old step's removal failure
    self.writing = step
    try:
      self.ckpt.save(step, self.trainer.canonical(self.state), self.cfg, force=force)
    except OSError as e:  # a save that blocks (several processes) removes old steps inside it
      if not self._not_removed(e):
        raise
    self.saved = step

  def _wait(self) -> None:
    """Waits for the save in flight; raises its failure, except a failure to remove an old step
    (`_not_removed`)."""
    try:
      self.ckpt.wait()
    except OSError as e:
      if not self._not_removed(e):
        raise

  def _not_removed(self, e: OSError) -> bool:
    """Whether `e`, raised by the newest save, is a failure to remove an old step
    (checkpoint_steps.removal_warning); says so, as a warning: the run goes on."""
    said = checkpoint_steps.removal_warning(self.ckpt.path, self.writing, e,
                                            self.cfg.checkpoint.keep)
    if said is not None:
      self.writer.say(said)
    return said is not None

  def _finish(self, stop: StopFlag) -> None:
    """After the steps: saves the last one and runs the final eval, unless a signal says not."""
    steps, say = self.cfg.train.steps, self.writer.say
    if stop.requested() and self.last is None:
      say(f"{stop.signal} before the first step: the newest checkpoint is step {self.saved}; "
          "run the same command to resume." if self.resumed else
          f"{stop.signal} before the first step: nothing to save.")
      return
    if self.start >= steps:
      say(f"checkpoint step {self.start} >= train.steps={steps}: nothing to train.")
    elif self.saved != steps:
      self._save(steps, self.last[1], force=True)
    if stop.requested():
      self._wait()
      say(f"{stop.signal}: saved step {steps} to {self.ckpt.path}; the final eval was skipped.")
      return
    # The state's step: train.steps, or a later one restored (train.steps lowered on a resume).
    at = max(steps, self.start)
    if self.finished or self._evaluated(at):
      return  # this step's eval is on record already
    say(f"step {at}: the final eval, {self.cfg.eval.samples} samples")  # a quiet wait otherwise
    result = self._evaluate(stop=None if jax.process_count() > 1 else stop.requested)
    if result is None:
      self._wait()
      say(f"{stop.signal}: step {at} is saved in {self.ckpt.path}; the final eval was cut "
          "short.")
      return
    self._log({"step": at, **result})

  def _evaluate(self, stop=None) -> dict | None:
    self.doing = memory.EVAL
    result = self.evaluator(self.state, self.eval_batches, stop=stop)
    self.doing = memory.STEP
    return result

  def _evaluated(self, step: int) -> bool:
    """Whether `step`'s eval is on record already: process 0's metrics say (the other processes'
    writers read none), and every process takes its answer, since the eval runs on all."""
    return distributed.main_says("final_eval_known", step in self.writer.evaluated)

  def _emergency_save(self, error: Exception) -> None:
    """After an exception in the loop, saves the newest dispatched step if it finished and is
    finite (a rerun loses nothing), logging its record as a logged step's; says what it did."""
    if self.last is None or self.last[0] <= self.saved:
      return
    step, metrics = self.last
    after = ("the device ran out of memory" if xla_errors.out_of_memory(error) else
             type(error).__name__)
    try:  # its record, before it is saved
      if self.pending is not None and self.pending[0] == step:
        self._flush(stopping=True)
      elif self.unlogged is not None and self.unlogged[0] == step:
        if step_records.finite(metrics)[0]:  # fetched, not logged: an error before its save
          self._log_step()
    except Exception:  # pylint: disable=broad-except  (the save goes on; `error` is reported)
      pass
    try:
      self._save(step, metrics, force=True)
      self._wait()
    except Exception as e:  # pylint: disable=broad-except
      # The steps committed, not those asked for: an earlier asynchronous save may have failed,
      # or be committing still (waited for here).
      try:
        self._wait()
      except Exception:  # pylint: disable=broad-except  (its failure is the one reported)
        pass
      done = checkpoint_steps.complete_steps(self.ckpt.path)
      why = ("it did not finish" if xla_errors.out_of_memory(e) else
             f"{type(e).__name__}: {xla_errors.sentence(e)}")
      self.writer.say(f"after {after}: could not save step {step} ({why}); " +
                      (f"the newest checkpoint is step {done[-1]}." if done else
                       "no step of this run is saved."))
      return
    self.writer.say(f"after {after}: saved step {step} to {self.ckpt.path}.")

  def close(self) -> None:
    """Stops the data's workers and closes the checkpoints and outputs."""
    try:
      if self.compiler is not None:
        self.compiler.close()  # first: nothing waits on the data's workers to stop
      if self.batches is not None:
        self.batches.close()  # stops grain's worker processes and threads
      try:
        self._wait()  # raises a save's failure; the last save's removal of old steps, a warning
      finally:
        self.ckpt.close()
    finally:
      if self.writer is not None:
        self.writer.close()
