"""Pipeline schedules as values (pipeline.py): the task tables gpipe and circular build, the table
the executor scans over, the checks on a schedule, and a schedule of our own run by `Stack`."""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mimo_jax import pipeline, topology
from mimo_jax.config import ConfigError, set_layout
from mimo_jax.models import fp8
from mimo_jax.pipeline import (BACKWARD, DONE, FORWARD, LOCAL, MICRO, PARK, SOURCE, Schedule,
                               Stack, Task, check, circular, gpipe, lower)

F = lambda m, c: Task(FORWARD, m, c)  # noqa: E731
B = lambda m, c: Task(BACKWARD, m, c)  # noqa: E731
_ = None  # an idle step
I, N, K = pipeline.FROM_INPUT, pipeline.FROM_PREVIOUS, pipeline.FROM_PARKED

GPIPE_2x4 = (  # p=2, M=4: stage s runs microbatch m at step m + s
    (F(0, 0), F(1, 0), F(2, 0), F(3, 0), _),
    (_, F(0, 1), F(1, 1), F(2, 1), F(3, 1)),
)
CIRCULAR_2x2x4 = (  # p=2, v=2, M=4: chunks 0 and 2 on stage 0, 1 and 3 on stage 1
    (F(0, 0), F(1, 0), F(2, 0), F(3, 0), F(0, 2), F(1, 2), F(2, 2), F(3, 2), _),
    (_, F(0, 1), F(1, 1), F(2, 1), F(3, 1), F(0, 3), F(1, 3), F(2, 3), F(3, 3)),
)


def test_gpipe_and_circular_are_the_textbook_order():
  assert gpipe(2, 4) == Schedule(2).tasks(4) == GPIPE_2x4
  assert circular(2, 4, 2) == Schedule(2, 2).tasks(4) == CIRCULAR_2x2x4
  for p, m in [(1, 3), (2, 2), (3, 5), (4, 4)]:  # one round of the ring is GPipe
    assert circular(p, m, 1) == gpipe(p, m)


@pytest.mark.parametrize("p,v,m", [(1, 1, 8), (2, 1, 3), (4, 1, 4), (4, 2, 4), (2, 4, 6)])
def test_bubble_is_the_idle_share_of_the_tasks(p, v, m):
  assert Schedule(p, v).bubble(m) == pytest.approx((p - 1) / (m * v + p - 1))


def _columns(table: np.ndarray, stage: int) -> dict[int, list[int]]:
  return {k: table[:, stage, k].tolist() for k in (MICRO, LOCAL, SOURCE, DONE, PARK)}


def test_lowered_gpipe_passes_every_activation_straight_on():
  table = lower(GPIPE_2x4)
  assert _columns(table, 0) == {MICRO: [0, 1, 2, 3, 3], LOCAL: [0] * 5, SOURCE: [I] * 5,
                                DONE: [0] * 5, PARK: [-1] * 5}
  assert _columns(table, 1) == {MICRO: [0, 0, 1, 2, 3], LOCAL: [0] * 5, SOURCE: [N] * 5,
                                DONE: [0, 1, 1, 1, 1], PARK: [-1] * 5}


def test_lowered_circular_parks_on_stage_0_until_the_next_round():
  table = lower(CIRCULAR_2x2x4)
  assert _columns(table, 0) == {
      MICRO: [0, 1, 2, 3, 0, 1, 2, 3, 3], LOCAL: [0, 0, 0, 0, 1, 1, 1, 1, 1],
      SOURCE: [I, I, I, I, K, K, K, K, K], DONE: [0] * 9,
      PARK: [-1, 0, 1, 2, 3, -1, -1, -1, -1]}  # stage 1's chunk 1 of microbatches 0..3
  assert _columns(table, 1) == {
      MICRO: [0, 0, 1, 2, 3, 0, 1, 2, 3], LOCAL: [0, 0, 0, 0, 0, 1, 1, 1, 1],
      SOURCE: [N] * 9, DONE: [0, 0, 0, 0, 0, 1, 1, 1, 1], PARK: [-1] * 9}
  # As many microbatches as stages: each comes back just in time for its next round.
  assert (lower(circular(2, 2, 2))[..., PARK] == -1).all()


