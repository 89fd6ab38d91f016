"""Converting LLaVA-format records into a conversation directory (conversations.py describes
it): each record rendered with the language model's chat template (chat.py), each image prepared
by the image tower's processor (images.py) and each audio clip's features made (audio_records.py),
in parallel worker processes, the shards and the manifest written atomically. `tools.convert` is
its command line; the digits tasks build their shards with it too. One record's conversion is in
conversion_record.py, the files a conversion writes in conversion_files.py.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import multiprocessing
import pathlib
import signal
import sys
import threading
import time
from typing import Iterator

import numpy as np
from tqdm import tqdm

from mimo_jax import encoders, output, words
from mimo_jax.config import ConfigError
from mimo_jax.data import audio, audio_records, conversion_files, images, meta, record_error
from mimo_jax.data.conversion_files import Files
from mimo_jax.data.conversion_record import (WORKER, Options, init_worker, pool_init,
                                               positions, work)
from mimo_jax.data.conversations import (FORMAT_VERSION, IMAGES, MANIFEST, SPLITS, VOCABULARY,
                                           encode, placeholders)
from mimo_jax.data.llava_json import default_eval, eval_split, read_records
from mimo_jax.workdir import describe_os_error

# Where stderr is no terminal (a log file, a pipe), progress is a line this often, in seconds: a
# bar's carriage returns would make one endless line of the log.
PROGRESS_SECONDS = 10.0
# The `skipped:` lines printed for each reason: past them, one line says the rest are not printed
# (one systematic mistake would print a line for every record).
SKIPS_SHOWN = 5


def estimate_bytes(records: list[dict], proc: images.ImageProcessor | None) -> int:
  """About the bytes a conversion writes: each listed image at the processor's size (a lower
  bound where the processor keeps the aspect ratio; None: records that list no image) and a
  header a record."""
  count = 0
  for r in records:
    f = r.get("image")
    count += 1 if isinstance(f, str) else len(f) if isinstance(f, list) else 0
  if not count:
    return len(records) * 256
  h, w = proc.output_size
  return count * h * w * proc.channels + len(records) * 256


def images_listed(records: list[dict]) -> bool:
  """Whether any record lists images (then the converter needs the image token and processor): a
  path, or a list of some; a field of another value is that record's fault (skipped as a bad
  image field), not the conversion's."""
  return any(bool(v) and isinstance(v, (str, list)) for v in (r.get("image") for r in records))


