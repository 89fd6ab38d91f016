"""The "global" layout of a checkpointed module whose mesh sits on the devices of some processes
only, which orbax refuses: its arrays are moved through the bridge to a layout over every process
before a save, and back onto the run's topology after a restore. An array is split by rows over
every device of every process where its first axis divides evenly, else held on one device of
each process."""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mimo_jax import bridge, distributed


@functools.lru_cache(maxsize=1)
def every_device() -> jax.sharding.Mesh:
  return jax.sharding.Mesh(np.asarray(jax.devices()), ("all",))


def splits(shape) -> bool:
  """Whether an array of this shape is split by rows in the global layout: where its first axis
  divides evenly over every device of every process."""
  return bool(shape) and shape[0] % every_device().devices.size == 0


def by_rows(mesh, shape) -> NamedSharding:
  """On `mesh`: split by rows over all its devices for an array `splits` splits (where they
  divide), else replicated; the layouts the bridge moves between meshes."""
  split = splits(shape) and shape[0] % mesh.devices.size == 0
  return NamedSharding(mesh, P(tuple(mesh.axis_names)) if split else P())


def global_sharding(shape) -> NamedSharding:
  """Where an array of a module on some processes only is saved from and restored to (the
  "global" layout): split by rows over every device of every process, each holding a 1/N part,
  where its first axis divides evenly; else on one device of each process."""
  return by_rows(every_device(), shape) if splits(shape) else distributed.report_sharding()


def spans_processes(tree) -> bool:
  """Whether every array of `tree` (arrays or abstract ones) lives on devices of every process."""
  every = set(range(jax.process_count()))
  return all({d.process_index for d in a.sharding.device_set} == every
             for a in jax.tree.leaves(tree))


def to_global(tree):
  """A module's arrays in the global layout: split by rows over its own mesh (one jit), then
  moved device to device by the bridge."""
  rows = jax.tree.map(lambda a: by_rows(a.sharding.mesh, a.shape), tree)
  tree = jax.jit(lambda t: t, out_shardings=rows)(tree)
  return jax.tree.map(lambda a: bridge.transfer(a, global_sharding(a.shape)), tree)


def settle(tree) -> None:
  """Every process holds its copies before orbax's device-collective barriers start: a process
  blocked in such a collective would otherwise stall the copies another process waits for."""
  jax.block_until_ready(tree)
  distributed.barrier("checkpoint")


def from_global(tree, abstract):
  """Arrays in the global layout -> the shardings of `abstract` (this run's topology): moved by
  rows onto the module's mesh, then resharded there (one jit)."""
  moved = jax.tree.map(lambda a, t: bridge.transfer(a, by_rows(t.sharding.mesh, t.shape)),
                       tree, abstract)
  return jax.jit(lambda t: t, out_shardings=jax.tree.map(lambda t: t.sharding, abstract))(moved)


def global_abstract(abstract):
  return jax.tree.map(lambda t: jax.ShapeDtypeStruct(t.shape, t.dtype,
                                                     sharding=global_sharding(t.shape)),
                      abstract)