@pytest.mark.parametrize("tasks,error", [
    (((F(0, 0), _), (_, F(0, 1)), (_, _)), r"one row of tasks per stage"),
    (((F(0, 0), F(1, 0)), (F(0, 1), F(1, 1))), r"chunk 1 of microbatch 0 runs at step 0, before"),
    (((F(0, 1), F(1, 0), _), (_, F(0, 0), F(1, 1))), r"chunk 1 lives on stage 1"),
    (((F(0, 0), F(1, 0), _), (_, F(0, 1), _)), r"never runs chunk 1 of microbatch 1"),
    (((F(0, 0), F(1, 0), F(1, 0)), (_, F(0, 1), F(1, 1))), r"runs a chunk of a microbatch twice"),
    (((F(0, 0), F(2, 0), _), (_, F(0, 1), F(1, 1))), r"microbatches are 0\.\.1"),
    (((F(0, 0), Task("sideways", 1, 0), _), (_, F(0, 1), F(1, 1))),
     r"runs only forward, backward tasks"),
    (((F(0, 0), F(1, 0), B(1, 0), _), (_, F(0, 1), F(1, 1), B(1, 1))),
     r"never runs the backward of chunk 0 of microbatch 0; a schedule runs every backward or "
     r"none"),
    (((F(0, 0), F(1, 0), B(0, 0), B(1, 0), _), (_, F(0, 1), F(1, 1), B(0, 1), B(1, 1))),
     r"backward of chunk 0 of microbatch 0 runs at step 2, before its forward and the next "
     r"chunk's backward have run \(step 4\)"),
])
def test_a_schedule_that_cannot_run_is_a_clear_error(tasks, error):
  check(GPIPE_2x4, 2, 4, 1)  # the textbook order passes
  with pytest.raises(ValueError, match=error):
    check(tasks, 2, 2, 1)


def test_microbatches_and_schedule_names_are_checked():
  with pytest.raises(ValueError, match=r"circular schedule needs at least as many microbatches "
                     r"as stages, got 1 for 2 stages.*use at least 2 microbatches"):
    Schedule(2, 2).tasks(1)
  with pytest.raises(ValueError, match=r"gpipe runs one chunk a stage.*use circular"):
    Schedule(2, 2, "gpipe").tasks(4)
  with pytest.raises(ValueError, match=r"unknown pipeline schedule 'zb'; one of gpipe, "
                     r"circular, 1f1b, interleaved_1f1b"):
    Schedule(2, 1, "zb")


def _late(stages: int, microbatches: int, virtual: int) -> pipeline.Tasks:
  """GPipe with stage s running microbatch m at step m + 2s, a step later than it could: what
  reaches it waits a step in its buffer."""
  steps = microbatches + 2 * (stages - 1)
  return tuple(tuple(F(t - 2 * s, s) if 0 <= t - 2 * s < microbatches else None
                     for t in range(steps)) for s in range(stages))


def test_stack_runs_a_schedule_of_our_own(monkeypatch):
  """A new value in SCHEDULES runs through `Stack` unchanged, here one that parks on stage 1,
  with the sequential layers' outputs and gradients."""
  monkeypatch.setitem(pipeline.SCHEDULES, "late", _late)
  assert _late(2, 3, 1) == ((F(0, 0), F(1, 0), F(2, 0), _, _), (_, _, F(0, 1), F(1, 1), F(2, 1)))
  assert lower(_late(2, 3, 1))[:, 1, PARK].tolist() == [0, 1, 2, -1, -1]
  mesh = Mesh(np.array(jax.devices()[:2]).reshape(2, 1, 1), topology.AXES)
  layer = lambda w, x: jnp.tanh(x @ w)  # noqa: E731
  w = 0.5 * jax.random.normal(jax.random.key(0), (4, 8, 8))
  x_m = jax.random.normal(jax.random.key(1), (3, 2, 8))

  def sequential(w, x_m):
    for i in range(4):
      x_m = layer(w[i], x_m)
    return x_m
  stack = Stack(layer, mesh, Schedule(2, 1, "late"))
  loss = lambda f: lambda w, x: jnp.sum(jnp.sin(f(w, x)))  # noqa: E731
  want = jax.value_and_grad(loss(sequential), argnums=(0, 1))(w, x_m)
  got = jax.jit(jax.value_and_grad(loss(stack), argnums=(0, 1)))(w, x_m)
  for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


