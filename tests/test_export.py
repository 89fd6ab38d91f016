"""tools.hf export writes a complete HF directory: on the recipe fixtures (tests/fixtures/recipe:
a CLIP + Llama-3.1-style LLaVA, and a SigLIP tower + Qwen2 imported from two directories), the
export holds the config (the source's context length), the image processor, LlavaProcessor's
config, the tokenizer with its chat template and the generation config; mimo_jax's processor and
greedy generation on the export's own import give transformers' references; the image token and
the tokenizer of a run come from its data; the write is staged (a failed write, too little
space or SIGTERM is one line and leaves nothing).

With transformers installed, the export also loads as LlavaForConditionalGeneration with its
AutoProcessor and generates what tools.generate does on the same workdir (skipped otherwise)."""

import errno
import json
import os
import pathlib
import shutil
import signal
from unittest import mock

import numpy as np
import PIL
import pytest
from PIL import Image

from mimo_jax import checkpoint_steps, output
from mimo_jax import generate as generate_lib
from mimo_jax.data import chat
from mimo_jax.data.images import ImageProcessor
from mimo_jax.hf import chat_parts
from tools import generate as generate_tool
from tools import hf as hf_tool
from tools import hf_export
from tests.helpers import assert_hf_error, file_size_limit

RECIPE = pathlib.Path(__file__).parent / "fixtures" / "recipe"
IMAGES = pathlib.Path(__file__).parent / "fixtures" / "images"
REF = json.loads((RECIPE / "reference.json").read_text())
PAIRS = {"llava": ["llava"], "siglip_qwen2": ["siglip", "qwen2"]}


class Pairs:
  """Each pair imported (tools.hf import with the references' flags) and exported, on first use."""

  def __init__(self, root: pathlib.Path):
    self.root, self.done = root, {}

  def __call__(self, pair: str) -> tuple[pathlib.Path, pathlib.Path]:
    if pair not in self.done:
      run, out = self.root / pair / "run", self.root / pair / "export"
      _import([RECIPE / d for d in PAIRS[pair]], run)
      hf_tool.main(["export", str(run), "--out", str(out)])
      self.done[pair] = run, out
    return self.done[pair]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
  return Pairs(tmp_path_factory.mktemp("export"))


def _import(dirs, out):
  hf_tool.main(["import", *[a for d in dirs for a in ("--hf", str(d))], "--out", str(out),
                *REF["import_flags"]])


_error = assert_hf_error


def _json(path) -> dict:
  return json.loads(pathlib.Path(path).read_text())


def _generated(workdir) -> list[int]:
  """tools.generate's greedy tokens for the references' prompt and image on `workdir`."""
  got = []
  real = generate_lib.generate

  def keep(*args, **kwargs):
    out = real(*args, **kwargs)
    got.append(np.asarray(out)[0].tolist())
    return out
  with mock.patch.object(generate_lib, "generate", keep):
    assert generate_tool.main([str(workdir), "--image", str(IMAGES / REF["image"]), "--prompt",
                               REF["prompt"], "--max_new_tokens",
                               str(REF["max_new_tokens"])]) == 0
  return got[0]


