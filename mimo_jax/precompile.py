"""Ahead-of-time compilation of the step's programs for the batch shapes a run will meet.

Bucketed layouts (data.row_buckets, the slot buckets) give a microbatch one of a few shapes, and
each shape is a program of its own: compiled when first met, each would stall the run for as long
as XLA takes. The loop reads its batches `run.compile_ahead` steps before it runs them (`Ahead`);
each shape read is compiled at once in a background thread (`jit(...).lower(...).compile()`,
which leaves its executable in jax's caches, the persistent one included, and releases the GIL
while XLA works), so the first step waits for its own program only and later shapes are ready
when met (tracing and lowering hold the GIL: the loop's dispatch may wait on them meanwhile, so
one thread traces at a time).
Only the fused step (every module on one dp-only mesh: `GradMode.fused`) varies with
the batch's shape in one program; split layouts compile their programs when met.

With `run.while_compiling=pad` no step waits for a shape after the first: the full shape (every
row and slot of a microbatch sent) compiles first, alone, and the first step runs on it; the
other shapes start once that step has ended, and until its own program is compiled a microbatch
is sent padded to the smallest compiled shape that holds it (`Compiler.fit`). Padding sends more
of the microbatch's empty rows and slots, which carry no loss: the loss and gradients are the
same sums, though a program of another shape may round them differently (so a run's last bits
depend on how fast its shapes compiled).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import threading
import time
from typing import Callable, Iterator

import jax
import numpy as np

from mimo_jax import xla_errors
from mimo_jax.batch import Batch
from mimo_jax.sharding import REPLICATED
from mimo_jax.step import Step


def abstract(tree):
  """Arrays -> their shapes, dtypes and shardings (what a program is compiled for)."""
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree)


def _abstract_put(x, sharding) -> jax.ShapeDtypeStruct:
  x = np.asarray(x)
  return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


def shape_key(x) -> tuple:
  """What tells one compiled program from another: the tree and its leaves' shapes and dtypes."""
  leaves, tree = jax.tree.flatten(x)
  return (tree, tuple((leaf.shape, str(leaf.dtype)) for leaf in leaves))


