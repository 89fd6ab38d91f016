"""Config against data, refused before anything is written: an eval split smaller than
eval.samples, an empty eval split (an older conversion with --eval 0), token ids the model's
vocabulary lacks, rows shorter than the longest converted sample and a built-in task pointed at
converted data each end in one `ConfigError` naming the field and a fix that applies."""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest
from array_record.python import array_record_module

from mimo_jax import eval_set, train
from mimo_jax.config import Config, ConfigError
from mimo_jax.data import conversations, conversion, conversion_record, loader, meta
from mimo_jax.validation import validate
from mimo_jax.validation_data import validate_data
from tests.configs import tiny

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
LAYOUT = "vision=0/2/1,language=2/2/1"
RECORDS = [r for k in range(2) for r in (
    {"id": f"text-{k}", "conversations": [{"from": "human", "value": "Hello."},
                                          {"from": "gpt", "value": "Hi."}]},
    {"id": f"image-{k}", "image": "portrait.png",
     "conversations": [{"from": "human", "value": "<image>\nWhat is it?"},
                       {"from": "gpt", "value": "Noise."}]})]


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict[int, pathlib.Path]:
  """The four records converted with --eval 2, and that conversion with its eval split emptied
  (as converters that allowed --eval 0 left it)."""
  root = tmp_path_factory.mktemp("validation")
  (root / "data.jsonl").write_text("\n".join(json.dumps(r) for r in RECORDS))
  out = {2: root / "eval2", 0: root / "eval0"}
  conversion.convert(root / "data.jsonl", out[2], conversion_record.Options(
      tokenizer=str(FIXTURES / "chat" / "llama3"), images=str(FIXTURES / "images"),
      processor=str(FIXTURES / "images" / "siglip")), eval_count=2, progress=False)
  shutil.copytree(out[2], out[0])
  shard = out[0] / "eval.array_record"
  array_record_module.ArrayRecordWriter(str(shard), "group_size:1").close()
  meta.save(str(shard), [])
  manifest = json.loads((out[0] / conversations.MANIFEST).read_text())
  manifest["samples"] = {"train": manifest["samples"]["train"], "eval": 0}
  (out[0] / conversations.MANIFEST).write_text(json.dumps(manifest))
  return out


def _flags(directory: pathlib.Path, workdir: pathlib.Path) -> list[str]:
  return [f"--config=tests/configs/tiny.py:{LAYOUT}", "--config.run.cpu_devices=4",
          "--config.data.task=conversations", f"--config.data.dir={directory}",
          "--config.data.image_token=5", "--config.data.seq_len=128",
          "--config.data.global_batch=8", "--config.model.vision.image_size=20",
          "--config.model.vision.channels=3", "--config.model.language.vocab_size=300",
          "--config.eval.batch=2", "--config.train.steps=2", f"--config.run.workdir={workdir}"]


def _config(directory: pathlib.Path, workdir: pathlib.Path) -> Config:
  """The config `_flags` gives, built in process."""
  cfg = tiny.get_config(LAYOUT)
  d, v = cfg.data, cfg.model.vision
  d.task, d.dir, d.image_token, d.seq_len, d.global_batch = "conversations", str(directory), 5, \
      128, 8
  v.image_size, v.channels = 20, 3
  cfg.model.language.vocab_size, cfg.eval.batch, cfg.eval.samples = 300, 2, 2
  cfg.train.steps, cfg.run.workdir, cfg.run.cpu_devices = 2, str(workdir), 4
  return cfg