@pytest.mark.parametrize("pair", list(PAIRS))
def test_the_export_is_a_complete_hf_directory(pairs, pair):
  _, out = pairs(pair)
  config = _json(out / "config.json")
  lm_source = _json(RECIPE / PAIRS[pair][-1] / "config.json")
  lm_source = lm_source.get("text_config", lm_source)
  clip = pair == "llava"
  assert config["architectures"] == ["LlavaForConditionalGeneration"]
  assert config["text_config"]["max_position_embeddings"] == lm_source[
      "max_position_embeddings"] == (131072 if clip else 32768)
  assert config["text_config"]["model_type"] == ("llama" if clip else "qwen2")
  assert config["vision_config"]["model_type"] == ("clip_vision_model" if clip else
                                                   "siglip_vision_model")
  assert config["vision_feature_select_strategy"] == ("default" if clip else "full")
  assert config["image_token_index"] == (5 if clip else 3)  # the tokenizers' <image>
  # The image processor: the tower's class, size, crop and resample, as the source's.
  pre = _json(out / "preprocessor_config.json")
  source_pre = _json(RECIPE / PAIRS[pair][0] / "preprocessor_config.json")
  for k in ("image_processor_type", "size", "crop_size", "resample", "image_mean", "image_std",
            "do_convert_rgb", "rescale_factor"):
    assert pre.get(k) == source_pre.get(k), k
  assert pre["do_center_crop"] is clip  # said, not left to the class's default
  assert pre["image_processor_type"] == ("CLIPImageProcessor" if clip else "SiglipImageProcessor")
  processor = _json(out / "processor_config.json")
  assert processor == {"processor_class": "LlavaProcessor", "image_token": "<image>",
                       "patch_size": 4, "vision_feature_select_strategy": config[
                           "vision_feature_select_strategy"],
                       "num_additional_image_tokens": int(clip)}
  # The tokenizer's files and chat template; generation with its bos, eos and pad.
  tok_source = RECIPE / PAIRS[pair][-1]
  assert (out / "tokenizer.json").read_bytes() == (tok_source / "tokenizer.json").read_bytes()
  # The template as the tokenizer's, taking a message's content as transformers' list of parts
  # too (mimo_jax/hf/chat_parts.py): the records' string, rendered as the source renders it.
  assert (out / "chat_template.jinja").read_text() == chat_parts.wrap(
      (tok_source / "chat_template.jinja").read_text(), {"image": "<image>\n"})
  as_text = [{"role": "user", "content": "<image>\nWhat is it?"},
             {"role": "assistant", "content": "A cat."}]
  as_parts = [{"role": "user", "content": [{"type": "image"}, {"type": "text",
                                                               "text": "What is it?"}]},
              {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]}]
  exported = chat.ChatTokenizer.open(out)
  assert exported.render(as_parts, True) == exported.render(as_text, True) == (
      chat.ChatTokenizer.open(tok_source).render(as_text, True))
  assert _json(out / "tokenizer_config.json")["processor_class"] == "LlavaProcessor"
  generation = _json(out / "generation_config.json")
  assert generation == ({"bos_token_id": 0, "eos_token_id": [4, 1], "pad_token_id": 1} if clip
                        else {"eos_token_id": [2], "pad_token_id": 0})


@pytest.mark.skipif(int(PIL.__version__.split(".")[0]) < 13,
                    reason="the references are Pillow 13's resampling")
@pytest.mark.parametrize("pair", list(PAIRS))
def test_the_exports_processor_prepares_images_as_transformers_did(pairs, pair):
  """mimo_jax's processor reads the export's and prepares odd-sized images as transformers'
  did for the references. Pillow 12 rounds some of the SigLIP resize's values one level apart
  (transformers' PIL processor and ours alike; the transformers-side test below compares the
  two on one Pillow)."""
  _, out = pairs(pair)
  proc = ImageProcessor.open(out)
  pixels = np.load(RECIPE / "reference.npz")
  for f in REF["images"]:
    with Image.open(IMAGES / f) as image:
      np.testing.assert_allclose(proc.normalized(proc(image)), pixels[f"{pair}/{f}"],
                                 atol=1e-6, err_msg=f)


@pytest.mark.parametrize("pair", list(PAIRS))
def test_generate_on_the_exports_import_gives_transformers_tokens(pairs, pair, tmp_path):
  """Greedy tokens of tools.generate on the export, imported again (its tokenizer, processor
  and weights), are transformers' on the export."""
  _, out = pairs(pair)
  _import([out], tmp_path / "again")
  assert _generated(tmp_path / "again") == REF["generated"][pair]


