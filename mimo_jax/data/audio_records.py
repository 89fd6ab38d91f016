"""Audio in LLaVA-style conversation records: the clips a record lists, their features, and the
text that marks them.

A record lists its clips under `"audio"` or `"audios"` (a path or a list of paths, relative to
the audio folder) and marks each, in order, with `<audio>` in its turns. A chat template's own
markers replace each mark (Qwen2-Audio's `<|audio_bos|><|AUDIO|><|audio_eos|>`); the one token of
the placeholder (`<|AUDIO|>`) stands for all the clip's tokens, as `<image>` does for an image's:
the layout expands it (`expand` gives the same ids written out, as Qwen2AudioProcessor writes
them). A clip's tokens are its windows' (audio.py: padding's are dropped).

Bad records raise conversations.RecordError with a reason the converter counts: a bad `audio`
field, a mark count other than the clips listed, a clip missing, empty, corrupt or of a format
the installed libsndfile does not decode, or one leading out of the audio folder.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib

import numpy as np

from mimo_jax.data import audio
from mimo_jax.data.conversations import RecordError

MARK = "<audio>"  # the mark of a clip in LLaVA-style text
QWEN2_AUDIO = "<|audio_bos|><|AUDIO|><|audio_eos|>"  # Qwen2-Audio's markers, placeholder inside
QWEN2_AUDIO_TOKEN = "<|AUDIO|>"
FIELDS = ("audio", "audios")


@dataclasses.dataclass(frozen=True)
class Clip:
  """A clip's features [windows · 3000, mel_bins] (float32) and each window's audio frames."""
  mel_fm: np.ndarray
  frames_w: tuple[int, ...]

  @property
  def frames(self) -> int:
    """Frames that hold audio over all its windows (the sample's `audio_frames` entry)."""
    return sum(self.frames_w)

  def tokens(self, pool: int = 1) -> int:
    return audio.clip_tokens(list(self.frames_w), pool)


def audio_files(record: dict, where: str) -> list[str]:
  """The clips a record lists (`audio` or `audios`: a path or a list of paths)."""
  given = [f for f in FIELDS if f in record]
  if len(given) > 1:
    raise RecordError("bad audio field", f"{where}: both \"audio\" and \"audios\"; list the clips "
                      "under one of them.")
  if not given:
    return []
  files = record[given[0]]
  if isinstance(files, str):
    return [files]
  if isinstance(files, list) and all(isinstance(f, str) for f in files):
    return files
  raise RecordError("bad audio field", f"{where}: \"{given[0]}\" is {json.dumps(files)[:60]}, "
                    "not a path or a list of paths.")


def check_marks(msgs: list[dict], files: list[str], where: str, mark: str = MARK) -> None:
  """One `mark` a clip, in the turns' text (chat.messages)."""
  marks = sum(m["content"].count(mark) for m in msgs)
  if marks != len(files):
    raise RecordError("audio count", f"{where}: its text has {marks} {mark} but it lists "
                      f"{len(files)} audio clips.")


def template_marks(msgs: list[dict], markers: str = QWEN2_AUDIO, mark: str = MARK) -> list[dict]:
  """The turns with each `mark` replaced by the chat template's `markers`."""
  return [{**m, "content": m["content"].replace(mark, markers)} for m in msgs]


def read_clip(folder: str | os.PathLike, f: str, where: str, mel_bins: int,
              allow_outside: bool = False) -> Clip:
  """Clip `f` (relative to `folder`) decoded and featurised."""
  path = pathlib.Path(folder) / f
  root, real = os.path.realpath(folder), os.path.realpath(path)
  if not allow_outside and os.path.commonpath([real, root]) != root:
    raise RecordError("outside audio folder", f"{where}: audio {f!r} leads out of the audio "
                      f"folder {root} ({real}); move it there or allow clips outside it.")
  try:
    mel_fm, frames_w = audio.file_features(path, mel_bins)
  except audio.AudioError as e:
    text = str(e)
    reason = ("missing audio" if "no such file" in text else "unsupported audio"
              if "unsupported format" in text else "empty audio" if "no samples" in text
              else "corrupt audio")
    raise RecordError(reason, f"{where}: {text}") from None
  return Clip(mel_fm, tuple(frames_w))


def expand(ids: np.ndarray, placeholder: int, tokens: list[int]) -> np.ndarray:
  """`ids` with the i-th `placeholder` written out `tokens[i]` times (Qwen2AudioProcessor's
  expansion of `<|AUDIO|>`), for tools that need the ids a model reads."""
  ids = np.asarray(ids)
  at = np.flatnonzero(ids == placeholder)
  if len(at) != len(tokens):
    raise ValueError(f"{len(at)} audio placeholders ({placeholder}) for {len(tokens)} clips.")
  counts = np.ones(len(ids), np.int64)
  counts[at] = tokens
  return np.repeat(ids, counts)


def positions(tokens: int, clip_tokens: list[int]) -> int:
  """Positions a sample takes in a row (as conversations.positions): every token but the last is
  an input, each clip's placeholder its tokens."""
  return tokens - 1 + sum(t - 1 for t in clip_tokens)
