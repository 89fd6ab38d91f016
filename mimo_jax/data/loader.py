"""grain pipelines: the global sample order and the per-step batches in slot layout.

Sample j of step s is element s * global_batch + j of one shuffled, endlessly repeated stream of
record indices that depends only on `data.seed`, never on the topology. The layout
(slots per language dp rank) is the only topology-dependent part, and it moves samples between
slots, never between steps.

Scalable data parallelism: the layout of a microbatch is computed from every sample's metadata
(data/meta.py: text and loss tokens, each item's size), but a process reads and decodes only the
records whose rows or slots live on its own devices (`Locality`); the other samples become stubs
that take their rows and slots without content. Every process computes the same layout, so every
module sees the same samples in the same places; `records_read` counts this process's reads.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Callable, Iterator

import grain
import jax
import numpy as np

from mimo_jax import encoders
from mimo_jax.batch import Batch, stack
from mimo_jax.config import Config, ConfigError
from mimo_jax.config_run import DataConfig
from mimo_jax.data import av_digits, conversations, digits, meta, reorder, synthetic
from mimo_jax.data.layout import Layout, first_fit, layout_microbatch, place_items
from mimo_jax.data.text import Vocabulary


@dataclasses.dataclass(frozen=True)
class Task:
  """What the loader needs of a task (`data.task`): how a record of its shards decodes, and the
  vocabulary whose ids the layout writes around its samples."""
  decode: Callable[[bytes, str, int], dict]
  vocabulary: Vocabulary


# The digits task's shards are converted conversations (data/digits.py).
TASKS = {"digits": Task(conversations.decode, conversations.VOCABULARY),
         "av_digits": Task(conversations.decode, conversations.VOCABULARY),
         "synthetic": Task(synthetic.decode, synthetic.VOCABULARY),
         "conversations": Task(conversations.decode, conversations.VOCABULARY)}


class DataError(ConfigError):
  """A shard that cannot be read; the message names it and how to rebuild it."""


def read_record(read, path: str, index: int, task: str) -> dict:
  """Record `index` of `task`'s shard `path` (`read()` gives its bytes), decoded; a damaged
  record or shard is a DataError naming the fix for the task's shards."""
  try:
    return TASKS[task].decode(read(), path, index)
  except Exception as e:  # pylint: disable=broad-except
    reason = str(e).splitlines()[0] if str(e) else type(e).__name__
    if task == "conversations":  # tools.convert writes a directory whole, never into one
      fix = (f"convert the data again with `python -m tools.convert` into a new --out (or "
             f"delete {os.path.dirname(path) or '.'} first)")
    else:
      fix = f"delete it and {meta.path_of(path)} and run again to rebuild them"
    raise DataError(f"{path}: record {index} cannot be read ({reason}); the shard is damaged: "
                    f"{fix}.") from None


def build_paths(cfg: Config, progress=None) -> dict[str, str]:
  """The task's train and eval shards, built on first use."""
  d = cfg.data
  if d.task == "conversations":
    return conversations.paths(cfg)
  if d.task == "synthetic":
    return synthetic.paths(cfg, progress)
  if d.task == "av_digits":
    return conversations.paths(cfg, av_digits.build(d.dir, d.train_samples, d.eval_samples))
  return conversations.paths(cfg, digits.build(d.dir, d.train_samples, d.eval_samples,
                                                d.probs()))


def make_layout(cfg: Config, groups: int, eval_batch: int = 0) -> Layout:
  """The training layout, or with `eval_batch` > 0 that of an eval batch of that many samples (no
  packing, slots for every sample's most items)."""
  slots = {n: e.slots(cfg, eval_batch) for n, e in encoders.of(cfg).items()}
  return Layout(seq_len=cfg.data.seq_len, groups=groups,
                encoders=tuple(e.slot_layout(cfg, groups, slots[n])
                               for n, e in encoders.of(cfg).items()),
                pack_rows=0 if eval_batch else cfg.data.pack_rows)


class _Decode(grain.transforms.Map):

  def __init__(self, path: str, task: str):
    self._path, self._task = path, task

  def map(self, element):
    index, record = element
    return index, read_record(lambda: record, self._path, index, self._task)


