"""Pipeline schedules as values (pipeline.py): the task tables gpipe and circular build, the table
the executor scans over, the checks on a schedule, and a schedule of our own run by `Stack`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from mimo_jax import pipeline, topology
from mimo_jax.pipeline import (DONE, FORWARD, LOCAL, MICRO, PARK, SOURCE, Schedule, Stack, Task,
                               check, circular, gpipe, lower)

F = lambda m, c: Task(FORWARD, m, c)  # noqa: E731
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
    (((F(0, 0), Task("backward", 1, 0), _), (_, F(0, 1), F(1, 1))), r"runs only forward tasks"),
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
  with pytest.raises(ValueError, match=r"unknown pipeline schedule '1f1b'; one of gpipe, circular"):
    Schedule(2, 1, "1f1b")


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
