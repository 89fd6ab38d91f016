"""Answer prompts with a trained or imported model: `python -m tools.generate WORKDIR --prompt TEXT
[--prompt TEXT ...] [--image FILE ...] [--audio FILE ...] [--pair]`.

  python -m tools.generate runs/llava --image cat.jpg --prompt "What is in the picture?"
  python -m tools.generate runs/qwen2_audio --audio call.flac --prompt "What is said?"
  python -m tools.generate runs/qwen2_audio --pair --audio a.flac --audio b.flac \\
      --prompt "What is said?" --prompt "Who speaks?"   # a.flac to the first, b.flac to the second
  python -m tools.generate runs/llava --prompt "Hello" --prompt "Name three colours." \\
      --temperature 0.7 --top_p 0.9 --max_new_tokens 64

Loads WORKDIR's newest checkpoint (or `--step N`: ours or a `tools.hf import`'s step 0) onto one
device, renders each prompt as a user turn with the language model's chat template and the
generation prompt (`--tokenizer`: tokenizer.json and tokenizer_config.json), every `--image`
given to every prompt (as `<image>` lines before its text unless the prompt places them itself),
prepared as the run's data was (`--processor`: preprocessor_config.json; padded to a square of the
mean colour first where the run's converted data was, `--pad_to_square`) and expanded to the
tower's image tokens. Every `--audio` file is given to every prompt likewise (as `<audio>` lines,
after the images', unless the prompt places them itself), decoded, mixed down to mono, resampled
to 16 kHz and turned into log-mel windows as tools.convert does (mimo_jax/data/audio.py); each
`<audio>` becomes `--audio_markers` (Qwen2-Audio's `<|audio_bos|><|AUDIO|><|audio_eos|>` by
default), whose `--audio_token` is expanded to the clip's audio tokens (its windows' tokens, the
padding's dropped). A file that cannot be decoded, or too short for one audio token, is one error
naming it. With `--pair`, the k-th prompt gets the k-th `--image` and the k-th `--audio` instead
(one of each kind given a prompt, or none of it; without `--prompt`, one prompt a file): a count
that differs from the prompts' is one error. Each answer's line shows the files its prompt got.
Defaults for `--audio_token`: the run's converted data's, else `<|AUDIO|>`. Defaults for
`--tokenizer`, `--processor`, `--image_token` and
`--pad_to_square`: with data.task=conversations those of the run's converted data (the manifest
in its data directory); otherwise those of the HF directories the model was imported or started
from (`tools.hf import`, `init_from`), as `tools.hf export` finds them, else of the digits task's
build; where the run's converted data directory is missing (moved or deleted), those HF
directories' (with a note), else an error naming the directory and `--tokenizer DIR`. A relative
path in those records is looked for beside the record, in the workdir, in the directory the run
was launched from, then in the current directory.

The prompts run as one batch, left-padded, with a key-value cache (mimo_jax/generate.py): greedy
by default, or sampled at `--temperature` among the `--top_p` mass, until the tokenizer's
end-of-turn token or `--max_new_tokens`. A prompt and its new tokens fit in the model's context:
its HF config's max_position_embeddings (an import, or a run started from one), else the run's
data.seq_len (the positions it trained on); `--max_new_tokens` defaults to 64 or what fits. Each
answer is printed after its prompt, with its control characters but newlines and tabs escaped
(`\\x1b`, `\\r`): an untrained model's tokens would act on the terminal.

The new tokens are decoded `mimo_jax.generate.CHUNK` (32) at a time: a SIGTERM, SIGHUP or Ctrl-C
while they decode is acted on after the chunk under way, and the tool stops with one line saying
how many were decoded (status 143, 129 or 130; a second Ctrl-C leaves at once). Stopped at any
point before the answers are printed, it prints none of them. A decoding that takes longer says
every 10 s on stderr how many new tokens it has decoded, of the most asked for.

Beside a run that is saving into WORKDIR (its run.lock), only committed steps are read; a step
the run rotates away while it is read is followed by the newest one.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import pathlib
import signal
import sys

import numpy as np

from mimo_jax import checkpoint_reader, output
from mimo_jax.run_paths import bases, launch_dir, resolve
from mimo_jax.config import Config, ConfigError
from mimo_jax.data import audio_records
from mimo_jax.stopping import StopFlag
from tools.common import Parser, fail, number, run_folder
from tools.display import Decoding, count, printable
from tools.prompts import check_vocab, load_audios, load_images, prompt_ids

TOOL = "tools.generate"
DEFAULT_NEW_TOKENS = 64
PROGRESS_SECONDS = 10.0  # between the lines that tell a long decoding's progress


class _Stopped(output.Interrupted):
  """A signal acted on between two chunks of new tokens; `detail` says how far they got."""

  def __init__(self, signum: int, detail: str):
    super().__init__(signum)
    self.detail = detail


def imported(workdir: str, cfg: Config) -> tuple[dict, dict[str, list[str]]]:
  """The import record (hf_import.json) and the HF directories each module came from (nearest
  first), of this run and of the runs it started from: as `tools.hf export` reads them."""
  from tools import hf_export  # pylint: disable=import-outside-toplevel
  record_file = pathlib.Path(workdir) / "hf_import.json"
  try:
    record = json.loads(record_file.read_text()) if record_file.is_file() else {}
  except ValueError as e:
    raise ConfigError(f"{record_file}: not JSON ({e}); give --tokenizer DIR and --processor "
                      "DIR.") from None
  return hf_export.history(workdir, cfg, record)


def defaults(workdir: str, cfg: Config) -> dict:
  """`tokenizer`, `processor`, `image_token`, `pad_to_square`, `vocab` (the data's tokenizer's
  size), `context` (the HF model's max_position_embeddings), `record` (where they come from),
  `named` (the paths it names) and `gone` (the run's data directory where it holds no manifest):
  those of the run's converted data, else (none, or gone) of the HF directories the model was
  imported or started from, as `tools.hf export` finds them, else of the digits task's build."""
  # pylint: disable-next=import-outside-toplevel
  from mimo_jax.data import av_digits, conversations, digits
  from tools import hf_export  # pylint: disable=import-outside-toplevel
  d, work = cfg.data, pathlib.Path(workdir)
  launched = launch_dir(workdir, cfg)
  record, sources = imported(workdir, cfg)
  out = {"tokenizer": "", "processor": "", "image_token": "<image>", "pad_to_square": False,
         "audio_token": audio_records.QWEN2_AUDIO_TOKEN,
         "vocab": None, "record": "", "named": {}, "gone": "",
         "context": hf_export.source_context(record, sources)}

  def hf_directories(gone: str = "") -> dict:
    where = bases(work, launched)
    first = lambda paths, wanted: next(
        (r for r in (resolve(p, wanted, where) for p in paths) if r), "")
    own = work / "hf_import.json"
    return dict(out, tokenizer=first(sources["language"], "tokenizer.json"),
                processor=first(sources["vision"], "preprocessor_config.json"), gone=gone,
                record=str(own) if own.is_file() else f"the HF directories {workdir} came from",
                named={"tokenizer": ", ".join(sources["language"]),
                       "processor": ", ".join(sources["vision"])})
  # An import (or a run started from one) without converted data of its own: the HF directories.
  if (d.task != "conversations" or not d.dir) and any(sources.values()):
    return hf_directories()
  if d.task == "synthetic":
    return out
  where = bases(launched, work)
  if d.task == "conversations":
    directory = resolve(d.dir, conversations.MANIFEST, where)
  else:  # the digits (or av_digits) build: under data.dir (or the default folder)
    root = resolve(d.dir, "", where) if d.dir else ""
    build = (av_digits.directory(root, d.train_samples, d.eval_samples) if d.task == "av_digits"
             else digits.directory(root, d.train_samples, d.eval_samples, d.probs()))
    directory = str(build) if root or not d.dir else ""
  if not directory or not (pathlib.Path(directory) / conversations.MANIFEST).is_file():
    # The run's data moved or deleted since: the HF directories its model started from, if any.
    gone = directory or d.dir
    if not any(sources.values()):
      return dict(out, gone=gone)
    print(f"note: {workdir}: its run's data directory {gone} is missing: the tokenizer and "
          "processor are the HF directories' it came from, the image token <image>, images not "
          "padded to a square (--tokenizer, --processor, --image_token, --pad_to_square to "
          "change).", file=sys.stderr)
    return hf_directories(gone)
  directory = pathlib.Path(directory)
  m = conversations.manifest(str(directory))
  where = bases(directory, work, launched)
  return dict(out, tokenizer=resolve(m.get("tokenizer", ""), "tokenizer.json", where),
              processor=resolve(m.get("processor", ""), "preprocessor_config.json", where),
              image_token=m.get("image_token_text", "<image>"),
              audio_token=m.get("audio_token_text", audio_records.QWEN2_AUDIO_TOKEN),
              pad_to_square=bool(m.get("pad_to_square", False)), vocab=m.get("vocab_size"),
              record=str(directory / conversations.MANIFEST),
              named={"tokenizer": m.get("tokenizer", ""), "processor": m.get("processor", "")})


def default_dir(found: dict, key: str, wanted: str, flag: str, workdir: str) -> str:
  """The directory of the run's `key` ("tokenizer" or "processor") that `defaults` found, or a
  ConfigError saying where it looked and to give `flag`."""
  if found[key]:
    return found[key]
  named, gone = found["named"].get(key), found["gone"]
  data = f"its run's data directory {gone} is missing (moved or deleted)" if gone else ""
  if named:
    raise ConfigError(f"{found['record']} names the {key} {named!r}, which holds no {wanted} "
                      "(looked for beside it, in the workdir, where the run was launched and in "
                      f"the current directory){'; ' + data if data else ''}; give {flag} DIR.")
  if gone:
    raise ConfigError(f"{workdir}: {data} and no import names a directory with {wanted}; give "
                      f"{flag} DIR (or put the data back).")
  raise ConfigError(f"{workdir}: neither its run's data nor an import names a directory with "
                    f"{wanted}; give {flag} DIR.")


def context(workdir: str, cfg: Config, found: dict) -> tuple[int, str]:
  """The positions the language model is for, and where that figure comes from: its HF config's
  max_position_embeddings (an import, or a run started from one), else the positions of the rows
  its run trained on (data.seq_len)."""
  if found["context"]:
    return int(found["context"]), "max_position_embeddings of the HF model it comes from"
  return cfg.data.seq_len, f"data.seq_len of the run in {workdir}: the positions it trained on"


def check_flags(args: argparse.Namespace) -> None:
  """The sampling and length flags' values, before anything is read."""
  if not 0 < args.top_p <= 1:  # nan fails too
    raise ConfigError(f"--top_p {args.top_p}: give the probability mass to sample from, more "
                      "than 0 and at most 1 (1: every token).")
  if not 0 <= args.seed < 2**32:  # as train.seed: jax's keys take 32 bits of it
    raise ConfigError(f"--seed {args.seed}: give 0 to 2**32 - 1.")
  if not (math.isfinite(args.temperature) and args.temperature >= 0):
    raise ConfigError(f"--temperature {args.temperature}: give 0 (greedy) or a positive finite "
                      "number.")
  if args.max_new_tokens is not None and args.max_new_tokens < 1:
    raise ConfigError(f"--max_new_tokens {args.max_new_tokens}: give at least 1.")
  for flag, files in (("--image", args.image), ("--audio", args.audio)):
    if args.pair and files and len(files) != len(args.prompt):
      raise ConfigError(f"--pair: {count(len(args.prompt), 'prompt')} and "
                        f"{count(len(files), flag + ' file')}: give one {flag} a prompt, in the "
                        "prompts' order, or none (without --pair every file goes to every "
                        "prompt).")


def files_of(args: argparse.Namespace, r: int, files):
  """What prompt `r` gets of `files` (the --image or the --audio files, or what was made of
  them, in their order): every one, or with --pair its own."""
  return files[r:r + 1] if args.pair and files else files


def _count(text: str) -> int:
  """An integer flag that also takes integral floats (1e3)."""
  try:
    return int(text)
  except ValueError:
    pass
  try:
    value = float(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"={text}: not an integer") from None
  if not value.is_integer():
    raise argparse.ArgumentTypeError(f"={text}: not an integer")
  return int(value)


def main(argv: list[str] | None = None) -> int:
  parser = Parser(TOOL, prog="python -m tools.generate", sep=" ", allow_abbrev=False,
                  description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("workdir")
  parser.add_argument("--prompt", action="append", default=[],
                      help="repeatable: a batch (default with --image: one empty prompt)")
  parser.add_argument("--image", action="append", default=[],
                      help="repeatable: every image is given to every prompt, in order "
                      "(--pair: one a prompt)")
  parser.add_argument("--audio", action="append", default=[], help="repeatable: an audio file "
                      "(WAV, FLAC, OGG/Opus, MP3); every clip is given to every prompt, in "
                      "order, after the images (--pair: one a prompt)")
  parser.add_argument("--pair", action="store_true",
                      help="the k-th --prompt gets the k-th --image and the k-th --audio (one of "
                      "each kind given a prompt, or none) instead of every file (default with "
                      "files and no --prompt: one prompt a file)")
  parser.add_argument("--step", type=number(int, least=0), default=None,
                      help="default: the newest")
  parser.add_argument("--tokenizer", default="")
  parser.add_argument("--processor", default="")
  parser.add_argument("--image_token", default="", help="default: the data's, else <image>")
  parser.add_argument("--audio_token", default="",
                      help="the audio placeholder token (default: the data's, else <|AUDIO|>)")
  parser.add_argument("--audio_markers", default="",
                      help="what each <audio> becomes in the prompt, --audio_token inside "
                      "(default: <|audio_bos|><|AUDIO|><|audio_eos|> for <|AUDIO|>, else the "
                      "token alone)")
  parser.add_argument("--pad_to_square", action=argparse.BooleanOptionalAction, default=None,
                      help="pad images to a square of the mean colour before the processor "
                      "(default: as the run's converted data was, else not)")
  parser.add_argument("--max_new_tokens", type=_count, default=None,
                      help=f"at least 1 (default: {DEFAULT_NEW_TOKENS}, or what fits in the "
                      "model's context after the longest prompt)")
  parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
  parser.add_argument("--top_p", type=float, default=1.0, help="in (0, 1]")
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  if not args.prompt:
    if not args.image and not args.audio:
      fail(TOOL, "give --prompt TEXT, or --image FILE or --audio FILE.")
    args.prompt = [""] * (max(len(args.image), len(args.audio)) if args.pair else 1)
  logging.getLogger("absl").setLevel(logging.ERROR)  # orbax's notes on reading a checkpoint
  try:
    check_flags(args)
    with output.interrupts_as_exceptions():
      answers = run(args)
  except (ConfigError, ValueError) as e:
    sys.stdout.flush()
    print(f"{TOOL}: error: {e}", file=sys.stderr)
    return 2
  except KeyboardInterrupt as e:
    sys.stdout.flush()
    signum, shown = output.said(e)
    print(f"{TOOL}: interrupted ({shown}){getattr(e, 'detail', '')}; no answer printed.",
          file=sys.stderr)
    return 128 + signum  # 130 for Ctrl-C, 143 for SIGTERM
  except Exception as e:  # pylint: disable=broad-except  (a device's memory is one line)
    from mimo_jax import memory  # pylint: disable=import-outside-toplevel
    if not (line := memory.device_ran_out(e, "fewer prompts at once or a smaller "
                                          "--max_new_tokens")):
      raise
    print(f"{TOOL}: error: {line}; no answer printed.", file=sys.stderr)
    return 1
  for r, (prompt, answer) in enumerate(zip(args.prompt, answers)):
    shown = " ".join(f"[{pathlib.Path(f).name}]"
                     for f in files_of(args, r, args.image) + files_of(args, r, args.audio))
    print(printable(f"> {' '.join(x for x in (shown, prompt) if x)}\n{answer}"))
  return 0


def Progress() -> Decoding:  # pylint: disable=invalid-name
  return Decoding(TOOL, PROGRESS_SECONDS)


def prepare(args: argparse.Namespace, cfg: Config, workdir: str) -> dict:
  """Everything a generation needs but the parameters, checked: tokenizer, prompt rows, pixels,
  new tokens. Errors name the flag or file to fix."""
  # pylint: disable=import-outside-toplevel
  from mimo_jax.data import audio
  from mimo_jax.data.chat import ChatTokenizer
  from mimo_jax.data.images import ImageProcessor
  found = defaults(workdir, cfg)
  image_token = args.image_token or found["image_token"]
  tok = ChatTokenizer.open(args.tokenizer or default_dir(found, "tokenizer", "tokenizer.json",
                                                         "--tokenizer", workdir))
  check_vocab(tok, cfg, found, bool(args.tokenizer))
  pixels = None
  if args.image:
    if getattr(cfg.model, "vision", None) is None:  # before a processor is looked for
      raise ConfigError(f"--image {args.image[0]}: the model has no vision encoder "
                        "(model.vision); give a model with one, or no --image.")
    pad = found["pad_to_square"] if args.pad_to_square is None else args.pad_to_square
    proc = ImageProcessor.open(args.processor or default_dir(
        found, "processor", "preprocessor_config.json", "--processor", workdir),
                               pad_to_square=pad)
    pixels = load_images(args.image, proc, cfg)
  clips = load_audios(args.audio, cfg) if args.audio else []
  audio_token = args.audio_token or found["audio_token"]
  markers = args.audio_markers or (audio_records.QWEN2_AUDIO if audio_token ==
                                   audio_records.QWEN2_AUDIO_TOKEN else audio_token)
  if clips:
    if audio_token not in markers:
      raise ConfigError(f"--audio_markers {markers!r} does not hold the audio token "
                        f"{audio_token!r}.")
    if tok.token_id(audio_token) != cfg.model.audio.audio_token:
      raise ConfigError(f"the tokenizer {tok.path}'s {audio_token} is id "
                        f"{tok.token_id(audio_token)} where the model's audio placeholder "
                        f"(model.audio.audio_token) is {cfg.model.audio.audio_token}; give the "
                        "model's tokenizer (--tokenizer) or its audio token (--audio_token).")
  per_clip = tuple(audio.clip_tokens(frames, cfg.model.audio.pool) for _, frames in clips)
  vision = getattr(cfg.model, "vision", None)
  per_image = vision.tokens_per_image if vision is not None else 0
  rows = [prompt_ids(tok, p, len(files_of(args, r, args.image)), image_token, per_image,
                     files_of(args, r, per_clip), audio_token, markers)
          for r, p in enumerate(args.prompt)]
  positions, source = context(workdir, cfg, found)
  longest = max(range(len(rows)), key=lambda r: len(rows[r]))
  width = len(rows[longest])
  if width >= positions:
    n = len(files_of(args, longest, args.image))
    images = f", {count(n, 'image')} of {per_image} tokens" if n else ""
    heard = list(zip(files_of(args, longest, args.audio or []),
                     files_of(args, longest, per_clip)))
    clips = "".join(f", {os.path.basename(f)}'s {t} tokens" for f, t in heard)
    raise ConfigError(f"the prompt {args.prompt[longest][:60]!r} is {width} tokens{images}{clips}, "
                      f"which leaves no room for an answer in the model's {positions} positions "
                      f"({source}); shorten it{' or its clips' if heard else ''}.")
  room = positions - width
  steps = args.max_new_tokens
  if steps is None:
    steps = min(DEFAULT_NEW_TOKENS, room)
  elif steps > room:
    raise ConfigError(f"--max_new_tokens {steps}: the longest prompt takes {width} of the "
                      f"model's {positions} positions ({source}), which leaves {room}; give at "
                      "most that.")
  return {"tok": tok, "rows": rows, "pixels": pixels, "image_token": image_token, "steps": steps,
          "clips": clips, "audio_token": audio_token}


def run(args: argparse.Namespace) -> list[str]:
  # pylint: disable=import-outside-toplevel
  import jax
  from mimo_jax import generate
  from mimo_jax.config import from_dict
  from mimo_jax import whole
  from mimo_jax.encoders import audio as audio_encoder
  from mimo_jax.encoders import vision as vision_encoder
  run_folder(args.workdir)
  reader = checkpoint_reader.Reader(args.workdir)
  reader.note(TOOL)

  def load(step: int) -> tuple[Config, dict, dict]:
    meta = reader.meta(step)
    cfg = from_dict(meta["config"])
    ready = prepare(args, cfg, args.workdir)  # before the parameters: errors come first
    return cfg, ready, reader.params_tree(step, meta)
  _, (cfg, ready, params) = checkpoint_reader.newest(reader, args.step, load, tool=TOOL)
  reader.close()
  tok, rows = ready["tok"], ready["rows"]
  width = max(map(len, rows))
  ids = np.zeros((len(rows), width), np.int32)
  mask = np.zeros((len(rows), width), np.int32)
  for r, row in enumerate(rows):
    ids[r, width - len(row):], mask[r, width - len(row):] = row, 1
  embeds = None
  if ready["pixels"] is not None:
    images = np.stack([p for r in range(len(rows)) for p in files_of(args, r, ready["pixels"])]
                      ).astype(np.float32) / 255
    tokens = vision_encoder.image_tokens(cfg, params["vision"], images)
    embeds = whole.merged_embeddings(cfg, params["language"], ids, tokens,
                                     tok.token_id(ready["image_token"]))
  if ready["clips"]:
    per_clip = [audio_encoder.audio_tokens(cfg, params["audio"], mel, np.asarray(frames))
                for mel, frames in ready["clips"]]
    tokens = np.concatenate([np.asarray(t) for r in range(len(rows))
                             for t in files_of(args, r, per_clip)])
    embeds = whole.merged_embeddings(cfg, params["language"], ids, tokens[None],
                                     tok.token_id(ready["audio_token"]), embeds)
  eos = tok.specials.get("eos_token")
  eos_id = tok.token_id(eos) if eos else None
  print(f"{args.workdir}: {count(len(rows), 'prompt')} of up to {width} tokens on "
        f"{jax.devices()[0]}",
        file=sys.stderr)
  # Noted, not raised: the decoder acts on them between two chunks (an exception raised inside
  # JAX's dispatch could be lost).
  with StopFlag(signals=(signal.SIGTERM, signal.SIGINT, signal.SIGHUP),
                second=f"{TOOL}: second interrupt: stopped at once; no answer printed.") as flag:
    try:
      out = generate.generate(cfg, params["language"], ids, mask, ready["steps"],
                              generate.Sampling(args.temperature, args.top_p, args.seed),
                              embeds, eos=eos_id,
                              stop=flag.requested, progress=Progress())
    except generate.Stopped as e:
      raise _Stopped(flag.signum, f" while decoding, {e}") from None
  if flag.signum is not None:  # taken during the last chunk: a stop asked for is a stop
    raise _Stopped(flag.signum, " as decoding ended")
  answers = [tok.tokenizer.decode([int(t) for t in row], skip_special_tokens=True).strip()
             for row in out]
  # A cut answer is said, as a truncation is; an empty one too (a blank line looks like a fault).
  for flags, said in (([eos_id is None or eos_id not in row for row in out],
                       f"stopped at {ready['steps']} new tokens (--max_new_tokens) before an end "
                       "token: {cut}; a larger --max_new_tokens lets {them} finish."),
                      ([not a for a in answers], "{be} empty: the model ended at once (its "
                       "first new token was an end token) or gave only special tokens.")):
    if any(flags):
      one = sum(flags) == 1
      name = "the answer" if len(out) == 1 else f"answer{'' if one else 's'} " + ", ".join(
          str(r + 1) for r, f in enumerate(flags) if f)
      print(f"{TOOL}: note: {name} " + said.format(
          cut="it is cut" if one else "they are cut", them="it" if one else "them",
          be="is" if one else "are"), file=sys.stderr)
  return answers


if __name__ == "__main__":
  output.run_main(main)