def open_shard(path: str, task: str) -> grain.sources.ArrayRecordDataSource:
  """A shard's records by index (its length is read from the file, no record is); a file that is
  not a shard (a truncated one, say) is a DataError naming the fix for `task`'s shards."""
  try:
    return grain.sources.ArrayRecordDataSource([path])
  except Exception as e:  # pylint: disable=broad-except
    reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    fix = ("convert the data again with `python -m tools.convert`" if task == "conversations"
           else "delete it and run again to rebuild it")
    raise DataError(f"{path} cannot be opened as a shard ({reason}); {fix}, or check "
                    "data.dir.") from None


def empty_shard(path: str, task: str) -> str:
  """What to do about a shard without records: converted data is made again by tools.convert
  (an empty eval shard is what `--eval 0` writes), the built-in tasks' shards are rebuilt."""
  if task == "conversations":
    return (f"{path} holds no samples; convert the data again with `python -m tools.convert`"
            + (" and --eval N (N held-out records for eval.samples)" if
               path.endswith("eval.array_record") else "") + ".")
  return f"{path} holds no samples; delete it and run again to rebuild it, or check data.dir."


def eval_shortfall(cfg: Config, path: str, count: int) -> str | None:
  """Why `count` records in the eval shard `path` cannot give eval.samples, or None if they
  can; the advice fits the task (converted data: tools.convert's --eval made the split)."""
  n = cfg.eval.samples
  if n <= count:
    return None
  if cfg.data.task == "conversations":
    return (f"config.eval.samples: {n} but {path} holds {count} held-out samples; lower "
            f"eval.samples to {count}, or convert the data again with --eval {n} or more.")
  return (f"config.eval.samples: {n} but {path} holds {count} held-out samples; lower "
          f"eval.samples to {count}, or raise data.eval_samples to {n} (the shards are rebuilt).")


def _source(path: str, task: str) -> grain.MapDataset:
  src = grain.sources.ArrayRecordDataSource([path])
  if len(src) == 0:
    raise DataError(empty_shard(path, task))
  ds = grain.MapDataset.source(src)
  return ds.map_with_index(lambda i, r: (i, r)).map(_Decode(path, task))


@dataclasses.dataclass(frozen=True)
class Locality:
  """Which language dp groups and which slots of each encoder a microbatch has on this process.
  `groups=None` means every group, `slots=None` every slot of every encoder; an encoder missing
  from `slots` has none here."""
  groups: frozenset | None = None
  slots: dict[str, tuple[tuple[int, int], ...]] | None = None  # encoder -> [lo, hi) slot ranges

  @property
  def everything(self) -> bool:
    return self.groups is None and self.slots is None

  def needs(self, group: int, slots: dict[str, set[int]]) -> bool:
    """Whether a sample of language group `group` whose items lie in `slots` (encoder -> slot
    numbers) has a row or a slot here."""
    if self.groups is None or group in self.groups:
      return True
    if self.slots is None:
      return any(slots.values())
    return any(lo <= j < hi for name, taken in slots.items()
               for j in taken for lo, hi in self.slots.get(name, ()))


def slot_counts(cfg: Config) -> dict[str, int]:
  """Each encoder's slots in a training microbatch."""
  return {n: e.slots(cfg) for n, e in encoders.of(cfg).items()}


def locality(topo, slots: dict[str, int]) -> Locality:
  """The `Locality` of this process under `topo` (a topology.Topology) for `slots` (encoder ->
  slots a microbatch): the dp indices of its language devices and the slot ranges of each
  encoder's devices."""
  def local_dp(name):
    mesh = topo.meshes[name]
    dp_axis = mesh.axis_names.index("dp")
    return {i[dp_axis] for i in np.ndindex(mesh.devices.shape)
            if mesh.devices[i].process_index == jax.process_index()}, mesh.shape["dp"]

  groups, lang_dp = local_dp("language")
  ranges, everything = {}, True
  for name, count in slots.items():
    ranks, dp = local_dp(name)
    per = count // dp
    everything &= len(ranks) == dp
    ranges[name] = tuple((r * per, (r + 1) * per) for r in sorted(ranks))
  return Locality(None if len(groups) == lang_dp else frozenset(groups),
                  None if everything else ranges)


