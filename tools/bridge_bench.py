"""Bridge bandwidth against a raw `jax.device_put` of the same bytes, between two meshes.

  python -m tools.bridge_bench [--src 0:1] [--dst 1:1] [--sizes_mib 8,64,512] [--record]

`--src OFFSET:DP` and `--dst OFFSET:DP` pick the device ranges (as in `topology.*`). The raw
baseline is `jax.device_put` between shardings whose shards line up one-to-one (a plain
device-to-device copy); where the dp sizes differ it copies each source shard to the destination
device that holds it first. Every bridge transfer runs with host<->device transfers forbidden and
its result is checked. `--record` appends the table to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mimo_jax import bridge
from tools.common import median_times, record



def _sharding(spec: str) -> NamedSharding:
  offset, dp = (int(v) for v in spec.split(":"))
  devices = np.asarray(jax.devices()[offset:offset + dp], dtype=object).reshape(dp, 1)
  return NamedSharding(Mesh(devices, ("dp", "tp")), P("dp"))


def _raw(x: jax.Array, dst: NamedSharding):
  """device_put of the same bytes without regrouping: each source shard to one destination."""
  targets = list(dst.mesh.devices.flat)
  return [jax.device_put(s.data, targets[i % len(targets)])
          for i, s in enumerate(x.addressable_shards)]


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--src", default="0:1")
  parser.add_argument("--dst", default="1:1")
  parser.add_argument("--sizes_mib", default="8,64,512")
  parser.add_argument("--reps", type=int, default=20)
  parser.add_argument("--record", action="store_true")
  args = parser.parse_args(argv)
  src, dst = _sharding(args.src), _sharding(args.dst)
  rows = []
  for mib in (int(s) for s in args.sizes_mib.split(",")):
    n = src.mesh.shape["dp"] * dst.mesh.shape["dp"] * 64
    cols = mib * 2**20 // (n * 4)
    x = jax.device_put(jax.random.normal(jax.random.key(mib), (n, cols), jnp.float32), src)
    with jax.transfer_guard_host_to_device("disallow_explicit"), \
         jax.transfer_guard_device_to_host("disallow_explicit"):
      y = jax.block_until_ready(bridge.transfer(x, dst))
      t = median_times({"bridge": lambda: bridge.transfer(x, dst), "raw": lambda: _raw(x, dst)},
                       args.reps)
      t_bridge, t_raw = t["bridge"], t["raw"]
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
    gb = x.nbytes / 1e9
    rows.append((mib, gb / t_bridge, gb / t_raw, t_raw / t_bridge))
  device = jax.devices()[0].device_kind
  header = ("| MiB | bridge GB/s | raw device_put GB/s | bridge / raw |\n"
            "|---:|---:|---:|---:|")
  table = "\n".join([header] + [f"| {m} | {b:.1f} | {r:.1f} | {q:.2f} |" for m, b, r, q in rows])
  print(f"bridge {args.src} -> {args.dst} on {len(jax.devices())} x {device}")
  print(table)
  if args.record:
    record(f"Bridge bandwidth, {args.src} -> {args.dst}", "bridge_bench", argv, table)


if __name__ == "__main__":
  main()
