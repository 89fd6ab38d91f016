"""The training eval's `eval.generate`: the first eval samples answered and scored at each eval,
logged beside eval_loss, with the scores tools.eval gives the same step; the digits tasks' accuracy
is such a score."""

import json
import pathlib
import struct

import numpy as np
import pytest

from mimo_jax import scoring, train
from mimo_jax.config import ConfigError
from mimo_jax.data import conversations, loader
from mimo_jax.validation import validate
from tests.helpers import tiny_config
from tests.test_conversations import _train_config, converted, source  # noqa: F401  (fixtures)
from tools import eval as eval_tool


@pytest.fixture
def answer_length():
  """A metric that tells answers apart: their length in characters / 100."""
  scoring.register("answer_length")(lambda prediction, references: len(prediction) / 100)
  yield "answer_length"
  scoring.METRICS.pop("answer_length")


def test_generated_answers_are_scored_at_each_eval_as_tools_eval_scores_them(converted, tmp_path,
                                                                             answer_length):
  cfg = _train_config(converted, tmp_path / "run")
  cfg.train.steps, cfg.eval.every = 2, 1
  cfg.eval.samples, cfg.eval.generate, cfg.eval.metric, cfg.eval.max_new_tokens = 4, 3, "contains", 3
  cfg.eval.metric = answer_length
  records = train.run(cfg)
  evals = [r for r in records if "eval_loss" in r]
  assert [r["step"] for r in evals] == [1, 2]
  assert all(r["eval_generated"] == 3 and r["eval_answer_length"] > 0 for r in evals)
  logged = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  assert [r["eval_answer_length"] for r in logged if "eval_loss" in r] == \
      [r["eval_answer_length"] for r in evals]
  assert eval_tool.main([str(tmp_path / "run"), "--data", str(converted), "--samples", "3",
                         "--metric", answer_length, "--max_new_tokens", "3", "--out",
                         str(tmp_path / "preds.jsonl")]) == 0
  rows = [json.loads(x) for x in (tmp_path / "preds.jsonl").read_text().splitlines()]
  assert len(rows) == 3 and all(r["reference"] for r in rows)
  # Each row names its record by the id the converter kept, and its place in the split.
  shard = loader.open_shard(str(converted / "eval.array_record"), "conversations")
  assert [(r["id"], r["position"]) for r in rows] == [
      (conversations.record_id(shard[i], "eval", i), i) for i in range(3)]
  assert all(isinstance(r["id"], str) and "-" in r["id"] for r in rows), rows
  assert np.mean([r["score"][answer_length] for r in rows]) == \
      pytest.approx(evals[-1]["eval_answer_length"])


@pytest.mark.parametrize("field,value,needle", [
    ("generate", 5, "eval.generate"), ("metric", "bleu", "eval.metric"),
    ("max_new_tokens", 0, "eval.max_new_tokens")])
def test_bad_eval_generation_fields_are_refused(field, value, needle, tmp_path):
  cfg = tiny_config(str(tmp_path))
  cfg.eval.samples = 4
  setattr(cfg.eval, field, value)
  with pytest.raises(ConfigError, match=needle):
    validate(cfg)


def test_eval_generate_needs_a_task_with_text(tmp_path):
  cfg = tiny_config(str(tmp_path))
  cfg.eval.generate = 4
  validate(cfg)  # the digits tasks' answers are text
  cfg.data.task, cfg.model.language.vocab_size = "synthetic", 64
  with pytest.raises(ConfigError, match="eval.generate: answers are scored as text, which "
                     "data.task=synthetic has none of"):
    validate(cfg)


def _scalars(tb: pathlib.Path) -> dict[str, dict[int, float]]:
  """TensorBoard's scalars as the run's event files hold them: tag -> step -> value (records
  framed as TFRecords: length, its CRC, the Event proto, its CRC)."""
  from tensorboardX.proto import event_pb2  # pylint: disable=import-outside-toplevel
  out = {}
  for path in sorted(tb.glob("events*")):
    data, at = path.read_bytes(), 0
    while at < len(data):
      (n,) = struct.unpack("<Q", data[at:at + 8])
      event = event_pb2.Event.FromString(data[at + 12:at + 12 + n])
      at += 12 + n + 4
      for value in event.summary.value:
        out.setdefault(value.tag, {})[event.step] = value.simple_value
  return out


def test_the_digits_accuracy_is_a_generated_score_as_tools_eval_scores_it(data_dir, tmp_path,
                                                                          capsys):
  """The digits run's eval_accuracy (over eval_digits) and eval.generate's score, beside eval_loss
  in metrics.jsonl and TensorBoard; tools.eval on the run's data gives the same figures."""
  cfg = tiny_config(data_dir)
  cfg.run.workdir = str(tmp_path / "run")
  cfg.train.steps = 1
  cfg.eval.samples, cfg.eval.batch, cfg.eval.generate, cfg.eval.max_new_tokens = 16, 16, 16, 3
  records = train.run(cfg)
  evals = [r for r in records if "eval_loss" in r]
  assert [r["step"] for r in evals] == [1]
  keys = ("eval_loss", "eval_accuracy", "eval_digits", "eval_exact_match", "eval_generated")
  assert all(set(keys) <= set(r) and r["eval_generated"] == 16 for r in evals), evals
  assert 0 < evals[-1]["eval_digits"] and 0 <= evals[-1]["eval_accuracy"] <= 1
  logged = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  assert [r for r in logged if "eval_loss" in r] == evals
  scalars = _scalars(tmp_path / "run" / "tb")
  for k in keys:  # float32 in the event file
    assert scalars[k] == {r["step"]: float(np.float32(r[k])) for r in evals}, k

  data = pathlib.Path(loader.build_paths(cfg)["eval"]).parent
  assert eval_tool.main([cfg.run.workdir, "--data", str(data), "--samples", "16", "--metric",
                         "digit_accuracy", "--metric", "exact_match", "--max_new_tokens", "3",
                         "--out", str(tmp_path / "preds.jsonl")]) == 0
  summary = json.loads((tmp_path / "preds.summary.json").read_text())
  assert summary["digit_accuracy"] == pytest.approx(evals[-1]["eval_accuracy"])
  assert summary["exact_match"] == pytest.approx(evals[-1]["eval_exact_match"])
  rows = [json.loads(x) for x in (tmp_path / "preds.jsonl").read_text().splitlines()]
  named = [r for r in rows if r["score"]["digit_accuracy"] is not None]  # images: 1-3 digits
  assert sum(len(r["reference"].split()) for r in named) == evals[-1]["eval_digits"]
  assert f"16 samples of {data} at step 1" in capsys.readouterr().out
