"""State sharded over data-parallel ranks (`topology.<module>.shard`): ZeRO-1 and FSDP keep the
single-device trajectory, shrink what each device holds, and checkpoints move between them."""

import os
import pathlib
import re
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from mimo_jax import memory, train
from mimo_jax.data import loader
from mimo_jax.step import Probe, Step
from tests.helpers import assert_close_trajectory, language_step_hlo, run_steps, tiny_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
STEPS = 4


def sharded_config(data_dir, shard: dict, **topo):
  cfg = tiny_config(data_dir, **topo)
  for name, mode in shard.items():
    cfg.topology.module(name).shard = mode
  return cfg


@pytest.fixture(scope="module")
def reference(single_reference):
  assert len(single_reference) == STEPS
  return single_reference


@pytest.mark.parametrize("topo,shard", [
    pytest.param({"vision": (0, 2, 1), "language": (2, 4, 1)}, {"language": "full"},
                 id="language-fsdp-dp4-vision-dp2-split"),
    pytest.param({"vision": (0, 4, 1), "language": (0, 4, 1)},
                 {"vision": "full", "language": "full"}, id="both-fsdp-colocated-dp4"),
    pytest.param({"vision": (0, 2, 1), "language": (2, 2, 2)}, {"language": "full"},
                 id="language-fsdp-dp2-tp2"),
    pytest.param({"vision": (0, 2, 1), "language": (2, 2, 1, 2)}, {"language": "full"},
                 id="language-fsdp-dp2-pp2"),
    pytest.param({"vision": (0, 4, 1), "language": (4, 4, 1)}, {"language": "optimizer"},
                 id="language-zero1-dp4"),
    pytest.param({"vision": (0, 4, 1), "language": (0, 4, 1)}, {"vision": "optimizer"},
                 id="vision-zero1-fused"),
    pytest.param({"vision": (0, 4, 1), "language": (0, 2, 2)},
                 {"vision": "full", "language": "optimizer"}, id="mixed-colocated"),
])
def test_sharded_state_matches_single_device(data_dir, reference, topo, shard):
  got, step, state, _ = run_steps(sharded_config(data_dir, shard, **topo), STEPS)
  assert_close_trajectory(reference, got, rtol=1e-4)
  for name, mode in shard.items():  # the state really is split as asked
    plan = step.plan[name]
    if mode == "full":
      assert any("dp" in a.sharding.spec for a in jax.tree.leaves(state[name].params))
    moments = [a for a in jax.tree.leaves(state[name].opt_state) if a.ndim > 1]
    assert moments and any("dp" in a.sharding.spec for a in moments), plan.name


def _per_device(tree, device) -> int:
  """Bytes of `tree`'s shards on `device`."""
  return sum(s.data.nbytes for a in jax.tree.leaves(tree) for s in a.addressable_shards
             if s.device == device)


def _first_step_bytes(data_dir, dp: int, mode: str) -> dict[str, int]:
  """Bytes on the first device of the language model's parameters, optimizer state and gradient
  accumulators (each accumulator as a step phase leaves it), vision dp2 on other devices."""
  cfg = sharded_config(data_dir, {"language": mode}, vision=(0, 2, 1), language=(2, dp, 1))
  step = Step.build(cfg)
  state = step.init_state(cfg.train.seed)
  device = step.plan["language"].mesh.devices.flat[0]
  out = {"params": _per_device(state["language"].params, device),
         "opt_state": _per_device(state["language"].opt_state, device), "grads": 0}

  def phase(name, tree):
    if name == "language" and "grads" in tree:  # the accumulator after a microbatch's step
      out["grads"] = max(out["grads"], _per_device(tree["grads"], device))
  ds = loader.train_dataset(cfg, loader.build_paths(cfg)["train"], step.ctx.groups)
  step.dispatch(state, *step.place_step(ds[0]), probe=Probe(phase=phase))
  # The memory check's figures, from the config alone, are what the arrays hold.
  need = memory.module_bytes(cfg)["language"]
  assert (need["parameters"], need["optimizer state"]) == (out["params"], out["opt_state"])
  assert need["gradients"] >= out["grads"]  # and the step's sum beside per-rank accumulators
  return out


def test_full_sharding_shrinks_each_device_as_one_over_dp(data_dir):
  one = _first_step_bytes(data_dir, 1, "none")
  for dp in (2, 4):
    got = _first_step_bytes(data_dir, dp, "full")
    for key in ("params", "opt_state", "grads"):  # every tiny leaf splits evenly over 2 and 4
      assert got[key] * dp == pytest.approx(one[key], rel=1e-3), (dp, key)
  # Replicated over dp4, each device keeps the per-rank gradients of a whole model; under full
  # sharding no device holds a full-size accumulator.
  replicated = _first_step_bytes(data_dir, 4, "none")
  assert replicated["grads"] == one["grads"] and replicated["params"] == one["params"]
  zero1 = _first_step_bytes(data_dir, 4, "optimizer")
  assert zero1["params"] == one["params"]
  assert zero1["opt_state"] * 4 == pytest.approx(one["opt_state"], rel=1e-3)


