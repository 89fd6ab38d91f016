"""One LLaVA-format record converted into a sample, in the process that converts it: how records
are converted (`Options`), the process's tokenizer, image processor and placeholder ids
(`init_worker`), the record's checks, its images read under --images and its clips' features
(audio_records.py). conversion.py runs it over a source's records, here or in worker processes
(`pool_init`, `work`)."""

from __future__ import annotations

import ctypes
import dataclasses
import multiprocessing
import os
import pathlib
import signal
import sys

from PIL import UnidentifiedImageError

from mimo_jax import words
from mimo_jax.config import ConfigError
from mimo_jax.data import audio_records, images, record_error
from mimo_jax.data.chat import (AssistantFirst, ChatError, ChatTokenizer, TokenizeError,
                                 UnknownToken, messages)
from mimo_jax.data.conversations import IMAGES
from mimo_jax.data.record_error import RecordError

PR_SET_PDEATHSIG = 1  # prctl(2): the signal this process gets when its parent thread ends

# The most records a conversion may skip, as a fraction of those read (`--max_skipped_fraction`):
# a few bad records are skipped, many mean a wrong flag or a broken source.
MAX_SKIPPED_FRACTION = 0.05


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


class TooLong(RecordError):
  """A sample longer than --seq_len, with the positions it takes (`length`)."""

  def __init__(self, message: str, length: int):
    super().__init__("too long", message)
    self.length = length


WORKER = {}  # this process's options, tokenizer, processor and ids (`init_worker`)


def init_worker(opts: Options) -> None:
  """The tokenizer of `opts` (one error naming the flag if unusable), its image and audio token ids
  and the image processor. The image token and the processor are needed only where records list
  images, the audio token only where they list clips (`conversion._prepare` checks): one that is
  unusable is None here, with its error under `image_error` or `processor_error`."""
  try:
    tok = ChatTokenizer.open(opts.tokenizer)
  except ChatError as e:
    raise ConfigError(f"--tokenizer {opts.tokenizer}: {e}") from None
  image_id, image_error = None, None
  try:
    image_id = tok.token_id(opts.image_token)
  except ChatError as e:
    image_error = ConfigError(f"--image_token {opts.image_token!r}: {e}")
  try:
    audio_id = tok.token_id(opts.audio.token)
  except ChatError:
    audio_id = None
  proc, processor_error = None, None
  try:
    proc = images.ImageProcessor.open(opts.processor or opts.tokenizer,
                                      pad_to_square=opts.pad_to_square)
  except ConfigError as e:
    processor_error = e if opts.processor else ConfigError(
        f"{e} --processor was not given, so it is --tokenizer's directory: give --processor DIR, "
        "the vision tower's HF directory.")
  folder = pathlib.Path(opts.images)
  WORKER.update(audio_id=audio_id, opts=opts, tok=tok, images=folder, root=os.path.realpath(folder),
                proc=proc, processor_error=processor_error, image_id=image_id,
                image_error=image_error)


def pool_init(opts: Options) -> None:
  # Ctrl-C reaches the whole process group: the parent alone unwinds and terminates workers.
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  _die_with_parent()
  init_worker(opts)


def _die_with_parent() -> None:
  """On Linux, this worker ends when the process that started it does, `kill -9` included (which
  leaves the pool no time to end its workers: they would convert on, unseen, until their next
  record found no parent to take it)."""
  if not sys.platform.startswith("linux"):
    return
  try:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
  except (OSError, AttributeError):
    return
  parent = multiprocessing.parent_process()
  if parent is not None and os.getppid() != parent.pid:  # it ended before the call above
    os._exit(1)  # pylint: disable=protected-access


def _image_files(record: dict, where: str) -> list[str]:
  return record_error.paths(record.get("image"), "image", "image", where)


