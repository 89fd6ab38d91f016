"""LLaVA-format conversations: `tools.convert` writes what the chat template and the image
processor give (bad records skipped with their reasons, or the conversion refused and nothing
written), and `data.task=conversations` trains on it."""

import argparse
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from mimo_jax import train
from mimo_jax.config import ConfigError
from mimo_jax.data import conversion_record, conversations
from mimo_jax.data.record_error import RecordError
from mimo_jax.data.chat import ChatTokenizer, messages
from mimo_jax.data.images import ImageProcessor
from tests.helpers import deep_images, tiny_config
from tools import convert

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
TOKENIZER = FIXTURES / "chat" / "llama3"
PROCESSOR = FIXTURES / "images" / "siglip"  # 20 x 20
GOOD = [
    {"id": "text", "conversations": [{"from": "human", "value": "Hello, who are you?"},
                                     {"from": "gpt", "value": "A careful assistant."}]},
    {"id": "one", "image": "portrait.png",
     "conversations": [{"from": "human", "value": "<image>\nWhat is in the picture?"},
                       {"from": "gpt", "value": "Noise, mostly."}]},
    {"id": "three", "image": ["landscape.png", "rgba.png", "grayscale.png"],
     "conversations": [{"from": "system", "value": "Answer briefly."},
                       {"from": "human", "value": "<image> <image> Are these the same?"},
                       {"from": "gpt", "value": "No."},
                       {"from": "human", "value": "And <image>?"},
                       {"from": "gpt", "value": "Gray."}]},
]
BAD = {
    "missing image": {"id": "gone", "image": "nowhere.png", "conversations": [
        {"from": "human", "value": "<image> what?"}, {"from": "gpt", "value": "x"}]},
    "unrecognised image": {"id": "broken", "image": "broken.png", "conversations": [
        {"from": "human", "value": "<image> what?"}, {"from": "gpt", "value": "x"}]},
    "image count": {"id": "count", "image": ["tiny.png"], "conversations": [
        {"from": "human", "value": "<image> and <image>?"}, {"from": "gpt", "value": "x"}]},
    "unknown role": {"id": "robot", "conversations": [
        {"from": "robot", "value": "beep"}, {"from": "gpt", "value": "x"}]},
    "too long": {"id": "long", "conversations": [
        {"from": "human", "value": "word " * 200}, {"from": "gpt", "value": "x"}]},
}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
  root = tmp_path_factory.mktemp("llava")
  images = root / "images"
  images.mkdir()
  for f in (FIXTURES / "images").glob("*.png"):
    shutil.copy(f, images)
  (images / "broken.png").write_text("not an image")
  good = [dict(r, id=f"{r['id']}-{k}") for k in range(4) for r in GOOD]
  (root / "data.jsonl").write_text("\n".join(json.dumps(r) for r in good + list(BAD.values())))
  return root


def _args(source, out, *extra):
  return ["--json", str(source / "data.jsonl"), "--images", str(source / "images"),
          "--tokenizer", str(TOKENIZER), "--processor", str(PROCESSOR), "--out", str(out),
          "--seq_len", "170", "--image_tokens", "25", "--eval", "4",
          "--max_skipped_fraction", "1", *extra]  # 5 bad records of 17


@pytest.fixture(scope="module")
def converted(source, tmp_path_factory):
  out = tmp_path_factory.mktemp("converted") / "data"
  assert convert.main(_args(source, out, "--workers", "2")) == 0
  return out


