"""Converting LLaVA-format records into a conversation directory (conversations.py describes
it): each record rendered with the language model's chat template (chat.py), each image prepared
by the image tower's processor (images.py) and each audio clip's features made (audio_records.py),
in parallel worker processes, the shards and the manifest written atomically. `tools.convert` is
its command line; the digits tasks build their shards with it too.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import json
import multiprocessing
import os
import pathlib
import signal
import sys
import threading
import time
import zlib
from typing import Iterator

from tqdm import tqdm

from mimo_jax import encoders, output, words
from mimo_jax.config import ConfigError
from mimo_jax.data import audio, audio_records, images, meta, record_error
from mimo_jax.data.llava_json import default_eval, eval_split, read_records
from mimo_jax.data.chat import ChatError, ChatTokenizer, TokenizeError, messages
from mimo_jax.data.conversations import (FORMAT_VERSION, IMAGES, MANIFEST, SPLITS, VOCABULARY,
                                           encode, placeholders)
from mimo_jax.data.record_error import RecordError
from mimo_jax.workdir import describe_os_error

# What an ArrayRecord writer may hold before its file grows (it writes 16 MiB of compressed
# records at a time): a file that has not grown while this much more was given to it, counted
# compressed (zlib's fastest level: the writer's own compression shrinks records at least about as
# much; audio features' padding shrinks some hundredfold), has failed.
WRITE_LAG = 64 << 20
# The most records a conversion may skip, as a fraction of those read (`--max_skipped_fraction`):
# a few bad records are skipped, many mean a wrong flag or a broken source.
MAX_SKIPPED_FRACTION = 0.05
SKIPPED = "skipped.jsonl"  # in the output: each skipped record, its reason and error


@dataclasses.dataclass(frozen=True)
class Options:
  """How records are converted (`tools.convert`'s flags of the same names)."""
  tokenizer: str  # HF directory: tokenizer.json, tokenizer_config.json with the chat template
  images: str = "."  # the folder image paths are relative to
  processor: str = ""  # HF directory with preprocessor_config.json; "" = tokenizer
  image_token: str = "<image>"  # the text that marks an image: one token of the tokenizer
  pad_to_square: bool = False  # LLaVA's pad to square
  seq_len: int = 0  # longest sample in positions; 0 = no limit
  image_tokens: int = 1  # positions an image takes, for seq_len
  on_error: str = "skip"  # or "fail"
  workers: int = 1  # processes; 1 = in this process
  allow_outside_images: bool = False  # read image paths that lead out of `images`
  max_skipped_fraction: float = MAX_SKIPPED_FRACTION  # more skipped records fail the conversion
  audio: audio_records.Settings = audio_records.Settings()  # clips: folder, token, features


def estimate_bytes(records: list[dict], proc: images.ImageProcessor) -> int:
  """About the bytes a conversion writes: each listed image at the processor's size (a lower
  bound where the processor keeps the aspect ratio) and a header a record."""
  h, w = proc.output_size
  count = 0
  for r in records:
    f = r.get("image")
    count += 1 if isinstance(f, str) else len(f) if isinstance(f, list) else 0
  return count * h * w * proc.channels + len(records) * 256


_WORKER = {}


def _init(opts: Options) -> None:
  """The tokenizer, processor and image token of `opts`; one error naming the flag if unusable."""
  try:
    tok = ChatTokenizer.open(opts.tokenizer)
  except ChatError as e:
    raise ConfigError(f"--tokenizer {opts.tokenizer}: {e}") from None
  try:
    image_id = tok.token_id(opts.image_token)
  except ChatError as e:
    raise ConfigError(f"--image_token {opts.image_token!r}: {e}") from None
  try:
    audio_id = tok.token_id(opts.audio.token)
  except ChatError:  # needed only where records list clips (_prepare)
    audio_id = None
  folder = pathlib.Path(opts.images)
  _WORKER.update(audio_id=audio_id, opts=opts, tok=tok, images=folder, root=os.path.realpath(folder),
                 proc=images.ImageProcessor.open(opts.processor or opts.tokenizer,
                                                 pad_to_square=opts.pad_to_square),
                 image_id=image_id)


def _pool_init(opts: Options) -> None:
  # Ctrl-C reaches the whole process group: the parent alone unwinds and terminates workers.
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  _init(opts)


@contextlib.contextmanager
def _workers_ignore_sigint() -> Iterator[None]:
  """Processes started in the block ignore SIGINT from their start (before `_pool_init` runs, a
  Ctrl-C would print their tracebacks); signals that reach this process meanwhile wait for the
  block's end (blocked, not lost)."""
  if threading.current_thread() is not threading.main_thread():
    yield
    return
  mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM, signal.SIGHUP})
  kept = signal.signal(signal.SIGINT, signal.SIG_IGN)  # inherited through exec
  try:
    yield
  finally:
    signal.signal(signal.SIGINT, kept)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def _image_files(record: dict, where: str) -> list[str]:
  return record_error.paths(record.get("image"), "image", "image", where)


