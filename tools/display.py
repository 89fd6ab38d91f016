"""What the tools print for a person to read: counts with their noun's number, and a model's text
with the control characters that would act on a terminal escaped (files get the text as it is)."""

from __future__ import annotations

import unicodedata

from mimo_jax.words import count  # noqa: F401  (the tools count through display)

_KEPT = "\n\t"  # an answer's own lines and tabs stay as they are




def printable(text: str) -> str:
  """`text` with each control character but newline and tab written as its escape (`\\x1b`,
  `\\r`, `\\x85`), and each format character (`\\u202e`, `\\u200b`): a random or untrained
  model's tokens would otherwise move the cursor, clear the screen, ring the bell or reverse the
  line where its answer is printed."""
  return "".join(c if c in _KEPT or unicodedata.category(c) not in ("Cc", "Cf")
                  else c.encode("unicode_escape").decode("ascii") for c in text)
