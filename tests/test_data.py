"""Bad data files are one clear error naming the file and the record; the digits task goes through
the conversation path and gives its vocabulary's ids and loss."""

import os
import pathlib

import numpy as np
import pytest
from array_record.python import array_record_module

from mimo_jax.data import conversations, digits, loader
from mimo_jax.data.layout import sample_tokens
from mimo_jax.data.tokenizer import IMG, Tokenizer
from tests.helpers import tiny_config


def _write(path, records):
  writer = array_record_module.ArrayRecordWriter(str(path), "group_size:1")
  for r in records:
    writer.write(r)
  writer.close()


def test_corrupt_record_names_file_and_index(tmp_path):
  good = conversations.encode({"tokens": [1, 5, 8, 4, 9, 2], "loss_mask": [0, 0, 0, 0, 1, 1],
                               "images": []})
  path = tmp_path / "bad.array_record"
  _write(path, [good, good, b"\x00not json", good])
  ds = loader._source(str(path), "digits")  # pylint: disable=protected-access
  assert ds[1][1]["tokens"].tolist() == [1, 5, 8, 4, 9, 2]
  with pytest.raises(ValueError, match=rf"{path}: record 2 is not a valid conversation sample"):
    ds[2]


def test_empty_file_is_an_error(tmp_path):
  path = tmp_path / "empty.array_record"
  _write(path, [])
  with pytest.raises(ValueError, match=r"holds no samples"):
    loader._source(str(path), "digits")  # pylint: disable=protected-access


def test_build_is_cached_and_keyed_by_parameters(data_dir):
  cfg = tiny_config(data_dir)
  first = loader.build_paths(cfg)
  mtime = {k: os.path.getmtime(v) for k, v in first.items()}
  assert loader.build_paths(cfg) == first  # second call reuses the files
  assert {k: os.path.getmtime(v) for k, v in first.items()} == mtime
  other = digits.build(data_dir, 1000, 200, cfg.data.probs())
  assert pathlib.Path(first["train"]).parent != pathlib.Path(other)
  # A deleted (damaged) shard is built again.
  os.remove(first["train"])
  assert loader.build_paths(cfg) == first and os.path.exists(first["train"])


def test_digits_conversations_give_the_vocabulary_ids_and_loss(data_dir):
  """The digits records, written as LLaVA conversations and converted with the word-level
  tokenizer and its chat template, hold the token ids, loss and images of the task's own text
  form (`<img> <img> : seven two`, loss on the answer and <eos>), in the drawn order."""
  cfg = tiny_config(data_dir)
  d = cfg.data
  paths = loader.build_paths(cfg)
  tr_x, tr_y, ev_x, ev_y = digits.split_images()
  tok = Tokenizer()
  for split, x, y, n, seed in (("train", tr_x, tr_y, d.train_samples, 1),
                               ("eval", ev_x, ev_y, d.eval_samples, 2)):
    expected = digits.make_samples(x, y, n, d.probs(), seed)
    reader = array_record_module.ArrayRecordReader(paths[split])
    assert reader.num_records() == n
    for i in range(0, n, 7):
      got = conversations.decode(reader.read([i])[0], paths[split], i)
      want = expected[i]
      k = len(want["images"])
      ids, loss = sample_tokens(tok, want, {IMG: [1] * k})
      got_ids, got_loss = sample_tokens(tok, got, {IMG: [1] * k})
      assert got_ids == ids and got["tokens"].tolist() == ids, (split, i)
      np.testing.assert_array_equal(got_loss, loss)
      assert loss.sum() == len(want["text"].split(" : ")[1].split()) + 1  # answer and <eos>
      assert len(got["images"]) == k
      for image, raw in zip(got["images"], want["images"]):
        np.testing.assert_array_equal(image[..., 0], digits.pixels(raw))
        assert image.shape == (8, 8, 1)
  # The converted directory records its source and tokenizer.
  m = conversations.manifest(str(pathlib.Path(paths["train"]).parent))
  assert m["image_token"] == IMG and m["vocab_size"] == tok.vocab_size
  assert m["samples"] == {"train": d.train_samples, "eval": d.eval_samples}


def test_the_metrics_writer_does_not_import_torch(tmp_path):
  """tensorboardX imports torch when it is installed (seconds before a run's first step); the
  writer keeps it out, and leaves `import torch` working afterwards."""
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  fake = tmp_path / "site" / "torch"
  fake.mkdir(parents=True)
  (fake / "__init__.py").write_text("import os\nopen(os.environ['MARK'], 'a').write('x')\n")
  code = ("import sys\nfrom mimo_jax.metrics import MetricsWriter\n"
          f"w = MetricsWriter({str(tmp_path / 'run')!r}, 2, progress='lines')\n"
          "w.write({'step': 1, 'loss': 1.5})\nw.close()\n"
          "print('torch' in sys.modules)\nimport torch\nprint('torch' in sys.modules)\n")
  env = dict(os.environ, MARK=str(tmp_path / "imported"),
             PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), os.getcwd()]))
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120, check=True).stdout.split()
  assert out[-2:] == ["False", "True"]  # not imported by the writer; importable after it
  assert (tmp_path / "imported").read_text() == "x"  # once: by the explicit import
  assert (tmp_path / "run" / "metrics.jsonl").read_text().count('"loss"') == 1


def test_metrics_lines_stay_strict_json_with_non_finite_values(tmp_path):
  import json  # pylint: disable=import-outside-toplevel
  import pytest  # pylint: disable=import-outside-toplevel
  from mimo_jax.metrics import MetricsWriter, NonFiniteError  # pylint: disable=all
  writer = MetricsWriter(str(tmp_path), 10, progress="lines")
  with pytest.raises(NonFiniteError):
    writer.write({"step": 3, "loss": float("nan"), "grad_norm": float("inf")})
  writer.close()
  line = (tmp_path / "metrics.jsonl").read_text().splitlines()[-1]
  assert json.loads(line, parse_constant=lambda c: pytest.fail(f"non-strict JSON {c}")) == {
      "step": 3, "loss": "nan", "grad_norm": "inf"}
