"""Fixes from a LLaVA probe: tools.generate refuses an image past Pillow's decompression-bomb
limit where Pillow would only warn, as tools.convert and tools.eval do; tools.convert says a
record's empty conversations list is empty, not missing; a run whose max_images is below its
converted data's is told the one flag to set (converted data's runs do not check
data.image_probs, which they do not read)."""

import dataclasses
import json
import shutil
import warnings

import pytest
from PIL import Image

from mimo_jax import checkpoint_config
from mimo_jax.config import Config, ConfigError
from mimo_jax.data import conversion, conversion_record, digits
from mimo_jax.data.images import ImageProcessor
from mimo_jax.encoders.vision import VisionConfig
from mimo_jax.validation import validate
from mimo_jax.validation_data import validate_data
from tests.test_convert_faults import FIXTURES, PROCESSOR, TOKENIZER, _main, _one_line_error
from tests.test_validation_faults import _config
from tools import prompts


def test_generate_refuses_an_image_pillow_only_warns_of(tmp_path, monkeypatch):
  """60x60 pixels past a limit of 2000 (under twice it: Pillow warns, it does not raise): one
  line naming the file, the limit and the fix, and no warning of Pillow's printed above it."""
  digits.write_tokenizer(tmp_path / "tok")
  Image.new("L", (60, 60), 128).save(tmp_path / "big.png")
  cfg = Config()
  cfg.add_encoder("vision", VisionConfig())  # the digits' tower: 8x8, one channel
  proc = ImageProcessor.open(tmp_path / "tok")
  prompts.load_images([str(tmp_path / "big.png")], proc, cfg)  # taken under Pillow's limit
  monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 2000)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with pytest.raises(ConfigError) as e:
      prompts.load_images([str(tmp_path / "big.png")], proc, cfg)
  assert str(e.value) == (
      f"{tmp_path / 'big.png'}: refused as a possible decompression bomb (Image size (3600 pixels) "
      "exceeds limit of 2000 pixels, could be decompression bomb DOS attack.); give a smaller "
      "image."), str(e.value)
  assert not caught, [str(w.message) for w in caught]


@pytest.mark.parametrize("turns,said", [
    ([], "empty conversations list (no turns)."), (None, "no conversations list."),
    ("hello", "no conversations list.")])
def test_a_record_of_no_turns_is_named_for_what_it_holds(tmp_path, capsys, turns, said):
  """An empty list is said to be empty (it is a list); a missing key (None here) or another type
  is no conversations list. The reason the record is counted under stays `no conversations`."""
  shutil.copy(FIXTURES / "images" / "portrait.png", tmp_path)
  record = {"id": "e", "image": "portrait.png", "conversations": turns}
  if turns is None:
    del record["conversations"]
  good = {"image": "portrait.png", "conversations": [
      {"from": "human", "value": "<image>\nWhat is it?"}, {"from": "gpt", "value": "A."}]}
  goods = [dict(good, id=f"g{k}") for k in range(4)]  # eval draws 2: one at least is good
  (tmp_path / "d.json").write_text(json.dumps([record] + goods))
  args = ["--json", str(tmp_path / "d.json"), "--images", str(tmp_path), "--tokenizer",
          str(TOKENIZER), "--processor", str(PROCESSOR), "--workers", "1", "--eval", "2"]
  rc, err, _ = _main(args + ["--out", str(tmp_path / "a"), "--on_error", "fail"], capsys)
  _one_line_error(rc, err, f"record 0 (id 'e'): {said} ")
  if turns == []:
    assert "no conversations list" not in err, err
  rc, err, _ = _main(args + ["--out", str(tmp_path / "b"), "--max_skipped_fraction", "1"],
                     capsys)
  assert rc == 0, err
  rows = [json.loads(line) for line in (tmp_path / "b" / "skipped.jsonl").read_text().splitlines()]
  assert [(r["reason"], r["error"].endswith(said)) for r in rows] == [("no conversations", True)]


def test_max_images_below_the_datas_is_the_one_flag_to_set(tmp_path):
  """Data of 2-image records and a config of max_images 1 (image_probs of two values, as a
  config for one-image data would have): the one error gives the one flag, which then passes
  both validations: a run on converted data reads its samples' images from the records, not
  from data.image_probs, and does not check that field's length against max_images."""
  two = {"image": ["portrait.png", "portrait.png"], "conversations": [
      {"from": "human", "value": "<image>\n<image>\nWhich is it?"},
      {"from": "gpt", "value": "Both."}]}
  (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(dict(two, id=k)) for k in range(4)))
  conversion.convert(tmp_path / "d.jsonl", tmp_path / "data", conversion_record.Options(
      tokenizer=str(TOKENIZER), images=str(FIXTURES / "images"), processor=str(PROCESSOR)),
                     eval_count=2, progress=False)
  cfg = _config(tmp_path / "data", tmp_path / "run")
  cfg.model.vision.max_images, cfg.data.image_probs = 1, "0.5,0.5"
  validate(cfg, 4)
  with pytest.raises(ConfigError) as e:
    validate_data(cfg)
  flag = "--config.model.vision.max_images=2"
  assert str(e.value) == (
      f"config.model.vision.max_images: 1, but a sample of {tmp_path / 'data'} holds 2 images "
      f"(its conversations.json); use >= 2: {flag}, as the launch line that tools.convert "
      "printed sets it."), str(e.value)
  cfg.model.vision.max_images = int(flag.rsplit("=", 1)[1])
  validate(cfg, 4)
  validate_data(cfg)
  assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("task", ["digits", "conversations"])
def test_a_resume_compares_image_probs_only_where_the_task_reads_it(task):
  """A checkpoint records data.image_probs, and a resume is refused for another value, only for
  a task that draws its samples' image counts from it: converted data's runs read theirs from
  the records."""
  cfg = Config()
  cfg.add_encoder("vision", VisionConfig())
  cfg.data.task = task
  values = checkpoint_config.data_values(cfg)
  meta = {"modules": list(cfg.topology.modules()),
          "config": {"model": dataclasses.asdict(cfg.model)},
          "data": {k: v for k, (_, v) in values.items()}}
  assert ("image_probs" in values) is (task == "digits")
  cfg.data.image_probs = "0.5,0.5"
  if task == "digits":
    with pytest.raises(checkpoint_config.CheckpointError,
                       match=r"data\.image_probs='0\.1,0\.3,0\.3,0\.3' \(this run: '0\.5,0\.5'\)"):
      checkpoint_config.check_compatible(meta, cfg, "ckpt", 3)
  else:
    assert checkpoint_config.check_compatible(meta, cfg, "ckpt", 3) == []