def _trained_run(pairs, tmp_path, relative: bool = False) -> pathlib.Path:
  """The SigLIP + Qwen2 import as a run elsewhere would be (no hf_import.json, no init_from)
  on converted conversation data padded to squares (data.image_token 3; a manifest naming a
  tokenizer of its own, marked by model_max_length 40). `relative`: its config names
  run.workdir and data.dir relative to `tmp_path`, where it was launched (as runs saved before
  checkpoints stored paths absolute do)."""
  run, _ = pairs("siglip_qwen2")
  tok = tmp_path / "tokenizer"
  shutil.copytree(RECIPE / "qwen2", tok, ignore=shutil.ignore_patterns("*.safetensors"))
  tok_config = _json(tok / "tokenizer_config.json")
  (tok / "tokenizer_config.json").write_text(json.dumps(dict(tok_config, model_max_length=40)))
  data = tmp_path / "data"
  data.mkdir()
  (data / "conversations.json").write_text(json.dumps(
      {"format": 1, "image_token": 3, "image_token_text": "<image>", "tokenizer": str(tok),
       "processor": str(RECIPE / "siglip"), "pad_to_square": True, "vocab_size": 300,
       "image_size": [16, 16]}))
  trained = tmp_path / "trained"
  shutil.copytree(run, trained)
  (trained / "hf_import.json").unlink()
  meta_file = trained / "checkpoints" / "0" / "meta" / "metadata"
  meta = _json(meta_file)
  meta["config"]["data"].update(task="conversations", dir="data" if relative else str(data),
                                image_token=3)
  if relative:
    meta["config"]["run"]["workdir"] = "trained"
  model = meta["config"]["model"]
  for section in (model["encoders"]["vision"], model["language"]):
    section["init_from"] = ""
  meta["digest"] = checkpoint_steps.digest(meta)
  meta_file.write_text(json.dumps(meta))
  return trained


def test_an_import_for_conversations_exports_its_llavas_image_token(tmp_path):
  """An import whose config trains on converted data (configs/llava_cpu.py), exported before
  any data was given (data.image_token unset): the token is the import's image_token_index, not
  the built-in tasks' placeholder."""
  run = tmp_path / "run"
  hf_tool.main(["import", "--hf", str(RECIPE / "llava"), "--out", str(run),
                "--config=configs/llava_cpu.py"])
  hf_tool.main(["export", str(run), "--out", str(tmp_path / "out")])
  assert _json(tmp_path / "out" / "config.json")["image_token_index"] == 5


def test_a_runs_export_takes_its_data_token_tokenizer_and_padding(pairs, tmp_path, capsys):
  """A run on converted data: the image token is data.image_token, the tokenizer the
  manifest's, and data padded to squares gives LLaVA's padding image processor; no
  --image_token_index needed."""
  trained = _trained_run(pairs, tmp_path)
  data = tmp_path / "data"
  hf_tool.main(["export", str(trained), "--out", str(tmp_path / "out")])
  out = tmp_path / "out"
  assert _json(out / "config.json")["image_token_index"] == 3
  assert _json(out / "tokenizer_config.json")["model_max_length"] == 40  # the data's tokenizer
  pre = _json(out / "preprocessor_config.json")
  assert pre["image_processor_type"] == "LlavaImageProcessor" and pre["do_pad"] is True
  # Another token than the run trained with would mark other text as images: refused.
  _error(capsys, lambda: hf_tool.main(["export", str(trained), "--out", str(tmp_path / "o1"),
                                       "--image_token_index", "7"]),
         "--image_token_index 7: the run trained with image token 3")
  assert not (tmp_path / "o1").exists()
  # Without a tokenizer anywhere: one error naming the fix.
  (data / "conversations.json").write_text(json.dumps(
      {"format": 1, "image_token": 3, "tokenizer": str(tmp_path / "none"),
       "processor": str(RECIPE / "siglip")}))
  _error(capsys, lambda: hf_tool.main(["export", str(trained), "--out", str(tmp_path / "o2")]),
         "--tokenizer DIR")
  assert not (tmp_path / "o2").exists()


def test_a_runs_export_from_another_directory_finds_its_relative_data(pairs, tmp_path,
                                                                      monkeypatch):
  """A run whose config names data.dir relative to where it was launched, exported from another
  directory: the data is found there, so the export pads images to squares as the data did and
  holds the data's tokenizer."""
  trained = _trained_run(pairs, tmp_path, relative=True)
  (tmp_path / "elsewhere").mkdir()
  monkeypatch.chdir(tmp_path / "elsewhere")
  hf_tool.main(["export", str(trained), "--out", str(tmp_path / "out")])
  out = tmp_path / "out"
  pre = _json(out / "preprocessor_config.json")
  assert pre["image_processor_type"] == "LlavaImageProcessor" and pre["do_pad"] is True
  assert _json(out / "tokenizer_config.json")["model_max_length"] == 40  # the data's tokenizer
  assert _json(out / "config.json")["image_token_index"] == 3


