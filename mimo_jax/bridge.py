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
from jax.sharding import NamedSharding

from mimo_jax.topology import BATCH, REPLICATED


def _grid(sharding: NamedSharding):
  return sharding.mesh.devices.reshape(sharding.mesh.shape["dp"], -1)


def _check(x: jax.Array, dst: NamedSharding) -> None:
  src = x.sharding
  if not isinstance(src, NamedSharding) or src.spec != BATCH or dst.spec != BATCH:
    raise ValueError(f"bridge moves dp-split arrays (spec {BATCH}); got {src} -> {dst}")
  n = x.shape[0]
  for s in (src, dst):
    if n % s.mesh.shape["dp"]:
      raise ValueError(f"{n} rows do not split over dp={s.mesh.shape['dp']}")


def transfer(x: jax.Array, dst: NamedSharding) -> jax.Array:
  """Moves a dp-split array to `dst` (also dp-split) shard by shard; see the module docstring."""
  _check(x, dst)
  if x.sharding == dst:
    return x
  n = x.shape[0]
  src_grid, dst_grid = _grid(x.sharding), _grid(dst)
  src_rows, dst_rows = n // src_grid.shape[0], n // dst_grid.shape[0]
  shards = {s.device: s.data for s in x.addressable_shards}
  out = {}
  for j in range(dst_grid.shape[0]):
    lo, hi = j * dst_rows, (j + 1) * dst_rows
    for t, device in enumerate(dst_grid[j]):
      pieces = []
      for i in range(lo // src_rows, (hi - 1) // src_rows + 1):
        shard = shards[src_grid[i, t % src_grid.shape[1]]]
        a, b = max(lo, i * src_rows) - i * src_rows, min(hi, (i + 1) * src_rows) - i * src_rows
        if (a, b) != (0, src_rows):
          shard = jax.lax.slice_in_dim(shard, a, b, axis=0)
        pieces.append(jax.device_put(shard, device))
      out[device] = pieces[0] if len(pieces) == 1 else jax.numpy.concatenate(pieces, axis=0)
  arrays = [out[d] for d in dst.addressable_devices_indices_map(x.shape)]
  return jax.make_array_from_single_device_arrays(x.shape, dst, arrays)


def transfer_tree(tree, dst: NamedSharding):
  return jax.tree.map(lambda x: transfer(x, dst), tree)


def replicate_to(x: jax.Array, dst: NamedSharding) -> jax.Array:
  """Copies a replicated array (a scalar, say) onto every device of another mesh."""
  if dst.spec != REPLICATED:
    raise ValueError(f"replicate_to needs a replicated destination, got {dst.spec}")
  if x.sharding == dst:
    return x
  src = x.addressable_shards[0].data
  arrays = [jax.device_put(src, d) for d in dst.addressable_devices_indices_map(x.shape)]
  return jax.make_array_from_single_device_arrays(x.shape, dst, arrays)
