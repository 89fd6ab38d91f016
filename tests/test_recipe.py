"""The README's LLaVA recipe, run as written at its tiny size: data, import, stage 1, stage 2 from
stage 1's weights, export, generation; and its second block, the same stages on a SigLIP tower +
Qwen2 pair imported from two directories. Stage 1 trains the projector alone, stage 2 the language
model too, and stage 2's first loss is the loss of stage 1's weights on the same batch."""

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

from mimo_jax import checkpoint, checkpoint_reader, checkpoint_steps, configfile, train
from mimo_jax.config import from_dict
from mimo_jax.data import loader
from mimo_jax.state import ModuleState
from mimo_jax.step import Step

ROOT = pathlib.Path(__file__).resolve().parents[1]
STEPS = 3  # a stage's steps here (the README's run 30)


def readme_commands(block: int = 0) -> list[list[str]]:
  """The commands of the README recipe section's `block`-th bash block (0: the recipe, 1: the
  SigLIP + Qwen2 pair), continuation lines joined."""
  text = (ROOT / "README.md").read_text(encoding="utf-8")
  section = text[text.index("## The LLaVA recipe"):]
  section = section[:section.index("\n## ", 1)]
  body = section.split("```bash\n")[block + 1]
  body = body[:body.index("```")]
  return [shlex.split(line) for line in body.replace("\\\n", " ").splitlines() if line.strip()]


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


def _launch_in_process(argv: list[str], cwd: pathlib.Path, steps: int) -> None:
  """`python -m mimo_jax.launch --config=FILE --config.a.b=v ...` for `steps` steps, its config
  read as launch reads it and trained by train.run in `cwd` (no process start)."""
  assert argv[:3] == ["python", "-m", "mimo_jax.launch"], argv
  spec, overrides, rest = configfile.split_args(argv[3:])
  assert not rest, rest
  here = os.getcwd()
  os.chdir(cwd)
  try:
    cfg = configfile.load(spec, [*overrides, f"--config.train.steps={steps}"])
    train.run(cfg)
  finally:
    os.chdir(here)


def _params(workdir: pathlib.Path, step: int | None = None) -> dict:
  """A step's parameters (default the newest) by module, on the host."""
  reader = checkpoint_reader.Reader(str(workdir))
  try:
    step = checkpoint_steps.complete_steps(checkpoint_steps.directory(str(workdir)))[-1] \
        if step is None else step
    return reader.params_tree(step, reader.meta(step))
  finally:
    reader.close()