def _read_image(f: str, where: str):
  """The processor's pixels of image file `f` (relative to --images)."""
  w = _WORKER
  path = w["images"] / f
  real = os.path.realpath(path)
  if not w["opts"].allow_outside_images and os.path.commonpath([real, w["root"]]) != w["root"]:
    raise RecordError("outside --images", f"{where}: image {f!r} leads out of --images "
                      f"({real}); --allow_outside_images reads it.")
  try:
    return images.load(path, w["proc"])
  except FileNotFoundError:
    raise RecordError("missing image", f"{where}: image {path} not found.") from None
  except images.TOO_LARGE as e:
    raise RecordError("image too large", f"{where}: image {path} is too large to decode ({e}).") \
        from None
  except images.UnsupportedImage as e:
    raise RecordError("unsupported image", f"{where}: image {path} is {e}.") from None
  except Exception as e:  # pylint: disable=broad-except
    raise RecordError("corrupt image", f"{where}: image {path} cannot be read ({e}).") from None


def _held(images: int, image_tokens: int, clip_tokens: list[int]) -> str:
  """" (2 images of 576 tokens; clips of 750, 375 tokens)": what a sample's media take."""
  held = []
  if images:
    held.append(f"{words.count(images, 'image')} of {image_tokens} tokens")
  if clip_tokens:
    sizes = ", ".join(map(str, clip_tokens))
    held.append(f"{words.noun(len(clip_tokens), 'clip')} of {sizes} tokens")
  return f" ({'; '.join(held)})" if held else ""


def convert_record(record: dict, where: str) -> dict:
  """One record -> a sample (`tokens`, `loss_mask`, `images`), or RecordError (after `_init`)."""
  w, opts = _WORKER, _WORKER["opts"]
  record_error.record_id(record, where)
  turns = record.get("conversations")
  if not isinstance(turns, list) or not turns:
    raise RecordError("no conversations", f"{where}: no conversations list.")
  try:
    msgs = messages(turns, f"{where}: ")
  except ChatError as e:
    reason = "unknown role" if "unknown role" in str(e) else "bad conversation"
    raise RecordError(reason, str(e)) from None
  files = _image_files(record, where)
  marks = sum(m["content"].count(opts.image_token) for m in msgs)
  if marks != len(files):
    raise RecordError("image count", f"{where}: its text has {marks} {opts.image_token} but it "
                      f"lists {words.count(len(files), 'image')}.")
  pixels = [_read_image(f, where) for f in files]
  msgs, clips = audio_records.convert(record, msgs, where, opts.audio)
  try:
    ids, mask = w["tok"].encode(msgs)
  except TokenizeError as e:
    raise RecordError("untokenizable", f"{where}: {e}") from None
  except ChatError as e:
    raise RecordError("template", f"{where}: {e}") from None
  found = int((ids == w["image_id"]).sum())
  if found != len(files):
    raise RecordError("image count", f"{where}: {found} image tokens after tokenizing, for "
                      f"{len(files)} images (is {opts.image_token!r} one special token of the "
                      "tokenizer?).")
  audio_records.check_tokens(ids, w["audio_id"], clips, where, opts.audio)
  if not mask.any():
    raise RecordError("no assistant turn", f"{where}: no assistant turn to learn from.")
  clip_tokens = [c.tokens(opts.audio.pool) for c in clips]
  length = positions(len(ids), len(files), opts.image_tokens, clip_tokens)
  if opts.seq_len and length > opts.seq_len:
    raise RecordError("too long", f"{where}: {length} tokens"
                      f"{_held(len(files), opts.image_tokens, clip_tokens)} exceed --seq_len "
                      f"{opts.seq_len}.")
  return {"tokens": ids, "loss_mask": mask, IMAGES: pixels, **audio_records.fields(clips)}


