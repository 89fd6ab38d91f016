"""The README's LLaVA recipe, run as written at its tiny size: data, import, stage 1, stage 2 from
stage 1's weights, export, generation; and the same stages on a SigLIP tower + Qwen2 pair imported
from two directories. Stage 2's first loss is the loss of stage 1's weights on the same batch."""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import pathlib
import shlex
import subprocess
import sys

import jax
import numpy as np
import pytest

from mimo_jax import checkpoint, train
from mimo_jax.config import from_dict
from mimo_jax.data import loader
from mimo_jax.state import ModuleState
from mimo_jax.step import Step

ROOT = pathlib.Path(__file__).resolve().parents[1]
RECIPE = ROOT / "tests" / "fixtures" / "recipe"
STEPS = 3  # a stage's steps here (the README's run 30)


def readme_commands() -> list[list[str]]:
  """The commands of the README's recipe block, continuation lines joined."""
  text = (ROOT / "README.md").read_text(encoding="utf-8")
  section = text[text.index("## The LLaVA recipe"):]
  block = section[section.index("```bash\n") + 8:]
  block = block[:block.index("```")]
  return [shlex.split(line) for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def _run(argv: list[str], cwd: pathlib.Path) -> str:
  assert argv[:2] == ["python", "-m"], argv
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
  proc = subprocess.run([sys.executable, *argv[1:]], cwd=cwd, env=env, capture_output=True,
                        text=True, timeout=900)
  assert proc.returncode == 0, f"{shlex.join(argv)}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
  return proc.stdout


def _in_process(argv: list[str], cwd: pathlib.Path, capsys) -> str:
  """`python -m tools.X ...` run by calling tools.X.main in `cwd`; its standard output."""
  assert argv[:2] == ["python", "-m"] and argv[2].startswith("tools."), argv
  here = os.getcwd()
  os.chdir(cwd)
  try:
    status = importlib.import_module(argv[2]).main(argv[3:])
  except SystemExit as e:
    status = e.code
  finally:
    os.chdir(here)
  out, err = capsys.readouterr()
  assert status in (0, None), f"{shlex.join(argv)}\n{out[-2000:]}\n{err[-3000:]}"
  return out


def _config(workdir: pathlib.Path):
  return from_dict(json.loads((workdir / "config.json").read_text()))


def _first_loss_of(cfg, source: pathlib.Path) -> float:
  """The loss of `source`'s newest step's parameters on `cfg`'s first batch (stage 2's config
  without its init_from, the step restored as saved)."""
  cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, init_from=""))
  trainer = Step.build(cfg)
  path = checkpoint.directory(str(source))
  ckpt = checkpoint.Checkpointer(path, list(trainer.modules), read_only=True)
  try:
    step = checkpoint.complete_steps(path)[-1]
    saved_cfg = from_dict(ckpt.read_meta(step)["config"])  # the step's own run
    saved, _ = ckpt.restore(step, trainer.abstract_state(canonical=True), saved_cfg,
                            trainer.fresh_opt_state)
  finally:
    ckpt.close()
  state = trainer.from_canonical({n: ModuleState(s.params, trainer.fresh_opt_state(n, s.params))
                                  for n, s in saved.items()})
  batch = loader.train_dataset(cfg, loader.build_paths(cfg)["train"], trainer.ctx.groups)[0]
  _, metrics = trainer.train_step(state, batch)
  return float(metrics["loss"])


def _losses(workdir: pathlib.Path) -> dict[int, float]:
  lines = (workdir / "metrics.jsonl").read_text().splitlines()
  return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}


