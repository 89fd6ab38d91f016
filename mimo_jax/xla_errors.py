"""XLA's errors that a user can act on, told from the others by their words."""

from __future__ import annotations

import re

import jax


def out_of_memory(e: BaseException | None) -> str | None:
  """XLA's sentence where `e`, or an exception it came from, is a device's memory running out
  (the allocation that failed, without its allocator's tags and the buffer listing after it);
  None for anything else."""
  seen = set()
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    if isinstance(e, jax.errors.JaxRuntimeError):
      for line in str(e).splitlines():
        if "RESOURCE_EXHAUSTED" in line and re.search(r"memory|allocat", line, re.IGNORECASE):
          line = re.sub(r"\s*\[[\w-]+='[^']*'\]| with allocator \S+", "", line)  # XLA's tags
          return line.split("RESOURCE_EXHAUSTED:", 1)[-1].strip().rstrip(".")
    e = e.__cause__ or e.__context__
  return None


def device_ordinal(text: str) -> int | None:
  """The local device an out-of-memory sentence names ("on device 0", "device ordinal 0")."""
  found = re.search(r"device (?:ordinal )?(\d+)", text)
  return int(found.group(1)) if found else None


def sentence(e: BaseException) -> str:
  """An error in one line: XLA's out-of-memory sentence, else the error's first line (XLA lists
  buffers and more after it)."""
  return out_of_memory(e) or (str(e).splitlines() or [""])[0]
