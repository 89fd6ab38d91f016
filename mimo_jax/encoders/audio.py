"""The audio encoder plug-in: a Whisper-style tower + projector over audio slots
(models/whisper.py).

A sample lists its clips under `audios`: each the log-mel features [F, mel_bins] (float32) of
whole windows (F = windows · frames, the padding's features as the feature extractor computes
them, since Whisper's convolutions and attention read them), and under `audio_frames` the frames
of each that hold audio (F if absent). A clip longer than one window spans several, whose tokens
follow each other; the tokens of padding are dropped, so a clip yields
sum over its windows of `window_tokens(frames)` tokens, and its placeholder
(`model.audio.audio_token`) stands for them all.

Slots: a slot holds one clip of up to `model.audio.max_windows` windows, sent as `mel_nwfm`
[n, windows, frames, mel_bins] (float32) and `mel_frames_nw` [n, windows] (audio frames of each
window; 0 = unused). With `model.audio.slot_frames` > 0 (packing, as dynamic resolution packs
images) a slot is a row of that many frames into which a rank's clips are packed first fit, each
window of a clip its audio frames alone (no padding), starting at an even frame: a clip takes
room for its positions (`item_room`: ceil(frames / 2) a window), so several short clips share
what one padded window would take. Sent as `mel_nfm` [n, slot_frames, mel_bins], `mel_seg_nf`
(each frame's window in the slot, 1, 2, ...; 0 = none), `audio_pos_nq` (each position's index in
its window) and `token_pos_nt` (each token's first position), the tower encodes every window as
it would alone on its own frames (models/whisper.packed_embed, packed_finish).
Sidecar fields: each clip's audio frames.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from mimo_jax import encoders, hf
from mimo_jax.config import ACTIVATIONS, Config, ModuleTopology, positive, require
from mimo_jax.models import lora, mimo, whisper
from mimo_jax.models.whisper import PROJECTORS, WhisperConfig
from mimo_jax.models.whisper_windows import window_tokens
from mimo_jax.trees import kernel_params

AUDIO_TOKEN = 4  # the default placeholder id (the built-in tokenizer's texts never use it)


@dataclasses.dataclass
class AudioConfig(WhisperConfig):
  """`model.audio`: the tower (models/whisper.py), its weights and the audio data settings."""
  # An HF directory (a Whisper model, or Qwen2AudioForConditionalGeneration: tower and projector)
  # or a mimo_jax run, WORKDIR[:STEP], whose weights this module starts from; not read on resume.
  init_from: str = ""
  audio_token: int = AUDIO_TOKEN  # the placeholder id of a clip in the text
  # Data settings (not the tower's parameters: a resume may change them).
  max_audios: int = 1  # most clips a sample may have
  max_windows: int = 1  # most windows a clip may span (a slot's windows)
  # Audio slots per microbatch, split evenly over the language dp ranks; 0 = global_batch /
  # microbatches * max_audios (never overflows).
  audio_slots: int = 0
  # Packing: each audio slot is a row of this many mel frames (even, at least max_windows whole
  # windows) holding several clips first fit, each window its own audio frames (a 4 s clip takes
  # 400 frames), encoded as alone; 0 = one clip a slot in whole padded windows.
  slot_frames: int = 0


def packed_positions(a: AudioConfig) -> int:
  """The length of the tower's rows where they are packed segments (cuDNN's packed attention):
  a packed slot's positions, or a window's with mask_padding (its valid positions and its
  padding); 0 where they are plain rows."""
  return a.slot_frames // 2 or (a.positions if a.mask_padding else 0)


def clip_windows(frames: int, window: int) -> list[int]:
  """Audio frames of each window of a clip of `frames` frames."""
  return [min(window, frames - s) for s in range(0, max(frames, 1), window)]


@dataclasses.dataclass(frozen=True)
class AudioSlots(encoders.SlotLayout):
  noun = "clip"
  slots_field = "model.audio.audio_slots"
  tower: WhisperConfig = dataclasses.field(default_factory=WhisperConfig)
  windows: int = 1
  slot_frames: int = 0  # packing: frames a slot (model.audio.slot_frames); 0 = a clip a slot

  @property
  def packed(self) -> bool:
    return self.slot_frames > 0

  @property
  def tokens_field(self) -> str:
    return "model.audio.slot_frames" if self.packed else "model.audio.max_windows"

  def item_room(self, size: tuple[int, ...], tokens: int) -> int:
    """Packed: the positions of the clip's windows (ceil(frames / 2) each: pooling keeps fewer
    tokens, but every position is attended); else its tokens."""
    if not self.packed:
      return tokens
    return sum(int(window_tokens(f)) for f in clip_windows(size[0], self.tower.frames))

  def items(self, sample: dict) -> list:
    return list(sample.get("audios", ()))

  def item_tokens(self, size: tuple[int, ...], sid: int) -> int:
    frames, window = size[0], self.tower.frames
    windows = clip_windows(frames, window)
    if len(windows) > self.windows:
      raise ValueError(f"sample {sid} has a clip of {frames} frames, {len(windows)} windows of "
                       f"{window}, but model.audio.max_windows is {self.windows}; raise it.")
    tokens = sum(self.tower.window_tokens(f) for f in windows)
    if tokens <= 0:
      raise ValueError(f"sample {sid} has a clip of {frames} frames, too short for one token.")
    return tokens

  def empty(self) -> dict[str, np.ndarray]:
    t, n, f = self.tower, self.slots, self.slot_frames
    if self.packed:
      return {"mel_nfm": np.zeros((n, f, t.mel_bins), np.float32),
              "mel_seg_nf": np.zeros((n, f), np.int32),
              "audio_pos_nq": np.zeros((n, f // 2), np.int32),
              "token_pos_nt": np.zeros((n, self.slot_tokens), np.int32)}
    return {"mel_nwfm": np.zeros((self.slots, self.windows, t.frames, t.mel_bins), np.float32),
            "mel_frames_nw": np.zeros((self.slots, self.windows), np.int32)}

  def write(self, inputs, slot, start, tokens, item, size, nth) -> None:
    t, frames = self.tower, size[0]
    windows = clip_windows(frames, t.frames)
    mel = np.asarray(item, np.float32)
    if mel.shape != (len(windows) * t.frames, t.mel_bins):
      raise ValueError(f"a clip of {frames} audio frames has features of shape {mel.shape}; "
                       f"expected {(len(windows) * t.frames, t.mel_bins)} (whole windows of "
                       f"{t.frames} frames, model.audio.mel_bins).")
    if self.packed:
      self._pack(inputs, slot, start, mel, windows)
      return
    inputs["mel_nwfm"][slot, :len(windows)] = mel.reshape(len(windows), t.frames, t.mel_bins)
    inputs["mel_frames_nw"][slot, :len(windows)] = windows

  def _pack(self, inputs, slot: int, start: int, mel_fm: np.ndarray, windows: list[int]) -> None:
    """A clip's windows after the slot's last (the layout writes a slot's clips in the order it
    placed them), each its audio frames from an even frame, with its own segment id."""
    seg_f = inputs["mel_seg_nf"][slot]
    taken = np.flatnonzero(seg_f)
    at = 2 * (int(taken[-1]) // 2 + 1) if len(taken) else 0  # the next even frame
    segment = int(seg_f.max()) + 1
    for w, f in enumerate(windows):
      span, q, kept = slice(at, at + f), int(window_tokens(f)), int(window_tokens(f, self.tower.pool))
      inputs["mel_nfm"][slot, span] = mel_fm[w * self.tower.frames:w * self.tower.frames + f]
      seg_f[span] = segment + w
      inputs["audio_pos_nq"][slot, at // 2:at // 2 + q] = np.arange(q)
      inputs["token_pos_nt"][slot, start:start + kept] = at // 2 + self.tower.pool * np.arange(kept)
      at, start = at + 2 * q, start + kept

  def work(self, sizes) -> dict[str, int]:
    windows = [clip_windows(s[0], self.tower.frames) for s in sizes]
    if self.packed:
      positions = [int(window_tokens(f)) for w in windows for f in w]
      return {"positions": sum(positions), "positions_sq": sum(q * q for q in positions),
              "tokens": sum(self.tower.window_tokens(f) for w in windows for f in w)}
    return {"windows": sum(len(w) for w in windows),
            "tokens": sum(self.tower.window_tokens(f) for w in windows for f in w)}


class Audio(encoders.Encoder):
  name, sample_key, size_fields, seed_salt = "audio", "audios", 1, 5
  placeholder = AUDIO_TOKEN  # model.audio.audio_token sets the slots' (slot_layout)
  noun, config_class, slots_field = "clip", AudioConfig, AudioSlots.slots_field
  data_settings = ("max_audios", "max_windows", "audio_slots", "slot_frames")

  def item_sizes(self, sample: dict) -> list[tuple[int]]:
    if "audio_frames" in sample:
      return [(int(f),) for f in sample["audio_frames"]]
    return [(len(a),) for a in sample.get("audios", ())]

  def module(self, cfg: Config) -> mimo.Module:
    a, lm = cfg.model.audio, cfg.model.language
    dtype = jnp.dtype(cfg.model.dtype)
    att = mimo.attention_implementation(cfg, packed_positions(a))
    # Runs of equal segment ids a packed slot may hold: a window a position at most, padding.
    segments = a.slot_frames // 2 + 1 if a.slot_frames else 0
    return mimo.Module(self.name,
                       lambda rngs: whisper.WhisperEncoder(rngs, a, lm, dtype, att),
                       lambda rngs: whisper.WhisperBlock(rngs, a, dtype, att, segments),
                       seed_salt=self.seed_salt, fixed=("pos",))

  def load(self, path: str, cfg: Config):
    """The tower's tensors (and Qwen2-Audio's projector's) in the HF directory `path`."""
    return hf.leaves(hf.Source.open(path), self.name, cfg)

  def slot_layout(self, cfg: Config, groups: int, slots: int) -> AudioSlots:
    a = cfg.model.audio
    tower = WhisperConfig(**{f.name: getattr(a, f.name)
                             for f in dataclasses.fields(WhisperConfig)})
    if a.slot_frames:
      return AudioSlots(self.name, a.audio_token, groups, slots,
                        a.slot_frames // 2 // a.pool, slot_room=a.slot_frames // 2, tower=tower,
                        windows=a.max_windows, slot_frames=a.slot_frames)
    return AudioSlots(self.name, a.audio_token, groups, slots, a.max_windows * a.tokens_per_window,
                      1, tower=tower, windows=a.max_windows)

  def slots(self, cfg: Config, eval_batch: int = 0) -> int:
    a = cfg.model.audio
    if eval_batch:
      return eval_batch * a.max_audios
    return a.audio_slots or cfg.data.micro_batch * a.max_audios

  def validate(self, cfg: Config) -> None:
    a = cfg.model.audio
    positive(a, "model.audio", ("mel_bins", "positions", "dim", "layers", "heads", "mlp_dim",
                                "projector_hidden", "pool", "max_audios", "max_windows"))
    require(a.dim % a.heads == 0, "model.audio.heads", f"{a.heads} must divide dim {a.dim}.")
    require(a.dim % 2 == 0 and a.dim >= 4, "model.audio.dim",
            f"{a.dim}: the sinusoidal positions need an even dim >= 4.")
    require(a.positions % a.pool == 0, "model.audio.pool",
            f"{a.pool} must divide positions {a.positions}.")
    for field in ("activation", "projector_activation"):
      require(getattr(a, field) in ACTIVATIONS, f"model.audio.{field}",
              f"must be one of {', '.join(ACTIVATIONS)}, got {getattr(a, field)!r}.")
    require(a.projector in PROJECTORS, "model.audio.projector",
            f"must be one of {', '.join(PROJECTORS)}, got {a.projector!r}.")
    require(a.norm_eps > 0, "model.audio.norm_eps", f"must be > 0, got {a.norm_eps}.")
    require(a.audio_slots >= 0, "model.audio.audio_slots", "must be >= 0 (0 = worst case).")
    require(a.audio_token >= 0, "model.audio.audio_token", "must be a token id (>= 0).")
    rows = packed_positions(a)
    require(not (cfg.model.attention == "cudnn" and rows % 2), "model.attention",
            f"cuDNN's packed attention trains even lengths only, and the audio tower's packed "
            f"rows are {rows} positions (model.audio.slot_frames / 2, or its positions with "
            "mask_padding); make them even (slot_frames a multiple of 4), or use auto or xla.")
    require(a.slot_frames == 0 or (a.slot_frames % 2 == 0 and
                                   a.slot_frames >= a.max_windows * a.frames),
            "model.audio.slot_frames",
            f"{a.slot_frames} must be even and hold the longest clip, max_windows * "
            f"{a.frames} frames = {a.max_windows * a.frames} (or 0: a clip a slot).")

  def validate_topology(self, cfg: Config) -> None:
    a, t = cfg.model.audio, cfg.topology.audio
    for field in ("heads", "mlp_dim") + (("projector_hidden",) if a.projector == "mlp" else ()):
      require(getattr(a, field) % t.tp == 0, "topology.audio.tp",
              f"{t.tp} must divide model.audio.{field} {getattr(a, field)}.")

  def max_items(self, cfg: Config) -> int:
    return cfg.model.audio.max_audios

  def tokens_per_item(self, cfg: Config) -> int:
    a = cfg.model.audio
    return a.max_windows * a.tokens_per_window

  def activation_bytes(self, cfg: Config, t: ModuleTopology) -> int:
    """Each slot's window positions at the block's input and, unless remat=full, the MLP's
    hidden units."""
    a = cfg.model.audio
    rows = self.slots(cfg) // t.dp * (a.slot_frames // 2 or a.max_windows * a.positions)
    kept = a.dim + (0 if t.remat == "full" else a.mlp_dim // t.tp)
    return rows * kept * np.dtype(cfg.model.dtype).itemsize

  def encode(self, model, run_blocks, inputs_m: dict) -> jax.Array:
    """`mel_nwfm` [M, n, w, f, m] and `mel_frames_nw` [M, n, w] -> tokens [M, n, w·t, d]: each
    slot's kept tokens first (models/whisper.compact); packed, `mel_nfm` [M, n, f, m] with
    `mel_seg_nf`, `audio_pos_nq` and `token_pos_nt` -> [M, n, t, d]."""
    if "mel_nfm" in inputs_m:
      seg = inputs_m["mel_seg_nf"]
      x = jax.vmap(model.packed_embed)(inputs_m["mel_nfm"], seg, inputs_m["audio_pos_nq"])
      x = run_blocks(x, (seg[..., ::2],))  # a position's window: its first frame's
      return jax.vmap(model.packed_finish)(x, inputs_m["token_pos_nt"])
    mel, frames = inputs_m["mel_nwfm"], inputs_m["mel_frames_nw"]
    M, n, w = frames.shape
    rows = lambda x: x.reshape((M, n * w) + x.shape[3:])
    x = jax.vmap(model.embed)(rows(mel))
    side = (jax.vmap(model.valid)(rows(frames)),) if model.cfg.mask_padding else ()
    tok = jax.vmap(model.finish)(run_blocks(x, side))
    tok = tok.reshape((M, n, w) + tok.shape[2:])
    return jax.vmap(lambda t, f: whisper.compact(t, f, model.cfg.pool))(tok, frames)

  def dropout_rows(self, cfg: Config):
    """A clip a slot: a row of the blocks (a window's position) is (its slot's sample, the
    clip's place among the sample's clips · windows · positions + the window's · positions + the
    position). Packed slots are not named so (None)."""
    a = cfg.model.audio
    if a.slot_frames:
      return None
    return lambda inputs, owner_nt: _clip_rows(owner_nt, a.max_windows, a.positions)

  def flops(self, cfg: Config, params, work: dict[str, int]) -> float:
    """6·N a position for the tower's matmuls (the first convolution at two frames a position),
    bidirectional attention over each window (packed: over its audio positions alone), and 6·N
    a kept token for the projector."""
    a = cfg.model.audio
    projector = kernel_params(params, "projector")
    conv1 = a.mel_bins * a.dim * 3
    tower = kernel_params(params) - projector + conv1  # conv1 runs at twice the positions
    if "positions" in work:  # packed: each window's own positions, attending among themselves
      return float(6 * tower * work["positions"] + 12 * a.layers * a.dim * work["positions_sq"]
                   + 6 * projector * work["tokens"])
    per_window = 6 * tower * a.positions + 12 * a.layers * a.dim * a.positions**2
    return float(per_window * work["windows"] + 6 * projector * work["tokens"])


ENCODER = encoders.register(Audio())


def _clip_rows(owner_nt: jax.Array, windows: int, positions: int) -> tuple[jax.Array, jax.Array]:
  """`Audio.dropout_rows`: sample ids and positions [n · windows, positions]."""
  n = owner_nt.shape[0]
  place = lora.item_places(owner_nt)[:, None, None] * windows
  pos = (place + jnp.arange(windows)[None, :, None]) * positions + jnp.arange(positions)
  ids = jnp.broadcast_to(owner_nt[:, :1, None], pos.shape)
  return ids.reshape(n * windows, positions), pos.reshape(n * windows, positions).astype(jnp.int32)


def hidden_states(cfg: Config, params: dict, mel_nfm, frames_n=None) -> jax.Array:
  """Windows [n, frames, mel_bins] -> the tower's features [n, positions / pool, dim] (final
  norm, no projector), in one piece on one device (checks against transformers' towers).
  `frames_n`: audio frames of each window, for a tower that masks padding."""
  module = ENCODER.module(cfg)
  model = module.bind(params)
  mel = jnp.asarray(mel_nfm, jnp.float32)
  side = ()
  if cfg.model.audio.mask_padding:
    frames = jnp.full(mel.shape[:1], mel.shape[1]) if frames_n is None else jnp.asarray(frames_n)
    side = (model.valid(frames),)
  return model.features(module.apply_blocks(params, model.embed(mel), *side))


def audio_tokens(cfg: Config, params: dict, mel_nfm, frames_n) -> jax.Array:
  """Windows [n, frames, mel_bins] with `frames_n` audio frames each -> each window's kept,
  projected tokens, concatenated [k, language dim] (what the text's placeholders receive), as
  training encodes them: padded windows, or with model.audio.slot_frames each window alone on
  its audio frames, as a packed slot encodes it."""
  kept = sum(cfg.model.audio.window_tokens(int(f)) for f in np.asarray(frames_n))
  if kept <= 0:
    raise ValueError(f"a clip of {int(np.sum(frames_n))} audio frames yields no audio token with "
                     f"model.audio.pool={cfg.model.audio.pool} (a clip needs more than "
                     f"{10 * (2 * cfg.model.audio.pool - 2)} ms); drop it or pad it with silence.")
  if cfg.model.audio.slot_frames:
    return _packed_tokens(cfg, params, np.asarray(mel_nfm, np.float32), np.asarray(frames_n))
  model = ENCODER.module(cfg).bind(params)
  tok = model.projector(hidden_states(cfg, params, mel_nfm, frames_n))
  frames = jnp.asarray(frames_n)[None]
  flat = whisper.compact(tok[None], frames, cfg.model.audio.pool)[0]
  return flat[:int(whisper.window_tokens(frames, cfg.model.audio.pool).sum())]


def _packed_tokens(cfg: Config, params: dict, mel_nfm: np.ndarray, frames_n: np.ndarray):
  """`audio_tokens` of windows laid out in one packed slot of room for them all."""
  a = cfg.model.audio
  room = sum(int(window_tokens(f)) for f in frames_n)
  slots = dataclasses.replace(ENCODER.slot_layout(cfg, 1, 1), slot_frames=2 * room,
                              slot_room=room, slot_tokens=room // a.pool)
  inputs, start = slots.empty(), 0
  for w, f in enumerate(frames_n):
    kept = a.window_tokens(int(f))
    slots.write(inputs, 0, start, kept, mel_nfm[w], (int(f),), w + 1)
    start += kept
  module = ENCODER.module(cfg)
  model = module.bind(params)
  seg = jnp.asarray(inputs["mel_seg_nf"])
  x = model.packed_embed(jnp.asarray(inputs["mel_nfm"]), seg, jnp.asarray(inputs["audio_pos_nq"]))
  x = module.apply_blocks(params, x, seg[:, ::2])
  return model.packed_finish(x, jnp.asarray(inputs["token_pos_nt"]))[0, :start]
