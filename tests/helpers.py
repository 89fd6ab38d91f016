"""Small configs and runners shared by the tests."""

from __future__ import annotations

import jax
import numpy as np

from mimo_jax import topology
from mimo_jax.config import Config
from mimo_jax.data import loader
from mimo_jax.models.mimo import build_modules
from mimo_jax.step import Stepper
from mimo_jax.validation import validate
from tests.configs import tiny


def tiny_config(data_dir: str, **topo) -> Config:
  """tests/configs/tiny.py; `topo` maps module -> (offset, dp, tp[, pp[, virtual]])."""
  cfg = tiny.get_config(topology_arg(**topo))
  cfg.data.dir = data_dir
  return cfg


def topology_arg(**topo) -> str:
  """The tiny config's argument for a topology, e.g. vision=0/4/1,language=4/2/2."""
  return ",".join(f"{name}={'/'.join(str(v) for v in spec)}" for name, spec in topo.items())


def run_steps(cfg: Config, steps: int, batches=None) -> tuple[list[dict], Stepper, dict, dict]:
  """Runs `steps` optimizer steps.

  Returns host metrics per step, the stepper, the final state and the initial parameters (host).
  """
  validate(cfg, len(jax.devices()))
  topo = topology.build(cfg)
  stepper = Stepper(cfg, topo, build_modules(cfg))
  state = stepper.init_state(cfg.train.seed)
  init = {n: jax.device_get(s.params) for n, s in state.items()}
  if batches is None:
    path = loader.build_paths(cfg)["train"]
    ds = loader.train_dataset(cfg, path, topo.dp("language"))
    batches = [ds[s] for s in range(steps)]
  elif callable(batches):
    batches = batches(topo.dp("language"))
  out = []
  for batch in batches[:steps]:
    state, metrics = stepper.train_step(state, batch)
    out.append(jax.device_get(metrics))
  return out, stepper, state, init


def assert_close_trajectory(ref: list[dict], got: list[dict], rtol: float) -> None:
  for key in ("loss", "grad_norm"):
    a = np.array([float(m[key]) for m in ref])
    b = np.array([float(m[key]) for m in got])
    np.testing.assert_allclose(b, a, rtol=rtol, atol=0, err_msg=key)
  assert all(int(m["mismatches"]) == 0 for m in got)
