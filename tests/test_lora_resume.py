"""A LoRA run's checkpoints keep its adapters and trained groups: a resume continues the run
bitwise, and a resume onto another layout (tp2 written, pp2 read) within float32 rounding."""

import json
import shutil

import numpy as np
import pytest

from mimo_jax import train
from tests.helpers import run_main
from tests.test_lora import lora_config
from tools import ckpt as ckpt_tool

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


def test_peft_export_of_a_run(full_run, tmp_path, capsys):
  # `tools.hf export --peft`: the language model's adapters under LLaVA's module paths and the
  # trained projector whole, equal to the step's arrays.
  from safetensors.numpy import load_file  # pylint: disable=import-outside-toplevel
  from mimo_jax import checkpoint_reader  # pylint: disable=import-outside-toplevel
  from tools import hf as hf_tool  # pylint: disable=import-outside-toplevel
  full_dir, _ = full_run
  hf_tool.main(["export", str(full_dir), "--out", str(tmp_path / "adapter"), "--peft",
                "--base", "exports/base"])
  tensors = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
  config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
  assert (config["r"], config["lora_alpha"]) == (4, 8.0)
  assert config["base_model_name_or_path"] == "exports/base"
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
  # Another export onto it is refused, naming --overwrite, which replaces it.
  again = ["export", str(full_dir), "--out", str(tmp_path / "adapter"), "--peft"]
  capsys.readouterr()
  with pytest.raises(SystemExit) as refused:
    hf_tool.main(again)
  assert refused.value.code == 2 and "pass --overwrite to replace it" in capsys.readouterr().err
  hf_tool.main(again + ["--overwrite"])
  assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())[
      "base_model_name_or_path"] != "exports/base"  # the new export's


def test_steps_hold_the_trained_weights_and_name_their_base(full_run):
  # pylint: disable=import-outside-toplevel
  from mimo_jax import checkpoint, checkpoint_steps
  full_dir, _ = full_run
  ckpt = checkpoint.Checkpointer(checkpoint_steps.directory(str(full_dir)), ["language", "vision"],
                                 read_only=True)
  try:
    assert checkpoint_steps.complete_steps(ckpt.path) == [0, 2, 4]
    zero, four = ckpt.read_meta(0), ckpt.read_meta(4)
    assert zero.get("params_only") and "base" not in zero
    assert (four["base"]["path"], four["base"]["step"]) == (".", 0)
    saved = ckpt.saved_arrays(4, ["language", "vision"])
    everything = ckpt.saved_arrays(0, ["language", "vision"])
  finally:
    ckpt.close()
  params = lambda n, arrays: {k for k in arrays[n] if k.startswith("params/")}
  # Step 4 holds the adapters and the projector; the frozen rest is step 0's, named by digest.
  assert params("language", saved) == {k for k in params("language", everything)
                                       if k.endswith(("lora_a", "lora_b"))}
  assert params("vision", saved) == {k for k in params("vision", everything)
                                     if k.startswith("params/projector/")}
  for n in ("language", "vision"):
    named = set(four["base"]["fingerprints"][n])
    assert named == params(n, everything) - params(n, saved)
    assert all(four["base"]["fingerprints"][n][k] == zero["fingerprints"][n][k] for k in named)


def test_a_moved_or_changed_base_is_refused(data_dir, full_run, tmp_path):
  from mimo_jax import checkpoint  # pylint: disable=import-outside-toplevel
  from mimo_jax.step import Step  # pylint: disable=import-outside-toplevel
  full_dir, records = full_run
  moved = tmp_path / "moved"
  _from_step_2(full_dir, moved)
  shutil.move(str(moved / "checkpoints" / "0"), str(tmp_path / "base0"))
  base = tmp_path / "base" / "checkpoints"
  base.mkdir(parents=True)
  shutil.move(str(tmp_path / "base0"), str(base / "0"))
  cfg = _cfg(data_dir, moved, vision=(0, 2, 1), language=(2, 2, 2))
  with pytest.raises(checkpoint.CheckpointError,
                     match=r"step 2 holds its trained weights; its frozen base weights are in "
                     r".*moved/checkpoints step 0, which is not there.*checkpoint\.base=DIR"):
    train.run(cfg)
  checked = run_main(ckpt_tool.main, "check", moved)  # tools.ckpt says so too, never "ok"
  assert checked.returncode == 2, checked.stdout
  assert ("step 2: FAILED: its frozen weights are in step 0 of this folder, which is not there "
          "(moved or deleted)") in checked.stdout
  # Named where it is now, the same weights: the run resumes as it would have.
  cfg.checkpoint.base = str(tmp_path / "base")
  assert _losses(train.run(cfg)) == _losses(records, first=3)
  # Other weights at that place: refused, naming them.
  other = tmp_path / "other" / "checkpoints"
  step = Step.build(cfg)
  ckpt = checkpoint.Checkpointer(str(other), list(step.modules))
  ckpt.save(0, step.canonical(step.init_state(seed=1)), cfg, params_only=True)
  ckpt.close()
  again = tmp_path / "again"
  _from_step_2(full_dir, again)
  cfg = _cfg(data_dir, again, vision=(0, 2, 1), language=(2, 2, 2))
  cfg.checkpoint.base = str(tmp_path / "other")
  with pytest.raises(checkpoint.CheckpointError, match=r"which now holds other weights"):
    train.run(cfg)


