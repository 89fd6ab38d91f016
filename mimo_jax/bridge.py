"""Moving arrays between module meshes, device to device, never through the host.

`jax.device_put` between two shardings whose shards do not line up one-to-one silently copies
through the host (DESIGN §3.2). The bridge therefore works on single-device shards: a dp-split array
[n, ...] is cut into the row ranges each destination dp rank needs (a slice on the device that holds
them), each piece is copied device-to-device, pieces of one destination are concatenated there, and
the result is assembled into one global array on the destination mesh. That covers fan-in
(source dp > destination dp), fan-out and any dp pair that divides n; the same function carries the
gradients back. Tensor-parallel replicas on the destination pull from different source replicas,
so copies spread over links instead of all leaving one device. Pieces that cross processes go in
batched `jax.device_put` calls between stacked shardings (NCCL on GPU, sockets on CPU); every
process computes the same plan and makes the same calls.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


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
class _Piece:
  src: jax.Device
  lo: int  # rows [lo, hi) of the source shard
  hi: int
  dst: jax.Device

  @property
  def crosses(self) -> bool:
    return self.src.process_index != self.dst.process_index


@functools.lru_cache(maxsize=256)
def _plan(src: jax.sharding.Sharding, shape: tuple[int, ...], dst: NamedSharding) -> dict:
  """For every destination device (of every process), the source pieces it is built from.

  The plan is computed identically on every process, so all of them make the same calls.
  A replica on the destination's own process is preferred; otherwise replicas take turns.
  Cached: the step moves the same shapes between the same shardings every microbatch.
  """
  replicas: dict[tuple[int, int], list] = {}
  for device, rows in sorted(_rows(src, shape, local=False).items(),
                             key=lambda kv: kv[0].id):
    replicas.setdefault(rows, []).append(device)
  plan = {}
  for k, (device, (lo, hi)) in enumerate(_rows(dst, shape, local=False).items()):
    pieces = []
    for a, b in sorted(replicas):
      if b <= lo or a >= hi:
        continue
      near = [d for d in replicas[(a, b)] if d.process_index == device.process_index]
      options = near or replicas[(a, b)]
      pieces.append(_Piece(options[k % len(options)], max(lo, a) - a, min(hi, b) - a, device))
    if sum(p.hi - p.lo for p in pieces) != hi - lo:
      raise ValueError(f"source shards of {src} do not cover rows [{lo}, {hi})")
    plan[device] = pieces
  return plan


def _whole(data: jax.Array, piece: _Piece) -> bool:
  """Whether the piece is all of its source shard (nothing to cut)."""
  return not data.ndim or (piece.lo, piece.hi) == (0, data.shape[0])


def _cut(shards: dict, piece: _Piece) -> jax.Array:
  data = shards[piece.src]
  if _whole(data, piece):
    return data
  return jax.lax.slice_in_dim(data, piece.lo, piece.hi, axis=0)


def _send_across(pieces: list[_Piece], shards: dict, x: jax.Array) -> dict:
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
    local = [_cut(shards, p)[None] for p in batch if p.src in shards]
    src = jax.make_array_from_single_device_arrays(
        (len(batch),) + shape, stack([p.src for p in batch]), local, dtype=x.dtype)
    moved = jax.device_put(src, stack([p.dst for p in batch]))
    by_device = {s.device: s.data[0] for s in moved.addressable_shards}
    for p in batch:
      if p.dst in by_device:
        out[p] = by_device[p.dst]
  return out


@functools.lru_cache(maxsize=256)
def _splitter(cuts: tuple[tuple[int, int], ...]):
  """One jitted call cutting every piece a source shard sends (one dispatch, not one a piece)."""
  return jax.jit(lambda a: [jax.lax.slice_in_dim(a, lo, hi, axis=0) for lo, hi in cuts])


def _cut_local(shards: dict, pieces: list[_Piece]) -> dict:
  """Piece -> its rows, on its source device."""
  out, todo = {}, {}
  for p in pieces:
    data = shards[p.src]
    if _whole(data, p):
      out[p] = data
    else:
      todo.setdefault(p.src, []).append(p)
  for src, ps in todo.items():
    for p, rows in zip(ps, _splitter(tuple((p.lo, p.hi) for p in ps))(shards[src])):
      out[p] = rows
  return out


@functools.lru_cache(maxsize=16)
def _concat(n: int):
  """One jitted call joining n pieces on their device (cheaper to dispatch than jnp.concatenate)."""
  del n  # one compiled function per piece count; jit specialises on the pieces' shapes
  return jax.jit(lambda *pieces: jnp.concatenate(pieces, axis=0))


@functools.lru_cache(maxsize=256)
def _aligned(src: jax.sharding.Sharding, shape: tuple[int, ...], dst: NamedSharding) -> bool:
  """Whether shard i of `src` is exactly shard i of `dst`: then one `jax.device_put` copies the
  shards device to device (no host), with less overhead than piece by piece."""
  a, b = src.devices_indices_map(shape), dst.devices_indices_map(shape)
  return (jax.process_count() == 1 and len(a) == len(b) and
          [tuple(i) for i in a.values()] == [tuple(i) for i in b.values()])


def send(x: jax.Array, dst: NamedSharding):
  """Dispatches the copies of `transfer(x, dst)` now and returns a function that assembles the
  array on `dst` when first called (later calls return the same array). Joining a destination's
  pieces is a program on that device: dispatched with the copies, ahead of when the array is
  needed, it would queue before the device's other work and hold it until the copies arrive."""
  if x.sharding == dst:
    return lambda: x
  if _aligned(x.sharding, tuple(x.shape), dst):
    y = jax.device_put(x, dst)
    return lambda: y
  plan = _plan(x.sharding, tuple(x.shape), dst)
  shards = {s.device: s.data for s in x.addressable_shards}
  across = _send_across([p for ps in plan.values() for p in ps if p.crosses], shards, x)
  mine = [d for d in plan if d.process_index == jax.process_index()]
  local = [p for d in mine for p in plan[d] if not p.crosses]
  cut = _cut_local(shards, local)
  # One call for every local copy: device_put's per-call cost is most of a small piece's.
  moved = dict(zip(local, jax.device_put([cut[p] for p in local], [p.dst for p in local])))

  @functools.cache
  def assemble() -> jax.Array:
    arrays = []
    for device in mine:
      pieces = [across[p] if p.crosses else moved[p] for p in plan[device]]
      arrays.append(pieces[0] if len(pieces) == 1 else _concat(len(pieces))(*pieces))
    return jax.make_array_from_single_device_arrays(x.shape, dst, arrays, dtype=x.dtype)

  return assemble


def transfer(x: jax.Array, dst: NamedSharding) -> jax.Array:
  """Moves an array split on axis 0 (or replicated) to `dst`; see the module docstring."""
  return send(x, dst)()