RESUME = {"vision": (0, 2, 1), "language": (2, 4, 1)}


def _run_cfg(data_dir, workdir, shard: str, steps: int):
  cfg = sharded_config(data_dir, {"vision": shard, "language": shard}, **RESUME)
  cfg.train.steps = steps
  cfg.checkpoint.every, cfg.checkpoint.keep = 2, 10
  cfg.run.workdir, cfg.run.log_every = str(workdir), 1
  cfg.eval.samples = 16
  return cfg


def _losses(records, first):
  return {r["step"]: (r["loss"], r["grad_norm"]) for r in records
          if "loss" in r and r["step"] >= first}


def _copy_until(src, dst, step: int) -> None:
  shutil.copytree(src / "checkpoints", dst / "checkpoints")
  for d in (dst / "checkpoints").iterdir():
    if d.name.isdigit() and int(d.name) > step:
      shutil.rmtree(d)


def test_resume_across_sharding_choices(data_dir, tmp_path):
  """Saved under FSDP, resumed replicated; saved replicated, resumed under FSDP: the losses go on
  as the uninterrupted FSDP run's."""
  full = _losses(train.run(_run_cfg(data_dir, tmp_path / "full", "full", 6)), first=1)
  _copy_until(tmp_path / "full", tmp_path / "replicated", 2)
  replicated = _losses(train.run(_run_cfg(data_dir, tmp_path / "replicated", "none", 6)), 1)
  _copy_until(tmp_path / "replicated", tmp_path / "sharded", 4)
  sharded = _losses(train.run(_run_cfg(data_dir, tmp_path / "sharded", "full", 6)), 1)
  assert sorted(replicated) == [3, 4, 5, 6] and sorted(sharded) == [5, 6]
  for got in (replicated, sharded):
    for step, want in full.items():
      if step in got:
        np.testing.assert_allclose(got[step], want, rtol=1e-4, err_msg=f"step {step}")


def test_a_layout_that_cannot_fit_is_refused_before_compiling(data_dir, tmp_path):
  workdir = tmp_path / "run"
  proc = subprocess.run(
      [sys.executable, "-m", "mimo_jax.launch", "--config=tests/configs/tiny.py:"
       "vision=0/2/1,language=2/4/1", f"--config.data.dir={data_dir}",
       f"--config.run.workdir={workdir}", "--config.run.device_memory_gb=0.0009765625"],
      cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True,
      timeout=600)
  assert proc.returncode == 2, proc.stderr[-2000:]
  last = proc.stderr.strip().splitlines()
  assert len(last) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
  assert last[0].startswith("mimo_jax: error: config.topology.language.shard: language needs "
                            "at least "), last[0]
  assert "where a device has 1.0 MiB" in last[0] and "shard=full" in last[0], last[0]
  assert not workdir.exists()  # nothing written
  # The estimate shrinks with the sharding: the same budget takes language's state split over dp.
  cfg = sharded_config(data_dir, {"language": "full"}, vision=(0, 2, 1), language=(2, 4, 1))
  need = memory.module_bytes(cfg)
  plain = memory.module_bytes(tiny_config(data_dir, vision=(0, 2, 1), language=(2, 4, 1)))
  for part in ("parameters", "optimizer state"):
    assert need["language"][part] * 4 == pytest.approx(plain["language"][part], rel=1e-3)
  assert need["language"]["gradients"] * 8 == plain["language"]["gradients"]  # per-rank + sum


def test_each_layer_is_gathered_for_its_forward_and_again_for_its_backward(data_dir):
  """Under FSDP no remat policy keeps a gathered layer for the backward: the compiled language
  step all-gathers the layers' parameters about twice (XLA may merge the last layer's two)."""
  cfg = sharded_config(data_dir, {"language": "full"}, vision=(0, 2, 1), language=(2, 4, 1))
  cfg.model.language.layers = 4
  cfg.topology.language.remat, cfg.topology.language.unroll = "none", True
  step = Step.build(cfg)
  state = step.init_state(cfg.train.seed)
  ds = loader.train_dataset(cfg, loader.build_paths(cfg)["train"], step.ctx.groups)
  hlo = language_step_hlo(step, state, ds[0])
  gathers = len(re.findall(r"= [^=]*? all-gather(?:-start)?\(", hlo[0]))
  per_layer = len(jax.tree.leaves(state["language"].params["blocks"]))
  assert gathers >= 1.5 * cfg.model.language.layers * per_layer, gathers


def test_a_layout_near_the_memory_is_warned_about(data_dir):
  cfg = tiny_config(data_dir, vision=(0, 2, 1), language=(2, 4, 1))
  need = memory.per_device(cfg, memory.module_bytes(cfg))
  for limit, warned in ((int(need * 1.1), True), (int(need * 2), False)):
    lines = []
    memory.check(cfg, limit=limit, warn=lines.append)
    assert len(lines) == int(warned), lines
    if warned:
      assert lines[0].startswith("warning: the layout needs at least ") and "may run out" in lines[0]
