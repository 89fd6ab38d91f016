"""LLaVA-style conversation data: records with a language model's own token ids, a loss mask on
the assistant turns and images prepared by the vision tower's processor (`tools.convert` writes
them; `data.task=conversations` trains on them).

A converted directory (`data.dir`) holds:

  train.array_record, eval.array_record   one record a sample (`encode`)
  <shard>.meta.npz                         the per-record sidecar of scalable reads (meta.py)
  conversations.json                       the manifest: image token id, tokenizer, processor,
                                           image sizes, counts

A record (records.py) is a JSON header (`tokens`, `loss_mask`, the shape of each image) and the
images' uint8 bytes. Each `<image>` of the text is one token, the image token
(`data.image_token`, checked against the manifest), which the layout expands to that image's
tokens; the loss mask is 1 on every assistant token and its end-of-turn token.

`convert` writes such a directory from LLaVA-format records (`tools.convert` is its command line;
the digits task builds its shards with it too): each record rendered with the language model's
chat template (chat.py), each image prepared by the vision tower's processor (images.py), in
parallel worker processes. Paths in the manifest (tokenizer, processor, source) are absolute, or
relative to the directory where they lie inside it; `source_path` resolves them, older relative
ones against the directory, then the working directory.
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
import warnings
from typing import Iterator

import numpy as np

from mimo_jax.config import Config, ConfigError
from mimo_jax.data import records
from mimo_jax.workdir import describe_os_error

MANIFEST = "conversations.json"
SPLITS = ("train", "eval")
FORMAT_VERSION = 1


def encode(sample: dict) -> bytes:
  return records.pack({"tokens": np.asarray(sample["tokens"]).tolist(),
                       "loss_mask": np.asarray(sample["loss_mask"]).tolist()}, sample["images"])


def decode(record: bytes, source: str, index: int) -> dict:
  """Record -> {"images": [uint8 [h, w, c]], "tokens": int32 [n], "loss_mask": int32 [n]}; a bad
  record names the file and index."""
  try:
    header, images = records.unpack(record)
    tokens = np.asarray(header["tokens"], np.int32)
    mask = np.asarray(header["loss_mask"], np.int32)
    if tokens.shape != mask.shape:
      raise ValueError(f"{mask.size} loss mask entries for {tokens.size} tokens")
    return {"images": images, "tokens": tokens, "loss_mask": mask}
  except (ValueError, KeyError, TypeError) as e:
    raise ValueError(f"{source}: record {index} is not a valid conversation sample ({e}).") \
        from None


def manifest(directory: str) -> dict:
  path = pathlib.Path(directory) / MANIFEST
  try:
    out = json.loads(path.read_text())
  except FileNotFoundError:
    raise ConfigError(f"config.data.dir: {path} not found; data.task=conversations reads a "
                      "directory written by `python -m tools.convert`.") from None
  except (OSError, ValueError) as e:
    raise ConfigError(f"config.data.dir: {path} is unreadable ({e}); convert the data again.") \
        from None
  if out.get("format") != FORMAT_VERSION:
    raise ConfigError(f"config.data.dir: {path} has format {out.get('format')!r}, not "
                      f"{FORMAT_VERSION}; convert the data again.")
  return out


def paths(cfg: Config, directory: str = "") -> dict[str, str]:
  """The converted train and eval shards of `directory` (default `data.dir`), after checking that
  the run's fields agree with its manifest."""
  d, v = cfg.data, cfg.model.vision
  directory = directory or d.dir
  m = manifest(directory)
  if d.placeholder != m["image_token"]:
    raise ConfigError(f"config.data.image_token: {d.image_token} where {directory} marks images "
                      f"with token {m['image_token']}; set data.image_token={m['image_token']}.")
  h, w = m["image_size"]
  if not v.slot_patches and (h, w) != (v.image_size, v.image_size):
    raise ConfigError(f"config.model.vision.image_size: {v.image_size} where {directory} holds "
                      f"{h}x{w} images; set model.vision.image_size={h}, or "
                      "model.vision.slot_patches.")
  others = [f"{a}x{b}" for a, b in m.get("image_sizes", []) if (a, b) != (h, w)]
  if others and not v.slot_patches:
    raise ConfigError(f"config.model.vision.slot_patches: {directory} holds images of several "
                      f"sizes ({h}x{w}, {', '.join(others[:3])}), which need dynamic resolution; "
                      "set model.vision.slot_patches, or convert with a processor that crops.")
  vocab = cfg.model.language.vocab_size or m["vocab_size"]
  if vocab < m["vocab_size"]:
    raise ConfigError(f"config.model.language.vocab_size: {vocab} is less than the tokenizer's "
                      f"{m['vocab_size']} ({source_path(directory, m['tokenizer'])}).")
  out = {}
  for split in SPLITS:
    path = pathlib.Path(directory) / f"{split}.array_record"
    if not path.exists():
      raise ConfigError(f"config.data.dir: {path} not found; convert the data again.")
    out[split] = str(path)
  return out