def test_the_base_step_is_never_rotated_away(data_dir, tmp_path):
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from mimo_jax import checkpoint, checkpoint_steps  # pylint: disable=import-outside-toplevel
  from mimo_jax.state import ModuleState  # pylint: disable=import-outside-toplevel
  cfg = _cfg(data_dir, tmp_path)
  ckpt = checkpoint.Checkpointer(str(tmp_path / "c"), ["m"], keep=1, keep_steps=(0,))
  for step in range(4):
    ckpt.save(step, {"m": ModuleState({"w": jnp.full((3,), step)}, None)}, cfg, params_only=True)
    ckpt.wait()
  ckpt.close()
  assert checkpoint_steps.complete_steps(str(tmp_path / "c")) == [0, 3]


def test_a_bfloat16_weight_saved_as_such_reads_back(data_dir, tmp_path):
  # A frozen weight of a bfloat16 run is saved in bfloat16 and fingerprinted so: the checkpoint
  # reader (which reads parameters as float32) checks it as stored.
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from mimo_jax import checkpoint, checkpoint_reader  # pylint: disable=import-outside-toplevel
  from mimo_jax.state import ModuleState  # pylint: disable=import-outside-toplevel
  w = jnp.linspace(-1, 1, 12, dtype=jnp.float32).reshape(3, 4) / 3
  ckpt = checkpoint.Checkpointer(str(tmp_path / "checkpoints"), ["m"], async_save=False)
  ckpt.save(0, {"m": ModuleState({"w": w.astype(jnp.bfloat16), "b": w[0]}, None)},
            _cfg(data_dir, tmp_path), params_only=True)
  ckpt.close()
  reader = checkpoint_reader.Reader(str(tmp_path))
  try:
    params = reader.params(0, reader.meta(0))
  finally:
    reader.close()
  np.testing.assert_array_equal(params["m/w"], np.asarray(w.astype(jnp.bfloat16), np.float32))
  np.testing.assert_array_equal(params["m/b"], np.asarray(w[0]))
  # tools.ckpt check finds nothing wrong with it.
  out = run_main(ckpt_tool.main, "check", tmp_path)
  assert out.returncode == 0 and "does not match" not in out.stdout, out.stdout + out.stderr


def test_a_new_stage_from_a_lora_run_starts_from_its_trained_weights(data_dir, full_run, tmp_path):
  """`model.init_from` naming a LoRA run: the new run starts from the step's adapters and
  projector over the frozen weights its base step holds, saves them once as its own step 0 of
  parameters only and names that step as its base from then on."""
  from mimo_jax import checkpoint_reader  # pylint: disable=import-outside-toplevel
  full_dir, _ = full_run
  cfg = _cfg(data_dir, tmp_path / "stage", vision=(0, 1, 1), language=(1, 1, 1))
  cfg.train.steps, cfg.checkpoint.every, cfg.eval.every = 1, 1, 0
  cfg.model.init_from = f"{full_dir}:{STEPS}"
  train.run(cfg)

  def params(workdir, step):
    reader = checkpoint_reader.Reader(str(workdir))
    try:
      meta = reader.meta(step)
      return meta, reader.params_tree(step, meta)
    finally:
      reader.close()
  _, source = params(full_dir, STEPS)
  zero_meta, zero = params(tmp_path / "stage", 0)
  one_meta, _ = params(tmp_path / "stage", 1)
  assert zero_meta.get("params_only") and "base" not in zero_meta
  assert (one_meta["base"]["path"], one_meta["base"]["step"]) == (".", 0)
  flat = lambda tree, p="": ({k2: v2 for k, v in tree.items() for k2, v2 in flat(v, f"{p}{k}/").items()}
                             if isinstance(tree, dict) else {p[:-1]: tree})
  want, got = flat(source), flat(zero)
  assert set(got) == set(want)
  for k, v in want.items():
    np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(v), err_msg=k)
  assert any(k.endswith("lora_b") and np.any(np.asarray(v)) for k, v in got.items())


