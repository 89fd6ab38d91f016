"""Shared helpers of the benchmark tools."""

from __future__ import annotations

import time

import jax
import numpy as np


def median_time(fn, reps: int = 5) -> float:
  """Median seconds of `fn()` (waited for) over `reps` calls, after one untimed call that
  compiles and allocates."""
  jax.block_until_ready(fn())
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t)
  return float(np.median(times))
