"""Audio on the host: decoding, resampling to 16 kHz, and Whisper's log-mel features.

Features are computed as transformers' `WhisperFeatureExtractor` computes them (NumPy, no torch),
so towers imported from HF see the inputs they were trained on: a 30 s window (480000 samples,
zero-padded) → periodic Hann STFT (n_fft 400, hop 160, centred reflect padding, last frame
dropped) → power → Slaney mel filters (80 or 128 bins, 0–8 kHz) → log10 (clamped at 1e-10) →
max(x, max − 8) per window → (x + 4) / 4.

A clip longer than one window is split into consecutive 30 s windows, each featurised as its own
example (as the extractor would), so nothing is truncated; each window's frames that hold audio
(ceil(samples / 160)) are returned, so the encoder drops the tokens of padding and a 4 s clip
costs 4 s of tokens. The layout of a clip's features, [windows · 3000, mel_bins] and its audio
frames, is what the audio encoder plug-in reads (mimo_jax/encoders/audio.py). A shorter window
(`window_s`: the extractor's chunk_length) suits towers of fewer positions (window_s · 50): the
same features, zero-padded to that length and normalised per window.
"""

import functools
import os

import numpy as np

from mimo_jax.models.whisper_windows import window_tokens

SAMPLE_RATE = 16000
N_FFT = 400
HOP = 160
WINDOW_SECONDS = 30  # Whisper's window (the extractor's chunk_length)
WINDOW_SAMPLES = WINDOW_SECONDS * SAMPLE_RATE  # one 30 s window
WINDOW_FRAMES = WINDOW_SAMPLES // HOP  # 3000 mel frames
MEL_BINS = (80, 128)  # Whisper (and Qwen2-Audio: 128) towers
# Extensions and the libsndfile format that decodes them.
FORMATS = {".wav": "WAV", ".flac": "FLAC", ".ogg": "OGG", ".oga": "OGG", ".opus": "OGG",
           ".mp3": "MP3"}


class AudioError(ValueError):
  """An audio file that cannot be used: missing, empty, corrupt, truncated (fewer frames than its
  header declares: `declared_frames`) or of an unsupported format. `reason`: the short key a
  conversion counts its skipped records by (`missing audio`, `empty audio`, ...)."""

  def __init__(self, path: str, why: str, reason: str = "corrupt audio"):
    super().__init__(f"audio file {path}: {why}")
    self.path, self.reason = path, reason


def supported_formats() -> list[str]:
  """The extensions the installed libsndfile decodes (MP3 needs libsndfile ≥ 1.1)."""
  import soundfile
  have = soundfile.available_formats()
  return sorted(ext for ext, fmt in FORMATS.items() if fmt in have)


