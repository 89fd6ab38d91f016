"""An eval set as prompts and references, and its generated answers scored: what `tools.eval` and
the training eval's generated answers (`eval.generate`, the digits tasks' accuracy) share.

A sample's prompt is its conversation before its last assistant turn (the tokens before the last
run of its loss mask), its reference that turn's text (or a record's own list of answers). For
the layout it becomes a sample of the prompt and the answer's first token as its one target, so
that `Samples.answer_b` is the prompt's last token, after which evaluate.Evaluator.answers
decodes; the encoders' items stay as they are, whichever encoders there are.
"""

from __future__ import annotations

import dataclasses
import pathlib

import numpy as np

from mimo_jax import encoders, scoring
from mimo_jax.config import Config, ConfigError
from mimo_jax.data import conversations, loader
from mimo_jax.data.chat import ChatTokenizer

DIGIT_TASKS = ("digits", "av_digits")  # built-in tasks whose answers name their items' digits


def split_answer(ids: np.ndarray, mask: np.ndarray, where: str) -> tuple[list[int], list[int]]:
  """(prompt ids, answer ids): the last run of loss-carrying tokens is the answer."""
  on = np.flatnonzero(mask)
  if not on.size:
    raise ConfigError(f"{where}: no assistant turn and no \"answers\": nothing to compare an "
                      "answer with; give each record a reference.")
  end = int(on[-1]) + 1
  start = end
  while start > 0 and mask[start - 1]:
    start -= 1
  return [int(i) for i in ids[:start]], [int(i) for i in ids[start:end]]


def eval_sample(prompt: list[int], answer: list[int], items: dict) -> dict:
  """The layout's sample: the prompt and the answer's first token as its one target."""
  return {**items, "tokens": prompt + answer[:1], "loss_mask": [0] * len(prompt) + [1]}


def converted(path: str, tok: ChatTokenizer, count: int = 0,
              task: str = "conversations") -> list[dict]:
  """The first `count` (0: all) samples of a converted shard: `id` (the LLaVA record's id, as
  the converter kept it; None in older conversions), `position` (the sample's index in the
  shard: records may share an id), `sample`, `prompt_ids`, `references`."""
  source = loader.open_shard(str(path), task)  # `task`: whose fix a damaged shard names
  out = []
  for i in range(min(count, len(source)) if count else len(source)):
    data = source[i]
    record = conversations.decode(data, str(path), i)
    prompt, answer = split_answer(record["tokens"], record["loss_mask"], f"{path}: record {i}")
    items = {k: v for k, v in record.items() if k not in ("tokens", "loss_mask")}
    out.append({"id": conversations.record_id(data, str(path), i), "position": i,
                "sample": eval_sample(prompt, answer, items), "prompt_ids": prompt,
                "references": [tok.tokenizer.decode(answer, skip_special_tokens=True).strip()]})
  return out


def named(s: dict) -> str:
  """How an error names sample `s`: its id, and its position in a converted shard."""
  where = f" (position {s['position']} of the split)" if "position" in s else ""
  return f"sample {s['id']!r}{where}"


def layout_for(cfg: Config, dp: int, bsz: int, samples: list[dict]) -> loader.Layout:
  """The eval batches' layout: the run's, with slots for `bsz` samples of the most items of any
  sample here (a run trained on one image a sample may be asked about three)."""
  base = loader.make_layout(cfg, dp, eval_batch=bsz)
  fitted = []
  for e in base.encoders:
    most = max((len(e.items(s["sample"])) for s in samples), default=0)
    fitted.append(dataclasses.replace(e, slots=max(e.slots, bsz * most)))
  return dataclasses.replace(base, encoders=tuple(fitted))


def check_lengths(layout: loader.Layout, samples: list[dict], flag: str) -> None:
  """An error naming the first sample whose prompt, its items expanded, exceeds the rows'
  positions (before anything is written)."""
  for s in samples:
    sample = s["sample"]
    n = len(sample["tokens"]) - 1 + sum(
        e.item_tokens(size, s["id"]) - 1 for e in layout.encoders for size in e.sizes(sample))
    if n > layout.seq_len:
      raise ConfigError(f"{named(s)} needs {n} positions, more than the eval rows' "
                        f"{layout.seq_len}; give {flag} {n} or more.")


