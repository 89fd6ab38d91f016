"""Devices -> one Mesh per module.

A module uses the dp*tp*pp consecutive devices of `jax.devices()` starting at its offset, laid out
as a (pp, dp, tp) grid: tp neighbours are adjacent devices, which on a GPU host keeps
tensor-parallel collectives on the fastest links; each pipeline stage is one contiguous block of
dp*tp devices. Identical device ranges are colocated modules; disjoint ranges run concurrently.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mimo_jax.config import Config
from mimo_jax.sharding import AXES, BATCH
from mimo_jax.validation_topology import validate_topology
from mimo_jax.words import noun


@dataclasses.dataclass(frozen=True)
class Topology:
  meshes: dict[str, Mesh]  # module name -> mesh; encoders first, `language` last

  def sharding(self, module: str, spec: P = BATCH) -> NamedSharding:
    return NamedSharding(self.meshes[module], spec)

  def dp(self, module: str) -> int:
    return self.meshes[module].shape["dp"]

  def pp(self, module: str) -> int:
    return self.meshes[module].shape["pp"]

  def colocated(self, a: str, b: str) -> bool:
    return set(self.meshes[a].devices.flat) == set(self.meshes[b].devices.flat)

  def describe(self) -> str:
    """Each module's mesh and devices, as the topology fields count them (places in
    jax.devices(), from the module's offset), with their processes on several."""
    place = {d: i for i, d in enumerate(jax.devices())}
    parts = []
    for name, mesh in self.meshes.items():
      at = sorted(place[d] for d in mesh.devices.flat)
      pp = f" pp={mesh.shape['pp']}" if mesh.shape["pp"] > 1 else ""
      procs = sorted({d.process_index for d in mesh.devices.flat})
      where = "" if jax.process_count() == 1 else \
          f" ({noun(len(procs), 'process', 'processes')} {', '.join(map(str, procs))})"
      parts.append(f"{name}: dp={mesh.shape['dp']} tp={mesh.shape['tp']}{pp} devices "
                   f"{at[0]}..{at[-1]}{where}")
    return "; ".join(parts)


def build(cfg: Config, devices: list | None = None) -> Topology:
  devices = list(jax.devices() if devices is None else devices)
  validate_topology(cfg, len(devices))
  meshes = {}
  for name, t in cfg.topology.modules().items():
    grid = np.asarray(devices[t.offset:t.offset + t.size], dtype=object)
    meshes[name] = Mesh(grid.reshape(t.pp, t.dp, t.tp), AXES)
  return Topology(meshes)
