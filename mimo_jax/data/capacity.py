"""The capacity check before anything compiles: every microbatch of a run fits each encoder's
configured slots and the packed rows, and every sample fits data.seq_len. It reads only the
metadata sidecar and follows the loader's sample order and layout (data/loader.py), so that a run
never meets a microbatch it cannot lay out.
"""

from __future__ import annotations

import grain

from mimo_jax.config import Config
from mimo_jax.data import loader, reorder
from mimo_jax.data.layout import Layout, first_fit


class CapacityError(ValueError):
  """The configured slots or packed rows cannot hold some microbatch of the run."""


def check_capacity(cfg: Config, path: str, lang_dp: int, start: int, steps: int,
                   progress=None, stop=None) -> bool:
  """Raises CapacityError, before anything compiles, if some microbatch of steps start+1..steps
  needs more slots of an encoder, or more packed rows, than configured, or holds a sample longer
  than data.seq_len; the error gives the value that works for the whole run. Reads only the
  metadata sidecar (the sample order is the loader's). Returns False if `stop()` turned true
  (a signal) before it finished."""
  d = cfg.data
  layout = loader.make_layout(cfg, lang_dp)
  records = loader.Records(path, d.task, tuple(e.name for e in layout.encoders))
  order = grain.MapDataset.range(len(records)).shuffle(seed=d.seed).repeat()
  micro = d.micro_batch
  tokens_of = {}  # record -> _tokens(...); once a record
  need = {e.name: (0, None) for e in layout.encoders}  # most slots a rank needs, and where
  rows_need, worst_len = (0, None), (0, None)
  first, last = start * d.microbatches, steps * d.microbatches
  for mb in range(first, last):
    if stop is not None and (mb - first) % 1000 == 0 and stop():
      return False
    if progress and mb > first and (mb - first) % 20000 == 0:
      progress(f"checking capacity: microbatch {mb - first}/{last - first}")
    ids = [mb * micro + j for j in range(micro)]
    indices = [order[i] for i in ids]
    for i, index in zip(ids, indices):
      if index not in tokens_of:
        tokens_of[index] = _tokens(layout, records.meta[index], i)
    samples = [tokens_of[index] for index in indices]
    lengths, ranks = _order(cfg, layout, samples)
    where = f"step {mb // d.microbatches + 1}, microbatch {mb % d.microbatches}"
    rows_need = _fill(layout, ranks, [s[2] for s in samples], lengths, where, need, rows_need)
    longest = max(lengths)
    if longest > worst_len[0]:
      worst_len = (longest, f"{where}, sample {ids[lengths.index(longest)]}")
  _refuse(layout, need, rows_need, worst_len, start, steps)
  return True


def _tokens(layout: Layout, m, sid: int) -> tuple[dict, int, dict]:
  """A record's ({encoder: [item tokens]}, text tokens, {encoder: [item rooms]}) from its
  metadata `m`; an item no slot can take is an error naming sample `sid`."""
  sizes = {e.name: e.sizes({"meta": m}) for e in layout.encoders}
  tokens = {e.name: [e.item_tokens(size, sid) for size in sizes[e.name]]
            for e in layout.encoders}
  rooms = {e.name: [e.item_room(size, t) for size, t in zip(sizes[e.name], tokens[e.name])]
           for e in layout.encoders}
  return tokens, m.text_tokens, rooms


def _order(cfg: Config, layout: Layout, samples: list[tuple]) -> tuple[list, list]:
  """A microbatch's samples' lengths (language positions) and the loader's order of them over
  the language dp ranks (`layout.groups` shares, one after the other)."""
  d = cfg.data
  items = [s[0] for s in samples]
  lengths = [text + sum(sum(t) for t in it.values()) - 1
             for it, text in zip(items, (s[1] for s in samples))]
  costs = [reorder.sample_cost(sum(sum(t) for t in it.values()), s[1],
                               d.image_token_cost, d.text_token_cost)
           for it, s in zip(items, samples)]
  # With microbatch_fill=pack: stream order's microbatches laid out as pack lays them out, the
  # bound that pack's microbatches keep to (loader._pack_step).
  return lengths, loader.sample_order(lengths, costs, layout.groups, d,
                                      d.microbatch_fill == "pack")


def _fill(layout: Layout, ranks: list, rooms: list[dict], lengths: list[int], where: str,
          need: dict, rows_need: tuple) -> tuple:
  """Each rank's share of a microbatch (`ranks`) first-fit into each encoder's slots (raising
  `need`, encoder -> most slots a rank needs and where) and into packed rows (returned: the
  most rows a rank needs and where). An item larger than a slot is a CapacityError."""
  G = layout.groups
  per = len(lengths) // G
  for g in range(G):
    mine = ranks[g * per:(g + 1) * per]
    for e in layout.encoders:
      sizes = [r for b in mine for r in rooms[b][e.name]]
      too_big = [r for r in sizes if r > e.room]
      if too_big:
        what = "tokens" if e.room == e.slot_tokens else "of a slot's room"
        raise CapacityError(f"{where}: a {e.noun} of {too_big[0]} {what} does not fit a slot "
                            f"of {e.room}; raise "
                            f"{e.tokens_field or f'the slot tokens of encoder {e.name}'}.")
      n = first_fit(sizes, e.room, e.slot_items)
      if n > need[e.name][0]:
        need[e.name] = (n, f"{where}, language dp rank {g}")
    if layout.pack_rows:
      n = first_fit([lengths[b] for b in mine], layout.seq_len)
      if n > rows_need[0]:
        rows_need = (n, f"{where}, language dp rank {g}")
  return rows_need


def _refuse(layout: Layout, need: dict, rows_need: tuple, worst_len: tuple, start: int,
            steps: int) -> None:
  """The CapacityError of the first limit the run's microbatches exceed: data.seq_len, an
  encoder's slots, data.pack_rows; each gives the value enough for steps start+1..steps."""
  G = layout.groups
  if worst_len[0] > layout.seq_len:
    raise CapacityError(f"{worst_len[1]} needs {worst_len[0]} tokens but data.seq_len is "
                        f"{layout.seq_len}; raise data.seq_len to {worst_len[0]}.")
  for e in layout.encoders:
    n, at = need[e.name]
    if n > e.slots_per_group:
      field = e.slots_field or f"the slots of encoder {e.name}"
      raise CapacityError(
          f"{field}={e.slots} is too small for this run: {at} needs {n} {e.noun} slots, "
          f"{e.slots_per_group} a rank are configured; set {field}={n * G} (enough for every "
          f"microbatch of steps {start + 1}-{steps}).")
  if layout.pack_rows and rows_need[0] > layout.pack_rows // G:
    raise CapacityError(
        f"data.pack_rows={layout.pack_rows} is too small for this run: {rows_need[1]} needs "
        f"{rows_need[0]} rows, {layout.pack_rows // G} a rank are configured; set "
        f"data.pack_rows={rows_need[0] * G} (enough for every microbatch of steps "
        f"{start + 1}-{steps}).")
