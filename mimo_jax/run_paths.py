"""The paths a run's config names (data.dir, every init_from, checkpoint.base), readable from any
working directory: a checkpoint stores its config with them absolute (`absolute`); the relative
ones of runs saved before that are looked for where the run was launched from (`launch_dir`), in
its workdir, then in the current directory (`bases`, `resolve`, `resolve_spec`)."""

from __future__ import annotations

import copy
import os
import pathlib

from mimo_jax.config import Config, split_spec


def cache_dir(name: str) -> str:
  """Where mimo_jax keeps what it makes once and reuses (the built-in tasks' data, compiled
  programs): $XDG_CACHE_HOME/mimo_jax/NAME, else ~/.cache/mimo_jax/NAME."""
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "mimo_jax", name)


def _split_spec(spec: str) -> tuple[str, str]:
  """An init_from `PATH[:STEP]` as (PATH, ":STEP" or "")."""
  path, step = split_spec(spec)
  return path, "" if step is None else f":{step}"


def absolute(cfg: Config) -> Config:
  """A copy of `cfg` with data.dir, checkpoint.base and every init_from (`PATH[:STEP]`) made
  absolute against the current directory, and each `lora.init_from`; "" stays "" (each field's
  default)."""
  out = copy.deepcopy(cfg)
  full = lambda p: os.path.abspath(os.path.expanduser(p)) if p else p
  out.data.dir, out.checkpoint.base = full(out.data.dir), full(out.checkpoint.base)
  for section in (out.model, *(out.model.module(n) for n in out.topology.modules())):
    if hasattr(section, "init_from"):  # an encoder's config may have none
      path, step = _split_spec(section.init_from)
      section.init_from = full(path) + step
    if getattr(section, "lora", None) is not None:  # a PEFT adapter directory
      section.lora.init_from = full(section.lora.init_from)
  return out


def launch_dir(workdir: str, cfg: Config) -> pathlib.Path | None:
  """The directory the run was launched from, where its run.workdir was relative: the given
  workdir's path without that relative tail (None where that cannot be told)."""
  rel = pathlib.PurePath(os.path.normpath(cfg.run.workdir)) if cfg.run.workdir else None
  given = pathlib.Path(os.path.abspath(workdir))
  if rel is None or rel.is_absolute() or ".." in rel.parts:
    return None
  n = len(rel.parts)
  return pathlib.Path(*given.parts[:-n]) if given.parts[-n:] == rel.parts else None


def bases(*dirs) -> list[pathlib.Path]:
  """Where a relative path of a record is looked for, in order, each once: `dirs` (None skipped),
  then the current directory."""
  out = []
  for d in [*dirs, pathlib.Path.cwd()]:
    if d is not None and pathlib.Path(d).resolve() not in [b.resolve() for b in out]:
      out.append(pathlib.Path(d))
  return out


def resolve(path: str, wanted: str, where: list[pathlib.Path]) -> str:
  """A record's directory `path` holding the file `wanted` (or, with "", existing): itself if
  absolute, else the first of `where`/path that does ("" if none does)."""
  if not path:
    return ""
  p = pathlib.Path(os.path.expanduser(path))
  for candidate in [p] if p.is_absolute() else [b / p for b in where]:
    if (candidate / wanted).is_file() if wanted else candidate.is_dir():
      return str(candidate)
  return ""


def resolve_spec(spec: str, where: list[pathlib.Path]) -> str:
  """An init_from `PATH[:STEP]` with a relative PATH made the first existing one of `where`/PATH
  (as it was where none exists)."""
  path, step = _split_spec(spec)
  found = resolve(path, "", where)
  return str(pathlib.Path(found).absolute()) + step if found else spec