def positions(tokens: int, image_count: int, image_tokens: int, clip_tokens=()) -> int:
  """Positions a sample takes in a row: every token but the last is an input (as the layout
  counts), each image `image_tokens` of them, each clip its `clip_tokens`."""
  return audio_records.positions(tokens, list(clip_tokens)) + image_count * (image_tokens - 1)


def _work(item):
  index, record, source = item
  where = f"{source}: record {index} (id {record.get('id', '?')!r})"
  try:
    return index, dict(convert_record(record, where), id=record.get("id", index)), None
  except RecordError as e:
    return index, None, (e.reason, str(e))
  except Exception as e:  # pylint: disable=broad-except
    # Whatever else one record raises is that record's fault: skipped like the others.
    return index, None, ("error", f"{where}: {type(e).__name__}: {e}")


def _stored(path: str, out: pathlib.Path) -> str:
  """A path as the manifest keeps it: relative to `out` when inside it (the directory may move),
  else absolute and resolved (tools read it from any working directory)."""
  p = pathlib.Path(path).resolve()
  return str(p.relative_to(out.resolve())) if p.is_relative_to(out.resolve()) else str(p)


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


@contextlib.contextmanager
def _caught_signals() -> Iterator[list[int]]:
  """Records SIGINT, SIGTERM and SIGHUP (where Python handles them) as they raise
  `output.Interrupted`. A handler's exception raised inside a garbage-collection callback or a
  finalizer cannot leave it: Python hands it to `sys.unraisablehook`, which would print a
  traceback. It stays silent here (`output.quiet_lost_interrupts`), and the conversion loop looks at
  the record."""
  caught, kept = [], {}

  def handle(signum, frame):  # pylint: disable=unused-argument
    caught.append(signum)
    raise output.Interrupted(signum)
  if threading.current_thread() is threading.main_thread():
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
      if callable(signal.getsignal(s)):
        kept[s] = signal.signal(s, handle)
  try:
    with output.quiet_lost_interrupts():
      yield caught
  finally:
    for s, h in kept.items():
      signal.signal(s, h)


def convert(source: pathlib.Path, out: pathlib.Path, opts: Options, eval_count: int | None = None,
            seed: int = 0, eval_ids=None, progress: bool = True) -> dict:
  """Converts the LLaVA-format records of `source` into directory `out` (shards, sidecars,
  manifest) and returns the manifest, with the seconds it took under `seconds`, the records read
  under `records`, the ids several records share under `shared_ids`, the skipped records
  (`SKIPPED`'s rows, in order) under `skipped_records` and the records drawn for eval under
  `eval_drawn` (a skipped one is not replaced: eval holds fewer samples). Eval takes
  `eval_count` records (None: `default_eval`) drawn with `seed`, every record of an id on one
  side, or the record indices `eval_ids`. Bad records are skipped and counted (`on_error="skip"`,
  each reported on stderr and listed in SKIPPED; more than `opts.max_skipped_fraction` of the
  records is a ConfigError with nothing written) or raise ConfigError with nothing written; a
  failed write is a ConfigError naming the file system's reason; any failure or interrupt
  removes what this conversion wrote. Callers that publish `out` as a whole (tools.convert) pass
  a fresh staging directory."""
  with _caught_signals() as caught:  # from the start: a signal at any point counts
    return _convert(pathlib.Path(source), pathlib.Path(out), opts, eval_count, seed, eval_ids,
                    progress, caught)


