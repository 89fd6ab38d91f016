"""Small configs and runners shared by the tests."""

from __future__ import annotations

import jax
import numpy as np

from mimo_jax import topology
from mimo_jax.config import Config, validate
from mimo_jax.data import loader
from mimo_jax.models.mimo import build_modules
from mimo_jax.step import Stepper


def tiny_config(data_dir: str, **topo) -> Config:
  """A config small enough to compile in seconds; `topo` maps module -> (offset, dp, tp)."""
  cfg = Config()
  cfg.data.dir = data_dir
  cfg.data.train_samples, cfg.data.eval_samples = 2_000, 200
  cfg.data.global_batch, cfg.data.microbatches = 32, 2
  cfg.model.vision.dim, cfg.model.vision.mlp_dim, cfg.model.vision.projector_hidden = 32, 64, 64
  cfg.model.language.dim, cfg.model.language.mlp_dim = 64, 128
  cfg.optim.warmup_steps = 2
  cfg.train.steps = 4
  cfg.eval.samples, cfg.eval.batch = 48, 16
  for name, (offset, dp, tp) in topo.items():
    t = getattr(cfg.topology, name)
    t.offset, t.dp, t.tp = offset, dp, tp
  return cfg


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
