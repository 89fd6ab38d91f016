"""A sample's text as the language model reads it: its token sequence, each item's placeholder
expanded to that item's tokens, and the loss mask of its targets (`sample_tokens`); and the token
ids a task's samples are written with besides their own (`Vocabulary`).
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import numpy as np


class Vocabulary(Protocol):
  """A task's token ids that the layout writes: `pad` after a row's samples, `bos` and `eos`
  around a sample without its own loss mask. A sample given as text (`text`: the digits task's
  words, data/tokenizer.py) also needs `encode(text)` and the id of the ':' before its answer
  (`colon`)."""
  pad: int
  bos: int
  eos: int


@dataclasses.dataclass(frozen=True)
class TokenIds:
  """A `Vocabulary` of ids alone, for samples of token ids; bos and eos are -1 where every sample
  has its own loss mask (converted data, whose chat template wrote them)."""
  pad: int
  bos: int = -1
  eos: int = -1


def sample_tokens(tok: Vocabulary | None, sample: dict, item_tokens: dict[int, list[int]],
                  nouns: dict[int, str] | None = None) -> tuple[list[int], np.ndarray]:
  """The sample's token sequence, its i-th placeholder of each encoder expanded to that item's
  tokens (`item_tokens` maps placeholder id -> tokens per item, `nouns` placeholder id -> what an
  item is called, for errors), and the loss mask of its targets (float32, one per position but
  the last: 1 where the next token carries loss).

  Three forms: a digits sample (`text`) and a sample of token ids (`tokens`, items first, as
  data/synthetic.py writes) get bos and eos around them and loss on the targets after ':' or after
  the last placeholder (or bos); a sample with its own `loss_mask` (one 0/1 per token of `tokens`:
  1 = the token is a target) is taken as it is, with loss on those tokens (never on an item's), and
  needs nothing of `tok`."""
  own = "loss_mask" in sample
  if not own and (tok is None or tok.bos < 0):
    raise ValueError("it has no loss_mask of its own, and its task's vocabulary no bos and eos "
                     "to put around it.")
  ids = tok.encode(sample["text"]) if "text" in sample else list(sample["tokens"])
  if own and len(sample["loss_mask"]) != len(ids):
    raise ValueError(f"its loss_mask has {len(sample['loss_mask'])} entries for {len(ids)} "
                     "tokens.")
  for mark, counts in item_tokens.items():
    if ids.count(mark) != len(counts):
      noun = (nouns or {}).get(mark, "item")
      raise ValueError(f"its text has {ids.count(mark)} {noun} placeholders (token {mark}) but it "
                       f"has {len(counts)} {noun}s.")
  words, items = ([] if own else [tok.bos]), {mark: iter(counts) for mark, counts in
                                              item_tokens.items()}
  marks = []  # with its own mask: the loss of each word as a target (none on an item's tokens)
  for i, w in enumerate(ids):
    n = next(items[w]) if w in items else 1
    words.extend([w] * n)
    if own:
      marks.extend([0.0] * n if w in items else [float(sample["loss_mask"][i])])
  if own:
    return words, np.asarray(marks[1:], np.float32)
  words.append(tok.eos)
  loss = np.zeros(len(words) - 1, np.float32)
  start = words.index(tok.colon) if "text" in sample else sum(sum(c) for c in item_tokens.values())
  loss[start:] = 1.0
  return words, loss


def text_length(sample: dict, tok: Vocabulary | None, placeholders: tuple[int, ...]) -> int:
  """Tokens of a sample other than its placeholders (bos and eos included)."""
  ids = tok.encode(sample["text"]) if "text" in sample else sample["tokens"]
  return 2 * ("loss_mask" not in sample) + sum(1 for w in ids if w not in placeholders)
