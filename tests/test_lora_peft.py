"""LoRA adapters in and out of PEFT's format (hf/peft.py), against an adapter PEFT itself saved
on the tiny Llama-3 fixture with the adapted model's outputs (tools/peft_fixtures.py; no torch
here)."""

import copy
import json
import pathlib

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

from mimo_jax import hf, modules, output, whole
from mimo_jax.config import Config, ConfigError
from mimo_jax.encoders.vision import VisionConfig
from mimo_jax.hf import peft
from mimo_jax.models import lora
from mimo_jax.step import Step
from mimo_jax.trees import paths
from mimo_jax.validation import validate
from tests.helpers import file_size_limit

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
ADAPTER = FIXTURES / "peft" / "llama3"


def _config() -> Config:
  cfg = Config()
  cfg.add_encoder("vision", VisionConfig())
  cfg.data.task, cfg.model.vision.max_images, cfg.data.image_probs = "synthetic", 1, "0.5,0.5"
  hf.configure(cfg, hf.Source.open(FIXTURES / "hf" / "llama3"))
  cfg.model.language.lora.rank, cfg.model.language.lora.alpha = 4, 8.0
  validate(cfg)
  return cfg


@pytest.fixture(scope="module")
def imported():
  cfg = _config()
  src = hf.Source.open(FIXTURES / "hf" / "llama3")
  base = hf.load(src, "language", cfg, modules.build_modules(cfg)["language"].init(0))
  return cfg, base, peft.read(ADAPTER, cfg, {"language": base})["language"]


def test_imported_adapter_gives_peft_outputs(imported):
  cfg, base, params = imported
  ref = np.load(ADAPTER / "reference.npz")
  ours = np.asarray(whole.language_logits(cfg, params, ref["input_ids"]))
  theirs = ref["logits"]
  assert np.abs(ours - theirs).max() <= 1e-5 * np.abs(theirs).max()
  # The adapter matters: the base alone is far from the adapted outputs.
  plain = np.asarray(whole.language_logits(cfg, base, ref["input_ids"]))
  assert np.abs(plain - theirs).max() > 1e-2 * np.abs(theirs).max()
  # Merged into the kernels, the plain model gives the same outputs.
  merged = lora.merge(params, cfg.model.language.lora)
  plain_cfg = _config()
  plain_cfg.model.language.lora.rank = 0
  got = np.asarray(whole.language_logits(plain_cfg, merged, ref["input_ids"]))
  assert np.abs(got - ours).max() <= 1e-5 * np.abs(ours).max()


def test_export_has_peft_names_and_is_bitwise_the_imported_adapter(imported, tmp_path):
  cfg, _, params = imported
  peft.write(tmp_path / "adapter", cfg, {"language": params}, base="tests/fixtures/hf/llama3")
  written = load_file(str(tmp_path / "adapter" / peft.WEIGHTS))
  expected = json.loads(str(np.load(ADAPTER / "reference.npz")["names"]))
  assert {k: list(v.shape) for k, v in written.items()} == expected
  theirs = load_file(str(ADAPTER / peft.WEIGHTS))
  for k, v in theirs.items():
    np.testing.assert_array_equal(written[k], v, err_msg=k)
  config = json.loads((tmp_path / "adapter" / peft.CONFIG).read_text())
  fixture = json.loads((ADAPTER / peft.CONFIG).read_text())
  for key in ("peft_type", "r", "lora_alpha", "task_type"):
    assert config[key] == fixture[key], key
  assert sorted(config["target_modules"]) == sorted(fixture["target_modules"])
  # Read back: the same parameters, bit for bit.
  again = paths(peft.read(tmp_path / "adapter", cfg, {"language": params})["language"])
  for k, v in paths(params).items():
    np.testing.assert_array_equal(again[k], v, err_msg=k)


def test_a_failed_write_is_one_error_naming_the_adapter_and_leaves_nothing(imported, tmp_path):
  cfg, _, params = imported
  out = tmp_path / "adapter"
  # A file size limit, as a full disk: safetensors raises its SafetensorError, no OSError.
  with file_size_limit(1024), pytest.raises(output.OutputError) as e:
    peft.write(out, cfg, {"language": params})
  assert str(e.value).startswith(f"--out={str(out)!r}: the file system refused the write (File "
                                 "too large)"), e.value
  assert list(tmp_path.iterdir()) == []  # no adapter, no staging directory, no lock


def test_export_writes_lora_dropout_and_import_reads_it(imported, tmp_path):
  cfg, _, params = imported
  assert peft.dropout(ADAPTER) == json.loads((ADAPTER / peft.CONFIG).read_text())["lora_dropout"]
  cfg = copy.deepcopy(cfg)
  cfg.model.language.lora.dropout = 0.125
  peft.write(tmp_path / "adapter", cfg, {"language": params})
  config = json.loads((tmp_path / "adapter" / peft.CONFIG).read_text())
  assert config["lora_dropout"] == 0.125 and peft.dropout(tmp_path / "adapter") == 0.125
  config["lora_dropout"] = 1.5
  (tmp_path / "adapter" / peft.CONFIG).write_text(json.dumps(config))
  for load in (lambda: peft.dropout(tmp_path / "adapter"),
               lambda: peft.read(tmp_path / "adapter", cfg, {"language": params})):
    with pytest.raises(hf.HFError, match=r"adapter_config\.json: lora_dropout is 1\.5, not a "
                       r"probability"):
      load()


