"""tools.hf import / export on the transformers fixtures (tests/fixtures/hf): the export holds the
fixture's own tensors bit for bit, import(export(x)) is x, and a malformed directory is one error
naming the file and tensor, with nothing written."""

import dataclasses
import json
import pathlib
import shutil
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from mimo_jax import checkpoint_reader, configfile, hf
from mimo_jax.config import Config, from_dict
from tools import hf as hf_tool
from tools import hf_export, hf_import
from tests.helpers import assert_hf_error

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "hf"
RUN = ["--config=tests/configs/tiny.py", "--config.data.task=synthetic",
       "--config.model.vision.max_images=1", "--config.data.image_probs=0.25,0.75",
       "--config.data.seq_len=40", "--config.data.text_len=12", "--config.eval.samples=16"]


def _import(hf_dir, out, *extra):
  dirs = hf_dir if isinstance(hf_dir, (list, tuple)) else [hf_dir]
  hf_tool.main(["import", *[a for d in dirs for a in ("--hf", str(d))], "--out", str(out), *RUN,
                *extra])


_error = assert_hf_error


def _tensors(directory) -> dict[str, np.ndarray]:
  out = {}
  for f in sorted(pathlib.Path(directory).glob("*.safetensors")):
    out.update(load_file(str(f)))
  return out


def _params(workdir, step=0):
  _, params, _, _ = hf_export._read_checkpoint(str(workdir), step)
  return params


def _tokenizer(directory: pathlib.Path) -> str:
  """A word-level tokenizer of the fixtures' 64 ids (an export copies the run's tokenizer; the
  fixtures have none)."""
  from tokenizers import Tokenizer, models  # pylint: disable=import-outside-toplevel
  directory.mkdir()
  Tokenizer(models.WordLevel({f"t{i}": i for i in range(64)}, unk_token="t0")).save(
      str(directory / "tokenizer.json"))
  return str(directory)


def test_import_export_round_trip(tmp_path):
  _import(FIXTURES / "llava15", tmp_path / "a")
  assert (tmp_path / "a" / "config.py").is_file()
  tok = _tokenizer(tmp_path / "tokenizer")
  hf_tool.main(["export", str(tmp_path / "a"), "--out", str(tmp_path / "hf"), "--tokenizer", tok])
  ours, theirs = _tensors(tmp_path / "hf"), _tensors(FIXTURES / "llava15")
  # LLaVA-1.5 reads layer -2: the tower's last layer is not part of the model.
  dropped = {k for k in theirs if ".layers.2." in k and k.startswith("vision_tower.")}
  assert set(ours) == set(theirs) - dropped
  for k, x in ours.items():
    np.testing.assert_array_equal(x, theirs[k], err_msg=k)
  config = json.loads((tmp_path / "hf" / "config.json").read_text())
  assert config["architectures"] == ["LlavaForConditionalGeneration"]
  assert config["vision_config"]["num_hidden_layers"] == 2 and config["vision_feature_layer"] == -1
  # import(export(x)) is x, bit for bit.
  _import(tmp_path / "hf", tmp_path / "b")
  first, second = _params(tmp_path / "a"), _params(tmp_path / "b")
  flat = lambda t: dict(hf.flatten(t))
  for module in ("vision", "language"):
    a, b = flat(first[module]), flat(second[module])
    assert set(a) == set(b)
    for path in a:
      np.testing.assert_array_equal(a[path], b[path], err_msg="/".join(path))
  # One module alone: the language model as LlamaForCausalLM, with the fixture's names.
  hf_tool.main(["export", str(tmp_path / "a"), "--module", "language", "--out",
                str(tmp_path / "lm"), "--tokenizer", tok])
  lm = _tensors(tmp_path / "lm")
  for k, x in lm.items():
    np.testing.assert_array_equal(x, theirs["language_model." + k if k.startswith("model.")
                                            else "language_model.lm_head.weight"], err_msg=k)