@contextlib.contextmanager
def _workers_ignore_sigint() -> Iterator[None]:
  """Processes started in the block ignore SIGINT from their start (before `pool_init` runs, a
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
  (`conversion_files.SKIPPED`'s rows, in order) under `skipped_records` and the records drawn
  for eval under `eval_drawn` (a skipped one is not replaced: eval holds fewer samples). Eval
  takes `eval_count` records (None: `default_eval`) drawn with `seed`, every record of an id on
  one side, or the record indices `eval_ids`. Bad records are skipped and counted
  (`on_error="skip"`, each reported on stderr and listed in SKIPPED; more than
  `opts.max_skipped_fraction` of the records is a ConfigError with nothing written) or raise
  ConfigError with nothing written. `progress`: a bar where stderr is a terminal, else a line
  every PROGRESS_SECONDS (records done, skipped, rate); a failed write is a ConfigError naming
  the file system's reason; any failure or interrupt removes what this conversion wrote. Callers
  that publish `out` as a whole (tools.convert) pass a fresh staging directory."""
  with _caught_signals() as caught:  # from the start: a signal at any point counts
    try:
      return _convert(pathlib.Path(source), pathlib.Path(out), opts, eval_count, seed, eval_ids,
                      progress, caught)
    except Exception as e:
      if caught:  # its Interrupted wrapped by another exception (raised inside an import's
        raise output.Interrupted(caught[0]) from e  # class creation: a RuntimeError)
      raise


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
  output.check_space(out, estimate_bytes(records, WORKER["proc"])
                     + audio_records.estimate_bytes(records, opts.audio.mel_bins,
                                                    opts.audio.window_s),
                     f"converting {source}")
  made = not out.exists()
  try:
    out.mkdir(parents=True, exist_ok=True)
  except OSError as e:
    raise ConfigError(describe_os_error(e, str(out))) from None
  files = Files(out)
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
  open (`init_worker`): a bad flag is one error before any work."""
  if (out / MANIFEST).exists():
    raise ConfigError(f"{out}: holds a conversion already ({MANIFEST}); choose another --out or "
                      "delete it.")
  if not pathlib.Path(opts.images).is_dir():
    raise ConfigError(f"--images {opts.images}: not a directory; give the folder the records' "
                      "image paths are relative to.")
  records = records_of(source)
  init_worker(opts)
  if images_listed(records):  # a conversion without images needs neither
    for error in (WORKER["image_error"], WORKER["processor_error"]):
      if error is not None:
        raise error
  if audio_records.listed(records):
    if not pathlib.Path(opts.audio.folder).is_dir():
      raise ConfigError(f"--audio {opts.audio.folder}: not a directory; give the folder the "
                        "records' audio paths are relative to.")
    if WORKER["audio_id"] is None:
      raise ConfigError(f"--audio_token {opts.audio.token!r}: not one token of --tokenizer "
                        f"{opts.tokenizer}; records list audio clips, so add it as a special "
                        "token or name the tokenizer's audio placeholder.")
  return records


def records_of(source: pathlib.Path) -> list[dict]:
  """`read_records`, where a JSON object that is no record (a list of records wrapped in one,
  `{"data": [...]}`, which reads as one record or as JSONL that is no JSON) is named as such."""
  try:
    records = read_records(source)
  except ConfigError:
    _refuse_an_object(source)
    raise
  if len(records) == 1:
    _refuse_an_object(source)
  return records


def _refuse_an_object(source: pathlib.Path) -> None:
  """A ConfigError naming the keys where `source` is one JSON object without conversations."""
  try:
    top = json.loads(source.read_bytes().decode("utf-8-sig"))
  except (OSError, ValueError):
    return
  if not isinstance(top, dict) or "conversations" in top:
    return
  keys = list(map(str, top))
  named = (f"{words.noun(len(keys), 'key')} {', '.join(keys[:8])}"
           f"{' ...' if len(keys) > 8 else ''}" if keys else "no keys")
  lists = [k for k in keys if isinstance(top[k], list)]
  inside = f", or the list inside it (under {' or '.join(lists)})" if lists else ""
  raise ConfigError(f"--json {source}: a JSON object with {named}, not a list of records; give "
                    f"a list of records (LLaVA's format){inside}.")


@dataclasses.dataclass
class _Tally:
  """What a conversion wrote, for its sidecars and manifest."""
  rows: dict[str, list] = dataclasses.field(default_factory=lambda: {s: [] for s in SPLITS})
  skipped: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  skipped_records: list[dict] = dataclasses.field(default_factory=list)  # SKIPPED's rows
  image_stats: images.Tally = dataclasses.field(default_factory=images.Tally)
  longest: int = 0  # positions of the longest sample
  longest_record: dict = dataclasses.field(default_factory=dict)  # its record: index and id
  lengths: list[int] = dataclasses.field(default_factory=list)  # positions of each sample
  clips: list[int] = dataclasses.field(default_factory=list)  # clips of each sample
  windows: int = 0  # 30 s windows of the longest clip
  too_long: int = 0  # positions of the longest sample skipped as longer than --seq_len


def _write(files: Files, items: list, eval_ids: set[int], opts: Options, progress: bool,
           caught: list[int]) -> _Tally:
  """Converts `items` (index, record, source) in this process or `opts.workers` ones and writes
  each sample to its split's shard as they come back, in order; a bad record is skipped and
  reported, or with `on_error="fail"` a ConfigError; a caught signal is `output.Interrupted`."""
  if opts.workers > 1:
    with _workers_ignore_sigint():
      files.pool = multiprocessing.get_context("spawn").Pool(opts.workers, pool_init, (opts,))
    results = files.pool.imap(work, items, chunksize=16)
  else:
    results = map(work, items)
  tally, marks, done = _Tally(), placeholders(WORKER["image_id"], WORKER["audio_id"]), 0
  bar = progress and sys.stderr.isatty()
  lines = _ProgressLines(len(items)) if progress and not bar else None
  for index, sample, error in tqdm(results, total=len(items), desc="converting",
                                   unit="record", file=sys.stderr, mininterval=1.0,
                                   disable=not bar):
    if lines is not None:
      lines.say(done, len(tally.skipped_records))
    done += 1
    if caught:
      raise output.Interrupted(caught[0])
    if error is not None:
      reason, message, length = error
      tally.too_long = max(tally.too_long, length or 0)
      if opts.on_error == "fail":
        raise ConfigError(message + " (--on_error skip converts the rest)")
      tally.skipped[reason] += 1
      tally.skipped_records.append({"record": index, "id": _id(items[index][1]),
                                    "reason": reason, "error": message})
      if tally.skipped[reason] <= SKIPS_SHOWN:
        tqdm.write(f"skipped: {message}", file=sys.stderr)
      elif tally.skipped[reason] == SKIPS_SHOWN + 1:
        tqdm.write(f"skipped: further records skipped as {reason!r} are not printed; a finished "
                   f"conversion lists every one in {conversion_files.SKIPPED} in --out.",
                   file=sys.stderr)
      continue
    split = "eval" if index in eval_ids else "train"
    try:
      files.shards[split].write(encode(sample))
    except OSError as e:
      raise ConfigError(describe_os_error(e, f"writing {files.tmp[split]} (record {done} of "
                                          f"{len(items)})")) from None
    tally.rows[split].append(meta.row(sample, VOCABULARY, marks))
    new = {int(x.shape[2]) for x in sample[IMAGES]} - set(tally.image_stats.first)
    tally.image_stats.add(sample[IMAGES], _image_names(items[index][1], index, opts)
                          if new else None)  # the first image of each channel count
    clip_tokens = [audio.clip_tokens(int(f), opts.audio.pool, opts.audio.window_frames)
                   for f in sample.get(audio_records.FRAMES, ())]
    tally.clips.append(len(clip_tokens))
    tally.windows = max([tally.windows] + [-(-int(f) // opts.audio.window_frames)
                                           for f in sample.get(audio_records.FRAMES, ())])
    tally.lengths.append(positions(len(sample["tokens"]), len(sample[IMAGES]), opts.image_tokens,
                                   clip_tokens))
    if tally.lengths[-1] > tally.longest:
      tally.longest = tally.lengths[-1]
      tally.longest_record = {"record": index, "id": _id(items[index][1])}
  if caught:  # after the last record
    raise output.Interrupted(caught[0])
  return tally


def _p99(lengths: list[int]) -> dict:
  """The positions that 99% of the samples fit in (a sample's own), and how many take more."""
  most = int(np.percentile(lengths, 99, method="lower")) if lengths else 0
  return {"positions_p99": most, "longer_than_p99": sum(n > most for n in lengths)}


def _id(record: dict):
  """A record's id as the outputs name it: a string or a number, else None."""
  rid = record.get("id")
  return rid if isinstance(rid, (str, int)) and not isinstance(rid, bool) else None


def _image_names(record: dict, index: int, opts: Options) -> list[str]:
  """"/abs/images/a.png of record 3 (id 'a')" for each image a converted `record` lists."""
  return [f"{pathlib.Path(opts.images).absolute() / f} of record {index} (id "
          f"{record.get('id', '?')!r})" for f in record_error.paths(record.get("image"), "image",
                                                                     "image", f"record {index}")]


class _ProgressLines:
  """Progress as a line every PROGRESS_SECONDS on stderr, for a stderr that is no terminal:
  "converting: 400 of 800 records (50%), 3 skipped, 41.2 records/s, about 10 s left"."""

  def __init__(self, total: int):
    self.total, self.started = total, time.monotonic()
    self.last = self.started

  def say(self, done: int, skipped: int) -> None:
    now = time.monotonic()
    if now - self.last < PROGRESS_SECONDS or not done:
      return
    self.last = now
    rate = done / max(now - self.started, 1e-9)
    print(f"converting: {done} of {words.count(self.total, 'record')} "
          f"({100 * done / self.total:.0f}%), {skipped} skipped, {rate:.1f} records/s, about "
          f"{(self.total - done) / rate:.0f} s left", file=sys.stderr, flush=True)


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


def _named_above(tally: _Tally) -> str:
  """Which skipped records of `tally` a `skipped:` line named: each, or each reason's first
  SKIPS_SHOWN."""
  if max(tally.skipped.values(), default=0) <= SKIPS_SHOWN:
    return "each is named above on a `skipped:` line"
  return f"the first {SKIPS_SHOWN} of each reason are named above on `skipped:` lines"


def _fixes(tally: _Tally, lower: bool = False) -> str:
  """What keeps the skipped records of `tally`: "Give --seq_len 57 or more (the tokens of the
  longest sample; 0: no limit) and fix the other records or the flags that reject them"."""
  rest = "the records or the flags that reject them"
  if not tally.too_long:
    fix = f"fix {rest}"
  else:
    fix = (f"give --seq_len {tally.too_long} or more (the tokens of the longest sample; 0: no "
           "limit)")
    if set(tally.skipped) - {"too long"}:
      fix += f" and fix the other {rest.removeprefix('the ')}"
  return fix if lower else fix[0].upper() + fix[1:]


def _stored(path: str, out: pathlib.Path) -> str:
  """A path as the manifest keeps it: relative to `out` when inside it (the directory may move),
  else absolute and resolved (tools read it from any working directory)."""
  p = pathlib.Path(path).resolve()
  return str(p.relative_to(out.resolve())) if p.is_relative_to(out.resolve()) else str(p)


def _manifest(source: pathlib.Path, out: pathlib.Path, opts: Options, tally: _Tally,
              held_out: bool) -> dict:
  """The manifest of a conversion that wrote `tally`; a ConfigError if train is left empty, eval
  while records were `held_out` for it, or more records were skipped than
  `opts.max_skipped_fraction` of them."""
  counts = {s: len(r) for s, r in tally.rows.items()}
  read = sum(counts.values()) + len(tally.skipped_records)
  summary = skipped_summary(tally.skipped_records, read)
  if not counts["train"]:
    if not tally.skipped_records:
      raise ConfigError(f"--json {source}: no record is left for train: every record was drawn "
                        "for eval (the records of one id go to one side); give a smaller --eval.")
    raise ConfigError(f"--json {source}: no record could be converted for train: {summary}; "
                      f"{_named_above(tally)}. {_fixes(tally)}.")
  if held_out and not counts["eval"]:
    raise ConfigError(f"--json {source}: every record drawn for eval was skipped ({summary}); "
                      f"hold out more with --eval, or {_fixes(tally, lower=True)}.")
  if len(tally.skipped_records) > opts.max_skipped_fraction * read:
    raise ConfigError(f"--json {source}: {summary}, more than --max_skipped_fraction "
                      f"{opts.max_skipped_fraction:g} allows; {_named_above(tally)}. "
                      f"{_fixes(tally)}, or raise --max_skipped_fraction (1 keeps every good "
                      "record whatever the rest).")
  # Without images, the image token and processor may be absent (unused): the image token is
  # then -1 (no token id) and the image size and channels null.
  proc, pictures = WORKER["proc"], tally.image_stats
  mixed = pictures.mixed_channels(opts.processor or opts.tokenizer)
  if mixed:  # a model reads one channel count (model.vision.channels): training would fail
    raise ConfigError(f"--json {source}: {mixed}.")
  image_id = WORKER["image_id"]
  return {"format": FORMAT_VERSION, "image_token": -1 if image_id is None else image_id,
          "image_token_text": opts.image_token,
          "image_size": None if proc is None else pictures.size(proc),
          "image_sizes": sorted([list(k) for k in pictures.sizes]),
          "channels": None if proc is None else pictures.channel(proc),
          "vocab_size": WORKER["tok"].tokenizer.get_vocab_size(),
          "tokenizer": _stored(opts.tokenizer, out),
          "processor": "" if proc is None else _stored(opts.processor or opts.tokenizer, out),
          "source": _stored(str(source), out),
          "samples": counts, "images": pictures.count, "skipped": dict(tally.skipped),
          "longest": tally.longest, "longest_record": tally.longest_record,
          **_p99(tally.lengths),
          "max_images": pictures.most,
          "pad_to_square": opts.pad_to_square,
          **audio_records.manifest(opts.audio, WORKER["audio_id"], tally.clips,
                                   tally.windows)}