def _convert(source: pathlib.Path, out: pathlib.Path, opts: Options, eval_count: int | None,
             seed: int, eval_ids, progress: bool, caught: list[int]) -> dict:
  """`convert`, with the signals `_caught_signals` recorded in `caught`."""
  # The built-in encoders, whose items the sidecars list, registered before any file or worker
  # exists: their imports take seconds.
  encoders.builtin()
  records = _prepare(source, out, opts)
  shared = []
  if eval_ids is None:
    eval_ids, shared = eval_split(records, default_eval(len(records)) if eval_count is None
                                  else eval_count, seed)
  eval_ids = set(eval_ids)
  output.check_space(out, estimate_bytes(records, _WORKER["proc"])
                     + audio_records.estimate_bytes(records, opts.audio.mel_bins,
                                                    opts.audio.window_s),
                     f"converting {source}")
  made = not out.exists()
  try:
    out.mkdir(parents=True, exist_ok=True)
  except OSError as e:
    raise ConfigError(describe_os_error(e, str(out))) from None
  files = _Files(out)
  items = [(i, r, str(source)) for i, r in enumerate(records)]
  started = time.perf_counter()
  try:
    files.open()
    tally = _write(files, items, eval_ids, opts, progress, caught)
    files.close_pool()
    written = _manifest(source, out, opts, tally, bool(eval_ids))
    files.publish(written, tally.rows, tally.skipped_records)
  except BaseException:  # nothing of this conversion stays behind; this cleanup cannot fail
    files.remove(made)
    raise
  return dict(written, seconds=time.perf_counter() - started, records=len(records),
              shared_ids=shared, skipped_records=tally.skipped_records,
              eval_drawn=len(eval_ids))


def _prepare(source: pathlib.Path, out: pathlib.Path, opts: Options) -> list[dict]:
  """The records of `source`, after checking `out` and --images, with the tokenizer and processor
  open (`_init`): a bad flag is one error before any work."""
  if (out / MANIFEST).exists():
    raise ConfigError(f"{out}: holds a conversion already ({MANIFEST}); choose another --out or "
                      "delete it.")
  if not pathlib.Path(opts.images).is_dir():
    raise ConfigError(f"--images {opts.images}: not a directory; give the folder the records' "
                      "image paths are relative to.")
  records = read_records(source)
  _init(opts)
  if audio_records.listed(records):
    if not pathlib.Path(opts.audio.folder).is_dir():
      raise ConfigError(f"--audio {opts.audio.folder}: not a directory; give the folder the "
                        "records' audio paths are relative to.")
    if _WORKER["audio_id"] is None:
      raise ConfigError(f"--audio_token {opts.audio.token!r}: not one token of --tokenizer "
                        f"{opts.tokenizer}; records list audio clips, so add it as a special "
                        "token or name the tokenizer's audio placeholder.")
  return records


@dataclasses.dataclass
class _Tally:
  """What a conversion wrote, for its sidecars and manifest."""
  rows: dict[str, list] = dataclasses.field(default_factory=lambda: {s: [] for s in SPLITS})
  skipped: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  skipped_records: list[dict] = dataclasses.field(default_factory=list)  # SKIPPED's rows
  image_stats: images.Tally = dataclasses.field(default_factory=images.Tally)
  longest: int = 0  # positions of the longest sample
  clips: list[int] = dataclasses.field(default_factory=list)  # clips of each sample
  windows: int = 0  # 30 s windows of the longest clip