def test_malformed_directories_are_one_error_and_write_nothing(tmp_path, capsys):
  out = tmp_path / "out"
  # A missing shard of a sharded checkpoint.
  sharded = tmp_path / "sharded"
  shutil.copytree(FIXTURES / "llama3", sharded)
  (sharded / "model-00002-of-00002.safetensors").unlink()
  _error(capsys, lambda: _import(sharded, out), "model-00002-of-00002.safetensors", "missing")
  # An unknown architecture.
  other = tmp_path / "gpt2"
  shutil.copytree(FIXTURES / "qwen2", other)
  config = json.loads((other / "config.json").read_text())
  (other / "config.json").write_text(json.dumps(dict(config, model_type="gpt2")))
  _error(capsys, lambda: _import(other, out), "config.json", "gpt2", "not supported")
  # A tensor whose shape does not match config.json.
  (other / "config.json").write_text(json.dumps(dict(config, intermediate_size=40)))
  _error(capsys, lambda: _import(other, out), "model.safetensors", "mlp.gate_proj.weight",
         "(48, 32)", "(40, 32)")
  # A tensor of integers.
  (other / "config.json").write_text(json.dumps(config))
  tensors = load_file(str(other / "model.safetensors"))
  tensors["model.norm.weight"] = tensors["model.norm.weight"].astype(np.int32)
  save_file(tensors, str(other / "model.safetensors"))
  _error(capsys, lambda: _import(other, out), "model.norm.weight", "int32")
  # An override that contradicts config.json names both values.
  _error(capsys, lambda: _import(FIXTURES / "qwen2", out, "--config.model.language.dim=48"),
         "--config.model.language.dim=48", "config.json: 32")
  # Two directories that both hold a language model.
  _error(capsys, lambda: _import([FIXTURES / "llava15", FIXTURES / "qwen2"], out),
         "both hold the language module")
  assert not out.exists()


def test_a_tower_and_a_language_model_from_two_directories(tmp_path):
  _import([FIXTURES / "siglip", FIXTURES / "qwen2"], tmp_path / "run",
          "--config.model.vision.projector_hidden=24")
  params = _params(tmp_path / "run")
  flat = lambda t: dict(hf.flatten(t))
  for module, name in (("vision", "siglip"), ("language", "qwen2")):
    src = hf.Source.open(FIXTURES / name)
    cfg = from_dict(json.loads((tmp_path / "run" / "config.json").read_text()))
    got = flat(params[module])
    for path, read in hf.leaves(src, module, cfg):
      np.testing.assert_array_equal(got[path], read(), err_msg="/".join(path))
  assert flat(params["vision"])[("projector", "up", "kernel")].shape == (16, 24)  # the seed's


def test_the_step_0_save_takes_arrays_larger_than_its_host_limit(tmp_path, monkeypatch):
  """The save copies a few GB to the host at a time and orbax refuses an array larger than
  that: the import raises the limit to its largest array (here every array is larger than a
  limit of 1 kB)."""
  monkeypatch.setattr(hf_import, "SAVE_HOST_GB", 1e-6)
  _import(FIXTURES / "llama3", tmp_path / "run")
  src = hf.Source.open(FIXTURES / "llama3")
  cfg = from_dict(json.loads((tmp_path / "run" / "config.json").read_text()))
  got = dict(hf.flatten(_params(tmp_path / "run")["language"]))
  for path, read in hf.leaves(src, "language", cfg):
    np.testing.assert_array_equal(got[path], read(), err_msg="/".join(path))


def _run_equals_init_from(hf_dir, tmp_path):
  """Two steps from the import's step 0 (restored, the optimizer fresh) equal two steps of a run
  that reads the HF directory itself (init_from)."""
  # pylint: disable=import-outside-toplevel
  from mimo_jax import checkpoint, checkpoint_steps, train
  from mimo_jax.config import from_dict  # pylint: disable=import-outside-toplevel
  ckpt = checkpoint.Checkpointer(checkpoint_steps.directory(str(tmp_path / "run")),
                                 ["vision", "language"], read_only=True)
  assert ckpt.read_meta(0).get("params_only") is True
  cfg = from_dict(json.loads((tmp_path / "run" / "config.json").read_text()))
  cfg.data.dir, cfg.train.steps, cfg.run.log_every = str(tmp_path / "data"), 2, 1
  cfg.eval.samples = cfg.eval.batch = 8
  resumed = [r for r in train.run(cfg) if "loss" in r]
  direct = tmp_path / "direct"
  cfg.run.workdir = str(direct)
  cfg.model.vision.init_from = cfg.model.language.init_from = str(hf_dir)
  fresh = [r for r in train.run(cfg) if "loss" in r]
  assert [r["step"] for r in resumed] == [1, 2]
  for a, b in zip(resumed, fresh):
    assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"])