# ---- schedules with backward tasks ----------------------------------------------------------

def _parse(rows: list[str], virtual: int = 1) -> pipeline.Tasks:
  """Rows of `F3`, `B0'` (a microbatch's forward or backward; one ' a round of the ring further:
  chunk round·p + stage) and `.` (idle), a row a stage."""
  def task(s: int, word: str):
    if word == ".":
      return None
    rnd = word.count("'")
    return Task(FORWARD if word[0] == "F" else BACKWARD, int(word[1:].rstrip("'")),
                rnd * len(rows) + s)
  return tuple(tuple(task(s, w) for w in row.split()) for s, row in enumerate(rows))


ONE_F_ONE_B_4x8 = _parse([  # p=4, M=8: 2(p - s - 1) forwards, then one forward and one
    # backward in turn; forwards at even steps, backwards at odd ones (phased)
    "F0 .  F1 .  F2 .  F3 .  F4 .  F5 .  F6 B0 F7 B1 .  B2 .  B3 .  B4 .  B5 .  B6 .  B7",
    ".  .  F0 .  F1 .  F2 .  F3 .  F4 B0 F5 B1 F6 B2 F7 B3 .  B4 .  B5 .  B6 .  B7 .  . ",
    ".  .  .  .  F0 .  F1 .  F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 .  B6 .  B7 .  .  .  . ",
    ".  .  .  .  .  .  F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7 .  .  .  .  .  . ",
])
# Interleaved, p=4, v=2, M=8: each stage's order of tasks (Megatron's: microbatches in groups of
# p, chunk rounds forward in order and backward in reverse; 2(p - s - 1) + (v - 1)p warm-up).
INTERLEAVED_4x2x8_ORDER = [
    "F0 F1 F2 F3 F0' F1' F2' F3' F4 F5 F6 B0' F7 B1' F4' B2' F5' B3' F6' B0 F7' B1 B2 B3 B4' B5' "
    "B6' B7' B4 B5 B6 B7",
    "F0 F1 F2 F3 F0' F1' F2' F3' F4 B0' F5 B1' F6 B2' F7 B3' F4' B0 F5' B1 F6' B2 F7' B3 B4' B5' "
    "B6' B7' B4 B5 B6 B7",
    "F0 F1 F2 F3 F0' F1' F2' B0' F3' B1' F4 B2' F5 B3' F6 B0 F7 B1 F4' B2 F5' B3 F6' B4' F7' B5' "
    "B6' B7' B4 B5 B6 B7",
    "F0 F1 F2 F3 F0' B0' F1' B1' F2' B2' F3' B3' F4 B0 F5 B1 F6 B2 F7 B3 F4' B4' F5' B5' F6' B6' "
    "F7' B7' B4 B5 B6 B7",
]


def test_1f1b_schedules_are_phased_megatron_orders():
  assert Schedule(4, 1, "1f1b").tasks(8) == ONE_F_ONE_B_4x8
  got = Schedule(4, 2, "interleaved_1f1b").tasks(8)
  want = _parse(INTERLEAVED_4x2x8_ORDER)
  assert [[x for x in row if x is not None] for row in got] == [list(row) for row in want]
  for row in got:  # forwards at even steps, backwards at odd ones
    assert all(t % 2 == (x.kind == BACKWARD) for t, x in enumerate(row) if x is not None)


@pytest.mark.parametrize("p,m", [(2, 4), (2, 8), (4, 8), (4, 16), (3, 7)])
def test_phased_1f1b_leaves_stages_idle_no_longer_than_gpipe(p, m):
  """Run in lockstep, a step takes its slowest task: phased, 1F1B idles a stage as long as
  GPipe's forward and backward (which autodiff mirrors) where a forward keeps its residuals (a
  backward weighs two forwards), and no longer than GPipe under remat=full, where a backward
  runs its chunk again (three); interleaved 1F1B the same against the circular schedule. An
  unphased schedule, a stage's forward beside another's backward, would idle 1F1B's p = 2,
  M = 8 under remat=full for 36% of the step (50 forwards' time for 32 of work)."""
  gpipe, one = Schedule(p, 1), Schedule(p, 1, "1f1b")
  assert one.bubble(m) == pytest.approx(gpipe.bubble(m))
  assert one.bubble(m, "full") <= gpipe.bubble(m) + 1e-12
  if m % p == 0 and m >= p:
    interleaved, circular = Schedule(p, 2, "interleaved_1f1b"), Schedule(p, 2)
    assert interleaved.bubble(m) == pytest.approx(circular.bubble(m))
    assert interleaved.bubble(m, "full") <= circular.bubble(m) + 1e-12
  assert Schedule(2, 1, "1f1b").bubble(8, "full") == pytest.approx(1 - 32 / 35)


