"""What a prompt is made of before the model sees it, as `tools.generate` (and tests that build
its rows) make it: the tokenizer checked against the model, the user turn tokenized with each
image's and clip's placeholder expanded to its tokens, image files prepared by the processor and
audio files made log-mel windows as the converter makes them."""

from __future__ import annotations

import pathlib
import re

import numpy as np

from mimo_jax.config import Config, ConfigError
from mimo_jax.data import audio_records, chat, images
from tools.display import count


def check_vocab(tok, cfg: Config, found: dict, given: bool) -> None:
  """The tokenizer's vocabulary against the model's and the run's data's: another model's
  tokenizer reads and writes other ids (answers of nothing, or of other words)."""
  from mimo_jax.data.tokenizer import Tokenizer  # pylint: disable=import-outside-toplevel
  # The model's rows: vocab_size, or (0) the built-in tokenizer's, as models/mimo.py sizes them.
  vocab = tok.tokenizer.get_vocab_size()
  model = cfg.model.language.vocab_size or Tokenizer().vocab_size
  where = f"--tokenizer {tok.path}" if given else f"the tokenizer {tok.path} ({found['record']})"
  if found["vocab"] is not None and vocab != found["vocab"]:
    raise ConfigError(f"{where} has {vocab} tokens where the run's data was tokenized with "
                      f"{found['vocab']} ({found['record']}); give the run's tokenizer with "
                      "--tokenizer DIR.")
  if vocab > model:
    raise ConfigError(f"{where} has {vocab} tokens, more than the model's {model} "
                      "(model.language.vocab_size): it is another model's; give this model's "
                      "tokenizer with --tokenizer DIR.")
  if vocab < model / 1.01:  # padding rows, not over 1% of the model's ids
    raise ConfigError(f"{where} has {vocab} tokens where the model has {model} "
                      "(model.language.vocab_size): it is another model's; give this model's "
                      "tokenizer with --tokenizer DIR.")
  run = found["tokenizer"]  # the run's own, where it can be found: the same ids, token by token
  if not given or not run or pathlib.Path(run).resolve() == pathlib.Path(tok.path).resolve():
    return
  theirs = _vocabulary(pathlib.Path(run))
  if theirs is None:  # unreadable: the sizes above are the check
    return
  ours = tok.tokenizer.get_vocab(with_added_tokens=True)
  other = sorted(t for t in set(ours) | set(theirs) if ours.get(t) != theirs.get(t))
  if other:
    t = other[0]
    raise ConfigError(f"{where} is not the run's tokenizer {run} ({found['record']}): "
                      f"{count(len(other), 'token')} {'has' if len(other) == 1 else 'have'} other "
                      f"ids or none there (e.g. {t!r}: "
                      f"{ours.get(t)} here, {theirs.get(t)} there); leave --tokenizer out to use "
                      "the run's, or give a tokenizer of the same vocabulary.")


def _vocabulary(directory: pathlib.Path) -> dict[str, int] | None:
  """A tokenizer directory's token -> id, added tokens included; None where it cannot be read."""
  import tokenizers  # pylint: disable=import-outside-toplevel
  try:
    return tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json")).get_vocab(
        with_added_tokens=True)
  except Exception:  # pylint: disable=broad-except
    return None


def prompt_ids(tok, text: str, images: int, image_token: str, tokens_per_image: int,
               clips: tuple[int, ...] = (), audio_token: str = audio_records.QWEN2_AUDIO_TOKEN,
               markers: str = audio_records.QWEN2_AUDIO) -> list[int]:
  """A user turn with `images` images (as `<image>` lines before the text unless it has them)
  and clips of `clips` audio tokens each (as `<audio>` lines after them unless the text has
  them; each `<audio>` as `markers`) and the generation prompt, tokenized, each image token
  repeated `tokens_per_image` times and the k-th `audio_token` `clips[k]` times."""
  if images and image_token not in text:
    text = f"{image_token}\n" * images + text
  if text.count(image_token) != images:
    raise ConfigError(f"the prompt {text!r} has {text.count(image_token)} {image_token} for "
                      f"{count(images, '--image file')}.")
  mark = audio_records.MARK
  if clips and mark not in text:
    at = text.rfind(image_token) + len(image_token) + 1 if images else 0  # after the images
    text = text[:at] + f"{mark}\n" * len(clips) + text[at:]
  if text.count(mark) != len(clips):
    raise ConfigError(f"the prompt {text!r} has {text.count(mark)} {mark} for "
                      f"{count(len(clips), '--audio file')}.")
  rendered = tok.render([{"role": "user", "content": text.replace(mark, markers)}],
                        add_generation_prompt=True)
  image_id = tok.token_id(image_token) if images else None
  audio_id = tok.token_id(audio_token) if clips else None
  try:
    enc = tok.tokenizer.encode(rendered, add_special_tokens=False)
  except Exception as e:  # pylint: disable=broad-except
    raise ConfigError(f"the prompt {text!r}: "
                      f"{with_marks(tok.cannot_encode(rendered, e), text, tok, image_token)}"
                      ) from None
  try:
    tok.check_known(rendered, enc)
  except chat.UnknownToken as e:
    raise ConfigError(f"the prompt {text!r}: {with_marks(e, text, tok, image_token)}") from None
  encoded = enc.ids
  if clips and encoded.count(audio_id) != len(clips):
    raise ConfigError(f"the prompt {text!r} holds {encoded.count(audio_id)} {audio_token} once "
                      f"rendered and tokenized, for {count(len(clips), '--audio file')}: give "
                      "--audio_markers holding --audio_token once, and a prompt without it.")
  out, clip = [], iter(clips)
  for i in encoded:
    out.extend([i] * (tokens_per_image if i == image_id else next(clip) if i == audio_id else 1))
  return out