def test_an_adapter_that_does_not_fit_is_refused(imported, tmp_path):
  cfg, base, _ = imported
  cfg.model.language.lora.rank = 8
  with pytest.raises(hf.HFError, match=r"adapter_config\.json: r is 4 .*model\.language\.lora"):
    peft.read(ADAPTER, cfg, {"language": base})
  cfg.model.language.lora.rank = 4
  with pytest.raises(hf.HFError, match="not a PEFT adapter directory"):
    peft.read(tmp_path, cfg, {"language": base})


def test_full_export_writes_the_merged_model(imported):
  cfg, base, params = imported
  from mimo_jax.hf.export import export_tensors  # pylint: disable=import-outside-toplevel
  plain_cfg = _config()
  plain_cfg.model.language.lora.rank = 0
  got = dict(export_tensors(("language",), cfg, {"language": params}))
  want = dict(export_tensors(("language",), plain_cfg,
                             {"language": lora.merge(params, cfg.model.language.lora)}))
  unmerged = dict(export_tensors(("language",), plain_cfg, {"language": base}))
  assert set(got) == set(want) == set(unmerged)
  for k, v in want.items():
    np.testing.assert_array_equal(got[k], v, err_msg=k)
  q = "model.layers.0.self_attn.q_proj.weight"
  assert np.abs(got[q] - unmerged[q]).max() > 1e-3  # the adapters are in it


LLAVA_ADAPTER = FIXTURES / "peft" / "llava15"
CLIP_NORM = ([0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711])


@pytest.fixture(scope="module")
def llava():
  """The LLaVA-1.5 fixture with adapters on the tower (rank 2) and the language model (rank 4)
  and the projector trained, as PEFT saved them, read into our parameters."""
  from mimo_jax.encoders import vision as vision_encoder  # pylint: disable=import-outside-toplevel
  src = hf.Source.open(FIXTURES / "hf" / "llava15")
  cfg = Config()
  cfg.add_encoder("vision", VisionConfig())
  cfg.data.task, cfg.model.vision.max_images, cfg.data.image_probs = "synthetic", 1, "0.5,0.5"
  hf.configure(cfg, src)
  cfg.model.language.lora.rank, cfg.model.language.lora.alpha = 4, 8.0
  cfg.model.vision.lora.rank, cfg.model.vision.lora.alpha = 2, 4.0
  validate(cfg)
  built = modules.build_modules(cfg)
  base = {n: hf.load(src, n, cfg, built[n].init(0)) for n in ("vision", "language")}
  params = peft.read(LLAVA_ADAPTER, cfg, base, ("vision", "language"))

  def logits(p):
    ref = np.load(LLAVA_ADAPTER / "reference.npz")
    tokens = vision_encoder.image_tokens(cfg, p["vision"], ref["pixels"])
    return np.asarray(whole.merged_logits(cfg, p["language"], ref["input_ids"], tokens,
                                          src.config["image_token_index"]))
  return cfg, base, params, logits


def test_tower_and_language_adapters_give_peft_outputs(llava):
  cfg, base, params, logits = llava
  theirs = np.load(LLAVA_ADAPTER / "reference.npz")["logits"]
  ours = logits(params)
  assert np.abs(ours - theirs).max() <= 1e-5 * np.abs(theirs).max()
  # Each part matters: without the tower's adapters, or the trained projector, it is far off.
  for module, keep in (("vision", lambda k: not lora.is_adapter(k)),
                       ("vision", lambda k: not k.startswith("projector/"))):
    flat, original = paths(params[module]), paths(base[module])
    mixed = dict(params, **{module: _nest({k: v if keep(k) else original[k]
                                           for k, v in flat.items()})})
    assert np.abs(logits(mixed) - theirs).max() > 1e-3 * np.abs(theirs).max()


def test_llava_export_has_peft_names_and_reads_back_bitwise(llava, tmp_path):
  cfg, _, params, _ = llava
  both = ("vision", "language")
  peft.write(tmp_path / "adapter", cfg, params, modules=both)
  written = load_file(str(tmp_path / "adapter" / peft.WEIGHTS))
  expected = json.loads(str(np.load(LLAVA_ADAPTER / "reference.npz")["names"]))
  assert {k: list(v.shape) for k, v in written.items()} == expected
  for k, v in load_file(str(LLAVA_ADAPTER / peft.WEIGHTS)).items():
    np.testing.assert_array_equal(written[k], v, err_msg=k)
  config = json.loads((tmp_path / "adapter" / peft.CONFIG).read_text())
  fixture = json.loads((LLAVA_ADAPTER / peft.CONFIG).read_text())
  for key in ("peft_type", "r", "lora_alpha", "rank_pattern", "alpha_pattern", "modules_to_save"):
    assert config[key] == fixture[key], key
  again = peft.read(tmp_path / "adapter", cfg, params, both)
  for n in both:
    for k, v in paths(params[n]).items():
      np.testing.assert_array_equal(paths(again[n])[k], v, err_msg=f"{n} {k}")


