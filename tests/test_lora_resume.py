"""A LoRA run's checkpoints keep its adapters and trained groups: a resume continues the run
bitwise, and a resume onto another layout (tp2 written, pp2 read) within float32 rounding."""

import json
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


def test_peft_export_of_a_run(full_run, tmp_path):
  # `tools.hf export --peft`: the language model's adapters under LLaVA's module paths and the
  # trained projector whole, equal to the step's arrays.
  from safetensors.numpy import load_file  # pylint: disable=import-outside-toplevel
  from mimo_jax import checkpoint_reader  # pylint: disable=import-outside-toplevel
  from tools import hf as hf_tool  # pylint: disable=import-outside-toplevel
  full_dir, _ = full_run
  hf_tool.main(["export", str(full_dir), "--out", str(tmp_path / "adapter"), "--peft"])
  tensors = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
  config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
  assert (config["r"], config["lora_alpha"]) == (4, 8.0)
  assert config["modules_to_save"] == ["multi_modal_projector"]
  reader = checkpoint_reader.Reader(str(full_dir))
  try:
    step = reader.steps()[-1]
    params = reader.params_tree(step, reader.meta(step))
  finally:
    reader.close()
  q = params["language"]["blocks"]["attn"]["q"]
  layers = q["lora_a"].shape[0]
  for i in range(layers):
    name = f"base_model.model.model.language_model.layers.{i}.self_attn.q_proj"
    np.testing.assert_array_equal(tensors[f"{name}.lora_A.weight"], q["lora_a"][i].T)
    np.testing.assert_array_equal(tensors[f"{name}.lora_B.weight"], q["lora_b"][i].T)
  up = params["vision"]["projector"]["up"]["kernel"]
  np.testing.assert_array_equal(
      tensors["base_model.model.model.multi_modal_projector.linear_1.weight"], up.T)
  assert not any("vision_tower" in k for k in tensors)  # the frozen tower has no adapters
  assert len(tensors) == 2 * 7 * layers + 4
