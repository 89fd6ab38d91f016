"""Counts in words for the lines a person reads: a noun in its number."""

from __future__ import annotations


def noun(n: int, singular: str, plural: str = "") -> str:
  """`singular` for 1, else `plural` (default singular + "s")."""
  return singular if n == 1 else plural or singular + "s"


def count(n: int, singular: str, plural: str = "") -> str:
  """`n` and its noun: "1 prompt", "2 prompts" (`plural` where it is not singular + "s")."""
  return f"{n} {noun(n, singular, plural)}"


def json_kind(value) -> str:
  """What a JSON value is, with its article, in JSON's words: "an integer", "a string", "null"."""
  kinds = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
           list: "a list", dict: "an object", type(None): "null"}
  return kinds.get(type(value), f"a {type(value).__name__}")


def amount(n: int) -> str:
  """A count of things at a glance: "96", "20.5 K", "301.2 M", "1.10 B"."""
  for scale, unit, digits in ((1e9, "B", 2), (1e6, "M", 1), (1e3, "K", 1)):
    if n >= scale:
      return f"{n / scale:.{digits}f} {unit}"
  return str(n)
