"""LLaVA-format conversations -> the shards `data.task=conversations` trains on.

  python -m tools.convert --json llava_instruct.json --images coco/ --tokenizer llava-1.5-7b-hf \\
      --out data/llava [--processor DIR] [--eval 1000] [--seq_len 2048] [--image_tokens 576] \\
      [--image_token "<image>"] [--pad_to_square] [--on_error skip|fail] [--workers N]

Input: a JSON list or JSONL file of records `{"id", "image": path | [paths] | absent,
"conversations": [{"from": "human" | "gpt" | "system", "value": "...<image>..."}]}`, image paths
relative to `--images`. Each record is rendered with the language model's chat template
(`--tokenizer`: tokenizer.json and tokenizer_config.json; mimo_jax/data/chat.py), each `<image>`
becoming the image token, with a loss mask on the assistant turns; each image is prepared by the
vision tower's processor (`--processor`, default the tokenizer's directory:
preprocessor_config.json; mimo_jax/data/images.py) and stored decoded, as uint8 pixels at the
processor's size (no decoding while training).

Output in `--out`: `train.array_record` and `eval.array_record` (`--eval` records drawn at random
go to eval) with their metadata sidecars, and `conversations.json` (the manifest: image token id,
image size, vocabulary, counts). Records are converted in parallel (`--workers` processes, default
every core) with a progress bar; each shard is written under a temporary name and renamed when
complete, and the manifest last, so an interrupted run leaves no shard behind. An existing
conversion in `--out` is refused.

Bad records (a missing or corrupt image file, an `<image>` count other than the images listed, a
sample longer than `--seq_len` once each image takes `--image_tokens`, an unknown role, no
assistant turn) are skipped and counted by reason, each reported with its record id and file
(`--on_error skip`, the default), or stop the conversion with that message and exit status 2,
writing nothing (`--on_error fail`). The last lines give the counts and the flags to train with.
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing
import os
import pathlib
import sys
import time

import numpy as np

from mimo_jax.config import ConfigError

_WORKER = {}


class RecordError(ValueError):
  """A record that cannot be converted: the reason (a short key) and the message."""

  def __init__(self, reason: str, message: str):
    super().__init__(message)
    self.reason = reason


def read_records(path: pathlib.Path) -> list[dict]:
  try:
    text = path.read_text()
  except OSError as e:
    raise ConfigError(f"{path}: unreadable ({e}).") from None
  try:
    if text.lstrip().startswith("["):
      records = json.loads(text)
    else:
      records = [json.loads(line) for line in text.splitlines() if line.strip()]
  except ValueError as e:
    raise ConfigError(f"{path}: not JSON or JSONL ({e}).") from None
  if not all(isinstance(r, dict) for r in records):
    raise ConfigError(f"{path}: every record must be an object with an id and conversations.")
  return records


def _init(tokenizer: str, processor: str, images: str, image_token: str, pad_to_square: bool,
          seq_len: int, image_tokens: int) -> None:
  # pylint: disable=import-outside-toplevel
  from mimo_jax.data.chat import ChatTokenizer
  from mimo_jax.data.images import ImageProcessor
  tok = ChatTokenizer.open(tokenizer)
  _WORKER.update(tok=tok, proc=ImageProcessor.open(processor, pad_to_square=pad_to_square),
                 images=pathlib.Path(images), image_token=image_token,
                 image_id=tok.token_id(image_token), seq_len=seq_len, image_tokens=image_tokens)


def convert(record: dict, where: str) -> dict:
  """One record -> a sample (`tokens`, `loss_mask`, `images`), or RecordError."""
  # pylint: disable=import-outside-toplevel
  from PIL import Image, UnidentifiedImageError
  from mimo_jax.data.chat import ChatError, messages
  w = _WORKER
  turns = record.get("conversations")
  if not isinstance(turns, list) or not turns:
    raise RecordError("no conversations", f"{where}: no conversations list.")
  try:
    msgs = messages(turns, f"{where}: ")
  except ChatError as e:
    raise RecordError("unknown role", str(e)) from None
  files = record.get("image", [])
  files = [files] if isinstance(files, str) else list(files)
  marks = sum(str(m["content"]).count(w["image_token"]) for m in msgs)
  if marks != len(files):
    raise RecordError("image count", f"{where}: its text has {marks} {w['image_token']} but it "
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
  if int((ids == w["image_id"]).sum()) != len(files):
    raise RecordError("image count", f"{where}: {int((ids == w['image_id']).sum())} image tokens "
                      f"after tokenizing, for {len(files)} images (is {w['image_token']!r} one "
                      "special token of the tokenizer?).")
  if not mask.any():
    raise RecordError("no assistant turn", f"{where}: no assistant turn to learn from.")
  # Positions it takes in a row: every token but the last is an input (as the layout counts).
  length = len(ids) - 1 + len(files) * (w["image_tokens"] - 1)
  if w["seq_len"] and length > w["seq_len"]:
    raise RecordError("too long", f"{where}: {length} tokens ({len(files)} images of "
                      f"{w['image_tokens']}) exceed --seq_len {w['seq_len']}.")
  return {"tokens": ids, "loss_mask": mask, "images": pixels}


def _work(item):
  index, record, source = item
  where = f"{source}: record {index} (id {record.get('id', '?')!r})"
  try:
    return index, convert(record, where), None
  except RecordError as e:
    return index, None, (e.reason, str(e))


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m tools.convert", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--json", required=True, help="LLaVA-format JSON or JSONL file")
  parser.add_argument("--images", required=True, help="the folder image paths are relative to")
  parser.add_argument("--tokenizer", required=True, help="HF directory: tokenizer.json and "
                      "tokenizer_config.json with the chat template")
  parser.add_argument("--processor", default="", help="HF directory with the vision tower's "
                      "preprocessor_config.json (default: --tokenizer)")
  parser.add_argument("--out", required=True, help="folder for the shards and manifest")
  parser.add_argument("--eval", type=int, default=0, help="records held out for eval")
  parser.add_argument("--seq_len", type=int, default=0, help="longest sample in tokens "
                      "(0 = no limit)")
  parser.add_argument("--image_tokens", type=int, default=1,
                      help="tokens an image takes in the sequence, for --seq_len")
  parser.add_argument("--image_token", default="<image>", help="the text that marks an image, "
                      "one special token of the tokenizer")
  parser.add_argument("--pad_to_square", action="store_true",
                      help="LLaVA's pad to square (on the processor's mean colour)")
  parser.add_argument("--on_error", choices=("skip", "fail"), default="skip")
  parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
  parser.add_argument("--seed", type=int, default=0, help="seed of the eval draw")
  args = parser.parse_args(argv)
  try:
    return _convert(args)
  except ConfigError as e:
    print(f"convert: error: {e}", file=sys.stderr)
    return 2


def _convert(args) -> int:
  # pylint: disable=import-outside-toplevel
  from array_record.python import array_record_module
  from tqdm import tqdm
  from mimo_jax.data import conversations, meta
  from mimo_jax.data.tokenizer import Tokenizer
  out = pathlib.Path(args.out)
  if (out / conversations.MANIFEST).exists():
    raise ConfigError(f"{out}: holds a conversion already ({conversations.MANIFEST}); choose "
                      "another --out or delete it.")
  source = pathlib.Path(args.json)
  records = read_records(source)
  setup = (args.tokenizer, args.processor or args.tokenizer, args.images, args.image_token,
           args.pad_to_square, args.seq_len, args.image_tokens)
  _init(*setup)  # here first: a bad tokenizer or processor is one error before any work
  tok, proc, image_id = _WORKER["tok"], _WORKER["proc"], _WORKER["image_id"]
  eval_ids = set(np.random.default_rng(args.seed).permutation(len(records))[:args.eval].tolist())
  made = not out.exists()
  out.mkdir(parents=True, exist_ok=True)
  tmp = {s: out / f".{s}.array_record.tmp" for s in conversations.SPLITS}
  writers = {s: array_record_module.ArrayRecordWriter(str(p), "group_size:1")
             for s, p in tmp.items()}
  rows = {s: [] for s in conversations.SPLITS}
  skipped, images, sizes = collections.Counter(), 0, collections.Counter()
  tok0 = Tokenizer()  # unused by samples with their own loss mask
  items = [(i, r, str(source)) for i, r in enumerate(records)]
  started = time.perf_counter()
  pool = None
  try:
    if args.workers > 1:
      pool = multiprocessing.get_context("spawn").Pool(args.workers, _init, setup)
      results = pool.imap(_work, items, chunksize=16)
    else:
      results = map(_work, items)
    placeholders = {"vision": image_id}
    for index, sample, error in tqdm(results, total=len(items), desc="converting",
                                     unit="record", file=sys.stderr, mininterval=1.0):
      if error is not None:
        reason, message = error
        if args.on_error == "fail":
          raise ConfigError(message + " (--on_error skip converts the rest)")
        skipped[reason] += 1
        tqdm.write(f"skipped: {message}", file=sys.stderr)
        continue
      split = "eval" if index in eval_ids else "train"
      writers[split].write(conversations.encode(sample))
      rows[split].append(meta.row(sample, tok0, placeholders))
      images += len(sample["images"])
      sizes.update(tuple(int(v) for v in p.shape[:2]) for p in sample["images"])
    if pool is not None:
      pool.close()
  except BaseException:  # nothing of this conversion stays behind
    if pool is not None:
      pool.terminate()
    for s, w in writers.items():
      w.close()
      tmp[s].unlink(missing_ok=True)
    if made and not any(out.iterdir()):
      out.rmdir()
    raise
  for w in writers.values():
    w.close()
  counts = {s: len(r) for s, r in rows.items()}
  if not counts["train"]:
    for p in tmp.values():
      p.unlink(missing_ok=True)
    raise ConfigError(f"{source}: no record could be converted ({dict(skipped)}).")
  # The most common image size (every one, with a crop or a square resize); text only: the
  # processor's own.
  size = (sizes.most_common(1)[0][0] if sizes else
          proc.crop or proc.size or (proc.shortest_edge,) * 2)
  for s in conversations.SPLITS:  # each shard complete before its name appears
    final = out / f"{s}.array_record"
    meta.save(str(final), rows[s])
    os.replace(tmp[s], final)
  vocab = tok.tokenizer.get_vocab_size()
  manifest = {"format": conversations.FORMAT_VERSION, "image_token": image_id,
              "image_token_text": args.image_token, "image_size": [int(v) for v in size],
              "image_sizes": sorted([list(k) for k in sizes]),
              "vocab_size": vocab, "tokenizer": str(args.tokenizer),
              "processor": str(args.processor or args.tokenizer), "source": str(source),
              "samples": counts, "images": images, "skipped": dict(skipped),
              "pad_to_square": args.pad_to_square}
  part = out / (conversations.MANIFEST + ".tmp")
  part.write_text(json.dumps(manifest, indent=1))
  os.replace(part, out / conversations.MANIFEST)
  took = time.perf_counter() - started
  print(f"converted {len(records)} records in {took:.1f} s ({len(records) / took:.1f} "
        f"records/s, {args.workers} workers): {counts['train']} train and {counts['eval']} eval "
        f"samples, {images} images, {sum(skipped.values())} skipped"
        + (f" ({', '.join(f'{k}: {v}' for k, v in sorted(skipped.items()))})" if skipped
           else ""))
  print(f"train with: --config.data.task=conversations --config.data.dir={out} "
        f"--config.data.image_token={image_id} --config.model.vision.image_size={size[0]} "
        f"--config.model.language.vocab_size={vocab} (or the model's larger vocabulary)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