def _changed(a: dict, b: dict) -> bool:
  return any(not np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _assert_stages_trained(stage1: pathlib.Path, stage2: pathlib.Path) -> None:
  """Stage 1 changed the projector alone (its newest step against the import's step 0); stage 2
  changed the language model and the projector, not the tower."""
  imported, first, second = _params(stage1, 0), _params(stage1), _params(stage2)
  tower = lambda p: {k: v for k, v in p["vision"].items() if k != "projector"}
  assert _changed(imported["vision"]["projector"], first["vision"]["projector"])
  assert not _changed(imported["language"], first["language"])
  assert not _changed(tower(imported), tower(first))
  assert _changed(first["language"], second["language"])
  assert _changed(first["vision"]["projector"], second["vision"]["projector"])
  assert not _changed(tower(first), tower(second))


def _config(workdir: pathlib.Path):
  return from_dict(json.loads((workdir / "config.json").read_text()))


def _first_loss_of(cfg, source: pathlib.Path) -> float:
  """The loss of `source`'s newest step's parameters on `cfg`'s first batch (stage 2's config
  without its init_from, the step restored as saved)."""
  cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, init_from=""))
  trainer = Step.build(cfg)
  path = checkpoint_steps.directory(str(source))
  ckpt = checkpoint.Checkpointer(path, list(trainer.modules), read_only=True)
  try:
    step = checkpoint_steps.complete_steps(path)[-1]
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
  # Stage 1 resumes the import's step 0 in its folder; stage 2 says where it is new.
  assert f"resumed from {stage1.resolve() / 'checkpoints'} step 0 (" in outputs[3], outputs[3]
  assert f"a new run in {stage2}\n" in outputs[5], outputs[5]
  assert sorted(_losses(stage1)) == list(range(1, STEPS + 1))
  # Logged every step, each with its time (that the first window leaves compilation out is
  # test_stages.py's; which step is slowest depends on what compiled ahead).
  lines = (stage1 / "metrics.jsonl").read_text().splitlines()
  took = {r["step"]: r["step_time_s"] for r in map(json.loads, lines) if "loss" in r}
  assert sorted(took) == list(range(1, STEPS + 1)) and min(took.values()) > 0, took
  assert checkpoint_steps.complete_steps(checkpoint_steps.directory(str(stage1)))[-1] == STEPS
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
  _assert_stages_trained(stage1, stage2)
  # The relative paths of stage 2's launch are stored absolute: tools read them from anywhere.
  saved = checkpoint_reader.Reader(str(stage2))
  try:
    data, model = (saved.meta(STEPS)["config"][k] for k in ("data", "model"))
  finally:
    saved.close()
  assert data["dir"] == str(tmp_path / "data" / "instruct")
  assert model["init_from"] == str(tmp_path / "runs" / "llava0")
  export = tmp_path / "exports" / "llava-stage2"
  assert json.loads((export / "config.json").read_text())["architectures"] == [
      "LlavaForConditionalGeneration"]
  for name in ("tokenizer.json", "preprocessor_config.json", "processor_config.json",
               "generation_config.json"):
    assert (export / name).is_file(), name
  assert outputs[-1].strip(), "tools.generate answered nothing"


def test_the_readme_pair_recipe_runs_as_written(tmp_path, capsys):
  """The README's SigLIP tower + Qwen2 block (24 records a stage, its commands in this process):
  a projector as wide as the language model, the projector alone, then projector and language
  model from stage 1's weights, then the export as LLaVA."""
  from tools import recipe_data  # pylint: disable=import-outside-toplevel
  for name in ("tests", "configs"):
    (tmp_path / name).symlink_to(ROOT / name)
  recipe_data.write(str(tmp_path / "data" / "recipe"), pretrain=24, instruct=24)
  commands = readme_commands(1)
  assert [c[2] for c in commands] == ["tools.hf", "tools.convert", "mimo_jax.launch",
                                      "tools.convert", "mimo_jax.launch", "tools.hf"]
  for argv in commands:
    if argv[2] == "mimo_jax.launch":
      _launch_in_process(argv, tmp_path, STEPS)
    else:
      printed = _in_process(argv, tmp_path, capsys)
      if argv[2] == "tools.convert":  # the image token the README's launch lines give
        assert "--config.data.image_token=3 " in printed, printed
  stage1, stage2 = tmp_path / "runs" / "pair0", tmp_path / "runs" / "pair-stage2"
  cfg = _config(stage1)
  assert not cfg.model.vision.final_norm
  assert cfg.model.vision.projector_hidden == cfg.model.language.dim  # LLaVA's projector
  _assert_stages_trained(stage1, stage2)
  cfg = _config(stage1)
  cfg.run.workdir, cfg.model.init_from = str(stage2), str(stage1)
  cfg.data.dir, cfg.data.image_token = str(tmp_path / "data" / "pair-instruct"), 3
  cfg.optim.freeze, cfg.optim.lr, cfg.train.steps = "vision", 2e-4, STEPS
  np.testing.assert_allclose(_losses(stage2)[1], _first_loss_of(cfg, stage1), rtol=1e-6)
  config = json.loads((tmp_path / "exports" / "pair-stage2" / "config.json").read_text())
  assert config["architectures"] == ["LlavaForConditionalGeneration"]
  assert config["vision_config"]["model_type"] == "siglip_vision_model"
  assert config["text_config"]["model_type"] == "qwen2"
