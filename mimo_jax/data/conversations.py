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
parallel worker processes. Paths in the manifest that lie inside the directory are stored relative
to it (`source_path` resolves them).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import multiprocessing
import os
import pathlib
import sys
import time

import numpy as np

from mimo_jax.config import Config, ConfigError
from mimo_jax.data import records

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
  if not d.slot_patches and (h, w) != (v.image_size, v.image_size):
    raise ConfigError(f"config.model.vision.image_size: {v.image_size} where {directory} holds "
                      f"{h}x{w} images; set model.vision.image_size={h}, or data.slot_patches.")
  others = [f"{a}x{b}" for a, b in m.get("image_sizes", []) if (a, b) != (h, w)]
  if others and not d.slot_patches:
    raise ConfigError(f"config.data.slot_patches: {directory} holds images of several sizes "
                      f"({h}x{w}, {', '.join(others[:3])}), which need dynamic resolution; set "
                      "data.slot_patches, or convert with a processor that crops.")
  vocab = cfg.model.language.vocab_size or m["vocab_size"]
  if vocab < m["vocab_size"]:
    raise ConfigError(f"config.model.language.vocab_size: {vocab} is less than the tokenizer's "
                      f"{m['vocab_size']} ({m['tokenizer']}).")
  out = {}
  for split in SPLITS:
    path = pathlib.Path(directory) / f"{split}.array_record"
    if not path.exists():
      raise ConfigError(f"config.data.dir: {path} not found; convert the data again.")
    out[split] = str(path)
  return out


def source_path(directory: str, path: str) -> str:
  """A manifest's path (tokenizer, processor, source) as a path to open."""
  return str(pathlib.Path(directory) / path) if not pathlib.Path(path).is_absolute() else path


# Conversion.

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


def read_records(path: pathlib.Path) -> list[dict]:
  """The records of a LLaVA-format JSON list or JSONL file."""
  try:
    text = path.read_text()
  except OSError as e:
    raise ConfigError(f"{path}: unreadable ({e}).") from None
  try:
    if text.lstrip().startswith("["):
      out = json.loads(text)
    else:
      out = [json.loads(line) for line in text.splitlines() if line.strip()]
  except ValueError as e:
    raise ConfigError(f"{path}: not JSON or JSONL ({e}).") from None
  if not isinstance(out, list) or not all(isinstance(r, dict) for r in out):
    raise ConfigError(f"{path}: every record must be an object with an id and conversations.")
  return out


_WORKER = {}


def _init(opts: Options) -> None:
  # pylint: disable=import-outside-toplevel
  from mimo_jax.data.chat import ChatTokenizer
  from mimo_jax.data.images import ImageProcessor
  tok = ChatTokenizer.open(opts.tokenizer)
  _WORKER.update(opts=opts, tok=tok, images=pathlib.Path(opts.images),
                 proc=ImageProcessor.open(opts.processor or opts.tokenizer,
                                          pad_to_square=opts.pad_to_square),
                 image_id=tok.token_id(opts.image_token))


def convert_record(record: dict, where: str) -> dict:
  """One record -> a sample (`tokens`, `loss_mask`, `images`), or RecordError (after `_init`)."""
  # pylint: disable=import-outside-toplevel
  from PIL import Image, UnidentifiedImageError
  from mimo_jax.data.chat import ChatError, messages
  w, opts = _WORKER, _WORKER["opts"]
  turns = record.get("conversations")
  if not isinstance(turns, list) or not turns:
    raise RecordError("no conversations", f"{where}: no conversations list.")
  try:
    msgs = messages(turns, f"{where}: ")
  except ChatError as e:
    raise RecordError("unknown role", str(e)) from None
  files = record.get("image", [])
  files = [files] if isinstance(files, str) else list(files)
  marks = sum(str(m["content"]).count(opts.image_token) for m in msgs)
  if marks != len(files):
    raise RecordError("image count", f"{where}: its text has {marks} {opts.image_token} but it "
                      f"lists {len(files)} images.")
  pixels = []
  for f in files:
    path = w["images"] / f
    try:
      with Image.open(path) as image:
        pixels.append(w["proc"](image))
    except FileNotFoundError:
      raise RecordError("missing image", f"{where}: image {path} not found.") from None
    except (UnidentifiedImageError, OSError, ValueError) as e:
      raise RecordError("corrupt image", f"{where}: image {path} cannot be read ({e}).") \
          from None
  try:
    ids, mask = w["tok"].encode(msgs)
  except ChatError as e:
    raise RecordError("template", f"{where}: {e}") from None
  found = int((ids == w["image_id"]).sum())
  if found != len(files):
    raise RecordError("image count", f"{where}: {found} image tokens after tokenizing, for "
                      f"{len(files)} images (is {opts.image_token!r} one special token of the "
                      "tokenizer?).")
  if not mask.any():
    raise RecordError("no assistant turn", f"{where}: no assistant turn to learn from.")
  # Positions it takes in a row: every token but the last is an input (as the layout counts).
  length = len(ids) - 1 + len(files) * (opts.image_tokens - 1)
  if opts.seq_len and length > opts.seq_len:
    raise RecordError("too long", f"{where}: {length} tokens ({len(files)} images of "
                      f"{opts.image_tokens}) exceed --seq_len {opts.seq_len}.")
  return {"tokens": ids, "loss_mask": mask, "images": pixels}