class _Metas:
  """checkpoint_reader.Reader's stand-in: the metas of a few runs' steps by workdir."""
  metas: dict = {}

  def __init__(self, workdir):
    self.workdir = workdir

  def meta(self, step):
    return self.metas[(self.workdir, step)]

  def close(self):
    pass


def test_the_history_of_a_stage_follows_model_init_from_over_an_imported_hf_directory(
    tmp_path, monkeypatch):
  # A run whose config carries the HF directory it was imported from (as an import's config.py
  # does) and `model.init_from` naming an earlier stage starts from that stage's weights: the
  # export's history walks to that stage, as the run itself started (init_from.sources).
  import dataclasses  # pylint: disable=import-outside-toplevel
  from mimo_jax import checkpoint, checkpoint_steps  # pylint: disable=import-outside-toplevel
  from mimo_jax.config import Config  # pylint: disable=import-outside-toplevel
  from tools import hf_export  # pylint: disable=import-outside-toplevel
  hf_dir, stage2, lora = (tmp_path / n for n in ("hf", "stage2", "lora"))
  for d in (hf_dir, stage2 / "checkpoints", lora):
    d.mkdir(parents=True)
  imported = Config()
  imported.model.language.init_from = str(hf_dir)
  cfg = Config()
  cfg.model.language.init_from, cfg.model.init_from = str(hf_dir), str(stage2)

  class Ckpt:  # the earlier stage's step 30, written by a run of the import's config
    def __init__(self, path, *_, **__):
      assert path == str(stage2 / "checkpoints")

    def read_meta(self, step):
      return {"config": dataclasses.asdict(imported)} if step == 30 else {}

  monkeypatch.setattr(checkpoint, "Checkpointer", Ckpt)
  monkeypatch.setattr(checkpoint_steps, "complete_steps", lambda path: [10, 30])
  stages = []
  _, sources = hf_export.history(str(lora), cfg, {}, stages)
  assert [(str(p), step) for p, step in stages] == [(str(lora), None), (str(stage2), 30)]
  assert sources["language"] == [str(hf_dir)]  # the import's, reached through the stage


@pytest.mark.parametrize("tower", [[1, 2], [7, 7]])
def test_a_peft_base_is_the_import_only_while_the_frozen_weights_are_its(tmp_path, monkeypatch,
                                                                         tower):
  # The LoRA run `lora` started from `stage1` (step 30), which started from the import `llava0`;
  # the adapter's base is the import's HF directory only while the LoRA run's frozen weights are
  # the ones the import's step 0 holds (the fingerprints each save records).
  from tools import hf_export  # pylint: disable=import-outside-toplevel
  lora, stage1, llava0 = (tmp_path / n for n in ("lora", "stage1", "llava0"))
  for d in (lora, stage1, llava0):
    d.mkdir()
  (llava0 / "hf_import.json").write_text(json.dumps({"sources": {"language": "/hf/llava"}}))
  _Metas.metas = {
      (str(lora), 5): {"base": {"fingerprints": {"vision": {"params/tower": tower},
                                                 "language": {"params/q": [3, 4]}}}},
      (str(llava0), 0): {"fingerprints": {"vision": {"params/tower": [1, 2]},
                                          "language": {"params/q": [3, 4], "params/k": [5, 6]}}}}
  monkeypatch.setattr(hf_export.checkpoint_reader, "Reader", _Metas)
  stages = [(lora, None), (stage1, 30), (llava0, 100)]
  got = hf_export._trained_base(str(lora), 5, stages, ("vision", "language"))
  assert got == (None if tower == [1, 2] else (str(stage1), "/hf/llava", 30))
  # The language adapter alone is over the import's weights either way; a run without frozen
  # weights (no base) or without an import among its stages tells nothing.
  assert hf_export._trained_base(str(lora), 5, stages, ("language",)) is None
  assert hf_export._trained_base(str(lora), 5, stages[:2], ("vision", "language")) is None
  _Metas.metas[(str(lora), 5)] = {}
  assert hf_export._trained_base(str(lora), 5, stages, ("vision", "language")) is None