def source_path(directory: str, path: str) -> str:
  """A manifest's path (tokenizer, processor, source) as a path to open from any working
  directory. Conversions store absolute paths, or paths inside the directory relative to it;
  older ones stored paths relative to where the converter ran, so a relative path that is not in
  the directory is tried against the working directory too."""
  if not path or pathlib.Path(path).is_absolute():
    return path
  inside = pathlib.Path(directory) / path
  if inside.exists() or not pathlib.Path(path).exists():
    return str(inside.absolute())
  return str(pathlib.Path(path).absolute())


# Conversion.

# What an ArrayRecord writer may hold before its file grows (it writes 16 MiB at a time): a file
# that has not grown while this much more was given to it has failed.
WRITE_LAG = 64 << 20
# A default eval split: 1% of the records, at least 10 and at most 1000, at most a tenth of them.
EVAL_FRACTION, EVAL_MIN, EVAL_MAX = 0.01, 10, 1000


class RecordError(ValueError):
  """A record that cannot be converted: the reason (a short key) and the message."""

  def __init__(self, reason: str, message: str):
    super().__init__(message)
    self.reason = reason


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


def read_records(path: pathlib.Path) -> list[dict]:
  """The records of a LLaVA-format JSON list or JSONL file (UTF-8)."""
  try:
    data = pathlib.Path(path).read_bytes()
  except OSError as e:
    raise ConfigError(f"--json {path}: unreadable ({os.strerror(e.errno) if e.errno else e}).") \
        from None
  try:
    text = data.decode("utf-8-sig")
  except UnicodeDecodeError as e:
    raise ConfigError(f"--json {path}: not UTF-8 (byte {data[e.start]:#04x} at offset {e.start}); "
                      "JSON is UTF-8: save the file as UTF-8.") from None
  if text.lstrip().startswith("["):
    try:
      out = json.loads(text)
    except ValueError as e:
      raise ConfigError(f"--json {path}: not JSON ({e}).") from None
  else:
    out = []
    for k, line in enumerate(text.splitlines()):
      if line.strip():
        try:
          out.append(json.loads(line))
        except ValueError as e:
          raise ConfigError(f"--json {path}: line {k + 1} is not JSON ({e}); JSONL holds one "
                            "record a line.") from None
  if not isinstance(out, list):
    raise ConfigError(f"--json {path}: a {type(out).__name__}, not a list of records.")
  bad = next((i for i, r in enumerate(out) if not isinstance(r, dict)), None)
  if bad is not None:
    raise ConfigError(f"--json {path}: record {bad} is a {type(out[bad]).__name__}, not an object "
                      "with an id and conversations.")
  if not out:
    raise ConfigError(f"--json {path}: no records.")
  return out


