"""The training eval's `eval.generate`: the first eval samples answered and scored at each eval,
logged beside eval_loss, with the scores tools.eval gives the same step; the digits task names its
digits through the same answers program."""

import json

import numpy as np
import pytest

from mimo_jax import evaluate, scoring, train
from mimo_jax.batch import Samples, Text
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
  shard = loader.open_shard(str(converted / "eval.array_record"))
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


def test_the_digits_are_named_right_from_the_answers():
  """Per-digit accuracy of a batch: each sample's first items_b answer tokens against its targets
  after the ':' at answer_b; empty rows count nothing."""
  targets = np.asarray([[9, 9, 3, 4, 9], [9, 5, 6, 7, 9], [0, 0, 0, 0, 0]])
  text = Text(tokens_rl=targets, targets_rl=targets, loss_mask_rl=targets, positions_rl=targets,
              segment_ids_rl=targets, token_sample_rl=targets, rows_sent=np.int32(3))
  samples = Samples(ids_b=np.asarray([0, 1, -1]), answer_b=np.asarray([2, 1, 0]),
                    items_b=np.asarray([2, 3, 0]), tokens_b=np.asarray([5, 5, 0]))
  batch = evaluate.Batch(text=text, samples=samples, slots={}, stats=None)
  answers = np.asarray([[3, 0, 0], [5, 6, 1], [0, 0, 0]])
  assert evaluate.digits_named(batch, answers) == (3, 5)
