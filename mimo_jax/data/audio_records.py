"""Audio in LLaVA-style conversation records: the clips a record lists, their features, and the
text that marks them.

A record lists its clips under `"audio"` or `"audios"` (a path or a list of paths, relative to
the audio folder) and marks each, in order, with `<audio>` in its turns. A chat template's own
markers replace each mark (Qwen2-Audio's `<|audio_bos|><|AUDIO|><|audio_eos|>`); the one token of
the placeholder (`<|AUDIO|>`) stands for all the clip's tokens, as `<image>` does for an image's:
the layout expands it (`expand` gives the same ids written out, as Qwen2AudioProcessor writes
them). A clip's tokens are its windows' (audio.py: padding's are dropped).

Bad records raise record_error.RecordError with a reason the converter counts: a bad `audio`
field, a mark count other than the clips listed, a clip missing, empty, too short for one token
(pool 2: 20 ms or less), corrupt or of a format the installed libsndfile does not decode, or one
leading out of the audio folder.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib

import numpy as np

from mimo_jax.config import ConfigError
from mimo_jax.data import audio
from mimo_jax.data import record_error
from mimo_jax.data.record_error import RecordError

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
  return record_error.paths(record[given[0]], given[0], "audio", where)


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
              allow_outside: bool = False, pool: int = 1,
              window_s: int = audio.WINDOW_SECONDS) -> Clip:
  """Clip `f` (relative to `folder`) decoded and featurised in windows of `window_s` seconds; one
  too short to yield a token with the tower's `pool` is a RecordError."""
  path = pathlib.Path(folder) / f
  root, real = os.path.realpath(folder), os.path.realpath(path)
  if not allow_outside and os.path.commonpath([real, root]) != root:
    raise RecordError("outside audio folder", f"{where}: audio {f!r} leads out of the audio "
                      f"folder {root} ({real}); move it under --audio, or give "
                      "--allow_outside_images (which reads such clips too).")
  try:
    mel_fm, frames_w = audio.file_features(path, mel_bins, pool, window_s)
  except audio.AudioError as e:
    if e.reason == "missing audio":  # where it was looked for, and the flag that says so
      raise RecordError(e.reason, f"{where}: audio file {path}: no such file under --audio "
                        f"{os.path.abspath(folder)}.") from None
    raise RecordError(e.reason, f"{where}: {e}") from None
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
  """Positions a sample takes in a row (as conversion_record.positions): every token but the last is
  an input, each clip's placeholder its tokens."""
  return tokens - 1 + sum(t - 1 for t in clip_tokens)


# Hooks of the converter (conversion.py, conversion_record.py): a sample's clips in records,
# and their conversion.

AUDIOS, FRAMES = "audios", "audio_frames"  # a sample's clips and each clip's audio frames


def listed(records: list[dict]) -> bool:
  """Whether any record lists clips (then the converter needs an audio token): a path, or a
  list of some; a field of another value is that record's fault (skipped as a bad audio field
  by `audio_files`), not the conversion's."""
  return any(bool(v) and isinstance(v, (str, list))
             for r in records for v in (r.get(f) for f in FIELDS))


def estimate_bytes(records: list[dict], mel_bins: int,
                   window_s: int = audio.WINDOW_SECONDS) -> int:
  """About the bytes the records' clips take stored: one window of features each (a lower bound:
  a clip over 30 s takes more; well-formed fields only, as a bad one is a skipped record)."""
  count = 0
  for r in records:
    for f in FIELDS:
      v = r.get(f)
      count += 1 if isinstance(v, str) else len(v) if isinstance(v, list) else 0
  return count * window_s * audio.SAMPLE_RATE // audio.HOP * mel_bins * 4  # float32 (records.py)


def header(sample: dict) -> dict:
  """The header fields of a sample's clips ({} without)."""
  return {FRAMES: [int(f) for f in sample[FRAMES]]} if sample.get(AUDIOS) else {}


def clips(sample: dict) -> list[np.ndarray]:
  return list(sample.get(AUDIOS, ()))


def sample_fields(header: dict, audios: list[np.ndarray]) -> dict:
  """The sample's `audios` and `audio_frames` from its record ({} for a record without clips);
  ValueError when the header's frames disagree with the stored features (whole windows, of the
  manifest's audio_window_frames each: the audio encoder checks their length)."""
  frames = header.get(FRAMES, [])
  if len(frames) != len(audios):
    raise ValueError(f"{len(frames)} audio_frames entries for {len(audios)} clips")
  for f, mel in zip(frames, audios):
    if mel.ndim != 2 or mel.shape[0] < f or f <= 0:
      raise ValueError(f"a clip of {f} audio frames has features of shape {mel.shape}")
  return {AUDIOS: audios, FRAMES: np.asarray(frames, np.int32)} if audios else {}


