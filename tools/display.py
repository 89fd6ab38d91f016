"""What the tools print for a person to read: counts with their noun's number, and a model's text
with the control characters that would act on a terminal escaped (files get the text as it is)."""

from __future__ import annotations

import sys
import time
import unicodedata

from mimo_jax.words import count  # noqa: F401  (the tools count through display)

_KEPT = "\n\t"  # an answer's own lines and tabs stay as they are


class Decoding:
  """A line on stderr every `every` seconds of decoding (new tokens so far, of the most asked
  for, and their rate), said as `tool`: a long answer is not a silent wait."""

  def __init__(self, tool: str, every: float):
    self.tool, self.every = tool, every
    self.start = self.last = time.monotonic()

  def __call__(self, decoded: int, steps: int) -> None:
    now = time.monotonic()
    if now - self.last < self.every or decoded >= steps:
      return
    self.last = now
    print(f"{self.tool}: {decoded:,} of up to {steps:,} new tokens decoded "
          f"({decoded / (now - self.start):,.0f} a second)", file=sys.stderr, flush=True)




def printable(text: str) -> str:
  """`text` with each control character but newline and tab written as its escape (`\\x1b`,
  `\\r`, `\\x85`), and each format character (`\\u202e`, `\\u200b`): a random or untrained
  model's tokens would otherwise move the cursor, clear the screen, ring the bell or reverse the
  line where its answer is printed."""
  return "".join(c if c in _KEPT or unicodedata.category(c) not in ("Cc", "Cf")
                  else c.encode("unicode_escape").decode("ascii") for c in text)