def test_the_converter_writes_the_template_and_processor_output(converted):
  m = conversations.manifest(str(converted))
  assert sum(m["samples"].values()) == 12 and m["samples"]["eval"] >= 2 and m["images"] == 16
  assert m["skipped"] == {reason: 1 for reason in BAD}
  assert m["image_size"] == [20, 20] and m["image_token"] == 5
  tok, proc = ChatTokenizer.open(TOKENIZER), ImageProcessor.open(PROCESSOR)
  seen, kept = set(), []
  from array_record.python import array_record_module  # pylint: disable=import-outside-toplevel
  for split in conversations.SPLITS:
    path = converted / f"{split}.array_record"
    reader = array_record_module.ArrayRecordReader(str(path))
    for i in range(reader.num_records()):
      got = conversations.decode(reader.read([i])[0], str(path), i)
      match = [r for r in GOOD
               if np.array_equal(tok.encode(messages(r["conversations"]))[0], got["tokens"])]
      assert len(match) == 1
      r = match[0]
      kept.append(conversations.record_id(reader.read([i])[0], str(path), i))
      assert kept[-1].rsplit("-", 1)[0] == r["id"], (kept[-1], r["id"])  # the source's "<id>-<k>"
      ids, mask = tok.encode(messages(r["conversations"]))
      np.testing.assert_array_equal(got["loss_mask"], mask)
      files = [r["image"]] if isinstance(r.get("image"), str) else r.get("image", [])
      assert int((got["tokens"] == 5).sum()) == len(files) == len(got["images"])
      for f, pixels in zip(files, got["images"]):
        np.testing.assert_array_equal(pixels, proc(Image.open(FIXTURES / "images" / f)))
      seen.add(r["id"])
      # Token 3, the built-in tasks' <img>, is ordinary text here (<|end_header_id|>): the image
      # placeholder is the tokenizer's own image token.
      assert (got["tokens"] == 3).any()
  assert seen == {r["id"] for r in GOOD}
  assert len(set(kept)) == len(kept) == 12  # each record's own id


def test_skipped_records_are_named_with_their_reasons(source, tmp_path, capsys, monkeypatch):
  assert convert.main(_args(source, tmp_path / "out", "--workers", "1")) == 0
  got = capsys.readouterr()
  err = got.err
  assert "converting" not in err and "1 worker)" in got.out, err  # a bar on a terminal only
  for reason, record in BAD.items():
    line = next(ln for ln in err.splitlines() if f"(id {record['id']!r})" in ln)
    assert line.startswith("skipped: ") and "data.jsonl: record " in line, line
  assert "nowhere.png not found" in err
  assert "broken.png cannot be read: Pillow recognises no image in it" in err
  assert "unknown role 'robot'" in err
  assert re.search(r": \d+ tokens exceed --seq_len 170\.", err), err  # no media: none named
  monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
  assert convert.main(_args(source, tmp_path / "out2", "--workers", "1")) == 0
  assert "converting: 100%" in capsys.readouterr().err


def test_16_bit_and_float_images_convert_as_their_8_bit_values(tmp_path, capsys):
  """A 16-bit PNG and a float TIFF in [0, 1] hold the 8-bit image's values (Pillow's own
  conversion clips them: almost white, black); a float image past [0, 1] is a bad record."""
  files = deep_images(FIXTURES / "images" / "portrait.png", tmp_path)
  (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(
      {"id": k, "image": f.name, "conversations": [{"from": "human", "value": "<image> what?"},
                                                   {"from": "gpt", "value": "x"}]})
      for k, f in files.items()))
  out = tmp_path / "out"
  args = ["--json", str(tmp_path / "d.jsonl"), "--images", str(tmp_path), "--tokenizer",
          str(TOKENIZER), "--processor", str(PROCESSOR), "--out", str(out), "--workers", "1",
          "--eval", "1", "--max_skipped_fraction", "0.25"]  # 1 of 4
  assert convert.main(args) == 0
  err = capsys.readouterr().err
  assert re.search(r"past\.tif is a float image with values from \d+ to \d+, where float pixels "
                   r"are read as \[0, 1\]", err), err
  assert conversations.manifest(str(out))["skipped"] == {"unsupported image": 1}
  from array_record.python import array_record_module  # pylint: disable=import-outside-toplevel
  got = {}
  for split in conversations.SPLITS:
    path = str(out / f"{split}.array_record")
    reader = array_record_module.ArrayRecordReader(path)
    for i in range(reader.num_records()):
      record = reader.read([i])[0]
      got[conversations.record_id(record, path, i)] = conversations.decode(record, path, i)
  assert sorted(got) == ["16", "8", "float"]
  np.testing.assert_array_equal(got["8"]["images"][0],
                                ImageProcessor.open(PROCESSOR)(Image.open(files["8"])))
  for k in ("16", "float"):
    np.testing.assert_array_equal(got[k]["images"][0], got["8"]["images"][0])