class Compiler:
  """Compiles the fused step's program per microbatch shape in background threads; `wait` makes
  the loop take a compiled program (never a second compile of one being compiled)."""

  def __init__(self, trainer: Step, threads: int, say: Callable[[str], None], pad: bool = False):
    self.trainer = trainer
    self.say = say
    self.enabled = trainer.ctx.mode.fused and threads > 0
    # run.while_compiling=pad: the full shape compiles first, and a microbatch whose own shape is
    # not compiled yet runs padded to the smallest compiled shape that holds it (`fit`).
    self.pad = pad and self.enabled
    self._sizes: dict[tuple, tuple] = {}  # key -> (rows a rank sends, {encoder: slots a rank sends})
    self._full: tuple | None = None
    self._pool = concurrent.futures.ThreadPoolExecutor(
        max(threads, 1), thread_name_prefix="mimo_jax-compile") if self.enabled else None
    self._futures: dict[tuple, concurrent.futures.Future] = {}
    self._lock = threading.Lock()
    self._tracing = threading.Lock()  # one compile thread traces at a time (`_compile`)
    self.seconds: dict[str, float] = {}  # shape -> seconds its compile took (in its thread)
    # With `pad`, the shapes after the full one start once the run's first step has ended: on a
    # restart they load from the compilation cache, and each load's tracing would hold Python's
    # lock against the first step's dispatch.
    self._first_step = threading.Event()
    self._closed = False
    self._rest = None  # the programs around the microbatches' (`_compile_rest`)
    if not self.enabled:
      return
    pr = trainer.programs
    # The parameters as the plan lays them out (what a restored or initialised state holds): the
    # programs compile while the state is still being restored.
    self._params = abstract({n: trainer.plan[n].abstract_params for n in trainer.plan.modules})
    self._acc = pr.fused_accumulator.lower(self._params).out_info
    self._inv = jax.ShapeDtypeStruct((), np.float32,
                                     sharding=trainer.plan.sharding("language", REPLICATED))
    # The programs around the microbatches' (the accumulator, each module's gradient sum over
    # ranks, squared norm and update) have one shape: compiled (or loaded from the cache) beside
    # the first step program, once that is lowered (it is the longer), not in the first step.
    self._lowered = threading.Event()  # the first step program is lowered (or failed to be)

  def keys(self, batch: Batch) -> list[tuple]:
    """Submits every microbatch shape of `batch` not met yet; returns their keys."""
    if not self.enabled:
      return []
    if self.pad and self._full is None:
      self._full = self._submit(_full(batch.microbatch(0), self.trainer.ctx.groups))
    return [self._submit(batch.microbatch(m)) for m in range(batch.microbatches)]

  def _submit(self, micro: Batch) -> tuple:
    """Submits the program of one microbatch's shape unless it was; returns its key."""
    x = self.trainer.place(micro, put=_abstract_put)
    key = shape_key((x.slots, x.text))
    with self._lock:
      if key not in self._futures:
        self._sizes[key] = _sizes(micro)
        self._futures[key] = self._pool.submit(self._compile, x, len(self._futures) + 1)
        if self._rest is None:  # next in the queue: before the shapes after the first
          self._rest = self._pool.submit(self._compile_rest)
    return key

  def fit(self, batch: Batch, keys: list[tuple]) -> tuple[Batch, list[tuple], int]:
    """With `pad`: `batch` with each microbatch whose program is not compiled yet sent padded to
    the smallest compiled shape that holds it (more of its empty rows and slots travel: the
    values are the same, the program is another), waiting only while no compiled shape holds it
    (the run's first step, for the full shape). Returns the batch, its microbatches' keys and
    how many of them run padded."""
    if not self.pad:
      return batch, keys, 0
    rows = np.array(batch.text.rows_sent)
    sent = {n: np.array(s.sent) for n, s in batch.slots.items()}
    out, padded = [], 0
    for m, key in enumerate(keys):
      if self._futures[key].done():
        out.append(key)
        continue
      need = self._sizes[key]
      fits = [k for k in self._compiled() if _holds(self._sizes[k], need)]
      if not fits:
        self._futures[self._full].result()  # the first step: wait for the shape that holds all
        fits = [self._full]
      best = min(fits, key=lambda k: _cost(self._sizes[k]))
      rows[m] = self._sizes[best][0]
      for n in sent:
        sent[n][m] = self._sizes[best][1][n]
      out.append(best)
      padded += 1
    if not padded:
      return batch, out, 0
    text = dataclasses.replace(batch.text, rows_sent=rows)
    slots = {n: dataclasses.replace(s, sent=sent[n]) for n, s in batch.slots.items()}
    return dataclasses.replace(batch, text=text, slots=slots), out, padded

  def _compiled(self) -> list[tuple]:
    with self._lock:
      return [k for k, f in self._futures.items() if f.done() and f.exception() is None]

  def _compile(self, x: Batch, number: int) -> float:
    if self.pad and number > 1:  # the full shape alone first: the first step needs only it
      concurrent.futures.wait([self._futures[self._full]])
      self._first_step.wait()
      if self._closed:  # the run ended before its first step: a process exit waits for compiles
        raise concurrent.futures.CancelledError()
    started = time.perf_counter()
    name = describe(x)
    try:
      # Tracing and lowering are Python, under its lock: one thread at a time, so that the loop's
      # own Python work competes with one of them, not with every thread; XLA's compiles, which
      # release that lock, run side by side.
      with self._tracing:
        try:
          lowered = self.trainer.programs.fused_step.lower(self._params, self._acc, x.slots,
                                                           x.text, self._inv)
        finally:
          self._lowered.set()
      lowered.compile()
    except Exception as e:  # raised where the loop waits for it; said here, in case it never does
      self.say(f"compiling step program {number} ({name}) failed: {type(e).__name__}: "
               f"{xla_errors.sentence(e)}")
      raise
    took = time.perf_counter() - started
    self.seconds[name] = took
    self.say(f"compiled step program {number} ({name}) in {took:.1f} s")
    return took

  def _compile_rest(self) -> None:
    self._lowered.wait()
    if self._closed:
      raise concurrent.futures.CancelledError()
    try:
      with self._tracing:
        lowered = self.trainer.lower_after_microbatches(self._params, self._acc)
      for one in lowered:
        if self._closed:  # the run ended: a process exit would wait for the compiles
          raise concurrent.futures.CancelledError()
        one.compile()
    except concurrent.futures.CancelledError:
      raise
    except Exception as e:  # the step compiles them when met, and raises there if they fail
      self.say(f"compiling the step's update programs ahead failed: {type(e).__name__}: "
               f"{xla_errors.sentence(e)}")
      raise

  def ready(self, keys: list[tuple]) -> bool:
    """Whether the programs of `keys` are compiled (or failed: `wait` raises their error)."""
    return all(self._futures[key].done() for key in keys)

  def wait(self, keys: list[tuple]) -> float:
    """Blocks until the programs of `keys` are compiled (raising a compile's error here);
    returns the seconds waited."""
    started = time.perf_counter()
    for key in keys:
      self._futures[key].result()
    if self._rest is not None and not self._rest.cancelled():  # not compiled twice at once (an
      concurrent.futures.wait([self._rest])  # error of its: raised when the step meets it)
    return time.perf_counter() - started

  def first_step_ended(self) -> None:
    """Lets the shapes after the full one start (with `pad`; see `__init__`)."""
    self._first_step.set()

  @property
  def shapes(self) -> int:
    return len(self._futures)

  def close(self) -> None:
    self._closed = True
    self._first_step.set()
    if self._rest is not None:
      self._lowered.set()
    if self._pool is not None:
      self._pool.shutdown(wait=False, cancel_futures=True)  # a running compile finishes alone