def load(path: str, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
  """The file's samples [s] (float32, mono: channels averaged) at `sample_rate` (soxr, HQ)."""
  import soundfile
  path = os.fspath(path)
  ext = os.path.splitext(path)[1].lower()
  if not os.path.exists(path):
    raise AudioError(path, "no such file.", "missing audio")
  if not os.path.isfile(path):
    raise AudioError(path, "not a file (give the path of an audio file).")
  if ext not in supported_formats():
    raise AudioError(path, f"unsupported format {ext or '(no extension)'}; this build decodes "
                     f"{', '.join(supported_formats())} (convert it, e.g. ffmpeg -i IN OUT.flac).",
                     "unsupported audio")
  if os.path.getsize(path) == 0:
    raise AudioError(path, "is an empty file (0 bytes), no audio; give the clip's file or drop "
                     "it.", "empty audio")
  try:
    wave_sc, rate = soundfile.read(path, dtype="float32", always_2d=True)
  except (soundfile.LibsndfileError, RuntimeError, ValueError, EOFError) as e:
    raise AudioError(path, f"cannot be decoded as {FORMATS[ext]} (corrupt or truncated?): "
                     f"{e}") from None
  declared = declared_frames(path, FORMATS[ext])
  if declared is not None and len(wave_sc) < declared:  # libsndfile reads what is there, quietly
    raise AudioError(path, f"truncated: {len(wave_sc)} of {declared} frames (its header declares "
                     f"{declared}; the file ends early); use the complete file or drop the clip.",
                     "truncated audio")
  if wave_sc.size == 0:
    data = wav_data(path) if FORMATS[ext] == "WAV" else None
    if data is not None and data[2] == 0 and data[3] > 0:  # libsndfile reads the size it is told
      raise AudioError(path, f"its header declares an empty data chunk (a size of 0, as a writer "
                       f"streaming to a pipe may leave it) while {data[3]} bytes follow it; write "
                       "it again with its size (e.g. sox IN OUT.wav) or drop the clip.",
                       "empty audio")
    raise AudioError(path, "holds no samples (empty clip).", "empty audio")
  if not np.isfinite(wave_sc).all():  # a float file can hold NaN or infinity; features would too
    bad = int(np.size(wave_sc) - np.isfinite(wave_sc).sum())
    raise AudioError(path, f"cannot be used: {bad} of its {wave_sc.size} samples are NaN or "
                     "infinite (corrupt?).")
  wave_s = wave_sc.mean(axis=1, dtype=np.float32) if wave_sc.shape[1] > 1 else wave_sc[:, 0]
  return resample(wave_s, rate, sample_rate)


# WAV codecs whose data chunk holds whole frames of block_align bytes: PCM, IEEE float, A-law,
# mu-law, and WAVE_FORMAT_EXTENSIBLE (of those).
WAV_FRAMED = (0x0001, 0x0003, 0x0006, 0x0007, 0xFFFE)
# A WAV data chunk's size from here up is taken as unknown: what writers that stream to a pipe put
# there (0xFFFFFFFF; SoX and espeak-ng --stdout: 0x7FFFF000), libsndfile reading to the file's end.
# A data chunk really this large (2 GiB) that is cut short is read as far as it goes.
STREAMED = 0x7FFFF000


def declared_frames(path: str, fmt: str) -> int | None:
  """The frames the file's header declares where the file holds fewer bytes than that: a WAV's
  data chunk (its size over block_align, for framed codecs: WAV_FRAMED) cut short; a FLAC's
  STREAMINFO total samples. None where the header declares no exact count (OGG, MP3, a WAV
  streamed with an unknown size: 0 or from STREAMED up, a FLAC's unknown total), a WAV's data is
  all there, or the header cannot be parsed (decoding reports that). libsndfile gives a truncated
  WAV's frames as those its file holds (soundfile.info too) and reads them without an error; the
  header says more."""
  try:
    if fmt == "FLAC":  # "fLaC", then STREAMINFO first: 4 bytes of header, 34 of fields
      with open(path, "rb") as f:
        head = f.read(42)
      if head[:4] != b"fLaC" or len(head) < 42 or head[4] & 0x7F != 0:
        return None
      return int.from_bytes(head[18:26], "big") & ((1 << 36) - 1) or None  # its bits 108..143
    data = wav_data(path) if fmt == "WAV" else None
  except OSError:
    return None
  if data is None:
    return None
  tag, block, length, held = data
  if tag not in WAV_FRAMED or block <= 0 or length == 0 or length >= STREAMED:
    return None  # a codec of blocks of several frames, or a size written as unknown
  return length // block if length > held else None


def wav_data(path: str) -> tuple[int | None, int, int, int] | None:
  """A WAV's data chunk: its codec's tag and block_align (from the fmt chunk before it), the size
  it declares and the bytes the file holds after its header; None for a file that is no RIFF (or
  RIFX) WAVE or has no data chunk."""
  with open(path, "rb") as f:
    size = os.fstat(f.fileno()).st_size
    head = f.read(12)
    if head[:4] not in (b"RIFF", b"RIFX") or head[8:12] != b"WAVE":
      return None
    order = "little" if head[:4] == b"RIFF" else "big"
    at, tag, block = 12, None, 0
    while at + 8 <= size:
      f.seek(at)
      chunk = f.read(8)
      kind, length = chunk[:4], int.from_bytes(chunk[4:8], order)
      if kind == b"fmt ":
        fields = f.read(14)
        if len(fields) == 14:
          tag, block = int.from_bytes(fields[:2], order), int.from_bytes(fields[12:14], order)
      elif kind == b"data":
        return tag, block, length, size - (at + 8)
      at += 8 + length + (length & 1)  # chunks are padded to an even size
  return None


def resample(wave_s: np.ndarray, rate_from: int, rate_to: int = SAMPLE_RATE) -> np.ndarray:
  """`wave_s` [s] from `rate_from` to `rate_to` Hz (soxr, HQ: what librosa's default uses)."""
  wave_s = np.asarray(wave_s, np.float32)
  if rate_from == rate_to:
    return wave_s
  import soxr
  return np.asarray(soxr.resample(wave_s, rate_from, rate_to, quality="HQ"), np.float32)


def _hz_to_mel(hz: np.ndarray) -> np.ndarray:
  """Slaney's mel scale: linear below 1 kHz, logarithmic above."""
  hz = np.asarray(hz, np.float64)
  log_region = hz >= 1000.0
  return np.where(log_region, 15.0 + np.log(np.maximum(hz, 1e-10) / 1000.0) * (27.0 / np.log(6.4)),
                  3.0 * hz / 200.0)


def _mel_to_hz(mel: np.ndarray) -> np.ndarray:
  return np.where(mel >= 15.0, 1000.0 * np.exp(np.log(6.4) / 27.0 * (mel - 15.0)), 200.0 * mel / 3.0)


@functools.lru_cache(maxsize=4)
def mel_filters(mel_bins: int) -> np.ndarray:
  """Slaney-normalised triangular filters [N_FFT // 2 + 1, mel_bins] over 0–8 kHz (float64)."""
  mel_m = np.linspace(_hz_to_mel(0.0), _hz_to_mel(8000.0), mel_bins + 2)
  edges_hz = _mel_to_hz(mel_m)
  fft_hz = np.linspace(0, SAMPLE_RATE // 2, N_FFT // 2 + 1)
  slopes = edges_hz[None, :] - fft_hz[:, None]
  width = np.diff(edges_hz)
  down = -slopes[:, :-2] / width[:-1]
  up = slopes[:, 2:] / width[1:]
  filters = np.maximum(0.0, np.minimum(down, up))
  return filters * (2.0 / (edges_hz[2:] - edges_hz[:-2]))[None, :]


@functools.lru_cache(maxsize=1)
def _hann() -> np.ndarray:
  return np.hanning(N_FFT + 1)[:-1]  # periodic


def window_features(wave_s: np.ndarray, mel_bins: int,
                    window_s: int = WINDOW_SECONDS) -> np.ndarray:
  """Log-mel features [window_s · 100, mel_bins] (float32) of one window: `wave_s` (≤ window_s ·
  16000 samples at 16 kHz) zero-padded to `window_s` seconds (the extractor's chunk_length:
  Whisper's 30, or shorter windows for towers of fewer positions)."""
  if mel_bins not in MEL_BINS:
    raise ValueError(f"mel_bins is {mel_bins}; Whisper features have {MEL_BINS[0]} or "
                     f"{MEL_BINS[1]}.")
  wave_s, samples = np.asarray(wave_s, np.float32), window_s * SAMPLE_RATE
  if wave_s.ndim != 1 or len(wave_s) > samples:
    raise ValueError(f"a window is at most {samples} mono samples; got {wave_s.shape}.")
  padded = np.zeros(samples, np.float32)
  padded[:len(wave_s)] = wave_s
  padded = np.pad(padded, N_FFT // 2, mode="reflect").astype(np.float64)
  frames_ft = np.lib.stride_tricks.sliding_window_view(padded, N_FFT)[::HOP][:samples // HOP]
  power_fk = np.abs(np.fft.rfft(frames_ft * _hann(), axis=1)) ** 2
  log_fm = np.log10(np.maximum(power_fk @ mel_filters(mel_bins), 1e-10)).astype(np.float32)
  log_fm = np.maximum(log_fm, log_fm.max() - 8.0)
  return (log_fm + 4.0) / 4.0


def split(wave_s: np.ndarray, window_s: int = WINDOW_SECONDS) -> list[np.ndarray]:
  """Consecutive windows of `window_s` seconds of a clip (the last one shorter)."""
  if len(wave_s) == 0:
    raise ValueError("an empty clip has no windows.")
  samples = window_s * SAMPLE_RATE
  return [wave_s[i:i + samples] for i in range(0, len(wave_s), samples)]


def audio_frames(samples: int) -> int:
  """Mel frames that hold audio in a clip of `samples` samples (16 kHz): ceil(samples / 160), as
  the extractor's attention mask counts them."""
  return -(-int(samples) // HOP)


def clip_features(wave_s: np.ndarray, mel_bins: int,
                  window_s: int = WINDOW_SECONDS) -> tuple[np.ndarray, list[int]]:
  """A clip's features [windows · window_s · 100, mel_bins] (float32) and each window's audio
  frames."""
  windows = split(np.asarray(wave_s, np.float32), window_s)
  mel_fm = np.concatenate([window_features(w, mel_bins, window_s) for w in windows])
  return mel_fm, [audio_frames(len(w)) for w in windows]


def file_features(path: str, mel_bins: int, pool: int = 1,
                  window_s: int = WINDOW_SECONDS) -> tuple[np.ndarray, list[int]]:
  """`clip_features` of an audio file (decoded, mixed down, resampled to 16 kHz) in windows of
  `window_s` seconds; AudioError for a clip too short to yield a token with a tower's `pool`
  (`check_tokens`)."""
  mel_fm, frames_w = clip_features(load(path), mel_bins, window_s)
  check_tokens(path, frames_w, pool)
  return mel_fm, frames_w


def check_tokens(path: str, frames_w: list[int], pool: int) -> None:
  """AudioError naming `path` where a clip of windows with `frames_w` audio frames yields no
  token: a tower must give each clip at least one (pool 2 needs more than 20 ms)."""
  if clip_tokens(frames_w, pool) <= 0:
    ms = sum(frames_w) * HOP * 1000 // SAMPLE_RATE
    need = (2 * pool - 2) * HOP * 1000 // SAMPLE_RATE
    raise AudioError(os.fspath(path), f"its {sum(frames_w)} mel frames (up to {ms} ms of audio) "
                     f"yield no audio token with pooling by {pool}; a clip needs more than "
                     f"{need} ms (drop it or pad it with silence).", "short audio")


def clip_tokens(frames: list[int] | int, pool: int = 1, window: int = WINDOW_FRAMES) -> int:
  """Encoder tokens of a clip: its windows' tokens (`frames`: each window's audio frames, or the
  clip's total, split into windows of `window` frames)."""
  if isinstance(frames, (int, np.integer)):
    frames = [min(window, frames - s) for s in range(0, max(int(frames), 1), window)]
  return sum(int(window_tokens(f, pool)) for f in frames)