@pytest.mark.parametrize("p,m", [(4, 8), (2, 1), (3, 7), (4, 2)])
def test_1f1b_keeps_at_most_2p_minus_2s_minus_1_microbatches_in_flight(p, m):
  tasks = Schedule(p, 1, "1f1b").tasks(m)
  for s, row in enumerate(tasks):
    in_flight, most = set(), 0
    for x in row:
      if x is not None:
        (in_flight.add if x.kind == FORWARD else in_flight.remove)(x.microbatch)
      most = max(most, len(in_flight))
    assert most == min(2 * (p - s) - 1, m)
  kept = pipeline.lower_explicit(tasks)  # forwards keep their residuals until their backward
  again = pipeline.lower_explicit(tasks, residuals=False)  # backwards run their chunk again
  assert kept.table.shape == again.table.shape == (len(tasks[0]), p, 10)
  assert kept.residuals == min(2 * p - 1, m) and kept.inputs == 1 and kept.cotangents <= 2
  assert again.residuals == 0 and again.inputs <= 2 * p - 1 and again.cotangents <= 1
  one = Schedule(p, 1, "1f1b")
  assert (one.held(m), one.kept(m)) == (kept.inputs, kept.residuals)
  assert (one.held(m, "full"), one.kept(m, "full")) == (again.inputs, 0)
  assert Schedule(p, 1).held(m) == m and Schedule(p, 1).kept(m) == 0


def test_explicit_schedules_are_checked():
  with pytest.raises(ValueError, match=r"1f1b runs one chunk a stage.*use interleaved_1f1b"):
    Schedule(2, 2, "1f1b").tasks(4)
  with pytest.raises(ValueError, match=r"interleaved_1f1b runs several chunks.*use 1f1b"):
    Schedule(2, 1, "interleaved_1f1b").tasks(4)
  with pytest.raises(ValueError, match=r"groups of the 2 stages, got 3; use a multiple of 2"):
    Schedule(2, 2, "interleaved_1f1b").tasks(3)


def _layer(w, x, shift):
  return x + jnp.tanh(x @ w + shift[..., None].astype(x.dtype))


def _rolled(w, x, shift):
  """`_layer` with its product rolled along its features: split over tp, a collective permute
  within the stage."""
  return x + jnp.tanh(jnp.roll(x @ w, 1, axis=-1) + shift[..., None].astype(x.dtype))


