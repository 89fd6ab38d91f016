"""The persistent compilation cache: compiled programs kept on disk, so that a restarted run (a
preempted job, a resume, a second run of the same config) loads its programs instead of
compiling them again.

jax keys an entry by a hash of the program, the jaxlib version, the backend and its version, the
XLA flags and the compile options, and the devices: a different jax, flag or device never reads
another's entry, so one directory serves every run. Within one multi-process run only process 0
writes (jax's rule); independent runs that share the directory at once are made safe by a size
bound, which makes jax take a file lock around every read and write (a reader never sees a
half-written entry) and evicts the least recently used entries past the bound. A size given in
the environment (JAX_COMPILATION_CACHE_MAX_SIZE) is kept: all writers of one directory should
agree, as a bounded writer reads an access-time file beside each entry, which an unbounded one
(-1) does not write, and fails to add its own entries (a warning, then a compile each time).
"""

from __future__ import annotations

import os
import warnings

import jax

from mimo_jax import run_paths
from mimo_jax.config import ConfigError

ENV = "MIMO_JAX_COMPILE_CACHE"  # overrides run.compile_cache ("" disables)
AUTO = "auto"
MAX_BYTES = 64 << 30  # past this, the least recently used entries go
MAX_SIZE_ENV = "JAX_COMPILATION_CACHE_MAX_SIZE"  # jax's own setting, kept where given


class CompileCacheError(ConfigError):
  """The cache directory cannot be created or written (a config error: exit status 2)."""


def default_dir() -> str:
  """$XDG_CACHE_HOME/mimo_jax/xla, else ~/.cache/mimo_jax/xla."""
  return run_paths.cache_dir("xla")


def resolve(field: str) -> str:
  """The directory that `run.compile_cache` (after $MIMO_JAX_COMPILE_CACHE) names; "" = off.

  `auto` keeps a directory already given to jax (JAX_COMPILATION_CACHE_DIR), else
  `default_dir()`."""
  value = os.environ.get(ENV, field)
  if value == AUTO:
    return jax.config.jax_compilation_cache_dir or default_dir()
  return os.path.expanduser(value)


def enable(field: str) -> str:
  """Points jax's persistent cache at `resolve(field)` (call before the run's first compile:
  jax decides once a process whether it uses a cache); returns the directory, "" when off."""
  path = resolve(field)
  if not path:
    jax.config.update("jax_enable_compilation_cache", False)
    return ""
  try:
    os.makedirs(path, exist_ok=True)
    probe = os.path.join(path, f".write_test.{os.getpid()}")
    with open(probe, "wb"):
      pass
    os.remove(probe)
  except OSError as e:
    raise CompileCacheError(
        f"run.compile_cache: cannot write the compilation cache directory {path} ({e}); set "
        f"--config.run.compile_cache to a writable directory, or '' to compile without a "
        f"cache (or {ENV}=...).") from e
  jax.config.update("jax_enable_compilation_cache", True)
  jax.config.update("jax_compilation_cache_dir", path)
  # A cache entry that cannot be read or written (its directory removed under the run, a full
  # disk) costs a compile, nothing else; jax says so in a warning with a source line, which would
  # stand in front of a run's one-line error. The run goes on the same either way.
  warnings.filterwarnings("ignore", message="Error (reading|writing) persistent compilation cache")
  # Unbounded (jax's default, -1) takes no file lock: bounded unless the environment asks for a
  # size itself (JAX_COMPILATION_CACHE_MAX_SIZE, -1 included).
  if jax.config.jax_compilation_cache_max_size == -1 and MAX_SIZE_ENV not in os.environ:
    jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
  return path


def describe() -> str:
  """Where compiled programs are cached now, for the run's first lines."""
  if not jax.config.jax_enable_compilation_cache or not jax.config.jax_compilation_cache_dir:
    return "compilation cache: off"
  return f"compilation cache: {jax.config.jax_compilation_cache_dir}"