def test_a_processor_that_keeps_bands_refuses_rgba_and_palette_images_with_the_fix(tmp_path,
                                                                                   capsys):
  """do_convert_rgb false: an RGBA or palette image is refused naming the record, the file and
  the fix (the Pillow conversion a converting processor's pixels come from, or a processor that
  converts), as tools.eval and tools.generate word it; not "cannot be read"."""
  keeps = tmp_path / "keeps"
  shutil.copytree(PROCESSOR, keeps)
  config = json.loads((keeps / "preprocessor_config.json").read_text())
  (keeps / "preprocessor_config.json").write_text(json.dumps(dict(config, do_convert_rgb=False)))
  data = tmp_path / "d.jsonl"
  turns = [{"from": "human", "value": "<image> what?"}, {"from": "gpt", "value": "x"}]
  data.write_text("\n".join(json.dumps({"id": n, "image": f"{n.rstrip('2')}.png",
                                        "conversations": turns})
                            for n in ("grayscale", "grayscale2", "rgba", "palette")))
  args = ["--json", str(data), "--images", str(FIXTURES / "images"), "--tokenizer",
          str(TOKENIZER), "--processor", str(keeps), "--out", str(tmp_path / "out"), "--workers",
          "1", "--eval", "1", "--max_skipped_fraction", "1"]
  convert.main(args)  # skipped; the eval split may then be empty (refused): the lines are the same
  err = capsys.readouterr().err
  fix = ("where the processor keeps an image's bands (\"do_convert_rgb\": false) and reads only "
         "grayscale (L) and RGB images; convert it to RGB or grayscale (L), as the model reads, "
         "any transparency onto white as a converting processor does (e.g. with Pillow: im = "
         "Image.open(path).convert(\"RGBA\"); Image.alpha_composite(Image.new(\"RGBA\", "
         "im.size, \"white\"), im).convert(\"RGB\").save(new_path); .convert(\"L\") for "
         "grayscale), or give a processor that converts it (\"do_convert_rgb\": true in its "
         "preprocessor_config.json).")
  for k, (name, kind) in enumerate([("rgba", "an RGBA image (with transparency)"),
                                    ("palette", "a palette (P) image")], 2):
    assert (f"skipped: {data}: record {k} (id {name!r}): image {FIXTURES / 'images' / f'{name}.png'} is "
            f"{kind}, {fix}") in err, err
  assert "cannot be read" not in err and "unsupported image 2 ('rgba', 'palette')" in err, err


def test_fail_policy_stops_at_the_first_bad_record_and_writes_nothing(source, tmp_path, capsys):
  out = tmp_path / "out"
  assert convert.main(_args(source, out, "--on_error", "fail", "--workers", "1")) == 2
  last = capsys.readouterr().err.strip().splitlines()[-1]
  assert last.startswith("tools.convert: error: ") and "(id 'gone')" in last and "nowhere.png" in last
  assert not out.exists()


def test_an_existing_conversion_is_refused(converted, source, capsys):
  assert convert.main(_args(source, converted)) == 2
  assert "holds a conversion already" in capsys.readouterr().err


def _train_config(converted, workdir):
  cfg = tiny_config(str(converted), vision=(0, 2, 1), language=(2, 2, 1))
  d, v = cfg.data, cfg.model.vision
  d.task, d.image_token, d.seq_len, v.max_images = "conversations", 5, 170, 3
  d.global_batch, d.microbatches = 8, 2
  v.image_size, v.channels = 20, 3
  cfg.model.language.vocab_size = 300
  cfg.eval.samples, cfg.eval.batch = 2, 2
  cfg.train.steps, cfg.run.workdir, cfg.run.log_every = 3, str(workdir), 1
  return cfg


@pytest.fixture(scope="module")
def plain_run(converted, tmp_path_factory) -> list[dict]:
  """The records of a run on the converted data in one process (vision dp=2, language dp=2)."""
  return train.run(_train_config(converted, tmp_path_factory.mktemp("plain") / "run"))