@pytest.mark.parametrize("p,dp,tp,v,m,name,policy,layer,branch", [
    (2, 1, 1, 1, 3, "1f1b", "none", _layer, True),
    (4, 2, 1, 1, 8, "1f1b", "full", _layer, True),
    (4, 1, 1, 1, 2, "1f1b", "none", _layer, None),  # fewer microbatches than stages (evaluation)
    (2, 2, 1, 2, 4, "interleaved_1f1b", "dots", _layer, True),
    (2, 1, 1, 2, 3, "interleaved_1f1b", "none", _layer, None),  # not a whole group: padded
    # A collective permute inside a chunk: on CPUs the stages run every task (no branches).
    (2, 1, 2, 2, 4, "interleaved_1f1b", "none", _rolled, None),
])
def test_explicit_backward_matches_autodiff_of_sequential_layers(p, dp, tp, v, m, name, policy,
                                                                 layer, branch):
  """Outputs and every gradient (parameters, inputs) of the stack with backward tasks against
  autodiff of the layers one after another; dp and tp stay automatic inside the stages. `branch`
  True: the stages branch on their task (`lax.switch`, as on GPUs); None: the platform's choice
  (on CPUs, every task at every step)."""
  mesh = Mesh(np.array(jax.devices()[:p * dp * tp]).reshape(p, dp, tp), topology.AXES)
  schedule = Schedule(p, v, name)
  keys = jax.random.split(jax.random.key(0), 3)
  w = 0.4 * jax.random.normal(keys[0], (8, 8, 8))
  x_m = jax.random.normal(keys[1], (m, 4, 8))
  shift_m = jax.random.randint(keys[2], (m, 4), 0, 3)

  def sequential(w, x_m):
    for i in range(8):
      x_m = jax.vmap(lambda x, s, i=i: layer(w[i], x, s))(x_m, shift_m)
    return x_m
  stack = Stack(layer, mesh, schedule, policy, branch=branch)
  placed = jax.device_put(schedule.to_layout(w), NamedSharding(
      mesh, P(*schedule.stage_spec(), None, "tp")))
  loss = lambda out: jnp.sum(jnp.sin(out))  # noqa: E731
  want = jax.value_and_grad(lambda w, x: loss(sequential(w, x)), argnums=(0, 1))(w, x_m)
  got = jax.jit(jax.value_and_grad(lambda w, x: loss(stack(w, x, (shift_m,))),
                                   argnums=(0, 1)))(placed, x_m)
  got = (got[0], (schedule.from_layout(np.asarray(got[1][0])), got[1][1]))
  for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(a))))
  np.testing.assert_allclose(jax.jit(stack)(placed, x_m, (shift_m,)), sequential(w, x_m),
                             rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("p,v,m,name,branch", [
    (2, 1, 3, "1f1b", True),
    (4, 1, 2, "1f1b", None),  # fewer microbatches than stages: padded, their weights 0
    (2, 2, 3, "interleaved_1f1b", True),  # not a whole group: padded
    (2, 1, 4, "gpipe", None),  # the head after the stack, a microbatch at a time
])
def test_a_head_inside_the_schedule_matches_autodiff_of_the_layers_then_the_head(p, v, m, name,
                                                                                branch):
  """`Stack.loss`: a loss head (a trained and a frozen leaf, per-microbatch targets and
  weights) run by the last chunk's backward tasks, so the stack's forward never runs alone: its
  loss and every gradient (stacked layers, head, inputs) as autodiff of the layers one after
  another, then the head on each microbatch."""
  mesh = Mesh(np.array(jax.devices()[:p]).reshape(p, 1, 1), topology.AXES)
  schedule = Schedule(p, v, name)
  keys = jax.random.split(jax.random.key(1), 5)
  w = 0.4 * jax.random.normal(keys[0], (8, 8, 8))
  x_m = jax.random.normal(keys[1], (m, 4, 8))
  shift_m = jax.random.randint(keys[2], (m, 4), 0, 3)
  targets_m = jax.random.normal(keys[3], (m, 4, 3))
  weights_m = (jnp.arange(m * 4).reshape(m, 4) % 3).astype(jnp.float32)
  trained = {"proj": 0.3 * jax.random.normal(keys[4], (8, 3))}
  frozen = {"bias": jnp.full((3,), 0.1)}

  def apply(t, f, h, targets, weights):
    return jnp.sum(weights[:, None] * (jnp.tanh(h @ t["proj"] + f["bias"]) - targets) ** 2)

  def sequential(w, t, x_m):
    for i in range(8):
      x_m = jax.vmap(lambda x, s, i=i: _layer(w[i], x, s))(x_m, shift_m)
    return sum(apply(t, frozen, x_m[k], targets_m[k], weights_m[k]) for k in range(m))
  stack = Stack(_layer, mesh, schedule, branch=branch)
  placed = jax.device_put(schedule.to_layout(w), NamedSharding(mesh, P(*schedule.stage_spec())))
  head = lambda t: pipeline.Head(apply, t, frozen, (targets_m, weights_m))  # noqa: E731
  want = jax.value_and_grad(sequential, argnums=(0, 1, 2))(w, trained, x_m)
  got = jax.jit(jax.value_and_grad(lambda w, t, x: 2.0 * stack.loss(w, x, (shift_m,), head(t)),
                                   argnums=(0, 1, 2)))(placed, trained, x_m)
  got = (got[0] / 2, (schedule.from_layout(np.asarray(got[1][0])) / 2,
                      jax.tree.map(lambda a: a / 2, got[1][1]), got[1][2] / 2))
  for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(a))))
  np.testing.assert_allclose(jax.jit(lambda w: stack.loss(w, x_m, (shift_m,), head(trained)))(
      placed), want[0], rtol=1e-5)  # the forward alone where no gradient is taken


