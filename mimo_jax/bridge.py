"""Moving arrays between module meshes, device to device, never through the host.

`jax.device_put` between two shardings whose shards do not line up one-to-one silently copies
through the host (DESIGN §3.2). The bridge therefore works on single-device shards: a dp-split array
[n, ...] is cut into the row ranges each destination dp rank needs (a slice on the device that holds
them), each piece is copied device-to-device, pieces of one destination are concatenated there, and
the result is assembled into one global array on the destination mesh. That covers fan-in
(source dp > destination dp), fan-out and any dp pair that divides n; the same function carries the
gradients back. Tensor-parallel replicas on the destination pull from different source replicas,
so copies spread over links instead of all leaving one device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding


def _rows(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> dict:
  """Device -> (first row, last row + 1) it holds; only splits of axis 0 are supported."""
  out = {}
  for device, index in sharding.addressable_devices_indices_map(shape).items():
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


def transfer(x: jax.Array, dst: NamedSharding) -> jax.Array:
  """Moves an array split on axis 0 (or replicated) to `dst` shard by shard; see the docstring."""
  if x.sharding == dst:
    return x
  shards = {s.device: s.data for s in x.addressable_shards}
  replicas: dict[tuple[int, int], list] = {}
  for device, rows in sorted(_rows(x.sharding, x.shape).items(), key=lambda kv: kv[0].id):
    replicas.setdefault(rows, []).append(device)
  sources = sorted(replicas)
  arrays = []
  for k, (device, (lo, hi)) in enumerate(_rows(dst, x.shape).items()):
    pieces = []
    for a, b in sources:
      if b <= lo or a >= hi:
        continue
      src = replicas[(a, b)][k % len(replicas[(a, b)])]  # spread copies over replicas
      piece = shards[src]
      if (max(lo, a), min(hi, b)) != (a, b):
        piece = jax.lax.slice_in_dim(piece, max(lo, a) - a, min(hi, b) - a, axis=0)
      pieces.append(jax.device_put(piece, device))
    if sum(p.shape[0] if p.ndim else 1 for p in pieces) != hi - lo:
      raise ValueError(f"source shards of {x.sharding} do not cover rows [{lo}, {hi})")
    arrays.append(pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces, axis=0))
  return jax.make_array_from_single_device_arrays(x.shape, dst, arrays)


def transfer_tree(tree, dst: NamedSharding):
  return jax.tree.map(lambda x: transfer(x, dst), tree)
