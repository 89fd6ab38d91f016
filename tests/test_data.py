"""Bad data files are one clear error naming the file and the record."""

import os

import pytest
from array_record.python import array_record_module

from mimo_jax.data import digits, loader
from tests.helpers import tiny_config


def _write(path, records):
  writer = array_record_module.ArrayRecordWriter(str(path), "group_size:1")
  for r in records:
    writer.write(r)
  writer.close()


def test_corrupt_record_names_file_and_index(tmp_path, data_dir):
  good = b'{"id": 0, "images": [], "text": "after one : two"}'
  path = tmp_path / "bad.array_record"
  _write(path, [good, good, b"\x00not json", good])
  ds = loader._source(str(path))  # pylint: disable=protected-access
  assert ds[1][1]["text"] == "after one : two"
  with pytest.raises(ValueError, match=rf"{path}: record 2 is not a valid digits sample"):
    ds[2]


def test_empty_file_is_an_error(tmp_path):
  path = tmp_path / "empty.array_record"
  _write(path, [])
  with pytest.raises(ValueError, match=r"holds no samples"):
    loader._source(str(path))  # pylint: disable=protected-access


def test_build_is_cached_and_keyed_by_parameters(data_dir):
  cfg = tiny_config(data_dir)
  first = loader.build_paths(cfg)
  mtime = {k: os.path.getmtime(v) for k, v in first.items()}
  assert loader.build_paths(cfg) == first  # second call reuses the files
  assert {k: os.path.getmtime(v) for k, v in first.items()} == mtime
  other = digits.build(data_dir, 1000, 200, cfg.data.probs())
  assert other["train"] != first["train"]


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
