"""Pipeline schedules as values: what each stage does at each time step, checked and lowered to the
integer tables the executors in pipeline.py scan over.

A schedule is `Tasks`: for each stage, a `Task` (kind, microbatch, chunk) or None (idle) a time
step. The layers form p·v chunks of L/(p·v) in model order; chunk c lives on stage c mod p (v
chunks a stage). A schedule of forward tasks alone has its backward made by autodiff (the
transpose of the forward loop: all forwards, then all backwards); a schedule with backward tasks
runs them itself, in its own order. For M microbatches:

* `gpipe` (v = 1): stage s runs microbatch m at step m + s; M + p − 1 steps.
* `circular` (v > 1): a microbatch goes round the ring v times, round r at step r·M + m + s
  (M ≥ p).
* `one_f_one_b` (v = 1): stage s runs 2(p − s − 1) forwards, then one forward and one backward
  in turn, then the remaining backwards; it holds at most 2(p − s) − 1 microbatches' inputs.
* `interleaved_1f1b` (v > 1, M a multiple of p): the same with v chunks a stage, in groups of p
  microbatches a chunk (Megatron's virtual pipeline), warming up with 2(p − s − 1) + (v − 1)·p.

The one-forward-one-backward schedules are built from each stage's order of tasks (`_as_soon`):
every task runs at the first step after what it needs (the previous chunk's forward, the next
chunk's backward) has run, forwards at even steps and backwards at odd ones. The stages run in
lockstep (a step ends with every stage's sends), so a step takes as long as its slowest task: a
backward (which recomputes its chunk) takes about three forwards, and a schedule that let one
stage's forward share a step with another's backward would pay a backward's time for both.
Phased, the steps alternate forwards and backwards on every stage, and a step of forwards costs
a forward; the longer warm-up of `one_f_one_b` (2(p − s − 1) forwards, not Megatron's p − s − 1)
fills the pipeline for that, and keeps the number of microbatches in flight independent of M.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np

FORWARD = "forward"  # run a chunk's layers on a microbatch's activations
BACKWARD = "backward"  # run a chunk's backward on a microbatch: recompute, apply the cotangent
KINDS = (FORWARD, BACKWARD)


class Task(NamedTuple):
  """One stage's work in one time step: `kind` on chunk `chunk` of microbatch `microbatch`.

  Chunk c is layers [c·L/(p·v), (c+1)·L/(p·v)) and lives on stage c mod p, so the stage a task
  runs on is implied by its chunk."""
  kind: str
  microbatch: int
  chunk: int


Tasks = tuple[tuple[Task | None, ...], ...]  # [stage][step]: a stage's work a step, None idle


def gpipe(stages: int, microbatches: int, virtual: int = 1) -> Tasks:
  """GPipe: stage s runs microbatch m at step m + s; M + p − 1 steps."""
  if virtual != 1:
    raise ValueError(f"gpipe runs one chunk a stage, got virtual={virtual}; use circular.")
  steps = microbatches + stages - 1
  return tuple(tuple(Task(FORWARD, t - s, s) if 0 <= t - s < microbatches else None
                     for t in range(steps)) for s in range(stages))


def circular(stages: int, microbatches: int, virtual: int) -> Tasks:
  """Circular: microbatch m goes round the ring v times, round r (chunk r·p + s) on stage s at
  step r·M + m + s. Round r + 1 starts M steps after round r on stage 0, and the microbatch comes
  back from the last stage after p steps: M ≥ p."""
  if virtual > 1 and microbatches < stages:
    raise ValueError(f"the circular schedule needs at least as many microbatches as stages, got "
                     f"{microbatches} for {stages} stages: a microbatch would start its next "
                     f"round before it comes back; use at least {stages} microbatches.")
  items = microbatches * virtual  # (round, microbatch) pairs, in the order every stage runs them

  def task(s: int, i: int) -> Task | None:
    if not 0 <= i < items:
      return None
    rnd, m = divmod(i, microbatches)
    return Task(FORWARD, m, rnd * stages + s)
  return tuple(tuple(task(s, t - s) for t in range(items + stages - 1)) for s in range(stages))


def _one_f_one_b_order(forwards: list[Task], backwards: list[Task], warmup: int) -> list[Task]:
  """A stage's order: `warmup` forwards, then one forward and one backward in turn, then the
  backwards left."""
  steady = len(forwards) - warmup
  order = forwards[:warmup]
  for i in range(steady):
    order += [forwards[warmup + i], backwards[i]]
  return order + backwards[steady:]


def _as_soon(orders: list[list[Task]], chunks: int) -> Tasks:
  """Each stage's `orders` on a time grid: a task runs at the first step after what it needs
  has run (a forward: the previous chunk's forward; a backward: its forward and the next chunk's
  backward) and after the task before it on its stage, forwards at even steps and backwards at
  odd ones (phased: every stage does the same kind of work in a step)."""
  stages, done, rows = len(orders), {}, [[] for _ in orders]
  nxt = [0] * stages
  t = idle = 0  # idle: steps in a row in which no task ran
  while any(n < len(o) for n, o in zip(nxt, orders)):
    ran = False
    for s, order in enumerate(orders):
      task = order[nxt[s]] if nxt[s] < len(order) else None
      needs = [] if task is None else (
          [(FORWARD, task.microbatch, task.chunk - 1)] if task.kind == FORWARD and task.chunk
          else [(FORWARD, task.microbatch, task.chunk)] + (
              [(BACKWARD, task.microbatch, task.chunk + 1)] if task.chunk + 1 < chunks else [])
          if task.kind == BACKWARD else [])
      phase = t % 2 == (0 if task is None or task.kind == FORWARD else 1)
      if task is not None and phase and all(done.get(n, t) < t for n in needs):
        rows[s].append(task)
        nxt[s] += 1
        ran = True
      else:
        rows[s].append(None)
    for s in range(stages):
      if rows[s][-1] is not None:
        done[tuple(rows[s][-1])] = t
    idle = 0 if ran else idle + 1
    if idle == 2:  # neither phase could run a task
      raise ValueError("the stages' task orders wait on each other: no task can run.")
    t += 1
  return tuple(tuple(row) for row in rows)


def one_f_one_b(stages: int, microbatches: int, virtual: int = 1) -> Tasks:
  """1F1B: stage s runs min(2(p − s − 1), M) forwards, then one forward and one backward in
  turn, then the backwards left (phased, `_as_soon`); a stage holds at most 2(p − s) − 1
  microbatches' inputs."""
  if virtual != 1:
    raise ValueError(f"1f1b runs one chunk a stage, got virtual={virtual}; use interleaved_1f1b.")
  orders = []
  for s in range(stages):
    f = [Task(FORWARD, m, s) for m in range(microbatches)]
    b = [Task(BACKWARD, m, s) for m in range(microbatches)]
    orders.append(_one_f_one_b_order(f, b, min(2 * (stages - s - 1), microbatches)))
  return _as_soon(orders, stages)