class Records:
  """Random access to a shard's records and their metadata (which must list the items of the
  encoders in `names`; default: every registered one, the built-in ones included); decodes on
  demand."""

  def __init__(self, path: str, task: str, names: tuple[str, ...] | None = None):
    self.path, self._task = path, task
    self.source = open_shard(path, task)
    if len(self.source) == 0:
      raise DataError(empty_shard(path, task))
    if names is None:
      encoders.builtin()
      names = tuple(encoders.REGISTRY)
    marks = conversations.shard_placeholders(path) if task == "conversations" else None
    self.meta = meta.load(path, len(self.source), self.read, names, TASKS[task].vocabulary, marks)

  def __len__(self) -> int:
    return len(self.source)

  def read(self, index: int) -> dict:
    return read_record(lambda: self.source[index], self.path, index, self._task)


def sample_order(lengths: list[int], costs: list[float], groups: int, data: DataConfig,
                 packed: bool) -> list[int]:
  """The order a microbatch's samples are laid out in, rank after rank (as many each): with
  data.reorder=balance, over the ranks by cost. With `packed` (data.microbatch_fill=pack) each
  rank's samples come longest first, so that its first fit of rows and slots is first fit
  decreasing, and without balance the samples are dealt to the ranks longest first, back and
  forth (0, 1, .., G-1, G-1, .., 0, ..)."""
  order = list(range(len(lengths)))
  if packed:
    order.sort(key=lambda b: (-lengths[b], b))
  if data.reorder == "balance":
    return [order[i] for i in reorder.balance([costs[b] for b in order], groups)]
  if packed and groups > 1:
    ranks = [[] for _ in range(groups)]
    for k, b in enumerate(order):
      g = k % groups
      ranks[g if (k // groups) % 2 == 0 else groups - 1 - g].append(b)
    order = [b for rank in ranks for b in rank]
  return order


def _needs(order: list[int], rooms: list[dict], lengths: list[int],
           layout: Layout) -> tuple[int, dict[str, int]]:
  """The packed rows and each encoder's slots that the fullest rank of a microbatch laid out in
  `order` needs (`rooms[b]`: encoder -> the room sample b's items take in a slot)."""
  per = len(order) // layout.groups
  rows, slots = 0, {e.name: 0 for e in layout.encoders}
  for g in range(layout.groups):
    mine = order[g * per:(g + 1) * per]
    for e in layout.encoders:
      slots[e.name] = max(slots[e.name], first_fit([t for b in mine for t in rooms[b][e.name]],
                                                   e.room, e.slot_items))
    if layout.pack_rows:
      rows = max(rows, first_fit([lengths[b] for b in mine], layout.seq_len))
  return rows, slots


def _plan(elements, layout: Layout, data: DataConfig, records: "Records", id_of):
  """Metadata of a list of (stream position, record index) pairs: stubs, sample ids, each
  sample's item tokens per encoder, its length in positions, its cost and the room its items
  take in their slots per encoder."""
  stubs = [{"meta": records.meta[index]} for _, index in elements]
  ids = [id_of(pos) for pos, _ in elements]
  items = [{e.name: [e.item_tokens(size, sid) for size in e.sizes(stub)]
            for e in layout.encoders} for stub, sid in zip(stubs, ids)]
  rooms = [{e.name: [e.item_room(size, t) for size, t in zip(e.sizes(stub), it[e.name])]
            for e in layout.encoders} for stub, it in zip(stubs, items)]
  lengths = [stub["meta"].text_tokens + sum(sum(t) for t in it.values()) - 1
             for stub, it in zip(stubs, items)]
  costs = [reorder.sample_cost(sum(sum(t) for t in it.values()), stub["meta"].text_tokens,
                               data.image_token_cost, data.text_token_cost)
           for stub, it in zip(stubs, items)]
  return stubs, ids, items, lengths, costs, rooms


def _layout_batch(elements, layout: Layout, tok: Vocabulary, id_of, data: DataConfig,
                  records: Records, where: Locality) -> Batch:
  """Lays out one microbatch of (stream position, record index) pairs: orders its samples
  (`sample_order`) and reads only the records `where` needs."""
  stubs, ids, items, lengths, costs, rooms = _plan(elements, layout, data, records, id_of)
  order = sample_order(lengths, costs, layout.groups, data, data.microbatch_fill == "pack")
  elements, stubs, ids = ([x[i] for i in order] for x in (elements, stubs, ids))
  item_tokens = {e.name: [items[i][e.name] for i in order] for e in layout.encoders}
  per_group = len(elements) // layout.groups
  places = {e.name: place_items(item_tokens[e.name], ids, e,
                                [rooms[i][e.name] for i in order]) for e in layout.encoders}
  samples = [records.read(index)
             if where.needs(b // per_group, {n: {j for j, _ in p[b]} for n, p in places.items()})
             else stub for b, ((_, index), stub) in enumerate(zip(elements, stubs))]
  out = layout_microbatch(samples, ids, layout, tok)
  out.stats.records_read = np.int32(sum("meta" not in s for s in samples))
  out.stats.cost_spread = np.float32(reorder.spread(costs, order, layout.groups))
  out.stats.cost_spread_in_order = np.float32(
      reorder.spread(costs, list(range(len(costs))), layout.groups))
  return out


def _pack_step(elements, cfg: Config, layout: Layout, records: "Records", id_of,
               lay_out) -> Batch:
  """A step with data.microbatch_fill=pack: its samples assigned to microbatches
  (`reorder.pack`) to lower the rows and slots they send, each microbatch then laid out by
  `lay_out` (longest first). No microbatch needs more rows or slots than the fullest of the
  step's stream-order microbatches laid out that way, which is what capacity.py checks."""
  d, G = cfg.data, layout.groups
  _, _, _, lengths, costs, rooms = _plan(elements, layout, d, records, id_of)
  n, m = len(elements), d.microbatches
  per = n // m

  def needs(members):
    order = sample_order([lengths[i] for i in members], [costs[i] for i in members], G, d, True)
    return _needs([members[k] for k in order], rooms, lengths, layout)

  stream = [needs(tuple(range(k * per, (k + 1) * per))) for k in range(m)]
  most_rows = max(r for r, _ in stream)
  most_slots = {e.name: max(s[e.name] for _, s in stream) for e in layout.encoders}
  row_count = layout.pack_rows // G if layout.pack_rows else per // G

  def evaluate(members):
    rows, slots = needs(members)
    fits = rows <= most_rows and all(slots[k] <= most_slots[k] for k in slots)
    rows = (reorder.bucket(rows, row_count, d.row_buckets, G) if d.row_buckets and
            layout.pack_rows else row_count)
    work = rows * G * layout.seq_len * d.text_token_cost
    for e in layout.encoders:
      sent = (reorder.bucket(slots[e.name], e.slots_per_group, d.slot_buckets, G,
                             cfg.topology.module(e.name).dp) if d.slot_buckets else
              e.slots_per_group)
      work += sent * G * e.slot_tokens * d.image_token_cost
    return work, fits

  perm = reorder.pack(n, m, evaluate)
  return _step_batch([lay_out([elements[i] for i in perm[k * per:(k + 1) * per]])
                      for k in range(m)], cfg=cfg, layout=layout)


def train_dataset(cfg: Config, path: str, lang_dp: int,
                  where: Locality | None = None) -> grain.MapDataset:
  """Element s = step s's batch: arrays with a leading [microbatches] axis. `where` limits the
  records read to this process's share (default: read everything)."""
  d = cfg.data
  layout = make_layout(cfg, lang_dp)
  records = Records(path, d.task, tuple(e.name for e in layout.encoders))
  ds = grain.MapDataset.range(len(records)).shuffle(seed=d.seed).repeat()
  # Stream position = sample id: unique within a step, identical on every topology.
  ds = ds.map_with_index(lambda pos, index: (pos, index))
  id_of = lambda pos: pos % (2**31 - 1)
  batch_fn = functools.partial(_layout_batch, layout=layout, tok=TASKS[d.task].vocabulary,
                               id_of=id_of, data=d, records=records,
                               where=where or Locality())
  if d.microbatch_fill == "pack":
    return ds.batch(d.global_batch, batch_fn=functools.partial(
        _pack_step, cfg=cfg, layout=layout, records=records, id_of=id_of, lay_out=batch_fn))
  ds = ds.batch(d.micro_batch, batch_fn=batch_fn)
  return ds.batch(d.microbatches, batch_fn=functools.partial(_step_batch, cfg=cfg, layout=layout))


def _step_batch(microbatches: list[Batch], cfg: Config, layout: Layout) -> Batch:
  """A step's microbatches stacked [m, ...]. With `data.slot_buckets`, each encoder's `Slots.sent`
  is how many of each rank's slots a microbatch sends to the encoder, and with `data.row_buckets`,
  `Text.rows_sent` how many of its packed rows go to the language model (the rest are empty; a
  pipelined module takes a step's microbatches as one array, so then every microbatch sends the
  step's most); with `data.microbatch_order=pipeline` the microbatches are reordered for the
  encoder -> language pipeline (reorder.pipeline_order)."""
  d, tops = cfg.data, cfg.topology
  pipelined = any(t.pp > 1 for t in tops.modules().values())

  def sent(used: list[int], buckets: int, per_rank: int, split: int) -> list[int]:
    if not buckets:
      return [per_rank] * len(used)
    out = [reorder.bucket(u, per_rank, buckets, layout.groups, split) for u in used]
    return [max(out)] * len(out) if pipelined else out

  slots = {e.name: sent([int(mb.slots[e.name].used_g.max()) for mb in microbatches],
                        d.slot_buckets, e.slots_per_group, tops.module(e.name).dp)
           for e in layout.encoders}
  rows = sent([int(mb.stats.rows_used_g.max()) for mb in microbatches], d.row_buckets,
              microbatches[0].text.tokens_rl.shape[0] // layout.groups, 1)
  order = list(range(len(microbatches)))
  if d.microbatch_order == "pipeline":
    # Time on each module's devices: encoder work grows with the slots it computes, the language
    # model's with the rows it computes, padding included.
    encoder = [sum(slots[e.name][i] * layout.groups * e.slot_tokens * d.image_token_cost
                   / tops.module(e.name).size for e in layout.encoders)
               for i in order]
    language = [r * layout.groups * layout.seq_len * d.text_token_cost / tops.language.size
                for r in rows]
    order = reorder.pipeline_order(encoder, language)
  for i, mb in enumerate(microbatches):
    mb.text.rows_sent = np.int32(rows[i])
    for name, s in slots.items():
      mb.slots[name].sent = np.int32(s[i])
  return stack([microbatches[i] for i in order])


def train_iterator(cfg: Config, path: str, lang_dp: int, start_step: int = 0,
                   where: Locality | None = None) -> Iterator[dict]:
  """Step batches from `start_step` on (the whole iterator state a checkpoint needs). With
  `data.worker_processes` > 0 each of that many processes builds every p-th step (`data.workers`
  read threads each) and grain hands them back in order; close the iterator to stop them."""
  ds = train_dataset(cfg, path, lang_dp, where)[start_step:]
  # Explicit options: grain's defaults (16 threads, 500 elements ahead) would apply otherwise.
  w, p = cfg.data.workers, cfg.data.worker_processes
  it = ds.to_iter_dataset(grain.ReadOptions(num_threads=w, prefetch_buffer_size=2 * w))
  if p:
    _absl_flags_parsed()
    it = it.mp_prefetch(grain.MultiprocessingOptions(num_workers=p, per_worker_buffer_size=2))
  return iter(it)


def _absl_flags_parsed() -> None:
  """grain's worker processes read absl flags (their defaults will do); a program that does not
  parse absl flags itself, like ours, must say so first."""
  from absl import flags  # pylint: disable=import-outside-toplevel
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()


def eval_batches(cfg: Config, path: str, lang_dp: int) -> list[Batch]:
  """The first `eval.samples` eval samples in file order, in batches of `eval.batch`.

  The last batch is padded with empty rows (sample id -1, no loss, no accuracy), never truncated.
  """
  n, bsz = cfg.eval.samples, cfg.eval.batch
  layout = make_layout(cfg, lang_dp, eval_batch=bsz)
  tok = TASKS[cfg.data.task].vocabulary
  records = Records(path, cfg.data.task, tuple(e.name for e in layout.encoders))
  short = eval_shortfall(cfg, path, len(records))
  if short:  # validation_data.validate_data refuses this before a run starts
    raise DataError(short)
  out = []
  for start in range(0, n, bsz):
    stop = min(start + bsz, n)
    samples = [records.read(i) for i in range(start, stop)] + [None] * (bsz - (stop - start))
    ids = list(range(start, stop)) + [-1] * (bsz - (stop - start))
    out.append(layout_microbatch(samples, ids, layout, tok))
  return out