def test_1f1b_activation_memory_is_at_most_pp_over_m_of_gpipes():
  """XLA's memory analysis of the compiled gradient (per device: one stage), p=4, M=8, two
  layers a stage, remat none: GPipe keeps every microbatch's layer internals until the
  backward, 1F1B the residuals of its forwards until their backward (at most 2(p − s) − 1
  microbatches'; the phased steps hold more than Megatron's p − s). On CPUs, the stages
  branching as on GPUs, 1F1B's temporaries are 0.40 of GPipe's (1,627,264 against 4,117,248
  bytes; at M = 16 and 32 1.66 and 1.73 MB against 6.90 and 12.47: they no longer grow with
  M); at most p/M. Under remat=full 0.15 (615,272 bytes)."""
  p, m, layers, dim, hidden = 4, 8, 8, 64, 256
  mesh = Mesh(np.array(jax.devices()[:p]).reshape(p, 1, 1), topology.AXES)
  layer = lambda w, x: x + jnp.tanh(x @ w["up"]) @ w["down"]  # noqa: E731
  on_stages = NamedSharding(mesh, P(pipeline.PP))
  w = {"up": jax.ShapeDtypeStruct((layers, dim, hidden), jnp.float32, sharding=on_stages),
       "down": jax.ShapeDtypeStruct((layers, hidden, dim), jnp.float32, sharding=on_stages)}
  x_m = jax.ShapeDtypeStruct((m, 16, dim), jnp.float32, sharding=NamedSharding(mesh, P()))

  def temporaries(name: str, remat: str = "none") -> int:
    stack = Stack(layer, mesh, Schedule(p, 1, name), remat, branch=True)  # as GPUs run it
    grad = jax.jit(jax.grad(lambda w, x: jnp.sum(jnp.sin(stack(w, x))), argnums=(0, 1)))
    return grad.lower(w, x_m).compile().memory_analysis().temp_size_in_bytes
  gpipe_bytes, one_f_one_b_bytes = temporaries("gpipe"), temporaries("1f1b")
  assert 0 < one_f_one_b_bytes <= p / m * gpipe_bytes, (one_f_one_b_bytes, gpipe_bytes)
  # Under remat=full a stage keeps its chunk inputs alone, each backward running its chunk again.
  assert temporaries("1f1b", "full") < one_f_one_b_bytes


def _fp8_layer(w, x):
  return x + jnp.tanh(fp8.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ()))))


def _layer_f32(w, x):
  return x + jnp.tanh(x @ w)


@pytest.mark.parametrize("v,reference,name,policy", [
    (1, "gpipe", "1f1b", "dots"),  # dots keeps the FP8 operands (fp8.OPERAND)
    (2, "circular", "interleaved_1f1b", "none"),
])
def test_fp8_under_1f1b_computes_what_it_computes_under_gpipe(v, reference, name, policy):
  """FP8 matmuls (current scaling: no state) in a stack with backward tasks: the backward task's
  recomputation quantizes as the forward did, so the outputs and gradients are GPipe's (up to the
  order the microbatches' gradients add in), and far from the float32 products'. (A pipelined
  FP8 training step runs in bfloat16, which XLA's CPU runtime cannot all-reduce.)"""
  p, m = 2, 4
  mesh = Mesh(np.array(jax.devices()[:p * 2]).reshape(p, 2, 1), topology.AXES)
  keys = jax.random.split(jax.random.key(0), 2)
  w = 0.4 * jax.random.normal(keys[0], (8, 16, 16))
  x_m = jax.device_put(jax.random.normal(keys[1], (m, 8, 16)), NamedSharding(mesh, P(None, "dp")))

  def grads(layer, schedule_name):
    schedule = Schedule(p, v, schedule_name)
    stack = Stack(layer, mesh, schedule, policy, branch=True)
    placed = jax.device_put(schedule.to_layout(w), NamedSharding(mesh, P(*schedule.stage_spec())))
    loss, (gw, gx) = jax.jit(jax.value_and_grad(lambda w, x: jnp.sum(jnp.sin(stack(w, x))),
                                                argnums=(0, 1)))(placed, x_m)
    return [np.asarray(loss), schedule.from_layout(np.asarray(gw)), np.asarray(gx)]
  want, got = grads(_fp8_layer, reference), grads(_fp8_layer, name)
  exact = grads(_layer_f32, name)
  for a, b, c in zip(want, got, exact):
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6 * float(np.max(np.abs(a))))
    assert np.max(np.abs(b - c)) > 0.01 * np.max(np.abs(c))  # really FP8



