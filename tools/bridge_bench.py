"""Bridge bandwidth against a raw `jax.device_put` of the same bytes, between two meshes.

  python -m tools.bridge_bench [--src 0:1] [--dst 1:1] [--sizes_mib 8,64,512] [--record]

`--src OFFSET:DP` and `--dst OFFSET:DP` pick the device ranges (as in `topology.*`; they may
overlap, as a fan-out to a mesh that includes the source device). The raw baseline is
`jax.device_put` of the same pieces the bridge copies, pre-cut on their source devices, each to its
destination device (as tools/bench.py measures it in the training step); GB/s count the bytes that
change device. The two are timed in turns. Every bridge transfer runs with host<->device transfers
forbidden and its result is checked. `--record` appends the table to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mimo_jax import bridge
from tools.bench import moved_bytes, raw_pieces
from tools.common import median_times, record



def _sharding(spec: str) -> NamedSharding:
  offset, dp = (int(v) for v in spec.split(":"))
  devices = np.asarray(jax.devices()[offset:offset + dp], dtype=object).reshape(dp, 1)
  return NamedSharding(Mesh(devices, ("dp", "tp")), P("dp"))


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--src", default="0:1", help="source devices, OFFSET:DP")
  parser.add_argument("--dst", default="1:1", help="destination devices, OFFSET:DP")
  parser.add_argument("--sizes_mib", default="8,64,512", help="array sizes to move, in MiB")
  parser.add_argument("--reps", type=int, default=20, help="timed rounds (bridge and raw in turns)")
  parser.add_argument("--record", action="store_true", help="append to docs/benchmarks.md")
  args = parser.parse_args(argv)
  src, dst = _sharding(args.src), _sharding(args.dst)
  rows = []
  for mib in (int(s) for s in args.sizes_mib.split(",")):
    n = src.mesh.shape["dp"] * dst.mesh.shape["dp"] * 64
    cols = mib * 2**20 // (n * 4)
    x = jax.device_put(jax.random.normal(jax.random.key(mib), (n, cols), jnp.float32), src)
    pieces = raw_pieces(x, dst)
    with jax.transfer_guard_host_to_device("disallow_explicit"), \
         jax.transfer_guard_device_to_host("disallow_explicit"):
      y = jax.block_until_ready(bridge.transfer(x, dst))
      t = median_times({"bridge": lambda: bridge.transfer(x, dst),
                        "raw": lambda: [jax.device_put(a, d) for a, d in pieces]}, args.reps)
      t_bridge, t_raw = t["bridge"], t["raw"]
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
    gb = moved_bytes(x, dst) / 1e9
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