def test_the_readme_recipe_runs_as_written(tmp_path, capsys):
  for name in ("tests", "configs"):
    (tmp_path / name).symlink_to(ROOT / name)
  commands = readme_commands()
  assert [c[2] for c in commands] == ["tools.recipe_data", "tools.hf", "tools.convert",
                                      "mimo_jax.launch", "tools.convert", "mimo_jax.launch",
                                      "tools.hf", "tools.generate"]
  outputs = []
  for argv in commands:
    if argv[2] == "mimo_jax.launch":  # a process of its own, as the user runs it
      outputs.append(_run([*argv, f"--config.train.steps={STEPS}"], tmp_path))
    else:  # the tools' own main, in this process (each process start costs seconds)
      outputs.append(_in_process(argv, tmp_path, capsys))
  stage1, stage2 = tmp_path / "runs" / "llava0", tmp_path / "runs" / "stage2"
  assert sorted(_losses(stage1)) == list(range(1, STEPS + 1))
  # Logged every step, each with its time (that the first window leaves compilation out is
  # test_stages.py's; which step is slowest depends on what compiled ahead).
  lines = (stage1 / "metrics.jsonl").read_text().splitlines()
  took = {r["step"]: r["step_time_s"] for r in map(json.loads, lines) if "loss" in r}
  assert sorted(took) == list(range(1, STEPS + 1)) and min(took.values()) > 0, took
  assert checkpoint.complete_steps(checkpoint.directory(str(stage1)))[-1] == STEPS
  # Stage 2 started from stage 1's newest step: its first loss is that step's on its first batch.
  cfg = _config(stage1)
  cfg.run.workdir = str(stage2)
  cfg.data.dir = str(tmp_path / "data" / "instruct")
  cfg.data.image_token, cfg.optim.freeze, cfg.optim.lr = 5, "vision", 2e-4
  cfg.model.init_from = str(stage1)
  cwd = os.getcwd()
  os.chdir(tmp_path)
  try:
    want = _first_loss_of(cfg, stage1)
  finally:
    os.chdir(cwd)
  np.testing.assert_allclose(_losses(stage2)[1], want, rtol=1e-6)
  export = tmp_path / "exports" / "llava-stage2"
  assert json.loads((export / "config.json").read_text())["architectures"] == [
      "LlavaForConditionalGeneration"]
  for name in ("tokenizer.json", "preprocessor_config.json", "processor_config.json",
               "generation_config.json"):
    assert (export / name).is_file(), name
  assert outputs[-1].strip(), "tools.generate answered nothing"


def test_a_tower_and_a_language_model_from_two_directories_train_both_stages(tmp_path, capsys):
  """The recipe on a SigLIP tower + Qwen2 imported from two directories (in this process): the
  projector alone, then projector and language model from stage 1's weights, then the export."""
  # pylint: disable=import-outside-toplevel
  from tools import convert, hf, recipe_data
  assert convert.tower_tokens(str(RECIPE / "llava"))[0] == 16  # a LLaVA's vision_config
  recipe_data.write(str(tmp_path / "data"), pretrain=24, instruct=24)
  hf.main(["import", "--hf", str(RECIPE / "siglip"), "--hf", str(RECIPE / "qwen2"),
           "--out", str(tmp_path / "pair0"), "--config=configs/llava_cpu.py"])
  manifests = {}
  for stage in ("pretrain", "instruct"):
    assert convert.main(["--json", str(tmp_path / "data" / f"{stage}.json"),
                         "--images", str(tmp_path / "data" / "images"),
                         "--tokenizer", str(RECIPE / "qwen2"),
                         "--processor", str(RECIPE / "siglip"), "--out", str(tmp_path / stage),
                         "--eval", "8", "--seq_len", "256", "--workers", "1"]) == 0
    # No --image_tokens: the tower's 4x4 patches of its config.json count in the launch line.
    assert "an image takes 16 tokens (4x4 patches" in capsys.readouterr().err
    manifests[stage] = json.loads((tmp_path / stage / "conversations.json").read_text())
  token = manifests["pretrain"]["image_token"]
  stage1 = tmp_path / "pair0"
  cfg = _config(stage1)
  cfg.data.dir, cfg.data.image_token = str(tmp_path / "pretrain"), token
  cfg.optim.freeze, cfg.train.steps = "vision,language", STEPS
  assert sorted(r["step"] for r in train.run(cfg) if "loss" in r) == list(range(1, STEPS + 1))

  cfg = _config(stage1)
  cfg.run.workdir, cfg.model.init_from = str(tmp_path / "stage2"), str(stage1)
  cfg.data.dir, cfg.data.image_token = str(tmp_path / "instruct"), token
  cfg.optim.freeze, cfg.optim.lr, cfg.train.steps = "vision", 2e-4, 1
  first = [r["loss"] for r in train.run(cfg) if "loss" in r]
  np.testing.assert_allclose(first[0], _first_loss_of(cfg, stage1), rtol=1e-6)

  hf.main(["export", str(tmp_path / "stage2"), "--out", str(tmp_path / "export")])
  config = json.loads((tmp_path / "export" / "config.json").read_text())
  assert config["architectures"] == ["LlavaForConditionalGeneration"]
  assert config["vision_config"]["model_type"] == "siglip_vision_model"
  assert config["text_config"]["model_type"] == "qwen2"