def test_a_tower_trained_whole_has_no_peft_adapter(llava, tmp_path):
  cfg, _, params, _ = llava
  cfg.model.vision.lora.rank = 0
  with pytest.raises(hf.HFError, match=r"model\.vision trains .*without --peft"):
    peft.write(tmp_path / "adapter", cfg, params, modules=("vision", "language"))
  cfg.model.vision.lora.rank = 2
  assert not (tmp_path / "adapter").exists()


def _nest(flat: dict) -> dict:
  out = {}
  for k, v in flat.items():
    node = out
    *head, last = k.split("/")
    for h in head:
      node = node.setdefault(h, {})
    node[last] = v
  return out


def test_a_run_starts_from_a_peft_adapter_over_its_hf_base(llava):
  """`model.<module>.lora.init_from`: a fresh run's tower and language adapters and its projector
  are PEFT's (read together from one directory) over the HF base its modules start from, so the
  run begins at PEFT's adapted model and trains on from there."""
  cfg, _, _, logits = llava
  cfg = copy.deepcopy(cfg)
  for n in ("vision", "language"):
    cfg.model.module(n).init_from = str(FIXTURES / "hf" / "llava15")
    cfg.model.module(n).lora.init_from = str(LLAVA_ADAPTER)
  validate(cfg)
  step = Step.build(cfg)
  made = step.init_state(0)
  params = {n: jax.device_get(s.params) for n, s in step.canonical(made).items()}
  theirs = np.load(LLAVA_ADAPTER / "reference.npz")["logits"]
  assert np.abs(logits(params) - theirs).max() <= 1e-5 * np.abs(theirs).max()
  # The optimizer starts fresh: every moment of the adapters is zero.
  assert all(not np.any(np.asarray(x)) for s in made.values()
             for x in jax.tree.leaves(s.opt_state) if np.asarray(x).ndim > 0)


def test_an_adapter_source_is_checked_before_the_run(llava, tmp_path):
  cfg, _, _, _ = llava
  cfg = copy.deepcopy(cfg)
  cfg.model.language.lora.init_from = str(tmp_path)
  with pytest.raises(ConfigError, match=r"model\.language\.lora\.init_from: .* is not a PEFT "
                     r"adapter directory: it has no adapter_config\.json or "
                     r"adapter_model\.safetensors"):
    validate(cfg)
  cfg.model.language.lora.init_from, cfg.model.language.lora.rank = str(LLAVA_ADAPTER), 0
  with pytest.raises(ConfigError, match=r"model\.language\.lora\.init_from: names a PEFT adapter "
                     r"but model\.language\.lora\.rank is 0"):
    validate(cfg)


def test_an_adapter_for_a_module_without_peft_names_is_refused_before_the_run(llava):
  from mimo_jax.encoders.audio import AudioConfig  # pylint: disable=import-outside-toplevel
  cfg, _, _, _ = llava
  cfg = copy.deepcopy(cfg)
  cfg.add_encoder("audio", AudioConfig())
  cfg.model.audio.lora.rank, cfg.model.audio.lora.init_from = 2, str(LLAVA_ADAPTER)
  with pytest.raises(ConfigError, match=r"model\.audio\.lora\.init_from: a PEFT adapter of "
                     r"audio: PEFT names exist for"):
    validate(cfg)


def test_peft_loads_our_export_over_transformers_model(llava, tmp_path):
  """Our PEFT export of the LLaVA adapters, loaded by peft.PeftModel.from_pretrained over the
  transformers model of the base, gives the outputs PEFT's own adapter gave."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  peft_lib = pytest.importorskip("peft")
  cfg, _, params, _ = llava
  peft.write(tmp_path / "adapter", cfg, params, modules=("vision", "language"))
  ref = np.load(LLAVA_ADAPTER / "reference.npz")
  base = transformers.LlavaForConditionalGeneration.from_pretrained(
      FIXTURES / "hf" / "llava15", torch_dtype=torch.float32)
  model = peft_lib.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
  mean, std = (torch.tensor(v, dtype=torch.float32).reshape(1, -1, 1, 1) for v in CLIP_NORM)
  pixels = (torch.from_numpy(ref["pixels"]).permute(0, 3, 1, 2) - mean) / std
  with torch.no_grad():
    got = model(input_ids=torch.from_numpy(ref["input_ids"]), pixel_values=pixels).logits.numpy()
  assert np.abs(got - ref["logits"]).max() <= 1e-5 * np.abs(ref["logits"]).max()