def _sizes(micro: Batch) -> tuple:
  return int(micro.text.rows_sent), {n: int(s.sent) for n, s in micro.slots.items()}


def _full(micro: Batch, groups: int) -> Batch:
  """`micro` with every row and slot of each rank sent: the shape that holds any microbatch."""
  text = dataclasses.replace(micro.text, rows_sent=np.asarray(micro.text.tokens_rl.shape[0]
                                                              // groups))
  slots = {n: dataclasses.replace(s, sent=np.asarray(s.owner_nt.shape[0] // groups))
           for n, s in micro.slots.items()}
  return dataclasses.replace(micro, text=text, slots=slots)


def _holds(big: tuple, small: tuple) -> bool:
  return big[0] >= small[0] and all(big[1][n] >= v for n, v in small[1].items())


def _cost(size: tuple) -> tuple:
  """Smaller first: rows (the language model's work), then slots."""
  return size[0], sum(size[1].values())


def describe(x: Batch) -> str:
  """A microbatch shape in words: its language rows and each encoder's slots."""
  rows = x.text.tokens_rl.shape[0]
  slots = ", ".join(f"{n} {jax.tree.leaves(s.owner_nt)[0].shape[0]} slots"
                    for n, s in sorted(x.slots.items()))
  return f"{rows} rows" + (f", {slots}" if slots else "")


class Ahead:
  """The loop's batches read `depth` steps ahead, each submitted to `compiler` as it is read:
  yields (batch, its program keys). Reads `limit` batches at most (the run's steps: none past its
  end is read or compiled)."""

  def __init__(self, batches: Iterator[Batch], compiler: Compiler | None, depth: int,
               limit: int | None = None):
    self.batches = batches
    self.compiler = compiler
    self.depth = depth
    self.left = limit  # batches still to read; None = no end
    self._buffer = collections.deque()
    self._done = False

  def _read(self) -> None:
    if self.left is not None:
      if self.left <= 0:
        self._done = True
        return
      self.left -= 1
    try:
      batch = next(self.batches)
    except StopIteration:
      self._done = True
      return
    self._buffer.append((batch, self.compiler.keys(batch) if self.compiler else []))

  def prime(self) -> None:
    """Reads the first step's batch now, so that its programs start compiling (while the run
    restores its state)."""
    if not self._buffer and not self._done:
      self._read()

  def __next__(self) -> tuple[Batch, list[tuple]]:
    if not self._buffer:
      self._read()  # the next step's batch first: its program compiles first
    while not self._done and len(self._buffer) <= self.depth:
      self._read()
    if not self._buffer:
      raise StopIteration
    return self._buffer.popleft()

  def close(self) -> None:
    self.batches.close()
