"""Moving arrays between module meshes, device to device, never through the host.

`jax.device_put` between two shardings whose shards do not line up one-to-one silently copies
through the host. The bridge therefore works on single-device shards: a dp-split array
[n, ...] is cut into the row ranges each destination dp rank needs (a slice on the device that holds
them), each piece is copied device-to-device, pieces of one destination are concatenated there, and
the result is assembled into one global array on the destination mesh. That covers fan-in
(source dp > destination dp), fan-out and any dp pair that divides n; the same function carries the
gradients back. Tensor-parallel replicas on the destination pull from different source replicas,
so copies spread over links instead of all leaving one device. Pieces that cross processes go in
batched `jax.device_put` calls between stacked shardings (NCCL on GPU, sockets on CPU); every
process computes the same plan and makes the same calls.

Cutting and joining are programs of their own, on the source and on the destination devices, and
the copies wait for the one, the other for them. Where the dp sizes differ by a whole factor k,
the programs on either side can do it instead: for a fan-out (each source dp rank's rows are those
of k destination ranks) `split`, the producer's last step inside its jit, returns `Parts` whose
shards are whole pieces, which `send` copies as they are; for a fan-in, `send(..., parts=True)`
delivers the k pieces of each destination rank as `Parts` without joining them, and the
consumer's jit joins them as its first step (`join`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mimo_jax import compat


def _rows(sharding: jax.sharding.Sharding, shape: tuple[int, ...], local: bool) -> dict:
  """Device -> (first row, last row + 1) it holds; only splits of axis 0 are supported."""
  index_map = (sharding.addressable_devices_indices_map(shape) if local
               else sharding.devices_indices_map(shape))
  out = {}
  for device, index in index_map.items():
    if not shape:  # a scalar: every device holds all of it
      out[device] = (0, 1)
      continue
    for axis, sl in enumerate(index[1:], start=1):
      if (sl.start or 0, shape[axis] if sl.stop is None else sl.stop) != (0, shape[axis]):
        raise ValueError(f"bridge moves arrays split on their first axis only; {sharding} "
                         f"splits axis {axis}")
    row = index[0]
    out[device] = (row.start or 0, shape[0] if row.stop is None else row.stop)
  return out


@dataclasses.dataclass(frozen=True)
class Piece:
  """Rows [lo, hi) of the shard on `src` that the bridge copies to `dst` (`plan`)."""
  src: jax.Device
  lo: int  # rows [lo, hi) of the source shard
  hi: int
  dst: jax.Device

  @property
  def crosses(self) -> bool:
    return self.src.process_index != self.dst.process_index


def _ranks(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> int:
  """How many distinct row ranges (dp ranks) the sharding splits axis 0 into."""
  return len(set(_rows(sharding, shape, local=False).values()))


@functools.lru_cache(maxsize=256)
def fan_out(src: jax.sharding.Sharding, shape: tuple[int, ...], dst: NamedSharding) -> int:
  """k > 1 when the source's dp ranks hold equal row ranges and each is exactly the rows of k
  consecutive destination dp ranks of equal size (a fan-out by k); 1 otherwise."""
  if not shape:
    return 1
  a = sorted(set(_rows(src, shape, local=False).values()))
  b = sorted(set(_rows(dst, shape, local=False).values()))
  if len(b) <= len(a) or len(b) % len(a):
    return 1
  k = len(b) // len(a)
  size = shape[0] // len(b)
  expect = [(i * size, (i + 1) * size) for i in range(len(b))]
  if b != expect or a != [(i * k * size, (i + 1) * k * size) for i in range(len(a))]:
    return 1
  return k


@functools.partial(jax.tree_util.register_dataclass, data_fields=["parts"],
                   meta_fields=["shape", "sharding"])
@dataclasses.dataclass(frozen=True)
class Parts:
  """An array [n, ...] split on axis 0 over `sharding`, in k parts: of every shard's k·r rows,
  `parts[j]` holds rows [j·r, (j + 1)·r) (each part split over `sharding` too). Made by a
  producer for a fan-out (`split`: one part for each destination rank), or by the bridge for a
  fan-in (`send(..., parts=True)`: one part from each source rank), and joined inside a
  consumer's jit (`join`)."""
  parts: tuple
  shape: tuple[int, ...]
  sharding: jax.sharding.Sharding

  @property
  def dtype(self):
    return self.parts[0].dtype

  @property
  def ndim(self) -> int:
    return len(self.shape)

  @property
  def nbytes(self) -> int:
    return sum(p.nbytes for p in self.parts)