@pytest.mark.parametrize("layout", ["plain", "packed", "dynamic"])
def test_a_run_trains_on_converted_conversations(converted, plain_run, tmp_path, layout):
  cfg = _train_config(converted, tmp_path / "run")
  d = cfg.data
  if layout == "packed":  # packing, cost-balanced ranks and slot and row buckets
    d.pack_rows, d.reorder, d.slot_buckets, d.row_buckets = 4, "balance", 2, 2
  if layout == "dynamic":  # images packed into slots of patches
    cfg.model.vision.slot_patches, cfg.model.vision.image_slots = 50, 8
  records = plain_run if layout == "plain" else train.run(cfg)
  losses = [r["loss"] for r in records if "loss" in r]
  assert len(losses) == 3 and all(np.isfinite(losses))
  assert all(r["images"] > 0 for r in records if "images" in r)
  assert np.isfinite([r["eval_loss"] for r in records if "eval_loss" in r]).all()


def test_a_run_that_disagrees_with_the_manifest_is_refused(converted, tmp_path):
  cfg = _train_config(converted, tmp_path / "run")
  cfg.data.image_token = 7
  with pytest.raises(ConfigError, match="set data.image_token=5"):
    train.run(cfg)
  assert not (tmp_path / "run").exists()


def test_two_processes_read_only_their_records_and_match_one(converted, plain_run, tmp_path):
  """Scalable reads on converted data: vision on process 0, the language model on process 1;
  the losses are the one-process run's (the plain run: language dp=2 as here), and process 0
  reads only the samples with images."""
  layout = "vision=0/4/1,language=4/2/2"
  sets = ["--config.data.task=conversations", f"--config.data.dir={converted}",
          "--config.data.image_token=5", "--config.data.seq_len=170",
          "--config.model.vision.max_images=3", "--config.data.global_batch=8",
          "--config.model.vision.image_size=20",
          "--config.model.vision.channels=3", "--config.model.language.vocab_size=300",
          "--config.eval.samples=4", "--config.eval.batch=4", "--config.train.steps=3",
          "--config.run.log_every=1"]
  proc = subprocess.run(
      [sys.executable, "-m", "tools.launch_local", "-n", "2", "--devices_per_process", "4", "--",
       f"--config=tests/configs/tiny.py:{layout}", f"--config.run.workdir={tmp_path / 'two'}",
       *sets], cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True,
      text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout[-3000:]
  lines = (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()
  two = [r for r in map(json.loads, lines) if "loss" in r]
  one = [r for r in plain_run if "loss" in r]
  assert [r["step"] for r in two] == [r["step"] for r in one] == [1, 2, 3]
  np.testing.assert_allclose([r["loss"] for r in two], [r["loss"] for r in one], rtol=1e-4)
  assert sum(r["records_read"] for r in two) < sum(r["records_read"] for r in one)


def test_a_cut_image_is_corrupt_and_one_pillow_cannot_identify_unrecognised(source, monkeypatch):
  """Skips name their reason: a file whose pixels are cut off is corrupt; one that no Pillow
  reader takes may be whole (a float64 TIFF), so it is named unrecognised, with the fix."""
  folder = source / "images"
  whole = (folder / "portrait.png").read_bytes()
  cut = folder.parent / "cut" / "cut.png"
  cut.parent.mkdir(exist_ok=True)
  cut.write_bytes(whole[:len(whole) // 2])
  for key, value in (("images", cut.parent), ("root", os.path.realpath(cut.parent)),
                     ("proc", ImageProcessor.open(PROCESSOR)),
                     ("opts", argparse.Namespace(allow_outside_images=False))):
    monkeypatch.setitem(conversion_record.WORKER, key, value)
  with pytest.raises(RecordError) as e:
    conversion_record._read_image("cut.png", "record 1")  # pylint: disable=protected-access
  assert e.value.reason == "corrupt image"
  assert str(e.value).endswith(f"image {cut} cannot be read (image file is truncated).")
  shutil.copy(folder / "broken.png", cut.parent)
  with pytest.raises(RecordError) as e:
    conversion_record._read_image("broken.png", "record 2")  # pylint: disable=protected-access
  assert e.value.reason == "unrecognised image" and str(e.value).endswith("save it as PNG or JPEG.")