def _work(item):
  index, record, source = item
  where = f"{source}: record {index} (id {record.get('id', '?')!r})"
  try:
    return index, convert_record(record, where), None
  except RecordError as e:
    return index, None, (e.reason, str(e))


def _relative(path: str, out: pathlib.Path) -> str:
  p = pathlib.Path(path).resolve()
  return str(p.relative_to(out.resolve())) if p.is_relative_to(out.resolve()) else str(path)


def convert(source: pathlib.Path, out: pathlib.Path, opts: Options, eval_count: int = 0,
            seed: int = 0, eval_ids=None, progress: bool = True) -> dict:
  """Converts the LLaVA-format records of `source` into `out` (shards, sidecars, manifest) and
  returns the manifest, with the seconds it took under `seconds`. Eval takes `eval_count`
  records drawn with `seed`, or the record indices `eval_ids`. Bad records are skipped and
  counted (`on_error="skip"`, each reported on stderr) or raise ConfigError with nothing written;
  any failure removes what this conversion wrote."""
  # pylint: disable=import-outside-toplevel
  from array_record.python import array_record_module
  from tqdm import tqdm
  from mimo_jax.data import meta
  from mimo_jax.data.tokenizer import Tokenizer
  source, out = pathlib.Path(source), pathlib.Path(out)
  if (out / MANIFEST).exists():
    raise ConfigError(f"{out}: holds a conversion already ({MANIFEST}); choose another --out or "
                      "delete it.")
  records = read_records(source)
  _init(opts)  # here first: a bad tokenizer or processor is one error before any work
  tok, proc, image_id = _WORKER["tok"], _WORKER["proc"], _WORKER["image_id"]
  if eval_ids is None:
    eval_ids = np.random.default_rng(seed).permutation(len(records))[:eval_count].tolist()
  eval_ids = set(eval_ids)
  made = not out.exists()
  out.mkdir(parents=True, exist_ok=True)
  tmp = {s: out / f".{s}.array_record.tmp" for s in SPLITS}
  writers = {s: array_record_module.ArrayRecordWriter(str(p), "group_size:1")
             for s, p in tmp.items()}
  rows = {s: [] for s in SPLITS}
  skipped, images, sizes = collections.Counter(), 0, collections.Counter()
  tok0 = Tokenizer()  # unused by samples with their own loss mask
  items = [(i, r, str(source)) for i, r in enumerate(records)]
  started = time.perf_counter()
  pool = None
  try:
    if opts.workers > 1:
      pool = multiprocessing.get_context("spawn").Pool(opts.workers, _init, (opts,))
      results = pool.imap(_work, items, chunksize=16)
    else:
      results = map(_work, items)
    placeholders = {"vision": image_id}
    for index, sample, error in tqdm(results, total=len(items), desc="converting",
                                     unit="record", file=sys.stderr, mininterval=1.0,
                                     disable=not progress):
      if error is not None:
        reason, message = error
        if opts.on_error == "fail":
          raise ConfigError(message + " (--on_error skip converts the rest)")
        skipped[reason] += 1
        tqdm.write(f"skipped: {message}", file=sys.stderr)
        continue
      split = "eval" if index in eval_ids else "train"
      writers[split].write(encode(sample))
      rows[split].append(meta.row(sample, tok0, placeholders))
      images += len(sample["images"])
      sizes.update(tuple(int(v) for v in p.shape[:2]) for p in sample["images"])
    if pool is not None:
      pool.close()
    for s in SPLITS:
      writers.pop(s).close()
    counts = {s: len(r) for s, r in rows.items()}
    if not counts["train"]:
      raise ConfigError(f"{source}: no record could be converted ({dict(skipped)}).")
    # The most common image size (every one, with a crop or a square resize); text only: the
    # processor's own.
    size = (sizes.most_common(1)[0][0] if sizes else
            proc.crop or proc.size or (proc.shortest_edge,) * 2)
    for s in SPLITS:  # each shard complete before its name appears
      final = out / f"{s}.array_record"
      meta.save(str(final), rows[s])
      os.replace(tmp[s], final)
    manifest_ = {"format": FORMAT_VERSION, "image_token": image_id,
                 "image_token_text": opts.image_token, "image_size": [int(v) for v in size],
                 "image_sizes": sorted([list(k) for k in sizes]),
                 "vocab_size": tok.tokenizer.get_vocab_size(),
                 "tokenizer": _relative(opts.tokenizer, out),
                 "processor": _relative(opts.processor or opts.tokenizer, out),
                 "source": _relative(str(source), out),
                 "samples": counts, "images": images, "skipped": dict(skipped),
                 "pad_to_square": opts.pad_to_square}
    part = out / (MANIFEST + ".tmp")
    part.write_text(json.dumps(manifest_, indent=1))
    os.replace(part, out / MANIFEST)
  except BaseException:  # nothing of this conversion stays behind
    if pool is not None:
      pool.terminate()
    for w in writers.values():
      w.close()
    if not (out / MANIFEST).exists():
      for s in SPLITS:
        final = out / f"{s}.array_record"
        for p in (tmp[s], final, pathlib.Path(meta.path_of(str(final)))):
          p.unlink(missing_ok=True)
    if made and out.exists() and not any(out.iterdir()):
      out.rmdir()
    raise
  return dict(manifest_, seconds=time.perf_counter() - started, records=len(records))