def split(x: jax.Array, src: NamedSharding, dst: NamedSharding):
  """Inside the producer's jit, as it returns `x` (split over `src`): `Parts` of x for a fan-out
  to `dst` (`fan_out`), x itself (constrained to `src`) otherwise. Each part stays on the source
  devices, split as x; the cut is local to every device (no communication)."""
  x = jax.lax.with_sharding_constraint(x, src)
  k = fan_out(src, tuple(x.shape), dst)
  if k == 1:
    return x
  dp = _ranks(src, tuple(x.shape))
  r = x.shape[0] // (dp * k)
  rows = x.reshape((dp, k, r) + x.shape[1:])
  parts = tuple(jax.lax.with_sharding_constraint(rows[:, j].reshape((dp * r,) + x.shape[1:]), src)
                for j in range(k))
  return Parts(parts, tuple(x.shape), src)


def join(x):
  """Inside a consumer's jit: the array of `Parts` (its rows in order, split as before), any other
  array as it is. Local to every device (no communication)."""
  if not isinstance(x, Parts):
    return x
  dp = _ranks(x.sharding, x.shape)
  k, rest = len(x.parts), x.shape[1:]
  r = x.shape[0] // (dp * k)
  y = jnp.stack([p.reshape((dp, r) + rest) for p in x.parts], axis=1).reshape(x.shape)
  return jax.lax.with_sharding_constraint(y, x.sharding)


def is_array(x) -> bool:
  """A leaf for `jax.tree.map` over what the bridge moves (an array or `Parts`)."""
  return isinstance(x, (jax.Array, Parts))


@functools.lru_cache(maxsize=256)
def plan(src: jax.sharding.Sharding, shape: tuple[int, ...], dst: NamedSharding) -> dict:
  """For every destination device (of every process), the source pieces it is built from (those
  with `src == dst` stay where they are; the rest are what a transfer copies).

  The plan is computed identically on every process, so all of them make the same calls.
  A replica on the destination's own process is preferred; otherwise replicas take turns.
  Cached: the step moves the same shapes between the same shardings every microbatch.
  """
  replicas: dict[tuple[int, int], list] = {}
  for device, rows in sorted(_rows(src, shape, local=False).items(),
                             key=lambda kv: kv[0].id):
    replicas.setdefault(rows, []).append(device)
  out = {}
  for k, (device, (lo, hi)) in enumerate(_rows(dst, shape, local=False).items()):
    pieces = []
    for a, b in sorted(replicas):
      if b <= lo or a >= hi:
        continue
      near = [d for d in replicas[(a, b)] if d.process_index == device.process_index]
      options = near or replicas[(a, b)]
      pieces.append(Piece(options[k % len(options)], max(lo, a) - a, min(hi, b) - a, device))
    if sum(p.hi - p.lo for p in pieces) != hi - lo:
      raise ValueError(f"source shards of {src} do not cover rows [{lo}, {hi})")
    out[device] = pieces
  return out


def _shards(x: jax.Array) -> dict:
  """Device -> x's shard on it (this process's devices). `addressable_data` rather than
  `addressable_shards`, which also computes every shard's index: on an array fresh from a program
  that is most of a small transfer's host time. (`addressable_data` of a fully replicated array
  is always its first shard; an array on one device is its own shard.)"""
  devices = _local_devices(x.sharding, tuple(x.shape))
  if len(devices) == 1 and len(x.sharding.device_set) == 1:
    return {devices[0]: x}
  if x.is_fully_replicated:
    return {s.device: s.data for s in x.addressable_shards}
  return {d: x.addressable_data(i) for i, d in enumerate(devices)}