def test_a_later_stage_finds_its_import_through_init_from(pairs, tmp_path):
  """A run started from the import's workdir (model.init_from=WORKDIR, a training stage) in a
  workdir of its own: the export finds the import's record and sources through it (context,
  tokenizer, image processor)."""
  run, _ = pairs("siglip_qwen2")
  stage = tmp_path / "stage2"
  shutil.copytree(run, stage)
  (stage / "hf_import.json").unlink()
  meta_file = stage / "checkpoints" / "0" / "meta" / "metadata"
  meta = _json(meta_file)
  meta["config"]["model"]["init_from"] = str(run)
  model = meta["config"]["model"]
  for section in (model["encoders"]["vision"], model["language"]):
    section["init_from"] = ""
  meta["digest"] = checkpoint_steps.digest(meta)
  meta_file.write_text(json.dumps(meta))
  hf_tool.main(["export", str(stage), "--out", str(tmp_path / "out")])
  config = _json(tmp_path / "out" / "config.json")
  assert config["text_config"]["max_position_embeddings"] == 32768
  assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (
      RECIPE / "qwen2" / "tokenizer.json").read_bytes()


def test_the_export_is_staged_refuses_what_it_would_overwrite_and_refuses_non_finite_weights(
    pairs, tmp_path, capsys, monkeypatch):
  run, _ = pairs("llava")
  out = tmp_path / "out"
  export = lambda *extra: hf_tool.main(["export", str(run), "--out", str(out), *extra])
  export()
  assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
  # A complete export is refused without --overwrite, replaced with it; any other content is
  # refused.
  _error(capsys, export, "--overwrite")
  (out / "model.safetensors").unlink()
  export("--overwrite")
  assert (out / "model.safetensors").is_file()
  other = tmp_path / "other"
  other.mkdir()
  (other / "notes.txt").write_text("mine")
  _error(capsys, lambda: hf_tool.main(["export", str(run), "--out", str(other), "--overwrite"]),
         "not empty", "notes.txt")
  assert sorted(p.name for p in other.iterdir()) == ["notes.txt"]
  # A checkpoint with a NaN weight is refused, naming the tensor; nothing is written.
  read = hf_export._read_checkpoint

  def with_nan(*args):
    cfg, params, step, record = read(*args)
    params["language"]["norm"]["scale"] = np.full_like(params["language"]["norm"]["scale"],
                                                       np.nan)
    return cfg, params, step, record
  monkeypatch.setattr(hf_export, "_read_checkpoint", with_nan)
  _error(capsys, lambda: hf_tool.main(["export", str(run), "--out", str(tmp_path / "nan")]),
         "language_model.model.norm.weight", "NaN or Inf", "--step")
  assert not (tmp_path / "nan").exists()


def test_a_failed_write_too_little_space_or_sigterm_leave_nothing(pairs, tmp_path, capsys,
                                                                   monkeypatch):
  """Each is one line naming --out and the reason (exit 2, SIGTERM 143); no output, no staging
  directory, no lock is left, and a rerun works."""
  run, _ = pairs("llava")
  out = tmp_path / "out"
  export = lambda: hf_tool.main(["export", str(run), "--out", str(out)])
  # The weights' write under a file size limit, as on a full disk: safetensors raises its
  # SafetensorError, which is no OSError.
  with file_size_limit(4096):
    _error(capsys, export, f"--out={str(out)!r}", "refused the write (File too large)")
  assert sorted(p.name for p in tmp_path.iterdir()) == []
  # The tokenizer's copy on a full disk.
  full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
  with mock.patch.object(shutil, "copyfile", side_effect=full):
    _error(capsys, export, f"--out={str(out)!r}", "No space left on device")
  assert sorted(p.name for p in tmp_path.iterdir()) == []
  # Too little free space: refused before anything is written.
  real = output.shutil.disk_usage
  with mock.patch.object(output.shutil, "disk_usage", lambda p: real(p)._replace(free=1000)):
    _error(capsys, export, "the export needs about", f"at {out}", "free space")
  assert sorted(p.name for p in tmp_path.iterdir()) == []
  # SIGTERM while the weights are written.
  write = hf_export._write_safetensors  # pylint: disable=protected-access

  def killed(tmp, tensors):
    write(tmp, tensors)
    os.kill(os.getpid(), signal.SIGTERM)
  monkeypatch.setattr(hf_export, "_write_safetensors", killed)
  with pytest.raises(SystemExit) as e:
    export()
  assert e.value.code == 128 + signal.SIGTERM
  assert capsys.readouterr().err.strip().splitlines() == [
      f"tools.hf: export interrupted; nothing was written to {out}"]
  assert sorted(p.name for p in tmp_path.iterdir()) == []
  monkeypatch.setattr(hf_export, "_write_safetensors", write)
  export()  # a rerun works
  assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()