def _read_image(f: str, where: str):
  """The processor's pixels of image file `f` (relative to --images)."""
  w = WORKER
  path = w["images"] / f
  real = os.path.realpath(path)
  if not w["opts"].allow_outside_images and os.path.commonpath([real, w["root"]]) != w["root"]:
    raise RecordError("outside --images", f"{where}: image {f!r} leads out of --images "
                      f"({real}); --allow_outside_images reads it.")
  try:
    return images.load(path, w["proc"])
  except FileNotFoundError:
    raise RecordError("missing image", f"{where}: image {path} not found.") from None
  except PermissionError:  # the file may be whole: the fix is access, not a new copy
    raise RecordError("unreadable image", f"{where}: image {path} cannot be opened (permission "
                      "denied); give the converter read access to it.") from None
  except images.TOO_LARGE as e:
    raise RecordError("image too large", f"{where}: image {path} is {images.too_large(e)}.") \
        from None
  except images.UnsupportedImage as e:
    raise RecordError("unsupported image", f"{where}: image {path} is {e}.") from None
  except Exception as e:  # pylint: disable=broad-except
    # A processor that keeps bands refuses an RGBA, palette or CMYK image: said with the fix (the
    # model's channels are not known here: those of the data it converts).
    bands = images.bands_refused(path, w["proc"].convert_rgb, None)
    if bands:
      raise RecordError("unsupported image", f"{where}: image {path} is {bands}.") from None
    if isinstance(e, UnidentifiedImageError):  # no Pillow reader took the file
      raise RecordError("unrecognised image", f"{where}: image {path} cannot be read: Pillow "
                        "recognises no image in it (a damaged file, or a format or layout Pillow "
                        "does not read, such as a float64 TIFF); save it as PNG or JPEG.") from None
    raise RecordError("corrupt image", f"{where}: image {path} cannot be read ({e}).") from None


def _assistant_marks(msgs: list[dict], where: str, image_mark: str) -> None:
  """A RecordError where an assistant turn holds an image's or a clip's mark: its tokens would be
  a target (the assistant's turns are what the model learns to say)."""
  for k, m in enumerate(msgs):
    if m["role"] != "assistant":
      continue
    for medium, mark in (("image", image_mark), ("audio", audio_records.MARK)):
      if mark in m["content"]:
        raise RecordError(f"{medium} in assistant turn", f"{where}: assistant turn {k} holds "
                          f"{mark}, which would be trained as the model's answer; images and "
                          "clips go in a user turn.")


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
  """One record -> a sample (`tokens`, `loss_mask`, `images`), or RecordError (after
  `init_worker`)."""
  w, opts = WORKER, WORKER["opts"]
  record_error.record_id(record, where)
  turns = record.get("conversations")
  if not isinstance(turns, list):
    raise RecordError("no conversations", f"{where}: no conversations list.")
  if not turns:  # a list, of no turn
    raise RecordError("no conversations", f"{where}: empty conversations list (no turns).")
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
  written = msgs  # the turns as the record has them, before `<audio>` becomes its markers
  msgs, clips = audio_records.convert(record, msgs, where, opts.audio)
  try:
    ids, mask = w["tok"].encode(msgs, strict=True)
  except UnknownToken as e:
    raise RecordError("unknown token", f"{where}: {e}") from None
  except TokenizeError as e:
    raise RecordError("untokenizable", f"{where}: {e}") from None
  except AssistantFirst as e:
    raise RecordError("assistant first", f"{where}: {e}") from None
  except ChatError as e:
    raise RecordError("template", f"{where}: {e}") from None
  _assistant_marks(written, where, opts.image_token)  # after the template's own errors
  found = int((ids == w["image_id"]).sum()) if w["image_id"] is not None else 0
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
    raise TooLong(f"{where}: {length} tokens{_held(len(files), opts.image_tokens, clip_tokens)} "
                  f"exceed --seq_len {opts.seq_len}.", length)
  return {"tokens": ids, "loss_mask": mask, IMAGES: pixels, **audio_records.fields(clips)}


def positions(tokens: int, image_count: int, image_tokens: int, clip_tokens=()) -> int:
  """Positions a sample takes in a row: every token but the last is an input (as the layout
  counts), each image `image_tokens` of them, each clip its `clip_tokens`."""
  return audio_records.positions(tokens, list(clip_tokens)) + image_count * (image_tokens - 1)


def work(item):
  """(index, sample, None) for a record converted, (index, None, (reason, message, positions of
  a sample too long or None)) for one skipped."""
  index, record, source = item
  where = f"{source}: record {index} (id {record.get('id', '?')!r})"
  try:
    return index, dict(convert_record(record, where), id=record.get("id", index)), None
  except RecordError as e:
    return index, None, (e.reason, str(e), getattr(e, "length", None))
  except Exception as e:  # pylint: disable=broad-except
    # Whatever else one record raises is that record's fault: skipped like the others.
    return index, None, ("error", f"{where}: {type(e).__name__}: {e}", None)