@functools.lru_cache(maxsize=256)
def _local_devices(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> tuple:
  """This process's devices of `sharding` in the order of its per-device arrays (the order of
  `addressable_data` and of what `_assemble` takes)."""
  return tuple(sharding.addressable_devices_indices_map(shape))


def _assemble(route: "_Route", sharding: jax.sharding.Sharding, arrays: list):
  """The array a route delivers from its per-device pieces: one on each of this process's devices
  of `sharding`, in `_local_devices` order (compat.assemble; tests/test_bridge.py compares both
  of its paths with `jax.make_array_from_single_device_arrays`)."""
  return compat.assemble(route.shape, route.dtype, route.aval, sharding, arrays)


def _send_across(pieces: list[Piece], cut: dict, x) -> dict:
  """Copies pieces between processes with `jax.device_put`, which pairs shard i of a source
  sharding with shard i of a destination sharding and needs every pair to cross processes. Pieces
  are sent in rounds of distinct devices and equal shapes, stacked on a new leading axis."""
  out, todo = {}, list(pieces)
  while todo:
    shape = (todo[0].hi - todo[0].lo,) + x.shape[1:] if x.ndim else ()
    batch, used, rest = [], set(), []
    for p in todo:
      p_shape = (p.hi - p.lo,) + x.shape[1:] if x.ndim else ()
      if p_shape == shape and p.src not in used and p.dst not in used:
        batch.append(p)
        used.update((p.src, p.dst))
      else:
        rest.append(p)
    todo = rest
    stack = lambda devices: NamedSharding(Mesh(np.asarray(devices, dtype=object), ("x",)),
                                          P("x"))
    local = [cut[p][None] for p in batch if p in cut]
    src = jax.make_array_from_single_device_arrays(
        (len(batch),) + shape, stack([p.src for p in batch]), local, dtype=x.dtype)
    moved = jax.device_put(src, stack([p.dst for p in batch]))
    by_device = {s.device: s.data[0] for s in moved.addressable_shards}
    for p in batch:
      if p.dst in by_device:
        out[p] = by_device[p.dst]
  return out


@functools.lru_cache(maxsize=256)
def _splitter(ranges: tuple[tuple[int, int], ...]):
  """One jitted call cutting every piece a source shard sends (one dispatch, not one a piece)."""
  return jax.jit(lambda a: [jax.lax.slice_in_dim(a, lo, hi, axis=0) for lo, hi in ranges])


def _sources(src: jax.sharding.Sharding, shape: tuple[int, ...], k: int, pieces) -> tuple:
  """How the pieces of this process's source devices are had, for an array (k = 0) or its `Parts`
  in k parts: `whole`, pairs (piece, j) of pieces that are all of their device's shard of part j
  (j = 0 for an array), sent as they are; `cut`, source device -> the pieces cut from its shard
  in one call (arrays only)."""
  rows = _rows(src, shape, local=True)
  whole, cut = [], {}
  for p in pieces:
    lo, hi = rows[p.src]
    if k:
      r = (hi - lo) // k
      if p.hi - p.lo != r or p.lo % r:
        raise ValueError(f"piece [{p.lo}, {p.hi}) of {src} is not a part of {shape} in {k}: "
                         "these Parts were split for another destination")
      whole.append((p, p.lo // r))
    elif not shape or (p.lo, p.hi) == (0, hi - lo):
      whole.append((p, 0))
    else:
      cut.setdefault(p.src, []).append(p)
  return tuple(whole), {d: tuple(ps) for d, ps in cut.items()}


def _take(x, whole: tuple, cut: dict) -> dict:
  """Piece -> its rows on its source device, as `_sources` says."""
  shards = [_shards(a) for a in x.parts] if isinstance(x, Parts) else [_shards(x)]
  out = {p: shards[j][p.src] for p, j in whole}
  for src, ps in cut.items():
    out.update(zip(ps, _splitter(tuple((p.lo, p.hi) for p in ps))(shards[0][src])))
  return out


def cuts(x, pieces: list[Piece]) -> dict:
  """Piece -> its rows on its source device (pieces of this process's source devices), as a
  transfer cuts them: a shard of `Parts` as it is; of an array, a whole shard as it is, else one
  cutting call a device. Benchmarks copy these to time raw `jax.device_put` beside the bridge."""
  k = len(x.parts) if isinstance(x, Parts) else 0
  return _take(x, *_sources(x.sharding, tuple(x.shape), k, pieces))


@functools.lru_cache(maxsize=16)
def _concat(n: int):
  """One jitted call joining n pieces on their device (cheaper to dispatch than jnp.concatenate)."""
  del n  # one compiled function per piece count; jit specialises on the pieces' shapes
  return jax.jit(lambda *pieces: jnp.concatenate(pieces, axis=0))


@dataclasses.dataclass(frozen=True)
class _Route:
  """What `send` does for one kind of array and destination, worked out once."""
  # The pieces of this process's source devices (`_sources`): those sent as they are (with the
  # part each is of), and, per source device, those cut from its shard first.
  whole: tuple
  cut: dict
  across: tuple  # pieces that change process
  local: tuple  # pieces that stay in this process (to this process's destination devices)
  targets: tuple  # their destinations, as one-device shardings
  device_lists: tuple  # what compat.copy takes with them
  k: int  # > 1: the destination gets `Parts` of k pieces a device
  # Per array to assemble on the destination (k of them for `Parts`, else one): for each of this
  # process's devices in `_local_devices` order, its pieces (one, or several it joins).
  arrays: tuple
  shape: tuple[int, ...]  # each of those arrays' shape and dtype
  dtype: object
  aval: object  # and what compat.assemble's private path takes for them (None on the public one)


@functools.lru_cache(maxsize=256)
def _route(src: jax.sharding.Sharding, shape: tuple[int, ...], dtype, k_in: int,
           dst: NamedSharding, parts: bool, private: bool) -> _Route:
  """For an array (k_in = 0) or its `Parts` in k_in parts, split over `src`, sent to `dst`
  (`private`: which compat path the route was made for)."""
  del private  # part of the cache key only
  by_dst = plan(src, shape, dst)
  pieces = [p for ps in by_dst.values() for p in ps]
  here = set(src.addressable_devices)
  whole, cut = _sources(src, shape, k_in, [p for p in pieces if p.src in here])
  mine = _local_devices(dst, shape)
  k = fan_out(dst, shape, src) if parts else 1
  if k > 1:  # every destination device holds k whole pieces, in row order: part j is the j-th
    arrays = tuple(tuple((by_dst[d][j],) for d in mine) for j in range(k))
    out_shape = (shape[0] // k,) + shape[1:]
  else:
    arrays = (tuple(tuple(by_dst[d]) for d in mine),)
    out_shape = shape
  local = tuple(p for d in mine for p in by_dst[d] if not p.crosses)
  targets, device_lists = compat.copy_targets(tuple(p.dst for p in local))
  return _Route(whole, cut, tuple(p for p in pieces if p.crosses), local, targets, device_lists,
                k, arrays, out_shape, dtype, compat.aval(out_shape, dtype, dst))


def send(x, dst: NamedSharding, parts: bool = False):
  """Dispatches the copies of `transfer(x, dst)` now and returns a function that assembles the
  array on `dst` when first called (later calls return the same array). Joining a destination's
  pieces is a program on that device: dispatched with the copies, ahead of when the array is
  needed, it would queue before the device's other work and hold it until the copies arrive.
  With `parts`, a fan-in by k (`fan_out(dst, shape, src)`) is delivered as `Parts` of its pieces,
  for a consumer that joins them inside its own program (`join`)."""
  if x.sharding == dst:
    return lambda: x
  shape = tuple(x.shape)
  k_in = len(x.parts) if isinstance(x, Parts) else 0
  route = _route(x.sharding, shape, x.dtype, k_in, dst, parts, compat.private_bridge())
  cut = _take(x, route.whole, route.cut)
  got = _send_across(route.across, cut, x) if route.across else {}
  got.update(zip(route.local, compat.copy([cut[p] for p in route.local], route.targets,
                                           route.device_lists)))
  done = []

  def assemble():
    if not done:
      arrays = [_assemble(route, dst, [got[ps[0]] if len(ps) == 1 else
                                            _concat(len(ps))(*(got[p] for p in ps))
                                            for ps in array]) for array in route.arrays]
      done.append(Parts(tuple(arrays), shape, dst) if route.k > 1 else arrays[0])
    return done[0]

  return assemble


def transfer(x, dst: NamedSharding, parts: bool = False):
  """Moves an array split on axis 0 (or replicated), or its `Parts`, to `dst`; see the module
  docstring and `send`."""
  return send(x, dst, parts)()
