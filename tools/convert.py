"""LLaVA-format conversations -> the shards `data.task=conversations` trains on.

  python -m tools.convert --json llava_instruct.json [--images coco/] --tokenizer llava-1.5-7b-hf \\
      --out data/llava [--processor DIR] [--eval N] [--seq_len 2048] [--image_tokens 576] \\
      [--global_batch N] \\
      [--image_token "<image>"] [--pad_to_square] [--on_error skip|fail] \\
      [--max_skipped_fraction 0.05] [--workers N] \\
      [--allow_outside_images] [--audio DIR] [--audio_token "<|AUDIO|>"] \\
      [--audio_markers "<|audio_bos|><|AUDIO|><|audio_eos|>"] [--mel_bins 128] [--audio_pool 2] \\
      [--audio_window 30]

Input: a JSON list or JSONL file (UTF-8) of records `{"id", "image": path | [paths] | absent,
"conversations": [{"from": "human" | "gpt" | "system", "value": "...<image>..."}]}`, image paths
relative to `--images` (default: the folder of `--json`, as tools.eval reads them). Each record is
rendered with the language model's chat template (`--tokenizer`: tokenizer.json and
tokenizer_config.json; mimo_jax/data/chat.py), each `<image>` becoming the image token, with a loss
mask on the assistant turns; each image is prepared by the vision tower's processor (`--processor`,
default the tokenizer's directory: preprocessor_config.json; mimo_jax/data/images.py) and stored
decoded, as uint8 pixels at the processor's size (no decoding while training); a 16-bit grayscale
image is scaled to 8 bits and a float one read as [0, 1]. The image token and the processor are
needed only where records list images: records of text and clips alone convert without them (the
manifest's image token is then -1, its image size and channels null, and the launch line names no
data.image_token).

Output in `--out`: `train.array_record` and `eval.array_record` (each sample with its record's
`"id"`, or its index in `--json` where it has none) with their metadata sidecars, and
`conversations.json` (the manifest: image token id, image size, vocabulary, counts, and the
tokenizer, processor and source as absolute paths, so tools read them from any directory). Eval
holds `--eval` records drawn at random (default: 1% of the records, at least 10 and at most 1000,
and at most a tenth of them); every record of one id goes to the same side, so that no eval
conversation is trained on. `--eval` below 1 (training evaluates on the eval split) or not below
the record count is refused. Records are converted in parallel (`--workers` processes, default
every core), with a progress bar where stderr is a terminal, else a line every 10 s (records
done, skipped, rate, time left).

`--out` is written as a whole or not at all: a lock beside it (`.<name>.lock`) stops a second
conversion into it, everything is written into a staging directory beside it that is renamed into
place when complete, and an interrupted or failed conversion (Ctrl-C: exit status 130, SIGTERM:
143) leaves nothing behind, not even the folders above `--out` it made; a staging directory left
by a killed one is removed by the next. The
output's size (each image at the processor's size) is checked against the free space first, and a
failed write (a full disk, a quota, a file size limit) stops the conversion at once with the
reason. An `--out` that is a file, a non-empty folder that holds no conversion, a folder with a
conversion, or a place that cannot be written is refused.

Bad records (a missing, corrupt or too large image, an unsupported one (a float image with values
outside [0, 1], a 32-bit integer image), an id that is not a string or an integer, an image field
that is not a path or a list of paths, an image path leading out of `--images` by `..`, an absolute
path or a symbolic link, an `<image>` count other than the images listed, an `<image>` or `<audio>`
in an assistant turn (images and clips go in a user turn), turns that are not objects
with text values, a word the tokenizer cannot encode or encodes as its unknown token (`[UNK]`: a
word outside the vocabulary), a sample longer than `--seq_len` once each
image takes `--image_tokens`, an unknown role, no assistant turn, an assistant turn first where the
chat template renders none without a turn before it) are skipped and counted by reason, each
reported on a `skipped:` line with its record id and file (the first 5 of a reason, then one line
saying the rest are not printed; `--on_error skip`, the default), or stop the conversion with
that message and exit status 2, writing nothing (`--on_error fail`). Skipped records end the
conversion with a warning that counts them by reason with each reason's first records, and are
listed in `skipped.jsonl` in `--out` (`record`, `id`, `reason`, `error` a row); more of them than
`--max_skipped_fraction` of the records (default 0.05; 1: never) fail the conversion with that
summary, exit status 2, writing nothing.
`--allow_outside_images` reads image paths outside `--images` too. A tokenizer without a chat
template, an `--image_token` that is not one token of it or a `--processor` without a usable
preprocessor_config.json (where records list images), or a `--json` that is not UTF-8 JSON is
one error line, exit status 2, and so is a `--json` whose top level is an object (`{"data":
[...]}`), not a list of records. Notes (the tokens an image takes) follow a conversion that is
done, so an error is one line.

Audio: a record may list clips under `"audio"` or `"audios"` (a path or a list of paths, relative to
`--audio`, default the folder of `--json` as for images; WAV, FLAC, OGG/Opus and, with libsndfile >=
1.1, MP3), each marked by `<audio>` in the text, with or without images. Each `<audio>` becomes
`--audio_markers` (Qwen2-Audio's `<|audio_bos|><|AUDIO|><|audio_eos|>` by default), whose
`--audio_token` (one special token of the tokenizer) the layout expands to the clip's tokens. Clips
are decoded, mixed down, resampled to 16 kHz and stored as Whisper log-mel features of `--mel_bins`
(80 or 128) bins, whole 30 s windows (3000 frames · mel_bins float32: 960 KB a window at 80 bins),
beside each clip's audio frames; a clip longer than 30 s spans several windows. `--audio_window S`
makes windows of S seconds instead (the feature extractor's chunk_length), for a tower of S · 50
positions (model.audio.positions): the toy towers of tests and demos. For `--seq_len` a clip takes
the tokens its audio frames give after the stride-2 convolution and `--audio_pool` (Qwen2-Audio: 2,
Whisper: 1). A missing clip (named with the folder it was looked for in), an empty, corrupt or
unsupported one, one too short to yield a token (20 ms or less under `--audio_pool 2`), an `<audio>`
count other than the clips listed, or a clip path leading out of `--audio` (`--allow_outside_images`
reads those too) is a bad record like a bad image. The manifest records the audio token id and mel
bins, which training checks against model.audio.audio_token and model.audio.mel_bins.

The last lines give the counts and a launch line with the flags to train with: data.task,
data.dir (absolute), data.image_token, data.seq_len (`--seq_len`, or the longest sample with
each image taking `--image_tokens`), data.global_batch (`--global_batch`, where given: else the
model config's), model.vision.max_images, eval.samples (the eval split), the image size and
channels, with clips model.audio's audio_token, mel_bins, max_audios, max_windows and positions
(half a window's frames: 1500 for 30 s windows), and model.language.vocab_size: the vocab_size
of config.json beside the tokenizer (a LLaVA's text_config's; it may exceed the tokenizer's
count), else the tokenizer's count.
MODEL_CONFIG in that line is the model's config file: the WORKDIR/config.py that `python -m
tools.hf import` wrote, or a configs/ file.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import shlex
import sys

# The conversion reads records through modules that import JAX; imported here, before SIGTERM
# becomes an exception, since an exception raised while jaxlib's extension module loads crashes
# the process instead of unwinding it.
import jax  # pylint: disable=unused-import

from mimo_jax import output
from mimo_jax.config import ConfigError
from mimo_jax.data import (audio, audio_records, conversion, conversion_files, conversion_record,
                           conversations, llava_json)
from mimo_jax.workdir import Made
from tools.common import Parser, path_flag
from tools.display import count

MODEL_CONFIG = ("the model's config file: the WORKDIR/config.py `python -m tools.hf import` "
                "wrote, or a configs/ file")


def tower_tokens(directory: str) -> tuple[int | None, str]:
  """The tokens an image of the tower in `directory` takes (its patches, as LLaVA uses them: the
  class token dropped, every patch kept) and where that came from; (None, why) when the
  directory's config.json names no tower."""
  path = pathlib.Path(directory) / "config.json"
  try:
    config = json.loads(path.read_text(encoding="utf-8"))
  except (OSError, ValueError):
    return None, f"{path} is missing or not JSON, so the tower's patches are unknown"
  tower = config.get("vision_config", config) if isinstance(config, dict) else {}
  size, patch = tower.get("image_size"), tower.get("patch_size")
  if not (isinstance(size, int) and isinstance(patch, int) and 0 < patch <= size):
    return None, f"{path} names no vision tower with an image_size and a patch_size"
  return (size // patch) ** 2, f"{size // patch}x{size // patch} patches of the tower in {path}"


def main(argv: list[str] | None = None) -> int:
  parser = Parser("tools.convert", prog="python -m tools.convert", sep=" ", allow_abbrev=False,
                  description=__doc__,
                  formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--json", required=True, help="LLaVA-format JSON or JSONL file (UTF-8)")
  parser.add_argument("--images", default=None, type=path_flag,
                      help="the folder image paths are relative to (default: --json's folder, as "
                      "tools.eval's; records without images need none)")
  parser.add_argument("--tokenizer", required=True, help="HF directory: tokenizer.json and "
                      "tokenizer_config.json with the chat template")
  parser.add_argument("--processor", default="", help="HF directory with the vision tower's "
                      "preprocessor_config.json (default: --tokenizer)")
  parser.add_argument("--out", required=True, type=path_flag,
                      help="folder for the shards and manifest (absent or empty)")
  parser.add_argument("--eval", type=int, default=None,
                      help="records held out for eval, at least 1 (default: 1%% of the records, "
                      f"at least {llava_json.EVAL_MIN} and at most {llava_json.EVAL_MAX}, "
                      "at most a tenth)")
  parser.add_argument("--seq_len", type=int, default=0, help="longest sample in tokens "
                      "(0 = no limit)")
  parser.add_argument("--image_tokens", type=int, default=None,
                      help="tokens an image takes in the sequence, for --seq_len and the launch "
                      "line's data.seq_len (default: the tower's patches, (image_size / "
                      "patch_size)^2, from config.json in --processor's or --tokenizer's "
                      "directory; 1, with a note, when it has none)")
  parser.add_argument("--global_batch", type=int, default=None,
                      help="samples a step, for the launch line's data.global_batch (default: "
                      "none in the line, so the model config's holds: configs/vlm.py's 32, "
                      "configs/llava_cpu.py's 8); a multiple of the config's data.microbatches, "
                      "which launch checks")
  parser.add_argument("--image_token", default="<image>", help="the text that marks an image, "
                      "one special token of the tokenizer")
  parser.add_argument("--pad_to_square", action="store_true",
                      help="LLaVA's pad to square (on the processor's mean colour)")
  parser.add_argument("--on_error", choices=("skip", "fail"), default="skip")
  parser.add_argument("--max_skipped_fraction", type=float,
                      default=conversion_record.MAX_SKIPPED_FRACTION,
                      help="with --on_error skip: the conversion fails, writing nothing, when "
                      "more than this fraction of the records is skipped (default "
                      f"{conversion_record.MAX_SKIPPED_FRACTION:g}; 1: never)")
  parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
  parser.add_argument("--seed", type=int, default=0, help="seed of the eval draw")
  parser.add_argument("--allow_outside_images", action="store_true",
                      help="read image paths that lead out of --images (.., absolute paths, "
                      "symbolic links); without it such records are skipped")
  parser.add_argument("--audio", default=None, help="the folder audio paths are relative to "
                      "(default: --json's folder, as tools.eval's; records without clips need "
                      "none)")
  parser.add_argument("--audio_token", default=audio_records.QWEN2_AUDIO_TOKEN,
                      help="the placeholder of a clip, one special token of the tokenizer (needed "
                      "only where records list clips)")
  parser.add_argument("--audio_markers", default=audio_records.QWEN2_AUDIO,
                      help="the text each <audio> becomes, --audio_token inside")
  parser.add_argument("--mel_bins", type=int, choices=audio.MEL_BINS, default=128,
                      help="mel bins of the stored features (the audio tower's "
                      "model.audio.mel_bins: Whisper 80, large-v3 and Qwen2-Audio 128)")
  parser.add_argument("--audio_pool", type=int, default=2, help="the audio tower's pooling "
                      "(model.audio.pool: Qwen2-Audio 2, Whisper 1), for --seq_len")
  parser.add_argument("--audio_window", type=int, default=audio.WINDOW_SECONDS,
                      help="seconds a window of features (Whisper's 30; the audio tower's "
                      "model.audio.positions / 50)")
  args = parser.parse_args(argv)
  for flag, path, there, kind in (("--json", args.json, os.path.isfile, "a file"),
                                  ("--tokenizer", args.tokenizer, os.path.isdir, "a directory")):
    if not there(path):  # before the notes below, which would read as if all were well
      found = "a directory" if os.path.isdir(path) else "a file" if os.path.exists(path) else \
          "not found"
      return _error(f"{flag} {path}: {found} ({kind} is needed).")
  wrong = (_below(args, 1, "workers", "image_tokens", "audio_pool", "audio_window",
                  "global_batch") + _below(args, 0, "seq_len", "seed"))
  if wrong:
    return _error(f"give {_listed(wrong)}.")
  if not 0 <= args.max_skipped_fraction <= 1:  # NaN too
    return _error(f"--max_skipped_fraction {args.max_skipped_fraction:g}: a fraction of the "
                  "records, from 0 (none may be skipped) to 1 (any may).")
  notes = []  # printed once the conversion is done (those on images where it holds some)
  if args.image_tokens is None:
    args.image_tokens, found = tower_tokens(args.processor or args.tokenizer)
    if args.image_tokens is None:
      args.image_tokens = 1
      notes.append(f"note: {found}: an image counts as 1 token in --seq_len and in the launch "
                   "line's data.seq_len; give --image_tokens (e.g. 576 for LLaVA-1.5's CLIP at "
                   "336 px).")
    else:
      notes.append(f"an image takes {args.image_tokens} tokens ({found}; --image_tokens to "
                   "change)")
  if args.audio_token not in args.audio_markers:
    return _error(f"--audio_markers {args.audio_markers!r} does not hold --audio_token "
                  f"{args.audio_token!r}.")
  hints = {}  # a skip reason -> where its files may come from a folder not given
  for flag, reason, kind in (("images", "missing image", "image"),
                             ("audio", "missing audio", "audio")):
    if getattr(args, flag) is None:  # as tools.eval reads a JSON's images and clips
      setattr(args, flag, os.path.dirname(os.path.abspath(args.json)))
      hints[reason] = (f"no --{flag} was given: {kind} paths were read relative to --json's "
                       f"folder {getattr(args, flag)}; give --{flag} DIR where they are elsewhere")
  opts = conversion_record.Options(
      tokenizer=args.tokenizer, images=args.images, processor=args.processor,
      image_token=args.image_token, pad_to_square=args.pad_to_square, seq_len=args.seq_len,
      image_tokens=args.image_tokens, on_error=args.on_error, workers=args.workers,
      allow_outside_images=args.allow_outside_images,
      max_skipped_fraction=args.max_skipped_fraction,
      audio=audio_records.Settings(args.audio, args.audio_token, args.audio_markers,
                                   args.mel_bins, args.audio_pool, args.allow_outside_images,
                                   args.audio_window))
  out = pathlib.Path(os.path.abspath(args.out))
  made = Made(str(out.parent))  # the folders above --out that this conversion makes
  try:
    with output.interrupts_as_exceptions():
      try:
        with output.staged(out, what="conversion", flag="--out",
                           complete=conversations.MANIFEST) as tmp:
          m = conversion.convert(pathlib.Path(args.json), tmp, opts, args.eval, args.seed,
                                 progress=True)
      except BaseException:  # a failure leaves nothing: the folders it made, left empty, go too
        made.remove_unused(None)
        raise
  except ConfigError as e:
    said = str(e)  # a summary of skipped records, or under --on_error fail the record's error
    found = {"missing image": ": image " in said and " not found." in said,
             "missing audio": ": no such file under --audio " in said}
    hint = "; ".join(h for r, h in hints.items() if r in said or found[r])
    return _error(f"{said.rstrip('.')}. {hint[0].upper()}{hint[1:]}." if hint else said)
  except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM / SIGHUP (output.Interrupted)
    return _interrupted(args.out, e)
  try:
    return _report(args, m, out, notes, hints)
  except KeyboardInterrupt as e:  # Ctrl-C once the conversion is in place: it is whole
    return _interrupted(args.out, e)


def _interrupted(out: str, e: KeyboardInterrupt) -> int:
  """The line and exit status of a conversion a signal stopped: before `--out` was in place,
  nothing was written; after, the conversion is whole and only its summary is cut short."""
  signum, name = output.said(e)
  print(f"tools.convert: interrupted ({name}); "
        + (f"{out} was complete before it came: the conversion is whole, its summary cut short."
           if output.published(out) else f"nothing was written to {out}."), file=sys.stderr)
  return 128 + signum


def _report(args, m: dict, out: pathlib.Path, notes: list[str], hints: dict) -> int:
  """What the finished conversion says: notes, counts, warnings and the launch line."""
  for note in notes if m["images"] else ():
    print(note, file=sys.stderr)
  counts, skipped, took = m["samples"], m["skipped"], m["seconds"]
  if m["shared_ids"]:
    shown = ", ".join(repr(i) for i in m["shared_ids"][:3])
    shared = len(m["shared_ids"])
    print(f"note: {count(shared, 'id')} {'is' if shared == 1 else 'are'} shared by several "
          f"records ({shown}"
          f"{' ...' if len(m['shared_ids']) > 3 else ''}); each id's records went to one side "
          "of the train/eval split.", file=sys.stderr)
  outlier = _outlier(args, m)
  if outlier:
    print(outlier, file=sys.stderr)
  print(f"converted {count(m['records'], 'record')} in {took:.1f} s "
        f"({m['records'] / max(took, 1e-9):.1f} records/s, {count(args.workers, 'worker')}): "
        f"{counts['train']} train and {count(counts['eval'], 'eval sample')}, "
        f"{count(m['images'], 'image')}, {count(m['audios'], 'audio clip')}, "
        f"{sum(skipped.values())} skipped"
        + (f" ({', '.join(f'{k}: {v}' for k, v in sorted(skipped.items()))})" if skipped
           else ""))
  if m["skipped_records"]:
    limit = (f" (--max_skipped_fraction {args.max_skipped_fraction:g} fails a conversion that "
             "skips more)" if args.max_skipped_fraction < 1 else "")
    summary = conversion.skipped_summary(m["skipped_records"], m["records"])
    print(f"tools.convert: warning: {summary}; "
          f"each with its error in {out / conversion_files.SKIPPED}{limit}"
          f"{''.join(f'; {h}' for r, h in hints.items() if r in skipped)}.", file=sys.stderr)
  if counts["eval"] < m["eval_drawn"]:
    drawn, lost = m["eval_drawn"], m["eval_drawn"] - counts["eval"]
    drew = f"--eval {args.eval} drew" if args.eval == drawn else "drawn for it"
    print(f"tools.convert: warning: eval holds {counts['eval']} of the {drawn} records {drew}: "
          f"{lost} of them {'was' if lost == 1 else 'were'} skipped (a skipped record is not "
          "replaced; a larger --eval holds more).", file=sys.stderr)
  vocab = model_vocab(args.tokenizer, m["vocab_size"])
  print(f"train with (MODEL_CONFIG: {MODEL_CONFIG}):\n  "
        + " ".join(["python -m mimo_jax.launch --config=MODEL_CONFIG"]
                   + launch_flags(out, m, args.seq_len, args.global_batch, vocab)))
  return 0


def model_vocab(tokenizer: str, tokens: int) -> int:
  """The model's vocabulary for the launch line: the vocab_size of config.json beside the
  tokenizer (a LLaVA's text_config's), which may hold more ids than the tokenizer's `tokens`
  (LLaVA-1.5: 32064 for 32002), else `tokens`."""
  try:
    config = json.loads((pathlib.Path(tokenizer) / "config.json").read_text(encoding="utf-8"))
  except (OSError, ValueError):
    return tokens
  text = config.get("text_config", config) if isinstance(config, dict) else {}
  vocab = text.get("vocab_size") if isinstance(text, dict) else None
  usable = isinstance(vocab, int) and not isinstance(vocab, bool) and vocab >= tokens
  return vocab if usable else tokens


def _outlier(args, m: dict) -> str | None:
  """A note where the longest sample, which sizes the launch line's data.seq_len (and with its
  clips model.audio.max_windows) for every row, is over twice what 99% of the samples take."""
  longest, most = m["longest"], m.get("positions_p99", 0)
  if args.seq_len or not most or longest <= 2 * most:
    return None
  at, longer = m["longest_record"], m["longer_than_p99"]
  named = f"record {at['record']}" + (f" (id {at['id']!r})" if at["id"] is not None else "")
  share = longer / max(m["records"], 1)
  allow = (f" with --max_skipped_fraction {math.ceil(share * 100) / 100:g}"
           if share > args.max_skipped_fraction else "")
  return (f"note: {named} is the longest sample, {longest} positions, where 99% of the samples "
          f"take {most} or fewer: the launch line's data.seq_len={longest} gives every row its "
          f"length{' (and model.audio.max_windows its clips)' if m.get('audios') else ''}; "
          f"--seq_len {most}{allow} skips the {count(longer, 'sample')} longer than that.")


def launch_flags(out: pathlib.Path, m: dict, seq_len: int = 0, global_batch: int | None = None,
                 vocab: int = 0) -> list[str]:
  """The launch flags that train on conversion `out` with manifest `m`, quoted for a shell: the
  model's `vocab` (default the tokenizer's); data.global_batch only where `global_batch` is given
  (else the model config's holds)."""
  flags = {"data.task": "conversations", "data.dir": str(out)}
  if m["image_token"] >= 0:  # -1: data without images, converted with no image token
    flags["data.image_token"] = m["image_token"]
  flags["data.seq_len"] = seq_len or m["longest"]
  if global_batch is not None:
    flags["data.global_batch"] = global_batch
  if m["max_images"]:
    flags["model.vision.max_images"] = m["max_images"]
  flags["eval.samples"] = m["samples"]["eval"]
  if m["images"]:
    flags["model.vision.image_size"] = m["image_size"][0]
    flags["model.vision.channels"] = m["channels"]
  if m.get("audios"):
    flags["model.audio.audio_token"] = m["audio_token"]
    flags["model.audio.mel_bins"] = m["mel_bins"]
    flags["model.audio.max_audios"] = m["max_audios"]
    flags["model.audio.max_windows"] = m["max_windows"]
    # Launch checks it against the windows, Whisper's 30 s ones too (a model config's tower may be
    # a toy of shorter windows).
    flags["model.audio.positions"] = m["audio_window_frames"] // 2
    flags["model.audio.pool"] = m["audio_pool"]  # a clip's tokens in data.seq_len
  flags["model.language.vocab_size"] = vocab or m["vocab_size"]
  return [shlex.quote(f"--config.{k}={v}") for k, v in flags.items()]  # a path may hold spaces


def _below(args: argparse.Namespace, least: int, *names: str) -> list[str]:
  """"--name at least `least` (not value)" for each flag of `names` given a value below `least`
  (None: not given)."""
  return [f"--{n} at least {least} (not {getattr(args, n)})" for n in names
          if getattr(args, n) is not None and getattr(args, n) < least]


def _listed(items: list[str]) -> str:
  """"a", "a and b", "a, b and c"."""
  return " and ".join([", ".join(items[:-1]), items[-1]] if len(items) > 1 else items)


def _error(message: str) -> int:
  print(f"tools.convert: error: {message}", file=sys.stderr)
  return 2


if __name__ == "__main__":
  output.run_main(main, at_once=False)  # a normal exit: its pool's resource tracker cleans up