@dataclasses.dataclass(frozen=True)
class Settings:
  """The converter's audio settings (`tools.convert`'s flags of the same names)."""
  folder: str = "."  # the folder clip paths are relative to
  token: str = QWEN2_AUDIO_TOKEN  # the placeholder: one token of the tokenizer
  markers: str = QWEN2_AUDIO  # what each <audio> becomes in the text, `token` inside
  mel_bins: int = 128  # Qwen2-Audio's (Whisper large-v3); 80 for the other Whisper towers
  pool: int = 2  # the tower's pooling after its stride-2 convolution (Qwen2-Audio: 2; Whisper 1)
  allow_outside: bool = False  # read clip paths that lead out of `folder`
  window_s: int = audio.WINDOW_SECONDS  # seconds a window (Whisper: 30; the tower's positions / 50)

  @property
  def window_frames(self) -> int:
    return self.window_s * audio.SAMPLE_RATE // audio.HOP


def convert(record: dict, msgs: list[dict], where: str,
            s: Settings) -> tuple[list[dict], list[Clip]]:
  """A record's turns with its `<audio>` marks as `s.markers`, and its clips (RecordError for a
  bad one), before tokenizing."""
  files = audio_files(record, where)
  check_marks(msgs, files, where)
  if not files:
    return msgs, []
  return template_marks(msgs, s.markers), [read_clip(s.folder, f, where, s.mel_bins,
                                                     s.allow_outside, s.pool, s.window_s)
                                           for f in files]


def check_tokens(ids: np.ndarray, token_id: int | None, clips_: list[Clip], where: str,
                 s: Settings) -> None:
  """One audio token a clip after tokenizing."""
  found = 0 if token_id is None else int((np.asarray(ids) == token_id).sum())
  if found != len(clips_):
    raise RecordError("audio count", f"{where}: {found} audio tokens after tokenizing, for "
                      f"{len(clips_)} clips (is {s.token!r} one special token of the "
                      "tokenizer?).")


def fields(clips_: list[Clip]) -> dict:
  """The sample fields of converted clips ({} without)."""
  if not clips_:
    return {}
  return {AUDIOS: [c.mel_fm for c in clips_], FRAMES: [c.frames for c in clips_]}


def manifest(s: Settings, token_id: int | None, counts: list[int], windows: int) -> dict:
  """The manifest's audio fields: the placeholder id, mel bins, pooling, window frames, clips
  (`counts`: each sample's) and the windows of the longest clip."""
  if token_id is None:
    return {"audios": 0}
  return {"audio_token": token_id, "audio_token_text": s.token, "mel_bins": s.mel_bins,
          "audio_pool": s.pool, "audio_window_frames": s.window_frames,
          "audios": int(sum(counts)), "max_audios": max(counts, default=0), "max_windows": windows}


def check_config(cfg, directory: str, m: dict) -> None:
  """The run's model.audio against a conversion's clips: one ConfigError naming both."""
  if not m.get("audios"):
    return
  a = getattr(cfg.model, "audio", None)
  if a is None:
    raise ConfigError(f"config.model: {directory} holds {m['audios']} audio clips but the config "
                      "has no audio encoder; add one (cfg.add_encoder(\"audio\", AudioConfig(), "
                      "...)) or convert without clips.")
  if a.audio_token != m["audio_token"]:
    raise ConfigError(f"config.model.audio.audio_token: {a.audio_token} where {directory} marks "
                      f"clips with token {m['audio_token']} ({m['audio_token_text']!r}); set "
                      f"model.audio.audio_token={m['audio_token']}.")
  if a.mel_bins != m["mel_bins"]:
    raise ConfigError(f"config.model.audio.mel_bins: {a.mel_bins} where {directory} holds "
                      f"features of {m['mel_bins']} mel bins; set model.audio.mel_bins="
                      f"{m['mel_bins']} or convert with --mel_bins {a.mel_bins}.")
  if a.frames != m["audio_window_frames"]:
    raise ConfigError(f"config.model.audio.positions: {a.positions} ({a.frames} frames a window) "
                      f"where {directory} holds windows of {m['audio_window_frames']} frames; set "
                      f"model.audio.positions={m['audio_window_frames'] // 2}.")
  if a.pool != m.get("audio_pool", a.pool):
    raise ConfigError(f"config.model.audio.pool: {a.pool} where {directory}'s clips were counted "
                      f"with --audio_pool {m['audio_pool']} (their tokens in its longest sample "
                      f"and data.seq_len); set model.audio.pool={m['audio_pool']} or convert with "
                      f"--audio_pool {a.pool}.")
  if a.max_audios < m["max_audios"]:
    raise ConfigError(f"config.model.audio.max_audios: {a.max_audios} where a sample of "
                      f"{directory} has {m['max_audios']} clips; set model.audio.max_audios="
                      f"{m['max_audios']}.")
  if a.max_windows < m["max_windows"]:
    raise ConfigError(f"config.model.audio.max_windows: {a.max_windows} where {directory} has a "
                      f"clip of {m['max_windows']} windows of "
                      f"{m['audio_window_frames'] * audio.HOP // audio.SAMPLE_RATE} s; set "
                      f"model.audio.max_windows="
                      f"{m['max_windows']}.")