# ---- tools.plan weighs the schedules ----------------------------------------------------------

def test_plan_weighs_each_schedules_memory_bubble_and_flops(tmp_path, capsys):
  """Language pp2 under gpipe and 1f1b, M = 8: 1F1B keeps its forwards' residuals for at most
  three microbatches and one more chunk's internals (and one chunk input) where GPipe keeps all
  eight microbatches' internals, so it needs less memory for the same FLOPs (the loss runs
  inside its schedule; an encoder's forward runs alone first, 4/3) and the same bubble (1F1B's
  weighed in lockstep, `Schedule.bubble`). A budget only 1F1B layouts fit makes one of them the
  recommendation."""
  from tools import plan
  spec, gpus = "tests/configs/tiny_vlm.py:encoder_heavy", 4
  sets = ["model.language.layers=4", "data.microbatches=8", f"data.dir={tmp_path}"]
  every = {c["layout"]: c for c in plan.candidates(spec, sets, gpus, 1, 1e6, pps=(1, 2))}
  gpipe = every["vision=0/2/1,language=2/1/1/2/1@gpipe"]
  one = every["vision=0/2/1,language=2/1/1/2/1@1f1b"]
  assert (gpipe["language"]["in_flight"], one["language"]["in_flight"]) == ((8, 0), (4, 1))
  assert one["gib"] < gpipe["gib"]
  for c in (gpipe, one):
    assert c["language"]["bubble"] == pytest.approx(1 / 9)
    assert plan.module_time(1.0, c["language"]) == pytest.approx(9 / 8)
  assert Schedule(2, 1, "1f1b").compute(8, "none") == pytest.approx(4 / 3)  # an encoder's
  assert every["vision=0/2/1,language=2/2/1"]["language"]["schedule"] == "none"
  cfg = plan.layout_config(spec, sets, "language=2/1/1/2/1@1f1b")
  assert (cfg.topology.language.pp, cfg.topology.language.schedule) == (2, "1f1b")
  with pytest.raises(ConfigError, match=r"topology\.language: .*offset/dp/tp\[/pp\[/virtual\]\]"
                     r"\[@schedule\]"):
    set_layout(cfg, "language=2/1/1/2@")
  # A profile of the unpipelined modules (dp only, colocated), and the planner on it.
  rows = [{"layout": layout, "busy_vision_s": 0.1 / g, "busy_language_s": 0.3 / g,
           "step_s": 0.35 / g} for g, layout in zip((1, 2, 4), plan.profile_layouts(gpus))]
  profile = tmp_path / "profile.json"
  profile.write_text(json.dumps({"config": spec, "set": sets, "rows": rows}))
  run = ["--profile", str(profile), f"--gpus={gpus}", "--max_tp=1", "--pp=1,2", "--data_steps=1"]
  recommended = lambda out: re.search(r"^recommended: (\S+)", out, re.M).group(1)  # noqa: E731
  plan.main(run)
  assert "@1f1b" not in recommended(capsys.readouterr().out)  # it fits, it pays less
  # Just less than any layout needs whose language model is not under 1F1B (listed last).
  budget = min(c["gib"] for c in every.values() if not c["layout"].endswith("@1f1b")) * 0.999
  plan.main(run + [f"--memory_gb={budget}"])
  out = capsys.readouterr().out
  assert recommended(out).endswith("@1f1b")
  assert all(line.split(" | ")[0].endswith("@1f1b") for line in out.splitlines()
             if line.startswith("| vision="))
