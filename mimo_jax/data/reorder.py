"""Reordering by cost: samples over language dp ranks (intra-microbatch), a step's samples over
its microbatches (`pack`), and a step's microbatches (inter-microbatch, with `data.slot_buckets` /
`data.row_buckets`).

A microbatch's samples are split over the G language dp ranks, b = B / G each. Taking them in
stream order can give one rank most of the images: its image slots overflow (or the encoder's slots
must be sized for the worst rank, so the encoder computes mostly padding) and its rows hold the most
work. `balance` assigns samples to ranks to minimise the largest per-rank cost under a linear cost
model (image tokens and text tokens), greedily, largest cost first (LPT), each rank taking exactly b
samples. The assignment is a pure function of the microbatch's samples, so every module and every
process derives the same one with no communication; the loss, a sum over samples, is unchanged.
"""

from __future__ import annotations

import numpy as np


def sample_cost(image_tokens: int, text_tokens: int, image_token_cost: float,
                text_token_cost: float) -> float:
  return image_tokens * image_token_cost + text_tokens * text_token_cost


def balance(costs: list[float], groups: int) -> list[int]:
  """A permutation of range(len(costs)): group 0's samples, then group 1's, ... (b each)."""
  n = len(costs)
  if groups < 1 or n % groups:
    raise ValueError(f"{n} samples do not split evenly over {groups} groups")
  per_group = n // groups
  load = np.zeros(groups)
  members: list[list[int]] = [[] for _ in range(groups)]
  for i in sorted(range(n), key=lambda i: (-costs[i], i)):  # stable: ties keep stream order
    open_groups = [g for g in range(groups) if len(members[g]) < per_group]
    g = min(open_groups, key=lambda g: (load[g], g))
    members[g].append(i)
    load[g] += costs[i]
  return [i for g in members for i in sorted(g)]


def pack(n: int, microbatches: int, evaluate, passes: int = 4,
         evaluations: int = 0) -> list[int]:
  """A permutation of a step's n samples, microbatch after microbatch (n / microbatches each),
  that lowers the step's padded work. `evaluate(members)` gives a microbatch's (cost, fits) for
  its members as a sorted tuple (the order inside a microbatch is the layout's). From stream
  order, a swap of two samples between two microbatches is kept when it lowers the summed cost of
  the two and both still fit. Pairs of microbatches come nearest first (each with the next, then
  the one after, ..), pass after pass until a pass keeps none, at most `passes`, and stopping once
  `evaluate` has run `evaluations` times (default 100 a sample: its time bounds the loader's work
  a step, about 30 us each)."""
  per = n // microbatches
  budget = evaluations or 100 * n
  groups = [list(range(k * per, (k + 1) * per)) for k in range(microbatches)]
  m = microbatches
  pairs = [(a, (a + d) % m) for d in range(1, m // 2 + 1) for a in range(m)
           if not (2 * d == m and a >= d)]
  memo = {}

  def of(members):
    key = tuple(sorted(members))
    if key not in memo:
      memo[key] = evaluate(key)
    return memo[key]

  for _ in range(passes):
    kept = False
    for a, b in pairs:
      ga, gb = groups[a], groups[b]
      for i in range(per):
        for j in range(per):
          if len(memo) >= budget:
            return [i for g in groups for i in sorted(g)]
          before = of(ga)[0] + of(gb)[0]
          ga[i], gb[j] = gb[j], ga[i]
          (ca, fa), (cb, fb) = of(ga), of(gb)
          if fa and fb and ca + cb < before - 1e-9:
            kept = True
          else:
            ga[i], gb[j] = gb[j], ga[i]
    if not kept:
      break
  return [i for g in groups for i in sorted(g)]


def spread(costs: list[float], order: list[int], groups: int) -> float:
  """Largest over mean per-rank cost for samples laid out in `order` (1.0 = perfectly even)."""
  per_rank = np.asarray([costs[i] for i in order]).reshape(groups, -1).sum(axis=1)
  mean = per_rank.mean()
  return float(per_rank.max() / mean) if mean > 0 else 1.0


def bucket(used: int, per_rank: int, buckets: int, groups: int, split: int = 1) -> int:
  """Image slots (or packed rows) a rank sends for a microbatch whose fullest rank fills `used` of
  its `per_rank`: the smallest of `buckets` evenly spaced sizes that holds them, rounded up so that
  `split` ranks (the encoder's dp, for slots) divide the microbatch's `groups` * size evenly (at
  least one, at most `per_rank`)."""
  for i in range(1, buckets + 1):
    size = -(-per_rank * i // buckets)
    while (groups * size) % split:
      size += 1
    if size >= max(used, 1):
      return min(size, per_rank)
  return per_rank


def pipeline_order(encoder: list[float], language: list[float]) -> list[int]:
  """Inter-microbatch reorder (DistTrain §5.3): the order of a step's microbatches through the
  two-stage pipeline encoder -> language model that Johnson's rule (1954) proves shortest for
  two machines: microbatches lighter on the encoder than on the language model first, by rising
  encoder time (the language model starts early), then the others by falling language time (the
  encoder's last, long microbatches hide behind the language model's work)."""
  idx = range(len(encoder))
  first = sorted((i for i in idx if encoder[i] < language[i]), key=lambda i: (encoder[i], i))
  last = sorted((i for i in idx if encoder[i] >= language[i]), key=lambda i: (-language[i], i))
  return first + last
