"""Bridge bandwidth against a raw `jax.device_put` of the same bytes, between two meshes.

  python -m tools.bridge_bench [--src 0:1] [--dst 1:1] [--sizes_mib 8,64,512] [--ends programs]
                               [--record]

`--src OFFSET:DP` and `--dst OFFSET:DP` pick the device ranges (as in `topology.*`; they may
overlap, as a fan-out to a mesh that includes the source device). The raw baseline is
`jax.device_put` of the same pieces the bridge copies, pre-cut on their source devices, each to its
destination device (as tools/bench.py measures it in the training step); GB/s count the bytes that
change device. The two are timed in turns. Every bridge transfer runs with host<->device transfers
forbidden and its result is checked. `--record` appends the table to docs/benchmarks.md.

`--ends bridge` (default): the bridge is handed a whole array and delivers one; it cuts pieces
smaller than a source shard (a program on the source device before the copies) and joins a
destination's pieces (a program there after them). `--ends programs`: as in the training step,
the program that makes the array (here `2 * x`) cuts a fan-out's pieces itself (`bridge.split`),
and a fan-in's pieces are delivered for the program that takes them (here `+ 1`) to join
(`bridge.join`). Two more columns then give the time from dispatching the first program to the
second's result, with the cut and join in the bridge and in those programs.
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



def _sharding(flag: str, spec: str) -> NamedSharding:
  try:
    offset, dp = (int(v) for v in spec.split(":"))
  except ValueError:
    raise SystemExit(f"{flag} {spec}: expected OFFSET:DP, e.g. {flag} 0:2") from None
  if offset < 0 or dp < 1 or offset + dp > len(jax.devices()):
    raise SystemExit(f"{flag} {spec} needs devices {offset}..{offset + dp - 1}; there are "
                     f"{len(jax.devices())} (on CPU, XLA_FLAGS="
                     f"--xla_force_host_platform_device_count=N fakes N)")
  devices = np.asarray(jax.devices()[offset:offset + dp], dtype=object).reshape(dp, 1)
  return NamedSharding(Mesh(devices, ("dp", "tp")), P("dp"))


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(prog="python -m tools.bridge_bench", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--src", default="0:1", help="source devices, OFFSET:DP")
  parser.add_argument("--dst", default="1:1", help="destination devices, OFFSET:DP")
  parser.add_argument("--sizes_mib", default="8,64,512", help="array sizes to move, in MiB")
  parser.add_argument("--reps", type=int, default=20, help="timed rounds (bridge and raw in turns)")
  parser.add_argument("--ends", choices=("bridge", "programs"), default="bridge",
                      help="who cuts a fan-out's and joins a fan-in's pieces: the bridge, or the "
                           "programs that make and take the array (as in the training step)")
  parser.add_argument("--record", action="store_true", help="append to docs/benchmarks.md")
  args = parser.parse_args(argv)
  src, dst = _sharding("--src", args.src), _sharding("--dst", args.dst)
  ends = args.ends == "programs"
  plain = jax.jit(lambda a: a * 2)
  cutting = jax.jit(lambda a: bridge.split(a * 2, src, dst))
  take = jax.jit(lambda y: y + 1)
  joining = jax.jit(lambda y: bridge.join(y) + 1)
  rows = []
  for mib in (int(s) for s in args.sizes_mib.split(",")):
    n = src.mesh.shape["dp"] * dst.mesh.shape["dp"] * 64
    cols = mib * 2**20 // (n * 4)
    x = jax.device_put(jax.random.normal(jax.random.key(mib), (n, cols), jnp.float32), src)
    made = jax.block_until_ready(cutting(x) if ends else x)
    pieces = raw_pieces(made, dst)
    fns = {"bridge": lambda: bridge.transfer(made, dst, parts=ends),
           "raw": lambda: [jax.device_put(a, d) for a, d in pieces]}
    if ends:
      fns.update(end_bridge=lambda: take(bridge.transfer(plain(x), dst)),
                 end_programs=lambda: joining(bridge.transfer(cutting(x), dst, parts=True)))
    with jax.transfer_guard_host_to_device("disallow_explicit"), \
         jax.transfer_guard_device_to_host("disallow_explicit"):
      y = bridge.transfer(made, dst, parts=ends)
      y = jax.block_until_ready(joining(y) if ends else y)
      t = median_times(fns, args.reps)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x) * 2 + 1 if ends else np.asarray(x))
    gb = moved_bytes(made, dst) / 1e9
    row = f"| {mib} | {gb / t['bridge']:.1f} | {gb / t['raw']:.1f} | {t['raw'] / t['bridge']:.2f} |"
    if ends:
      row += f" {t['end_bridge'] * 1e3:.3f} | {t['end_programs'] * 1e3:.3f} |"
    rows.append(row)
  device = jax.devices()[0].device_kind
  header = "| MiB | bridge GB/s | raw device_put GB/s | bridge / raw |"
  if ends:
    header += " 2·x, bridge, + 1: ms, bridge cuts and joins | programs do |"
  header += "\n|" + "---:|" * (header.count("|") - 1)
  table = "\n".join([header] + rows)
  print(f"bridge {args.src} -> {args.dst} on {len(jax.devices())} x {device}, "
        f"pieces cut and joined by the {args.ends}")
  print(table)
  if args.record:
    record(f"Bridge bandwidth, {args.src} -> {args.dst}, ends: {args.ends}", "bridge_bench",
           argv, table)


if __name__ == "__main__":
  main()