def batch_size(cfg: Config, dp: int, asked: int = 0) -> int:
  """`asked` (default eval.batch) rounded up to a multiple of the language dp ranks."""
  return -(-(asked or cfg.eval.batch) // dp) * dp


def batches(samples: list[dict], layout: loader.Layout, bsz: int, where: str) -> list:
  """The samples laid out `bsz` at a time (ids: their positions in `samples`); the last batch
  padded with empty rows."""
  out = []
  for start in range(0, len(samples), bsz):
    chunk = [s["sample"] for s in samples[start:start + bsz]]
    ids = list(range(start, start + len(chunk))) + [-1] * (bsz - len(chunk))
    try:
      out.append(loader.layout_microbatch(chunk + [None] * (bsz - len(chunk)), ids, layout,
                                          conversations.VOCABULARY))
    except ValueError as e:
      raise ConfigError(f"{where}: {e}") from None
  return out


def eos_id(tok: ChatTokenizer) -> int | None:
  text = tok.specials.get("eos_token")
  return tok.token_id(text) if text else None


def item_count(layout: loader.Layout, s: dict) -> int:
  """Sample `s`'s items (images, clips) of every encoder."""
  return sum(len(e.items(s["sample"])) for e in layout.encoders)


def scored(samples: list[dict], answers: list, tok: ChatTokenizer, metrics: list[str],
           layout: loader.Layout) -> list:
  """One row a sample: `id`, `position` (a converted shard's samples), `prompt`, `reference` (one,
  or the list), `prediction` (the answer's text before its end token), `at_limit` (no end token
  came: the answer is cut at the new tokens asked for) and `score` by metric (None: a per-item
  metric of a sample without items)."""
  eos, rows = eos_id(tok), []
  for s, answer in zip(samples, answers):
    answer = [int(t) for t in answer]
    at_limit = eos not in answer
    answer = answer[:answer.index(eos)] if eos in answer else answer
    prediction = tok.tokenizer.decode(answer, skip_special_tokens=True).strip()
    refs, items = s["references"], item_count(layout, s)
    rows.append({"id": s["id"], **({"position": s["position"]} if "position" in s else {}),
                 "prompt": tok.tokenizer.decode(s["prompt_ids"], skip_special_tokens=False),
                 "reference": refs[0] if len(refs) == 1 else refs, "prediction": prediction,
                 "at_limit": at_limit,
                 "score": {m: scoring.score(m, prediction, refs, items) for m in metrics}})
  return rows


class Generated:
  """Eval samples answered greedily at each eval and scored by a metric: the first `count` of
  `path`, answered up to `steps` tokens, logged as `names` (the metric's figure, what it counts)."""

  def __init__(self, cfg: Config, path: str, dp: int, count: int, metric: str, steps: int,
               names: tuple[str, str]):
    m = conversations.manifest(str(pathlib.Path(path).parent))
    self.tok = ChatTokenizer.open(conversations.source_path(str(pathlib.Path(path).parent),
                                                            m["tokenizer"]))
    self.metric, self.steps, self.names = metric, steps, names
    self.samples = converted(path, self.tok, count, cfg.data.task)
    bsz = batch_size(cfg, dp)
    self.layout = layout_for(cfg, dp, bsz, self.samples)
    self.batches = batches(self.samples, self.layout, bsz, f"{names[0]}: {path}")

  def __call__(self, evaluator, state, stop=None) -> dict | None:
    got = evaluator.answers(state, self.batches, self.steps, eos_id(self.tok), stop=stop)
    if got is None:
      return None
    rows = scored(self.samples, [got[i] for i in range(len(self.samples))], self.tok,
                  [self.metric], self.layout)
    value, counted = scoring.figure(self.metric, [r["score"][self.metric] for r in rows],
                                    [item_count(self.layout, s) for s in self.samples])
    return {self.names[0]: value, self.names[1]: counted}


def generated(cfg: Config, path: str, dp: int) -> list[Generated]:
  """What a run's eval answers besides its loss: on the digits tasks every eval sample, their
  per-digit accuracy (`eval_accuracy` over `eval_digits`); `eval.generate`'s samples scored by
  `eval.metric` (`eval_<metric>` over `eval_generated` samples)."""
  out = []
  if cfg.data.task in DIGIT_TASKS:  # an answer names the items: as many words as the most items
    out.append(Generated(cfg, path, dp, cfg.eval.samples, "digit_accuracy",
                         encoders.max_items(cfg), ("eval_accuracy", "eval_digits")))
  if cfg.eval.generate:
    out.append(Generated(cfg, path, dp, cfg.eval.generate, cfg.eval.metric,
                         cfg.eval.max_new_tokens, (f"eval_{cfg.eval.metric}", "eval_generated")))
  return out
