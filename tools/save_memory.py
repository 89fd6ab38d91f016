"""Host memory of an orbax save of device arrays, per handler option (run on a GPU host):
`python -m tools.save_memory [--gib 6] [--variants standard,pytree,pytree_batched,numpy]`.

Each variant runs in its own process: it makes `--gib` GiB of float32 arrays on the first device,
then saves them with orbax (synchronously) while a thread samples the process's resident memory
every 5 ms, and prints the increase over the memory held before the save:

* `standard`: `StandardCheckpointHandler(save_concurrent_gb=2)` (limits bytes being written);
* `pytree`: `PyTreeCheckpointHandler` with `save_concurrent_gb=2` and
  `save_device_host_concurrent_gb=2` (orbax applies that limit only to arrays its transfer
  callback defers; its default defers none);
* `pytree_batched`: the same with every array deferred, so the arrays are copied off the device
  2 GB at a time (`pytree_batched_unpinned`: into pageable memory; `tools.hf import` saves step 0
  that way and without compression, mimo_jax/checkpoint.py);
* `pytree_zarr`: the same without OCDBT;
* `pytree_raw`: the same as `pytree` without compression;
* `numpy`: every array copied to the host first, then saved as numpy arrays.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import threading
import time


def one(variant: str, gib: int) -> None:
  # pylint: disable=import-outside-toplevel
  import jax
  import numpy as np
  import orbax.checkpoint as ocp
  from mimo_jax.state import host_gib
  peak = [0.0]

  def sample():
    while True:
      peak[0] = max(peak[0], host_gib())
      time.sleep(0.005)

  threading.Thread(target=sample, daemon=True).start()
  tree = {f"w{i}": jax.random.normal(jax.random.key(i), (16, 2048, 8192)) for i in range(gib)}
  jax.block_until_ready(tree)
  time.sleep(0.3)
  base = host_gib()
  peak[0] = base
  if variant == "standard":
    handler, args = ocp.StandardCheckpointHandler(save_concurrent_gb=2), ocp.args.StandardSave
  elif variant.startswith("pytree"):
    kw = {}
    if variant.startswith("pytree_batched"):
      from mimo_jax.checkpoint_orbax import batched_array_registry
      kw["type_handler_registry"] = batched_array_registry()
      if variant.endswith("unpinned"):
        kw["enable_pinned_host_transfer"] = False
    handler = ocp.PyTreeCheckpointHandler(save_concurrent_gb=2, save_device_host_concurrent_gb=2,
                                          use_ocdbt=variant != "pytree_zarr",
                                          use_compression=variant != "pytree_raw", **kw)
    args = ocp.args.PyTreeSave
  elif variant == "numpy":
    handler, args = ocp.StandardCheckpointHandler(save_concurrent_gb=2), ocp.args.StandardSave
    tree = {k: np.asarray(v) for k, v in tree.items()}
  else:
    raise SystemExit(f"save_memory: unknown variant {variant!r}")
  path = tempfile.mkdtemp(prefix=f"save_memory_{variant}_")
  try:
    mngr = ocp.CheckpointManager(path, item_handlers={"p": handler},
                                 options=ocp.CheckpointManagerOptions(
                                     enable_async_checkpointing=False))
    start = time.time()
    mngr.save(0, args=ocp.args.Composite(p=args(tree)), force=True)
    mngr.wait_until_finished()
    mngr.close()
    print(f"| {variant} | {base:.2f} | {peak[0]:.2f} | +{peak[0] - base:.2f} | "
          f"{(peak[0] - base) / gib:.2f} | {time.time() - start:.1f} |", flush=True)
  finally:
    shutil.rmtree(path, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(prog="python -m tools.save_memory", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--gib", type=int, default=6, help="GiB of float32 arrays (1 GiB each)")
  parser.add_argument("--variants", default="standard,pytree,pytree_batched,numpy")
  parser.add_argument("--one", default="", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.one:
    one(args.one, args.gib)
    return
  print("| save | GiB before | peak GiB | increase | increase / array GiB | seconds |\n"
        "|---|---:|---:|---:|---:|---:|", flush=True)
  for v in args.variants.split(","):
    subprocess.run([sys.executable, "-m", "tools.save_memory", "--one", v, "--gib",
                    str(args.gib)], check=False)


if __name__ == "__main__":
  main()
