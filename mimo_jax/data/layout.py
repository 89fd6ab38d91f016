"""The slot layout: how a microbatch's items and text are laid out for the module meshes.

A microbatch of B samples is split contiguously over the language model's G = dp ranks, b = B / G
samples each. For every encoder, every rank gets S item *slots*; slots are numbered globally, rank g
owning slots [g*S, (g+1)*S). The items of rank g's samples fill its slots first fit in sample
order, the rest stay empty. So an encoder's input array [G*S, ...] is already in the order the
language model needs: the encoder runs on it with any dp that divides G*S, and moving its output
to the language mesh is a reshard of one array split on its first axis (fan-in and fan-out fall
out of the shapes). How an item is written into a slot, and how many tokens it yields, is the
encoder's (`encoders.SlotLayout`, which each encoder's plug-in implements).

For every text position that holds one of an encoder's placeholders, `Slots.pos_rl` gives the
index of its token inside the rank's own slots (slot_local * t + token), or -1: the merge on the
language mesh is a gather that never leaves the rank. `Slots.owner_nt` records which sample owns
each token of each slot (-1 = empty); it travels through the bridge beside the encoder's tokens so
the language side can verify that every placeholder receives a token of its own sample.

The layout works in three jobs: where each sample's items go (`place_items`), where its text goes
(`_Rows`; its tokens: text.sample_tokens), and writing both (`layout_microbatch`), which also counts
the microbatch's statistics, once (`batch.Stats`). The token ids it writes itself (padding, and bos
and eos around samples without their own loss mask) are the task's (`text.Vocabulary`); each
encoder's placeholder id is its slot layout's.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from mimo_jax.batch import Batch, Samples, Slots, Stats, Text
from mimo_jax.data.text import Vocabulary, sample_tokens
from mimo_jax.encoders import SlotLayout


@dataclasses.dataclass(frozen=True)
class Layout:
  seq_len: int  # l, tokens fed to the language model per row
  groups: int  # g, language dp ranks
  encoders: tuple[SlotLayout, ...]  # each encoder's slots, in dispatch order
  pack_rows: int = 0  # rows per microbatch when packing several samples a row; 0 = one per row

  def encoder(self, name: str) -> SlotLayout:
    return next(e for e in self.encoders if e.name == name)


def place_items(tokens: list[list[int]], ids: list[int], slots: SlotLayout,
                rooms: list[list[int]] | None = None) -> list[list[tuple]]:
  """(slot, token offset in the slot) of every item of every sample: each language dp rank fills
  its own slots first fit, in sample order. `tokens[b]` lists sample b's items' tokens, `rooms[b]`
  the room each takes in a slot (`SlotLayout.item_room`; default: its tokens)."""
  per_group, S, cap = len(tokens) // slots.groups, slots.slots_per_group, slots.room
  most = slots.slot_items or cap
  free, items, used = [cap] * slots.slots, [0] * slots.slots, [0] * slots.slots
  out = []
  for b, (counts, sid) in enumerate(zip(tokens, ids)):
    g, placed = b // per_group, []
    for t, r in zip(counts, counts if rooms is None else rooms[b]):
      if r > cap:
        article = "an" if slots.noun[0] in "aeiou" else "a"
        what = f"{t} tokens" if slots.room == slots.slot_tokens else f"{r} of a slot's room"
        raise ValueError(f"sample {sid} has {article} {slots.noun} of {what} but a slot holds "
                         f"{cap}; raise "
                         f"{slots.tokens_field or f'the slot tokens of encoder {slots.name}'}.")
      slot = next((j for j in range(g * S, (g + 1) * S) if free[j] >= r and items[j] < most),
                  None)
      if slot is None:
        raise ValueError(
            f"sample {sid} needs {len(counts)} {slots.noun}s but the {slots.noun} slots of "
            f"language dp rank {g} are full in this microbatch; raise "
            f"{slots.slots_field or f'the slots of encoder {slots.name}'} (now {slots.slots} "
            "per microbatch).")
      placed.append((slot, used[slot]))
      free[slot] -= r
      used[slot] += t
      items[slot] += 1
    out.append(placed)
  return out


def first_fit(sizes: list[int], capacity: int, most: int = 0) -> int:
  """Bins of `capacity` (each taking at most `most` items; 0 = any number) that first fit opens
  for `sizes` in order: the slots or packed rows a rank needs."""
  free, items = [], []
  for t in sizes:
    j = next((j for j, f in enumerate(free) if f >= t and (not most or items[j] < most)), None)
    if j is None:
      free.append(capacity)
      items.append(0)
      j = len(free) - 1
    free[j] -= t
    items[j] += 1
  return len(free)


class _Rows:
  """Where each sample's tokens go: its own row, or first fit among its rank's packed rows."""

  def __init__(self, layout: Layout, bsz: int):
    self.layout, self.packed = layout, layout.pack_rows > 0
    self.count = layout.pack_rows if self.packed else bsz
    self.per_group = self.count // layout.groups
    self.free = [layout.seq_len] * self.count
    self.segments = [0] * self.count

  def place(self, b: int, g: int, n: int, sid: int) -> tuple[int, int, int]:
    """Row, offset and segment number (1-based) for sample b of rank g with n tokens."""
    L = self.layout.seq_len
    if not self.packed:
      self.free[b] -= n
      return b, 0, 1
    for r in range(g * self.per_group, (g + 1) * self.per_group):
      if self.free[r] >= n:
        offset, self.free[r] = L - self.free[r], self.free[r] - n
        self.segments[r] += 1
        return r, offset, self.segments[r]
    raise ValueError(
        f"sample {sid} ({n} tokens) does not fit in the {self.per_group} packed rows of language "
        f"dp rank {g}; raise data.pack_rows (now {self.count} per microbatch) or data.seq_len.")

  def used(self) -> np.ndarray:
    """Rows each rank fills: its samples, or its packed rows holding any (a prefix)."""
    G = self.layout.groups
    if not self.packed:
      return np.full((G,), self.per_group, np.int32)
    return np.asarray([sum(n > 0 for n in self.segments[g * self.per_group:
                                                        (g + 1) * self.per_group])
                       for g in range(G)], np.int32)


def _empty_text(rows: int, L: int, pad: int) -> Text:
  return Text(tokens_rl=np.full((rows, L), pad, np.int32),
              targets_rl=np.full((rows, L), pad, np.int32),
              loss_mask_rl=np.zeros((rows, L), np.float32),
              positions_rl=np.broadcast_to(np.arange(L, dtype=np.int32), (rows, L)).copy(),
              segment_ids_rl=np.zeros((rows, L), np.int32),
              token_sample_rl=np.full((rows, L), -1, np.int32),
              rows_sent=np.int32(0))


def _empty_slots(slots: SlotLayout, rows: int, L: int) -> Slots:
  return Slots(inputs=slots.empty(), owner_nt=np.full((slots.slots, slots.slot_tokens), -1,
                                                      np.int32),
               pos_rl=np.full((rows, L), -1, np.int32),
               used_g=np.zeros((slots.groups,), np.int32),
               sent=np.int32(slots.slots_per_group))


def _used_slots(places: list[list[tuple]], slots: SlotLayout, per_group: int) -> np.ndarray:
  used = np.zeros((slots.groups,), np.int32)
  for b, placed in enumerate(places):
    g = b // per_group
    for slot, _ in placed:
      used[g] = max(used[g], slot - g * slots.slots_per_group + 1)
  return used


def layout_microbatch(samples: list[dict | None], ids: list[int], layout: Layout,
                      tok: Vocabulary) -> Batch:
  """Lays out one microbatch (see the module docstring). Empty samples (None) have id -1; `tok`
  gives the ids the layout writes (`text.Vocabulary`).

  Rows (`_rl`) hold one sample each, or `pack_rows` rows hold several samples as segments (ids 1,
  2, ...; 0 = padding) whose positions restart at 0. Per-sample arrays (`_b`) keep one entry per
  sample in both cases.

  A sample given only as `{"meta": meta.Meta}` (text and loss tokens, its items' sizes;
  data/meta.py) takes its row and slots like the full sample would, but they stay empty: scalable
  data parallelism passes such stubs for samples whose rows and slots live on other processes'
  devices.
  The statistics count the whole microbatch, stubs included.
  """
  bsz, L, G = len(samples), layout.seq_len, layout.groups
  if bsz % G:
    raise ValueError(f"microbatch of {bsz} samples does not split over {G} language dp ranks")
  per_group = bsz // G
  rows = _Rows(layout, bsz)
  text = _empty_text(rows.count, L, tok.pad)
  samples_ = Samples(ids_b=np.full((bsz,), -1, np.int32), answer_b=np.zeros((bsz,), np.int32),
                     items_b=np.zeros((bsz,), np.int32), tokens_b=np.zeros((bsz,), np.int32))
  slots = {e.name: _empty_slots(e, rows.count, L) for e in layout.encoders}
  sizes, tokens, places = {}, {}, {}
  for e in layout.encoders:
    sizes[e.name] = [e.sizes(x) if x is not None else [] for x in samples]
    tokens[e.name] = [[e.item_tokens(sz, sid) for sz in szs]
                      for szs, sid in zip(sizes[e.name], ids)]
    rooms = [[e.item_room(sz, t) for sz, t in zip(szs, ts)]
             for szs, ts in zip(sizes[e.name], tokens[e.name])]
    places[e.name] = place_items(tokens[e.name], ids, e, rooms)
    slots[e.name].used_g[:] = _used_slots(places[e.name], e, per_group)
  counts = {"tokens": 0, "target_tokens": 0}
  filled = {e.name: [0] * e.slots for e in layout.encoders}
  for b, (sample, sid) in enumerate(zip(samples, ids)):
    if sample is None:
      continue
    g = b // per_group
    n_items = sum(len(sizes[e.name][b]) for e in layout.encoders)
    n_tok = sum(sum(tokens[e.name][b]) for e in layout.encoders)
    if "meta" in sample:
      m = sample["meta"]
      seq, n = None, m.text_tokens + n_tok - 1
      answer = n - m.loss_tokens
    else:
      try:
        seq, loss = sample_tokens(tok, sample, {e.placeholder: tokens[e.name][b]
                                                for e in layout.encoders},
                                  {e.placeholder: e.noun for e in layout.encoders})
      except ValueError as err:
        raise ValueError(f"sample {sid}: {err}") from None
      n = len(seq) - 1
      answer = n - int(loss.sum())
    if n > L:
      raise ValueError(f"sample {sid} needs {n} tokens but data.seq_len is {L}; "
                       "raise data.seq_len.")
    r, o, segment = rows.place(b, g, n, sid)
    counts["tokens"] += n
    counts["target_tokens"] += n - answer
    samples_.answer_b[b], samples_.items_b[b] = answer, n_items
    samples_.tokens_b[b], samples_.ids_b[b] = n, sid
    if seq is None:  # a stub: its row and slots belong to another process
      continue
    _write_text(text, r, o, seq, loss, segment, sid)
    for e in layout.encoders:
      _write_items(slots[e.name], e, sample, seq, r, o, g, sid, sizes[e.name][b],
                   tokens[e.name][b], places[e.name][b], filled[e.name])
  text.rows_sent = np.int32(rows.per_group)
  stats = Stats(tokens=np.int32(counts["tokens"]), target_tokens=np.int32(counts["target_tokens"]),
                items={e.name: np.int32(sum(len(s) for s in sizes[e.name]))
                       for e in layout.encoders},
                item_tokens={e.name: np.int32(sum(sum(t) for t in tokens[e.name]))
                             for e in layout.encoders},
                work={e.name: {k: np.int64(v) for k, v in
                               e.work([s for szs in sizes[e.name] for s in szs]).items()}
                      for e in layout.encoders},
                rows_used_g=rows.used(), records_read=np.int32(0),
                cost_spread=np.float32(1.0), cost_spread_in_order=np.float32(1.0))
  return Batch(text=text, samples=samples_, slots=slots, stats=stats)


def _write_text(text: Text, r: int, o: int, seq: list[int], loss: np.ndarray, segment: int,
                sid: int) -> None:
  n = len(seq) - 1
  span = slice(o, o + n)
  text.tokens_rl[r, span] = seq[:-1]
  text.targets_rl[r, span] = seq[1:]
  text.loss_mask_rl[r, span] = loss
  text.positions_rl[r, span] = np.arange(n)
  text.segment_ids_rl[r, span] = segment
  text.token_sample_rl[r, span] = sid


def _write_items(slots: Slots, e: SlotLayout, sample: dict, seq: list[int], r: int, o: int,
                 g: int, sid: int, sizes: list, tokens: list[int], places: list[tuple],
                 filled: list[int]) -> None:
  """A sample's items into its rank's slots (`filled`: items in each slot so far), and their
  placeholders' token indices."""
  S, T = e.slots_per_group, e.slot_tokens
  placeholder = o + np.flatnonzero(np.asarray(seq[:-1]) == e.placeholder)
  slots.pos_rl[r, placeholder] = np.concatenate(
      [(slot - g * S) * T + start + np.arange(t) for (slot, start), t in zip(places, tokens)]
      or [np.zeros(0, np.int32)])
  for item, size, (slot, start), t in zip(e.items(sample), sizes, places, tokens):
    slots.owner_nt[slot, start:start + t] = sid
    filled[slot] += 1
    e.write(slots.inputs, slot, start, t, item, size, filled[slot])