def interleaved_1f1b(stages: int, microbatches: int, virtual: int) -> Tasks:
  """Interleaved 1F1B (Megatron's virtual pipeline): a stage's k-th forward is microbatch
  (k // (p·v))·p + k mod p on its round (k mod p·v) // p (chunk round·p + s); its backwards go
  through the rounds in reverse. Warm-up: min(2(p − s − 1) + (v − 1)·p, M·v) forwards."""
  if virtual < 2:
    raise ValueError(f"interleaved_1f1b runs several chunks a stage, got virtual={virtual}; "
                     "use 1f1b.")
  if microbatches % stages:
    raise ValueError(f"the interleaved 1F1B schedule takes microbatches in groups of the "
                     f"{stages} stages, got {microbatches}; use a multiple of {stages}.")
  group = stages * virtual

  def nth(kind: str, s: int, k: int) -> Task:
    rnd = (k % group) // stages
    m = (k // group) * stages + k % stages
    return Task(kind, m, (rnd if kind == FORWARD else virtual - 1 - rnd) * stages + s)
  orders = []
  for s in range(stages):
    items = range(microbatches * virtual)
    warmup = min(2 * (stages - s - 1) + (virtual - 1) * stages, microbatches * virtual)
    orders.append(_one_f_one_b_order([nth(FORWARD, s, k) for k in items],
                                     [nth(BACKWARD, s, k) for k in items], warmup))
  return _as_soon(orders, stages * virtual)


# A schedule's name -> the function building its tasks from (stages, microbatches, virtual).
SCHEDULES: dict[str, Callable[[int, int, int], Tasks]] = {
    "gpipe": gpipe, "circular": circular, "1f1b": one_f_one_b,
    "interleaved_1f1b": interleaved_1f1b}


def has_backward(tasks: Tasks) -> bool:
  """Whether `tasks` runs its own backward (else autodiff transposes its forward loop)."""
  return any(x is not None and x.kind == BACKWARD for row in tasks for x in row)


def _steps(tasks: Tasks, kind: str = FORWARD) -> dict[tuple[int, int], int]:
  """(microbatch, chunk) -> the step its `kind` task runs at."""
  return {(x.microbatch, x.chunk): t for row in tasks for t, x in enumerate(row)
          if x is not None and x.kind == kind}


def _check_task(task: Task, s: int, t: int, stages: int, microbatches: int, chunks: int) -> None:
  """Raises ValueError unless `task`, found at stage `s`, step `t`, is one the executor runs."""
  where = f"the task at stage {s}, step {t} ({task})"
  if task.kind not in KINDS:
    raise ValueError(f"{where}: the pipeline runs only {', '.join(KINDS)} tasks.")
  if not (0 <= task.microbatch < microbatches and 0 <= task.chunk < chunks):
    raise ValueError(f"{where}: microbatches are 0..{microbatches - 1} and chunks "
                     f"0..{chunks - 1}.")
  if task.chunk % stages != s:
    raise ValueError(f"{where}: chunk {task.chunk} lives on stage {task.chunk % stages}.")


def check(tasks: Tasks, stages: int, microbatches: int, virtual: int) -> None:
  """Raises ValueError unless `tasks` runs every chunk of every microbatch once, on the chunk's
  stage, after the chunk before it, and either no backward or every backward once, after its
  forward and the next chunk's backward: what the executors (`lower`, `lower_explicit`, `Stack`)
  rely on."""
  if min(stages, microbatches, virtual) < 1:
    raise ValueError(f"a schedule needs stages, microbatches and virtual >= 1, got {stages}, "
                     f"{microbatches} and {virtual}.")
  if len(tasks) != stages or len({len(row) for row in tasks}) != 1:
    raise ValueError(f"a schedule has one row of tasks per stage, all as long: got rows of "
                     f"{[len(row) for row in tasks]} steps for {stages} stages.")
  chunks = stages * virtual
  for s, row in enumerate(tasks):
    for t, task in enumerate(row):
      if task is not None:
        _check_task(task, s, t, stages, microbatches, chunks)
  when, back = _steps(tasks), _steps(tasks, BACKWARD)
  if len(when) + len(back) != sum(task is not None for row in tasks for task in row):
    raise ValueError("the schedule runs a chunk of a microbatch twice; each runs once.")
  for m in range(microbatches):
    for c in range(chunks):
      if (m, c) not in when:
        raise ValueError(f"the schedule never runs chunk {c} of microbatch {m}; each runs once.")
      if c and when[m, c] <= when[m, c - 1]:
        raise ValueError(f"chunk {c} of microbatch {m} runs at step {when[m, c]}, before chunk "
                         f"{c - 1}'s output reaches stage {c % stages} (step "
                         f"{when[m, c - 1] + 1}).")
      if not back:
        continue
      if (m, c) not in back:
        raise ValueError(f"the schedule never runs the backward of chunk {c} of microbatch {m}; "
                         "a schedule runs every backward or none.")
      after = max(when[m, c], back.get((m, c + 1), -1))
      if back[m, c] <= after:
        raise ValueError(f"the backward of chunk {c} of microbatch {m} runs at step "
                         f"{back[m, c]}, before its forward and the next chunk's backward have "
                         f"run (step {after + 1}).")


# Columns of a lowered schedule (`lower`), and where a task's input comes from (SOURCE).
MICRO, LOCAL, SOURCE, DONE, PARK = range(5)
FROM_INPUT, FROM_PREVIOUS, FROM_PARKED = range(3)


def lower(tasks: Tasks) -> np.ndarray:
  """Checked forward `tasks` as the int32 table [steps, stages, 5] the executor scans over: each
  task's MICRO (its microbatch), LOCAL (its chunk's index among the stage's chunks), SOURCE, DONE
  (its output is the stack's) and PARK.

  What a stage sends at step t arrives at the next stage for step t + 1. A task that runs then
  reads it there (FROM_PREVIOUS); one that runs later reads it from the stage's buffer, one slot a
  microbatch, where the arriving stage stored it at step t (PARK: the slot, -1 for none). The
  first chunk reads the stack's input (FROM_INPUT). An idle step repeats the stage's nearest task
  (its last, else its first) with DONE 0, so that it computes on real values and is masked out."""
  stages, steps = len(tasks), len(tasks[0])
  when = _steps(tasks)
  last = max(c for _, c in when)
  table = np.zeros((steps, stages, 5), np.int32)
  table[:, :, PARK] = -1
  for s, row in enumerate(tasks):
    entries = {}
    for t, task in enumerate(row):
      if task is None:
        continue
      m, c = task.microbatch, task.chunk
      source = (FROM_INPUT if c == 0 else
                FROM_PREVIOUS if when[m, c - 1] == t - 1 else FROM_PARKED)
      entries[t] = (m, c // stages, source, int(c == last))
      if c < last and when[m, c + 1] > t + 1:
        table[t, (s + 1) % stages, PARK] = m
    for t in range(steps):
      near = max((u for u in entries if u <= t), default=min(entries))
      table[t, s, :PARK] = entries[near] if near == t else entries[near][:DONE] + (0,)
  return table


# Columns of a lowered schedule with backward tasks (`lower_explicit`), and its task kinds (KIND).
(KIND, E_MICRO, E_LOCAL, FIRST, LAST, IN_SLOT, COT_SLOT, RES_SLOT, RECV_IN,
 RECV_COT) = range(10)
IDLE, RUN_FORWARD, RUN_BACKWARD = range(3)


def _slots(intervals: dict, stages: int) -> tuple[dict, int]:
  """(microbatch, chunk) -> (first, last) step its value is held on the chunk's stage -> a slot
  per key, no two overlapping in one slot of a stage, and the most slots a stage needs."""
  slot, most = {}, 0
  for s in range(stages):
    free_at = []
    for key, (first, last) in sorted((kv for kv in intervals.items() if kv[0][1] % stages == s),
                                     key=lambda kv: kv[1]):
      i = next((i for i, f in enumerate(free_at) if f < first), len(free_at))
      if i == len(free_at):
        free_at.append(0)
      free_at[i], slot[key] = last, i
    most = max(most, len(free_at))
  return slot, most


class Lowered(NamedTuple):
  """A schedule with backward tasks as its executor scans it (`lower_explicit`): the table and
  the slots a stage needs for chunk inputs, cotangents and a forward's residuals."""
  table: np.ndarray
  inputs: int
  cotangents: int
  residuals: int


def lower_explicit(tasks: Tasks, residuals: bool = True) -> Lowered:
  """Checked `tasks` with backward tasks as the int32 table [steps, stages, 10] the explicit
  executor scans over, and the input, cotangent and residual slots a stage needs.

  A forward sends its output to the next chunk's stage, a backward the input's cotangent to the
  previous chunk's; what is sent at step t arrives for step t + 1 and is stored on arrival
  (RECV_IN, RECV_COT: the slot, -1 for none). With `residuals`, a chunk's input stays in its slot
  until its forward has run, which keeps what its backward needs (the residuals of `jax.vjp`) in
  a residual slot (RES_SLOT) until the backward runs; the last chunk's forward (LAST) also keeps
  the cotangent a loss head after it gives, in a cotangent slot. Without, the input stays until
  the backward, which runs the chunk again from it, and the last chunk's forward is IDLE (its
  backward runs it, with the loss head or the stack output's cotangent). The first chunk reads
  the stack's input (FIRST)."""
  stages, steps = len(tasks), len(tasks[0])
  when, back = _steps(tasks), _steps(tasks, BACKWARD)
  last = max(c for _, c in when)
  held_in = {(m, c): (when[m, c - 1] + 1, when[m, c] if residuals else back[m, c])
             for m, c in when if c}
  held_cot = {(m, c): (back[m, c + 1] + 1 if c < last else when[m, c], back[m, c])
              for m, c in when if c < last or residuals}
  held_res = {(m, c): (when[m, c], back[m, c]) for m, c in when if residuals}
  slot_in, n_in = _slots(held_in, stages)
  slot_cot, n_cot = _slots(held_cot, stages)
  slot_res, n_res = _slots(held_res, stages)
  table = np.zeros((steps, stages, 10), np.int32)
  table[..., IN_SLOT:] = -1
  for s, row in enumerate(tasks):
    for t, task in enumerate(row):
      if task is None:
        continue
      m, c = task.microbatch, task.chunk
      kind = (RUN_BACKWARD if task.kind == BACKWARD else
              RUN_FORWARD if c < last or residuals else IDLE)
      table[t, s, :IN_SLOT] = (kind, m, c // stages, int(c == 0), int(c == last))
      table[t, s, IN_SLOT] = slot_in.get((m, c), -1)
      table[t, s, COT_SLOT] = slot_cot.get((m, c), -1)
      table[t, s, RES_SLOT] = slot_res.get((m, c), -1)
  for (m, c), (first, _) in held_in.items():
    table[first, c % stages, RECV_IN] = slot_in[m, c]
  for (m, c), (first, _) in held_cot.items():
    if c < last:  # the last chunk's is its forward's, not sent
      table[first, c % stages, RECV_COT] = slot_cot[m, c]
  return Lowered(table, n_in, n_cot, n_res)