def default_eval(records: int) -> int:
  """The eval split's size when none is given (EVAL_FRACTION, EVAL_MIN, EVAL_MAX)."""
  return max(1, min(EVAL_MAX, max(EVAL_MIN, round(records * EVAL_FRACTION)), records // 10))


def eval_split(records: list[dict], count: int, seed: int) -> tuple[set[int], list]:
  """The indices of about `count` records drawn for eval with `seed`, every record of one id on
  the same side (records without an id stand alone), and the ids several records share."""
  n = len(records)
  if n < 2:
    raise ConfigError(f"--json holds {n} record; a conversion needs at least 2 (one to train on, "
                      "one to evaluate).")
  if count < 1:
    raise ConfigError(f"--eval {count}: a run evaluates on the eval split (eval.samples > 0); "
                      f"hold out at least 1 record (without --eval: {default_eval(n)}).")
  if count >= n:
    raise ConfigError(f"--eval {count}: --json holds {n} records, and training needs some; hold "
                      f"out fewer (without --eval: {default_eval(n)}).")
  groups: dict[str, list[int]] = {}
  for i, r in enumerate(records):
    key = r.get("id")
    groups.setdefault(f"i{i}" if key is None else "k" + json.dumps(key, sort_keys=True),
                      []).append(i)
  members = list(groups.values())
  chosen: set[int] = set()
  for g in np.random.default_rng(seed).permutation(len(members)):
    if len(chosen) >= count:
      break
    chosen.update(members[g])
  if len(chosen) >= n:
    raise ConfigError(f"--eval {count}: the records share ids so that none would be left to "
                      "train on (each id's records stay on one side); hold out fewer.")
  shared = [records[g[0]].get("id") for g in members if len(g) > 1]
  return chosen, shared


def estimate_bytes(records: list[dict], proc) -> int:
  """About the bytes a conversion writes: each listed image at the processor's size (a lower
  bound where the processor keeps the aspect ratio) and a header a record."""
  h, w = proc.crop or proc.size or (proc.shortest_edge,) * 2
  images = 0
  for r in records:
    f = r.get("image")
    images += 1 if isinstance(f, str) else len(f) if isinstance(f, list) else 0
  return images * h * w * (3 if proc.convert_rgb else 1) + len(records) * 256


_WORKER = {}


def _init(opts: Options) -> None:
  """The tokenizer, processor and image token of `opts`; one error naming the flag if unusable."""
  # pylint: disable=import-outside-toplevel
  from mimo_jax.data.chat import ChatError, ChatTokenizer
  from mimo_jax.data.images import ImageProcessor
  try:
    tok = ChatTokenizer.open(opts.tokenizer)
  except ChatError as e:
    raise ConfigError(f"--tokenizer {opts.tokenizer}: {e}") from None
  try:
    image_id = tok.token_id(opts.image_token)
  except ChatError as e:
    raise ConfigError(f"--image_token {opts.image_token!r}: {e}") from None
  images = pathlib.Path(opts.images)
  _WORKER.update(opts=opts, tok=tok, images=images, root=os.path.realpath(images),
                 proc=ImageProcessor.open(opts.processor or opts.tokenizer,
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
  files = record.get("image")
  if files is None:
    return []
  if isinstance(files, str):
    return [files]
  if isinstance(files, list) and all(isinstance(f, str) for f in files):
    return files
  raise RecordError("bad image field", f"{where}: \"image\" is {json.dumps(files)[:60]}, not a "
                    "path or a list of paths.")


def _read_image(f: str, where: str):
  """The processor's pixels of image file `f` (relative to --images)."""
  # pylint: disable=import-outside-toplevel
  from PIL import Image
  w = _WORKER
  path = w["images"] / f
  real = os.path.realpath(path)
  if not w["opts"].allow_outside_images and os.path.commonpath([real, w["root"]]) != w["root"]:
    raise RecordError("outside --images", f"{where}: image {f!r} leads out of --images "
                      f"({real}); --allow_outside_images reads it.")
  try:
    with warnings.catch_warnings():
      # Past MAX_IMAGE_PIXELS Pillow only warns; such an image would take a worker's memory.
      warnings.simplefilter("error", Image.DecompressionBombWarning)
      with Image.open(path) as image:
        return w["proc"](image)
  except FileNotFoundError:
    raise RecordError("missing image", f"{where}: image {path} not found.") from None
  except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
    raise RecordError("image too large", f"{where}: image {path} is too large to decode ({e}).") \
        from None
  except Exception as e:  # pylint: disable=broad-except
    raise RecordError("corrupt image", f"{where}: image {path} cannot be read ({e}).") from None


def convert_record(record: dict, where: str) -> dict:
  """One record -> a sample (`tokens`, `loss_mask`, `images`), or RecordError (after `_init`)."""
  # pylint: disable=import-outside-toplevel
  from mimo_jax.data.chat import ChatError, TokenizeError, messages
  w, opts = _WORKER, _WORKER["opts"]
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
                      f"lists {len(files)} images.")
  pixels = [_read_image(f, where) for f in files]
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
  if not mask.any():
    raise RecordError("no assistant turn", f"{where}: no assistant turn to learn from.")
  length = positions(len(ids), len(files), opts.image_tokens)
  if opts.seq_len and length > opts.seq_len:
    raise RecordError("too long", f"{where}: {length} tokens ({len(files)} images of "
                      f"{opts.image_tokens}) exceed --seq_len {opts.seq_len}.")
  return {"tokens": ids, "loss_mask": mask, "images": pixels}


def positions(tokens: int, images: int, image_tokens: int) -> int:
  """Positions a sample takes in a row: every token but the last is an input (as the layout
  counts), each image `image_tokens` of them."""
  return tokens - 1 + images * (image_tokens - 1)


def _work(item):
  index, record, source = item
  where = f"{source}: record {index} (id {record.get('id', '?')!r})"
  try:
    return index, convert_record(record, where), None
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
    self.given += len(record)
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
  `output.Interrupted`: a handler's exception raised inside a garbage-collection callback is only
  printed, so the conversion loop looks at the record too."""
  # pylint: disable-next=import-outside-toplevel
  from mimo_jax import output
  caught, kept = [], {}

  def handle(signum, frame):  # pylint: disable=unused-argument
    caught.append(signum)
    raise output.Interrupted(signum)
  if threading.current_thread() is threading.main_thread():
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
      if callable(signal.getsignal(s)):
        kept[s] = signal.signal(s, handle)
  try:
    yield caught
  finally:
    for s, h in kept.items():
      signal.signal(s, h)


def convert(source: pathlib.Path, out: pathlib.Path, opts: Options, eval_count: int | None = None,
            seed: int = 0, eval_ids=None, progress: bool = True) -> dict:
  """Converts the LLaVA-format records of `source` into directory `out` (shards, sidecars,
  manifest) and returns the manifest, with the seconds it took under `seconds`, the records read
  under `records` and the ids several records share under `shared_ids`. Eval takes `eval_count`
  records (None: `default_eval`) drawn with `seed`, every record of an id on one side, or the
  record indices `eval_ids`. Bad records are skipped and counted (`on_error="skip"`, each reported
  on stderr) or raise ConfigError with nothing written; a failed write is a ConfigError naming the
  file system's reason; any failure or interrupt removes what this conversion wrote. Callers that
  publish `out` as a whole (tools.convert) pass a fresh staging directory."""
  with _caught_signals() as caught:  # from the start: a signal during the imports counts too
    return _convert(pathlib.Path(source), pathlib.Path(out), opts, eval_count, seed, eval_ids,
                    progress, caught)


def _convert(source: pathlib.Path, out: pathlib.Path, opts: Options, eval_count: int | None,
             seed: int, eval_ids, progress: bool, caught: list[int]) -> dict:
  """`convert`, with the signals `_caught_signals` recorded in `caught`."""
  # pylint: disable=import-outside-toplevel
  from tqdm import tqdm
  from mimo_jax import output
  from mimo_jax.data import meta
  from mimo_jax.data.tokenizer import Tokenizer
  if (out / MANIFEST).exists():
    raise ConfigError(f"{out}: holds a conversion already ({MANIFEST}); choose another --out or "
                      "delete it.")
  if not pathlib.Path(opts.images).is_dir():
    raise ConfigError(f"--images {opts.images}: not a directory; give the folder the records' "
                      "image paths are relative to.")
  records = read_records(source)
  _init(opts)  # here first: a bad tokenizer or processor is one error before any work
  tok, proc, image_id = _WORKER["tok"], _WORKER["proc"], _WORKER["image_id"]
  shared = []
  if eval_ids is None:
    eval_ids, shared = eval_split(records, default_eval(len(records)) if eval_count is None
                                  else eval_count, seed)
  eval_ids = set(eval_ids)
  output.check_space(out, estimate_bytes(records, proc), f"converting {source}")
  made = not out.exists()
  try:
    out.mkdir(parents=True, exist_ok=True)
  except OSError as e:
    raise ConfigError(describe_os_error(e, str(out))) from None
  tmp = {s: out / f".{s}.array_record.tmp" for s in SPLITS}
  shards = {}
  rows = {s: [] for s in SPLITS}
  skipped, images, sizes = collections.Counter(), 0, collections.Counter()
  channels, longest, most_images = collections.Counter(), 0, 0
  tok0 = Tokenizer()  # unused by samples with their own loss mask
  items = [(i, r, str(source)) for i, r in enumerate(records)]
  started = time.perf_counter()
  pool = None
  done = 0
  try:
    try:
      shards.update({s: _Shard(p) for s, p in tmp.items()})
    except (OSError, ValueError, RuntimeError) as e:
      raise ConfigError(f"{out}: cannot create the shards ({e}).") from None
    if opts.workers > 1:
      with _workers_ignore_sigint():
        pool = multiprocessing.get_context("spawn").Pool(opts.workers, _pool_init, (opts,))
      results = pool.imap(_work, items, chunksize=16)
    else:
      results = map(_work, items)
    placeholders = {"vision": image_id}
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
        skipped[reason] += 1
        tqdm.write(f"skipped: {message}", file=sys.stderr)
        continue
      split = "eval" if index in eval_ids else "train"
      try:
        shards[split].write(encode(sample))
      except OSError as e:
        raise ConfigError(describe_os_error(e, f"writing {tmp[split]} (record {done} of "
                                            f"{len(items)})")) from None
      rows[split].append(meta.row(sample, tok0, placeholders))
      images += len(sample["images"])
      sizes.update(tuple(int(v) for v in p.shape[:2]) for p in sample["images"])
      channels.update(int(p.shape[2]) for p in sample["images"])
      longest = max(longest, positions(len(sample["tokens"]), len(sample["images"]),
                                       opts.image_tokens))
      most_images = max(most_images, len(sample["images"]))
    if caught:  # after the last record
      raise output.Interrupted(caught[0])
    if pool is not None:
      pool.close()
      pool.join()
    counts = {s: len(r) for s, r in rows.items()}
    if not counts["train"]:
      raise ConfigError(f"--json {source}: no record could be converted for train "
                        f"({dict(skipped) or 'every record was drawn for eval'}).")
    if eval_ids and not counts["eval"]:
      raise ConfigError(f"--json {source}: every record drawn for eval was skipped "
                        f"({dict(skipped)}); hold out more with --eval, or fix the records.")
    # The most common image size (every one, with a crop or a square resize); text only: the
    # processor's own.
    size = (sizes.most_common(1)[0][0] if sizes else
            proc.crop or proc.size or (proc.shortest_edge,) * 2)
    manifest_ = {"format": FORMAT_VERSION, "image_token": image_id,
                 "image_token_text": opts.image_token, "image_size": [int(v) for v in size],
                 "image_sizes": sorted([list(k) for k in sizes]),
                 "channels": channels.most_common(1)[0][0] if channels else
                 (3 if proc.convert_rgb else 1),
                 "vocab_size": tok.tokenizer.get_vocab_size(),
                 "tokenizer": _stored(opts.tokenizer, out),
                 "processor": _stored(opts.processor or opts.tokenizer, out),
                 "source": _stored(str(source), out),
                 "samples": counts, "images": images, "skipped": dict(skipped),
                 "longest": longest, "max_images": most_images,
                 "pad_to_square": opts.pad_to_square}
    try:
      for s in SPLITS:  # each shard complete before its name appears
        shards[s].close()
        final = out / f"{s}.array_record"
        meta.save(str(final), rows[s])
        os.replace(tmp[s], final)
      part = out / (MANIFEST + ".tmp")
      part.write_text(json.dumps(manifest_, indent=1))
      os.replace(part, out / MANIFEST)
    except OSError as e:
      raise ConfigError(describe_os_error(e, f"writing {getattr(e, 'filename', None) or out}")) \
          from None
  except BaseException:  # nothing of this conversion stays behind; this cleanup cannot fail
    if pool is not None:
      try:
        pool.terminate()
        pool.join()
      except Exception:  # pylint: disable=broad-except
        pass
    for shard in shards.values():
      shard.abandon()
    if not (out / MANIFEST).exists():
      for s in SPLITS:
        final = out / f"{s}.array_record"
        for p in (tmp[s], final, pathlib.Path(meta.path_of(str(final))),
                  out / (MANIFEST + ".tmp")):
          output.remove(p)
    if made:
      try:
        out.rmdir()  # only if empty
      except OSError:
        pass
    raise
  return dict(manifest_, seconds=time.perf_counter() - started, records=len(records),
              shared_ids=shared)