def test_eval_samples_beyond_the_converted_split_is_one_line_and_writes_nothing(converted,
                                                                                tmp_path):
  workdir = tmp_path / "run"
  proc = subprocess.run([sys.executable, "-m", "mimo_jax.launch",
                         *_flags(converted[2], workdir), "--config.eval.samples=10"],
                        cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"),
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 2, proc.stderr[-3000:]
  lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
  assert lines == [f"mimo_jax: error: config.eval.samples: 10 but {converted[2]}/eval.array_record"
                   " holds 2 held-out samples; lower eval.samples to 2, or convert the data again "
                   "with --eval 10 or more."], proc.stderr[-3000:]
  assert not workdir.exists()  # no checkpoints/, no lock
  # data.eval_samples builds the built-in tasks' eval split only: converted data is not held to it.
  cfg = _config(converted[2], workdir)
  cfg.data.eval_samples = 1
  validate(cfg, 4)
  validate_data(cfg)


def test_an_empty_eval_split_names_the_conversion_that_fills_it(converted, tmp_path):
  workdir = tmp_path / "run"
  cfg = _config(converted[0], workdir)
  with pytest.raises(ConfigError, match=r"^config\.data\.dir: .*eval\.array_record holds no "
                     r"held-out samples \(converted with --eval 0\) and a run evaluates "
                     r"eval\.samples=2 of them; convert the data again with --eval 2 \(or more\)"):
    train.run(cfg)
  assert not workdir.exists()
  # Reached some other way, the loader says the same, not to delete the shard to rebuild it.
  with pytest.raises(ConfigError, match=r"holds no samples; convert the data again with `python "
                     r"-m tools\.convert` and --eval N"):
    loader.Records(str(converted[0] / "eval.array_record"), "conversations")


def _largest_id(path: pathlib.Path) -> int:
  reader = array_record_module.ArrayRecordReader(str(path))
  return max(int(conversations.decode(r, str(path), 0)["tokens"].max())
             for r in reader.read(list(range(reader.num_records()))))


def test_token_ids_past_the_vocabulary_are_refused_before_training(converted, tmp_path):
  """A manifest's vocab_size counts the tokenizer's tokens, which need not exceed its largest id
  (added tokens past a gap): the records' own ids, from the sidecars, decide."""
  directory = tmp_path / "data"
  shutil.copytree(converted[2], directory)
  manifest = json.loads((directory / conversations.MANIFEST).read_text())
  manifest["vocab_size"] = 64
  (directory / conversations.MANIFEST).write_text(json.dumps(manifest))
  top = max(_largest_id(directory / f"{s}.array_record") for s in conversations.SPLITS)
  assert top >= 64
  names = ("vision",)
  assert max(int(loader.Records(str(directory / f"{s}.array_record"), "conversations",
                                names).meta.max_token.max())
             for s in conversations.SPLITS) == top
  workdir = tmp_path / "run"
  cfg = _config(directory, workdir)
  cfg.model.language.vocab_size = 64
  validate(cfg, 4)
  conversations.paths(cfg)  # the manifest agrees: only the records tell
  with pytest.raises(ConfigError, match=rf"^config\.model\.language\.vocab_size: 64, but record "
                     rf"\d+ of .* holds token id {top}, which the model's embedding lacks .*; set "
                     rf"it to {top + 1} or more"):
    train.run(cfg)
  assert not workdir.exists()
  cfg.model.language.vocab_size = top + 1
  validate_data(cfg)


def test_a_sidecar_without_token_ids_still_loads(converted, tmp_path):
  """Sidecars written before `max_token` stay valid (no rescan of a large dataset)."""
  shard = tmp_path / "train.array_record"
  shutil.copy(converted[2] / "train.array_record", shard)
  with np.load(f"{converted[2]}/train.array_record.meta.npz") as z:
    arrays = {k: z[k] for k in z.files if k != "max_token"}
  np.savez(f"{shard}.meta.npz", **arrays)
  records = loader.Records(str(shard), "conversations")
  assert records.meta.max_token is None and records.meta[0].max_token == -1
  assert "max_token" not in np.load(f"{shard}.meta.npz").files  # not rebuilt


def test_an_unset_image_token_says_where_the_data_names_it(tmp_path):
  cfg = _config(tmp_path / "data", tmp_path / "run")
  cfg.data.image_token = -1
  with pytest.raises(ConfigError, match=r"^config\.data\.image_token: is not set; set the image "
                     r"token id that tools\.convert reports"):
    validate(cfg)


def test_fields_that_converted_data_decides_are_named_with_its_manifests_values(converted,
                                                                                 tmp_path):
  """Without the converter's launch line: a built-in task is refused converted data (it would
  build its own data in that folder), a missing vocabulary and rows shorter than the longest
  converted sample are refused with the manifest's values as the fix."""
  directory, workdir = converted[2], tmp_path / "run"
  manifest = json.loads((directory / conversations.MANIFEST).read_text())
  cfg = _config(directory, workdir)
  cfg.data.task = "digits"
  with pytest.raises(ConfigError, match=rf"^config\.data\.task: digits, but data\.dir {directory} "
                     r"holds converted data .*set --config\.data\.task=conversations"):
    validate_data(cfg)
  cfg = _config(directory, workdir)
  cfg.model.language.vocab_size = 0
  with pytest.raises(ConfigError, match=rf"needs a vocabulary \(> 0; 0 is the digits task's\), "
                     rf"e\.g\. "
                     rf"{manifest['vocab_size']}: its tokenizer's"):
    validate(cfg, 4)
  longest = manifest["longest"]
  cfg = _config(directory, workdir)
  cfg.model.vision.max_images, cfg.data.image_probs = 1, "0.5,0.5"  # rows that hold an image
  cfg.data.seq_len = longest - 1
  for check in (lambda: validate(cfg, 4), lambda: validate_data(cfg)):
    with pytest.raises(ConfigError, match=rf"^config\.data\.seq_len: {longest - 1}, but the "
                       rf"longest sample of {directory} takes {longest} positions .*use >= "
                       rf"{longest},"):
      check()
  cfg.data.seq_len = longest
  validate(cfg, 4)
  validate_data(cfg)
  cfg.model.vision.max_images = 0  # rows of text alone: the data's images would have no slot
  with pytest.raises(ConfigError, match=rf"^config\.model\.vision\.max_images: 0, but a sample "
                     rf"of {directory} holds 1 image \(its conversations\.json\); use >= 1:"):
    validate_data(cfg)
  assert not workdir.exists()


def test_a_shard_that_is_not_one_names_the_conversion_or_the_rebuild(converted, tmp_path,
                                                                      monkeypatch):
  """A truncated shard is one line naming the fix for its kind of data, also when the reader's
  exception has no message (its type is named then)."""
  shard = tmp_path / "train.array_record"
  data = (converted[2] / "train.array_record").read_bytes()
  shard.write_bytes(data[:len(data) // 2])
  with pytest.raises(loader.DataError, match=r"cannot be opened as a shard \(.+\); convert the "
                     r"data again with `python -m tools\.convert`, or check data\.dir\.$"):
    loader.Records(str(shard), "conversations")
  # The launch's eval reads a built-in task's eval shard: its fix is the rebuild.
  with pytest.raises(loader.DataError, match=r"as a shard \(.+\); delete it and run again"):
    eval_set.converted(str(shard), None, 2, "digits")

  def unreadable(paths):
    raise RuntimeError("")
  monkeypatch.setattr(loader.grain.sources, "ArrayRecordDataSource", unreadable)
  with pytest.raises(loader.DataError, match=r"as a shard \(RuntimeError\); delete it and run "
                     r"again to rebuild it"):
    loader.open_shard(str(shard), "digits")
  # A record that does not decode: converted data is converted again (tools.convert writes a
  # directory whole), a built-in task's shard and sidecar are rebuilt.
  garbage = lambda: b"\x00garbage"
  with pytest.raises(loader.DataError, match=r"record 3 cannot be read \(.+\); the shard is "
                     r"damaged: convert the data again with `python -m tools\.convert` into a "
                     rf"new --out \(or delete {tmp_path} first\)\.$"):
    loader.read_record(garbage, str(shard), 3, "conversations")
  with pytest.raises(loader.DataError, match=r"damaged: delete it and .+meta\.npz and run again"):
    loader.read_record(garbage, str(shard), 3, "digits")


def test_a_missing_or_garbage_sidecar_is_rebuilt_with_the_conversions_placeholders(converted,
                                                                                  tmp_path):
  """The sidecar of a converted shard, made again from its records, marks items with the
  manifest's image token (not the built-in tasks'): the same table as the converter's."""
  directory = tmp_path / "data"
  shutil.copytree(converted[2], directory)
  shard = str(directory / "train.array_record")
  want = loader.Records(shard, "conversations", ("vision",)).meta
  for damage in (lambda p: p.unlink(), lambda p: p.write_bytes(b"not a sidecar")):
    damage(pathlib.Path(meta.path_of(shard)))
    got = loader.Records(shard, "conversations", ("vision",)).meta
    np.testing.assert_array_equal(got.text_tokens, want.text_tokens)
    np.testing.assert_array_equal(got.loss_tokens, want.loss_tokens)
    assert [got[i].sizes for i in range(len(got.text_tokens))] == \
        [want[i].sizes for i in range(len(want.text_tokens))]