def with_marks(error: Exception, text: str, tok, image_token: str) -> str:
  """The message of a tokenizer's `error` on `text`, with, where the text holds a `<...>` mark
  that is no token of the tokenizer (`<image>` where the run's is `<img>`), the run's mark and
  the flag that sets it (tools.generate's and tools.eval's --image_token)."""
  marks = [m for m in dict.fromkeys(re.findall(r"<[^<>\s]+>", text))
           if m not in (image_token, audio_records.MARK) and tok.tokenizer.token_to_id(m) is None]
  if not marks:
    return str(error)
  return (f"{str(error).rstrip('.')}; {', '.join(map(repr, marks))} "
          f"{'is no mark' if len(marks) == 1 else 'are no marks'} of this run: its image mark is "
          f"{image_token!r} (--image_token sets it).")


def check_shape(where: str, shape: tuple[int, ...], cfg: Config) -> None:
  """ConfigError, said of `where` (an image file), where the processor made the image another
  shape (height x width x channels) than the model's tower reads, with the fix."""
  size, channels = cfg.model.vision.image_size, cfg.model.vision.channels
  if tuple(shape) == (size, size, channels):
    return
  if tuple(shape[:2]) != (size, size):
    fix = ("give the processor of the model's data (--processor DIR), which makes "
           f"{size}x{size}")
  elif channels == 1:  # a PNG: WebP holds no grayscale (Pillow reads a gray WebP as RGB)
    fix = ("convert the image to one channel, a grayscale PNG (e.g. with Pillow: "
           "Image.open(path).convert(\"L\").save(\"new.png\"))")
  elif channels == 3:
    fix = ("convert the image to three channels, an RGB image (e.g. with Pillow: "
           "Image.open(path).convert(\"RGB\").save(new_path)), or give a processor that "
           "converts it (\"do_convert_rgb\": true in its preprocessor_config.json)")
  else:
    fix = f"convert the image to {channels} channels"
  raise ConfigError(f"{where}: the processor makes it {'x'.join(map(str, shape))} (height x "
                    f"width x channels) where the model reads {size}x{size}x{channels}; {fix}.")


def bands_refused(path, proc, cfg: Config) -> str | None:
  """Where the processor keeps an image's bands (do_convert_rgb false) and image file `path` has
  others than the grayscale (L) or RGB it reads (RGBA, a palette, CMYK; tools.convert refuses
  them too): what it is and the fix, the image converted to the model's channels as a converting
  processor converts it (transparency onto white), as `images.bands_refused` words it. None
  where the processor takes it."""
  vision = cfg.model.encoders.get("vision")
  return images.bands_refused(path, proc.convert_rgb,
                              vision.channels if vision is not None else 3,
                              also=" (tools.convert refuses it too)")


def load_images(files: list[str], proc, cfg: Config) -> list[np.ndarray]:
  """Each image file as the processor prepares it (uint8 [h, w, c]), of the tower's shape; an
  image past Pillow's decompression-bomb limit (Image.MAX_IMAGE_PIXELS, where Pillow would only
  warn too) is refused as tools.convert and tools.eval refuse it."""
  pixels = []
  for f in files:
    try:
      pixels.append(images.load(f, proc))
    except images.TOO_LARGE as e:
      raise ConfigError(f"{f}: {images.too_large(e)}.") from None
    except images.UnsupportedImage as e:  # as the converter refuses it
      raise ConfigError(f"{f}: {e}.") from None
    except FileNotFoundError:  # as the converter and tools.eval name it
      raise ConfigError(f"{f}: not found.") from None
    except (OSError, ValueError) as e:
      bands = bands_refused(f, proc, cfg)
      raise ConfigError(f"{f} is {bands}." if bands else
                        f"{f}: cannot be read as an image ({e}).") from None
  for f, p in zip(files, pixels):
    check_shape(f, p.shape, cfg)
  return pixels


def window_seconds(a, where: str) -> int:
  """The seconds of a window of the audio tower `a` (model.audio), for reading audio files into
  its windows (tools.convert --audio_window); ConfigError, said of `where`, for a tower whose
  window is no whole number of seconds."""
  from mimo_jax.data import audio  # pylint: disable=import-outside-toplevel
  per_second = audio.SAMPLE_RATE // audio.HOP  # frames
  if a.frames % per_second:
    raise ConfigError(f"{where}: the model's audio tower reads windows of {a.frames} frames "
                      f"(model.audio.positions {a.positions}), not whole seconds of {per_second} "
                      "frames (Whisper: 3000, 30 s); it was not made for audio files.")
  return a.frames // per_second


def load_audios(files: list[str], cfg: Config) -> list[tuple[np.ndarray, list[int]]]:
  """Each audio file's log-mel windows [windows, frames, mel_bins] and their audio frames, as
  the converter makes them for the model's tower."""
  from mimo_jax.data import audio  # pylint: disable=import-outside-toplevel
  a = getattr(cfg.model, "audio", None)
  if a is None:
    raise ConfigError(f"--audio {files[0]}: the model has no audio encoder (model.audio); give "
                      "a model with one, or no --audio.")
  seconds = window_seconds(a, f"--audio {files[0]}")
  out = []
  for f in files:
    try:  # a clip too short for one token with the tower's pooling is refused too
      mel_fm, frames_w = audio.file_features(f, a.mel_bins, a.pool, seconds)
    except audio.AudioError as e:
      raise ConfigError(f"--audio: {e}") from None
    out.append((mel_fm.reshape(len(frames_w), a.frames, a.mel_bins), frames_w))
  return out
