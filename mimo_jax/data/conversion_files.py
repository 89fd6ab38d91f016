"""What a conversion writes into its output directory: each split's ArrayRecord shard under a
temporary name (a writer that stops growing is a failed write, said at once), then its sidecar,
the skipped records' list and the manifest, each named only once complete; and what a failed or
interrupted conversion removes again. `Files` also holds the worker pool, which it stops first."""

from __future__ import annotations

import errno
import json
import os
import pathlib
import zlib

from mimo_jax import output
from mimo_jax.config import ConfigError
from mimo_jax.data import meta
from mimo_jax.data.conversations import MANIFEST, SPLITS
from mimo_jax.workdir import describe_os_error

# What an ArrayRecord writer may hold before its file grows (it writes 16 MiB of compressed
# records at a time): a file that has not grown while this much more was given to it, counted
# compressed (zlib's fastest level: the writer's own compression shrinks records at least about as
# much; audio features' padding shrinks some hundredfold), has failed.
WRITE_LAG = 64 << 20
SKIPPED = "skipped.jsonl"  # in the output: each skipped record, its reason and error


def _os_error(e: RuntimeError, path: pathlib.Path) -> OSError:
  """The OSError an ArrayRecord writer's message describes (it reports none of its own)."""
  text = str(e)
  for code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EIO):
    if os.strerror(code) in text:
      return OSError(code, os.strerror(code), str(path))
  return OSError(f"{path}: {text}")


class _Shard:
  """One split's ArrayRecord file being written. The writer reports a failed write late (a later
  record's write, or only its close), so a file that stops growing while records keep coming is
  closed at once to say why."""

  def __init__(self, path: pathlib.Path):
    # pylint: disable-next=import-outside-toplevel
    from array_record.python import array_record_module
    self.path, self.given, self.size, self.grown_at = path, 0, 0, 0
    self.writer = array_record_module.ArrayRecordWriter(str(path), "group_size:1")

  def write(self, record: bytes) -> None:
    try:
      self.writer.write(record)
    except RuntimeError as e:  # a failed flush, seen by a later record's
      self.abandon()
      raise _os_error(e, self.path) from None
    self.given += len(zlib.compress(record, 1))
    if self.given - self.grown_at > WRITE_LAG:
      size = os.path.getsize(self.path)
      if size <= self.size:
        self.close()
        raise OSError(errno.EIO, f"{self.path} stopped growing")
      self.size, self.grown_at = size, self.given

  def close(self) -> None:
    """Closes the file; an OSError if any of its writes failed."""
    w, self.writer = self.writer, None
    if w is not None:
      try:
        w.close()
      except RuntimeError as e:
        raise _os_error(e, self.path) from None

  def abandon(self) -> None:
    """Closes the file, never raising (its writes failed or are not wanted)."""
    try:
      self.close()
    except Exception:  # pylint: disable=broad-except
      pass


class Files:
  """What a conversion writes into `out`: each split's shard under a temporary name until
  `publish` names it, beside its sidecar, then the manifest; and the worker pool, if any."""

  def __init__(self, out: pathlib.Path):
    self.out, self.pool = out, None
    self.tmp = {s: out / f".{s}.array_record.tmp" for s in SPLITS}
    self.shards: dict[str, _Shard] = {}

  def open(self) -> None:
    try:
      self.shards.update({s: _Shard(p) for s, p in self.tmp.items()})
    except (OSError, ValueError, RuntimeError) as e:
      raise ConfigError(f"{self.out}: cannot create the shards ({e}).") from None

  def close_pool(self) -> None:
    if self.pool is not None:
      self.pool.close()
      self.pool.join()

  def publish(self, written: dict, rows: dict[str, list], skipped: list[dict]) -> None:
    """Closes each shard and gives it its name once its sidecar (`rows`) is written, writes the
    `skipped` records' rows (SKIPPED, where there are any), then the manifest `written`; a failed
    write is a ConfigError naming the file system's reason."""
    try:
      for s in SPLITS:  # each shard complete before its name appears
        self.shards[s].close()
        final = self.out / f"{s}.array_record"
        meta.save(str(final), rows[s])
        os.replace(self.tmp[s], final)
      if skipped:
        (self.out / SKIPPED).write_text("".join(json.dumps(r) + "\n" for r in skipped))
      part = self.out / (MANIFEST + ".tmp")
      part.write_text(json.dumps(written, indent=1))
      os.replace(part, self.out / MANIFEST)
    except OSError as e:
      where = getattr(e, "filename", None) or self.out
      raise ConfigError(describe_os_error(e, f"writing {where}")) from None

  def remove(self, made: bool) -> None:
    """Stops the workers and removes every file of this conversion unless its manifest is
    written (and `out` itself, if `made` by it and left empty); never raises."""
    if self.pool is not None:
      try:
        self.pool.terminate()
        self.pool.join()
      except Exception:  # pylint: disable=broad-except
        pass
    for shard in self.shards.values():
      shard.abandon()
    if not (self.out / MANIFEST).exists():
      for s in SPLITS:
        final = self.out / f"{s}.array_record"
        for p in (self.tmp[s], final, pathlib.Path(meta.path_of(str(final))),
                  self.out / (MANIFEST + ".tmp"), self.out / SKIPPED):
          output.remove(p)
    if made:
      try:
        self.out.rmdir()  # only if empty
      except OSError:
        pass