def test_a_run_starts_from_the_imports_step_0(tmp_path):
  """The import saves step 0 with the parameters only (a third of the bytes through the host);
  a run on the workdir restores them and starts the optimizer fresh, as a run that reads the HF
  directory itself does (init_from)."""
  _import(FIXTURES / "llava15", tmp_path / "run")
  _run_equals_init_from(FIXTURES / "llava15", tmp_path)


def test_bfloat16_weights_are_stored_as_bfloat16_and_read_back_exactly(tmp_path, capsys):
  """Weights whose values are bfloat16 values (a checkpoint saved in bfloat16) are stored as
  bfloat16 in step 0, half the bytes; every reader gets the same float32 values back: the
  parameters bitwise, `tools.ckpt check` against the fingerprints, and a run restoring them."""
  import ml_dtypes  # pylint: disable=import-outside-toplevel
  from tools import ckpt  # pylint: disable=import-outside-toplevel
  src = tmp_path / "llava_bf16"
  shutil.copytree(FIXTURES / "llava15", src)
  for f in src.glob("*.safetensors"):
    tensors = load_file(str(f))
    save_file({k: v.astype(ml_dtypes.bfloat16).astype(np.float32) if v.dtype == np.float32
               else v for k, v in tensors.items()}, str(f), metadata={"format": "pt"})
  _import(src, tmp_path / "run")
  reader = checkpoint_reader.Reader(str(tmp_path / "run"))
  stored = reader.params_metadata(0, ["vision", "language"])
  reader.close()
  dtypes = {str(v.dtype) for v in stored.values()}
  assert "bfloat16" in dtypes, dtypes
  params = _params(tmp_path / "run")
  cfg = from_dict(json.loads((tmp_path / "run" / "config.json").read_text()))
  for module in ("vision", "language"):
    got = dict(hf.flatten(params[module]))
    for path, read in hf.leaves(hf.Source.open(src), module, cfg):
      assert got[path].dtype == np.float32
      np.testing.assert_array_equal(got[path], read(), err_msg="/".join(path))
  capsys.readouterr()
  ckpt.main(["check", str(tmp_path / "run")])  # exits 2 on a mismatch
  out = capsys.readouterr().out
  assert "step 0: " in out and "arrays restored, ok" in out, out
  _run_equals_init_from(src, tmp_path)


@pytest.mark.parametrize("missing", ["torch", "transformers"])
def test_check_names_a_bad_directory_before_a_missing_torch(tmp_path, capsys, monkeypatch,
                                                             missing):
  # None in sys.modules makes `import` fail as an absent package does, installed or not.
  monkeypatch.setitem(sys.modules, missing, None)
  _error(capsys, lambda: hf_tool.main(["check", "--hf", str(tmp_path / "nope")]),
         "nope", "not a directory")
  _error(capsys, lambda: hf_tool.main(["check", "--hf", str(FIXTURES / "qwen2")]),
         "torch and transformers", "pip install -e '.[hf]'")


def test_an_imports_config_trains_in_its_own_folder_wherever_it_is_moved(tmp_path):
  """The config.py an import writes takes its run.workdir from the folder it is in (config.json
  names the import's --out), and has no variants."""
  cfg = Config()
  cfg.run.workdir = str(tmp_path / "imported")
  moved = tmp_path / "moved"
  moved.mkdir()
  (moved / "config.json").write_text(json.dumps(dataclasses.asdict(cfg)))
  (moved / "config.py").write_text(hf_import.CONFIG_PY.format(source="DIR"))
  assert configfile.load_file(str(moved / "config.py")).run.workdir == str(moved.resolve())
  with pytest.raises(ValueError, match=r"config\.py: no variant 'stage2'; an import's config"):
    configfile.load_file(f"{moved / 'config.py'}:stage2")