# transformers' side: the export as transformers loads it.

def test_transformers_loads_the_export_and_generates_what_mimo_jax_does(pairs):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  for pair in PAIRS:
    run, out = pairs(pair)
    processor = transformers.AutoProcessor.from_pretrained(str(out), use_fast=False)
    assert type(processor).__name__ == "LlavaProcessor"
    mimo = ImageProcessor.open(out)
    fast = transformers.AutoImageProcessor.from_pretrained(str(out))
    for f in REF["images"]:
      with Image.open(IMAGES / f) as image:
        theirs = processor.image_processor(images=image, return_tensors="np")["pixel_values"][0]
        np.testing.assert_allclose(mimo.normalized(mimo(image)), theirs, atol=1e-6, err_msg=f)
        _within_rounding(fast, image, theirs, f)
    model = transformers.LlavaForConditionalGeneration.from_pretrained(str(out)).eval()
    text = processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": f"<image>\n{REF['prompt']}"}], add_generation_prompt=True,
        tokenize=False)
    image_id = model.config.image_token_index
    # transformers' PIL processor, and AutoProcessor as it comes (its fast image processor).
    for each in (processor, transformers.AutoProcessor.from_pretrained(str(out))):
      with Image.open(IMAGES / REF["image"]) as image:
        inputs = each(text=text, images=image.convert("RGB"), return_tensors="pt",
                      add_special_tokens=False)
      assert int((inputs["input_ids"] == image_id).sum()) == 16  # (16 / 4)^2 image tokens
      with torch.no_grad():
        seq = model.generate(**inputs, do_sample=False, max_new_tokens=REF["max_new_tokens"])
      theirs = seq[0, inputs["input_ids"].shape[1]:].tolist()
      assert theirs == REF["generated"][pair], (pair, type(each.image_processor).__name__)
      assert _generated(run) == theirs, pair


def test_transformers_pads_images_to_squares_as_the_conversion_did(pairs, tmp_path):
  transformers = pytest.importorskip("transformers")
  trained = _trained_run(pairs, tmp_path)
  hf_tool.main(["export", str(trained), "--out", str(tmp_path / "out")])
  out = str(tmp_path / "out")
  theirs = transformers.AutoImageProcessor.from_pretrained(out, use_fast=False)
  fast = transformers.AutoImageProcessor.from_pretrained(out)
  mimo = ImageProcessor.open(tmp_path / "out")
  assert mimo.pad_to_square
  for f in REF["images"]:
    with Image.open(IMAGES / f) as image:
      slow = theirs(images=image, return_tensors="np")["pixel_values"][0]
      np.testing.assert_allclose(slow, mimo.normalized(mimo(image)), atol=1e-6, err_msg=f)
      _within_rounding(fast, image, slow, f)


def _within_rounding(fast, image, slow, f: str) -> None:
  """transformers' default (fast, torchvision) image processor resamples in floating point where
  its PIL one (and ours) rounds to 8-bit levels: its pixel values are within two levels (2/255
  over the processor's std) of the PIL one's."""
  got = np.asarray(fast(images=image, return_tensors="np")["pixel_values"][0], np.float32)
  bound = 2 / 255 / min(fast.image_std) + 1e-6
  assert got.shape == slow.shape, f
  assert np.abs(got - slow).max() <= bound, (f, type(fast).__name__, np.abs(got - slow).max())