def _write(files: _Files, items: list, eval_ids: set[int], opts: Options, progress: bool,
           caught: list[int]) -> _Tally:
  """Converts `items` (index, record, source) in this process or `opts.workers` ones and writes
  each sample to its split's shard as they come back, in order; a bad record is skipped and
  reported, or with `on_error="fail"` a ConfigError; a caught signal is `output.Interrupted`."""
  if opts.workers > 1:
    with _workers_ignore_sigint():
      files.pool = multiprocessing.get_context("spawn").Pool(opts.workers, _pool_init, (opts,))
    results = files.pool.imap(_work, items, chunksize=16)
  else:
    results = map(_work, items)
  tally, marks, done = _Tally(), placeholders(_WORKER["image_id"], _WORKER["audio_id"]), 0
  for index, sample, error in tqdm(results, total=len(items), desc="converting",
                                   unit="record", file=sys.stderr, mininterval=1.0,
                                   disable=not progress):
    done += 1
    if caught:
      raise output.Interrupted(caught[0])
    if error is not None:
      reason, message = error
      if opts.on_error == "fail":
        raise ConfigError(message + " (--on_error skip converts the rest)")
      tally.skipped[reason] += 1
      rid = items[index][1].get("id")
      tally.skipped_records.append({
          "record": index, "id": rid if isinstance(rid, (str, int)) and not isinstance(rid, bool)
          else None, "reason": reason, "error": message})
      tqdm.write(f"skipped: {message}", file=sys.stderr)
      continue
    split = "eval" if index in eval_ids else "train"
    try:
      files.shards[split].write(encode(sample))
    except OSError as e:
      raise ConfigError(describe_os_error(e, f"writing {files.tmp[split]} (record {done} of "
                                          f"{len(items)})")) from None
    tally.rows[split].append(meta.row(sample, VOCABULARY, marks))
    tally.image_stats.add(sample[IMAGES])
    clip_tokens = [audio.clip_tokens(int(f), opts.audio.pool, opts.audio.window_frames)
                   for f in sample.get(audio_records.FRAMES, ())]
    tally.clips.append(len(clip_tokens))
    tally.windows = max([tally.windows] + [-(-int(f) // opts.audio.window_frames)
                                           for f in sample.get(audio_records.FRAMES, ())])
    tally.longest = max(tally.longest, positions(len(sample["tokens"]), len(sample[IMAGES]),
                                                 opts.image_tokens, clip_tokens))
  if caught:  # after the last record
    raise output.Interrupted(caught[0])
  return tally


def skipped_summary(skipped: list[dict], read: int, shown: int = 3) -> str:
  """"5 of 40 records (12.5%) were skipped: missing image 4 ('a', 'b', record 7, ...), ..."
  for the rows `skipped` (`SKIPPED`'s) of `read` records, each reason with its first records."""
  by_reason: dict[str, list[dict]] = {}
  for r in skipped:
    by_reason.setdefault(r["reason"], []).append(r)
  parts = []
  for reason, rows in sorted(by_reason.items(), key=lambda kv: -len(kv[1])):
    named = [repr(r["id"]) if r["id"] is not None else f"record {r['record']}"
             for r in rows[:shown]]
    more = ", ..." if len(rows) > shown else ""
    parts.append(f"{reason} {len(rows)} ({', '.join(named)}{more})")
  share = 100 * len(skipped) / max(read, 1)
  return (f"{len(skipped)} of {words.count(read, 'record')} ({share:.1f}%) "
          f"{'was' if len(skipped) == 1 else 'were'} skipped: {', '.join(parts)}")


def _manifest(source: pathlib.Path, out: pathlib.Path, opts: Options, tally: _Tally,
              held_out: bool) -> dict:
  """The manifest of a conversion that wrote `tally`; a ConfigError if train is left empty, eval
  while records were `held_out` for it, or more records were skipped than
  `opts.max_skipped_fraction` of them."""
  counts = {s: len(r) for s, r in tally.rows.items()}
  if not counts["train"]:
    raise ConfigError(f"--json {source}: no record could be converted for train "
                      f"({dict(tally.skipped) or 'every record was drawn for eval'}).")
  if held_out and not counts["eval"]:
    raise ConfigError(f"--json {source}: every record drawn for eval was skipped "
                      f"({dict(tally.skipped)}); hold out more with --eval, or fix the records.")
  read = sum(counts.values()) + len(tally.skipped_records)
  if len(tally.skipped_records) > opts.max_skipped_fraction * read:
    raise ConfigError(f"--json {source}: {skipped_summary(tally.skipped_records, read)}, more "
                      f"than --max_skipped_fraction {opts.max_skipped_fraction:g} allows; each is "
                      "named above on a `skipped:` line. Fix the records or the flags that "
                      "reject them, or raise --max_skipped_fraction (1 keeps every good record "
                      "whatever the rest).")
  proc, pictures = _WORKER["proc"], tally.image_stats
  return {"format": FORMAT_VERSION, "image_token": _WORKER["image_id"],
          "image_token_text": opts.image_token, "image_size": pictures.size(proc),
          "image_sizes": sorted([list(k) for k in pictures.sizes]),
          "channels": pictures.channel(proc),
          "vocab_size": _WORKER["tok"].tokenizer.get_vocab_size(),
          "tokenizer": _stored(opts.tokenizer, out),
          "processor": _stored(opts.processor or opts.tokenizer, out),
          "source": _stored(str(source), out),
          "samples": counts, "images": pictures.count, "skipped": dict(tally.skipped),
          "longest": tally.longest, "max_images": pictures.most,
          "pad_to_square": opts.pad_to_square,
          **audio_records.manifest(opts.audio, _WORKER["audio_id"], tally.clips,
                                   tally.windows)}


class _Files:
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
