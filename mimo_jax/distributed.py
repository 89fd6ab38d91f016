"""Several processes (hosts): start-up, and bringing device values to every process.

Every process runs the same program and makes the same jit and transfer calls in the same order
(docs/multihost.md); a process may call a jit on a mesh where it has no devices. Only process 0
writes metrics, progress and the run's logs.
"""

from __future__ import annotations

import os
import socket
import sys

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mimo_jax import bridge, compat
from mimo_jax.config import ConfigError

CLUSTER_ENV = ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE")


def silence_stderr() -> None:
  """Closes stderr after a process's last error line: library threads still failing on their way
  out (orbax's writers after a failed save, its reads left behind by a failed one) must not
  follow it."""
  sys.stdout.flush()
  sys.stderr.flush()
  devnull = os.open(os.devnull, os.O_WRONLY)
  os.dup2(devnull, 2)
  os.close(devnull)


def cluster_detected() -> bool:
  return any(int(os.environ.get(k, "1")) > 1 for k in CLUSTER_ENV)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def initialize(coordinator: str | None, num_processes: int | None, process_id: int | None,
               heartbeat_timeout_s: int = 60) -> None:
  """Starts jax.distributed when flags are given or SLURM / Open MPI launched several tasks."""
  explicit = coordinator is not None or num_processes is not None or process_id is not None
  if not explicit and not cluster_detected():
    return
  if explicit and None in (coordinator, num_processes, process_id):
    raise ValueError("--coordinator, --num_processes and --process_id go together.")
  # CPU processes exchange arrays over sockets (GPUs use NCCL; there this setting is unused).
  host = os.environ.get("MIMO_JAX_TRANSFER_HOST", "127.0.0.1")
  jax.config.update("jax_cross_host_transfer_socket_address", f"{host}:{_free_port()}")
  jax.distributed.initialize(coordinator, num_processes, process_id,
                             heartbeat_timeout_seconds=heartbeat_timeout_s)


_barriers = [0]


def barrier(tag: str, timeout_s: int = 300) -> None:
  """Waits until every process reaches this point, through the coordination service.

  Unlike a device collective it does not occupy the devices, so pending cross-process copies
  (which on CPU are served by the devices' threads) still complete while a process waits here.
  """
  if jax.process_count() == 1:
    return
  _barriers[0] += 1
  compat.barrier(f"mimo_jax_{tag}_{_barriers[0]}", timeout_s)


def main_says(tag: str, flag: bool, timeout_s: int = 300) -> bool:
  """Process 0's `flag` on every process, once every process has reached this point: through
  the coordination service, as `barrier` (a device collective here could hold the devices'
  threads while another process still waits for a cross-process copy they serve, such as its
  share of the last step's metrics)."""
  if jax.process_count() == 1:
    return flag
  _barriers[0] += 1
  name = f"mimo_jax_{tag}_{_barriers[0]}"
  said = compat.share(name, str(int(flag)) if is_main() else None, timeout_s)
  compat.barrier(f"{name}_taken", timeout_s)
  return said == "1"


class Together(Exception):
  """Raised on every process at one point of the run, for an error that process 0 found alone
  (`main_check`); its cause is the error. launch ends such processes together, through the
  coordination service's shutdown (`shutdown(status)`): a process that exits first would have the
  service end the others, each with an abort and its stack instead of its error line."""


def main_check(tag: str, error: Exception | None, what: str) -> None:
  """Process 0's outcome of a check that only it makes (`what`, such as the run.workdir it takes),
  on every process: returns where process 0 found no `error`; else raises `Together` on every
  process, from `error` on process 0 and from an error naming process 0's line on the others. In
  one process, raises `error` itself."""
  if jax.process_count() == 1:
    if error is not None:
      raise error
    return
  if main_says(tag, error is None):
    return
  raise Together() from (error if is_main() else ConfigError(
      f"process 0 could not use {what} (its error line says why); nothing was written"))


def is_main() -> bool:
  return jax.process_index() == 0


def report_sharding() -> NamedSharding:
  """One device of every process, replicated: where values go to be read by every process."""
  first = {}
  for d in jax.devices():
    first.setdefault(d.process_index, d)
  devices = np.asarray([first[p] for p in sorted(first)], dtype=object)
  return NamedSharding(Mesh(devices, ("process",)), P())


def fetch(tree):
  """Host copies of replicated device values, on every process (a no-op move in one process)."""
  if jax.process_count() == 1:
    return jax.device_get(tree)
  report = report_sharding()
  moved = jax.tree.map(lambda a: bridge.transfer(a, report) if isinstance(a, jax.Array) else a,
                       tree)
  return jax.tree.map(
      lambda a: np.asarray(a.addressable_shards[0].data) if isinstance(a, jax.Array) else a,
      moved)


def shutdown(status: int = 0) -> None:
  """Leaves the coordination service at the end of a run, together, and ends the process with
  `status` (0: a normal run; a `Together` error's status otherwise).

  Each process's device client watches the other processes through the service, from threads
  that outlive `jax.distributed.shutdown`: when the service goes away they report the lost
  connection ("WatchTasksAsync failed", "Connection refused", "CANCELLED") although the run ended
  normally. So once the run is over and everything it writes is written, standard error goes to
  /dev/null for the shutdown barrier and the process exits with `status` right after it. A failing
  shutdown gets standard error back, reports, and exits with status 1.
  """
  if jax.process_count() == 1:
    return
  sys.stdout.flush()
  sys.stderr.flush()
  saved = os.dup(2)
  devnull = os.open(os.devnull, os.O_WRONLY)
  os.dup2(devnull, 2)
  try:
    jax.distributed.shutdown()
  except Exception as e:  # pylint: disable=broad-except
    os.dup2(saved, 2)
    print(f"mimo_jax: process {jax.process_index()}: error: leaving the coordination service: "
          f"{type(e).__name__}: {e}", file=sys.stderr, flush=True)
    os._exit(1)
  sys.stdout.flush()
  os._exit(status)
