"""A word-level tokenizer for the digits-captioning task."""

from __future__ import annotations

DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
SPECIALS = ("<pad>", "<bos>", "<eos>", "<img>")
WORDS = (":", "after", "before") + DIGIT_WORDS

PAD, BOS, EOS, IMG = range(4)


class Tokenizer:
  """Maps whitespace-separated words to ids; unknown words are an error, never silently mapped.
  The digits task's vocabulary as the layout reads it (data/layout.Vocabulary)."""

  def __init__(self) -> None:
    self.vocab = SPECIALS + WORDS
    self.pad, self.bos, self.eos = PAD, BOS, EOS
    self._ids = {w: i for i, w in enumerate(self.vocab)}
    self.colon = self._ids[":"]
    self.digit_ids = tuple(self._ids[w] for w in DIGIT_WORDS)

  @property
  def vocab_size(self) -> int:
    return len(self.vocab)

  def encode(self, text: str) -> list[int]:
    try:
      return [self._ids[w] for w in text.split()]
    except KeyError as e:
      raise ValueError(f"word {e.args[0]!r} is not in the digits vocabulary") from None

  def decode(self, ids: list[int]) -> str:
    return " ".join(self.vocab[i] for i in ids)
