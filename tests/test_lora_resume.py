"""A LoRA run's checkpoints keep its adapters and trained groups: a resume continues the run
bitwise, and a resume onto another layout (tp2 written, pp2 read) within float32 rounding."""

import shutil

import numpy as np
import pytest

from mimo_jax import train
from tests.test_lora import lora_config

STEPS = 4


def _cfg(data_dir, workdir, **topo):
  cfg = lora_config(data_dir, **topo)
  cfg.train.steps = STEPS
  cfg.checkpoint.every, cfg.checkpoint.keep = 2, 10
  cfg.run.workdir, cfg.run.log_every, cfg.run.progress = str(workdir), 1, "lines"
  cfg.eval.samples = 16
  return cfg


def _losses(records, first=1):
  return {r["step"]: (r["loss"], r["grad_norm"]) for r in records
          if "loss" in r and r["step"] >= first}


@pytest.fixture(scope="module")
def full_run(data_dir, tmp_path_factory):
  workdir = tmp_path_factory.mktemp("lora_full")
  return workdir, train.run(_cfg(data_dir, workdir, vision=(0, 2, 1), language=(2, 2, 2)))


def _from_step_2(full_dir, workdir):
  shutil.copytree(full_dir / "checkpoints", workdir / "checkpoints")
  for d in (workdir / "checkpoints").iterdir():
    if d.name.isdigit() and int(d.name) > 2:
      shutil.rmtree(d)


def test_resume_is_bitwise(data_dir, full_run, tmp_path):
  full_dir, records = full_run
  _from_step_2(full_dir, tmp_path)
  got = _losses(train.run(_cfg(data_dir, tmp_path, vision=(0, 2, 1), language=(2, 2, 2))))
  assert sorted(got) == [3, 4] and got == _losses(records, first=3)


def test_resume_onto_another_layout(data_dir, full_run, tmp_path):
  full_dir, records = full_run
  _from_step_2(full_dir, tmp_path)
  got = _losses(train.run(_cfg(data_dir, tmp_path, vision=(0, 4, 1), language=(4, 2, 1, 2))))
  want = _losses(records, first=3)
  assert sorted(got) == sorted(want)
  for step, pair in want.items():
    np.testing.assert_allclose(got[step], pair, rtol=1e-4, err_msg=f"step {step}")
