"""The slot layout: how a microbatch's images and text are laid out for two meshes.

A microbatch of B samples is split contiguously over the language model's G = dp ranks, b = B / G
samples each. Every rank gets S image *slots*; slots are numbered globally, rank g owning slots
[g*S, (g+1)*S). The images of rank g's samples fill its slots in sample order, the rest stay zero.
So the image array `images_nhwc` [G*S, ...] is already in the order the language model needs: the
encoder runs on it with any dp that divides G*S, and moving its output to the language mesh is a
reshard of one array split on its first axis (fan-in and fan-out fall out of the shapes).

Images travel as their raw uint8 pixels (a quarter of float32's bytes from host to device); the
encoder scales them on device (`Config.data.pixel_max`). For every text position that holds an image
placeholder, `img_pos_bl` gives the index of the image
token inside the rank's own slots (slot_local * T + t), or -1: the merge on the language mesh is a
gather that never leaves the rank. `image_owner_nt` records which sample owns each image token of
each slot (-1 = empty); it travels through the bridge beside the embeddings so the language side can
verify that every placeholder receives an image of its own sample.

Dynamic resolution (`slot_patches` > 0): a slot is a row of `slot_patches` patches into which the
rank's images of any size (sides multiples of patch * downsample, up to `image_shape`) are packed,
first fit in sample order. An image of gh x gw patches gives gh*gw/s² tokens, so a sample's image
tokens, its placeholders and what the bridge moves for it are counted in tokens, not images. The
slot travels as `patches_npk` (uint8, block order, see patches.py), `patch_pos_np` (position ids)
and `patch_seg_np` (1, 2, ... per image in the slot, 0 = padding); the ViT attends only within an
image. Without it (`slot_patches` = 0) a slot holds one image of exactly `image_shape`, sent as
`images_nhwc`.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from mimo_jax.data.tokenizer import BOS, EOS, IMG, PAD, Tokenizer
from mimo_jax.patches import grid_positions, patchify


@dataclasses.dataclass(frozen=True)
class Layout:
  seq_len: int  # L, tokens fed to the language model per row
  tokens_per_image: int  # T
  groups: int  # G, language dp ranks
  slots: int  # G*S, image slots in the whole microbatch
  image_shape: tuple[int, ...] = (8, 8, 1)  # the largest image (the only size without packing)
  pack_rows: int = 0  # rows per microbatch when packing several samples a row; 0 = one per row
  slot_patches: int = 0  # dynamic resolution: patches a slot; 0 = one image a slot
  patch_size: int = 4
  downsample: int = 1
  slot_images: int = 0  # most images a packed slot takes (config.slot_images); 0 = no limit

  @property
  def slots_per_group(self) -> int:
    return self.slots // self.groups

  @property
  def packed_images(self) -> bool:
    return self.slot_patches > 0

  @property
  def slot_tokens(self) -> int:
    """Image tokens a slot yields (and the language model can gather from)."""
    return self.slot_patches // self.downsample**2 if self.packed_images else self.tokens_per_image

  def image_tokens(self, h: int, w: int, sid: int) -> int:
    """Tokens of an h x w image, or an error naming sample `sid` if this layout cannot take it."""
    H, W = self.image_shape[:2]
    if not self.packed_images:
      if (h, w) != (H, W):
        raise ValueError(f"sample {sid} has a {h}x{w} image but model.vision.image_size is {H}; "
                         "set data.slot_patches > 0 for images of several sizes (dynamic "
                         "resolution).")
      return self.tokens_per_image
    unit = self.patch_size * self.downsample
    if h % unit or w % unit or h > H or w > W or h == 0 or w == 0:
      raise ValueError(f"sample {sid} has a {h}x{w} image; sides must be multiples of "
                       f"patch_size * downsample = {unit} and at most {H}x{W} "
                       "(model.vision.image_size).")
    return (h // self.patch_size) * (w // self.patch_size) // self.downsample**2


def image_sizes(sample: dict) -> list[tuple[int, int]]:
  """(h, w) of each image of a sample, read or a stub's metadata (data/meta.py)."""
  if "meta" in sample:
    m = [int(v) for v in sample["meta"]]
    return [(m[3 + 2 * i], m[4 + 2 * i]) for i in range(m[0])]
  return [tuple(int(v) for v in np.shape(img)[:2]) for img in sample["images"]]


def place_images(tokens: list[list[int]], ids: list[int], layout: Layout) -> list[list[tuple]]:
  """(slot, token offset in the slot) of every image of every sample: each language dp rank fills
  its own slots first fit, in sample order. `tokens[b]` lists sample b's image tokens."""
  per_group, S, cap = len(tokens) // layout.groups, layout.slots_per_group, layout.slot_tokens
  most = layout.slot_images or cap
  free, images = [cap] * layout.slots, [0] * layout.slots
  out = []
  for b, (counts, sid) in enumerate(zip(tokens, ids)):
    g, placed = b // per_group, []
    for t in counts:
      slot = next((j for j in range(g * S, (g + 1) * S) if free[j] >= t and images[j] < most),
                  None)
      if t > cap:
        raise ValueError(f"sample {sid} has an image of {t} tokens but a slot holds {cap}; "
                         "raise data.slot_patches.")
      if slot is None:
        raise ValueError(
            f"sample {sid} needs {len(counts)} images but the image slots of language dp rank "
            f"{g} are full in this microbatch; raise data.image_slots (now {layout.slots} per "
            "microbatch).")
      placed.append((slot, cap - free[slot]))
      free[slot] -= t
      images[slot] += 1
    out.append(placed)
  return out


def sample_tokens(tok: Tokenizer, sample: dict, image_tokens: list[int]) -> tuple[list[int], int]:
  """bos + the sample's tokens (its i-th <img> expanded to image_tokens[i] placeholders) + eos, and
  the position whose target starts the loss: ':' for a digits sample (`text`), the last image
  placeholder (or bos) for a sample given as token ids (`tokens`, images first, as
  data/synthetic.py writes)."""
  ids = tok.encode(sample["text"]) if "text" in sample else list(sample["tokens"])
  if ids.count(IMG) != len(image_tokens):
    raise ValueError(f"its text has {ids.count(IMG)} <img> placeholders but it has "
                     f"{len(image_tokens)} images.")
  words, image = [BOS], iter(image_tokens)
  for w in ids:
    words.extend([IMG] * next(image) if w == IMG else [w])
  words.append(EOS)
  if "text" in sample:
    return words, words.index(tok.colon)
  return words, sum(image_tokens)


def text_length(sample: dict, tok: Tokenizer) -> int:
  """Tokens of a sample other than its images (bos and eos included)."""
  ids = tok.encode(sample["text"]) if "text" in sample else sample["tokens"]
  return 2 + sum(1 for w in ids if w != IMG)


class _Rows:
  """Where each sample's tokens go: its own row, or first fit among its rank's packed rows."""

  def __init__(self, layout: Layout, bsz: int):
    self.layout, self.packed = layout, layout.pack_rows > 0
    self.count = layout.pack_rows if self.packed else bsz
    self.per_group = self.count // layout.groups
    self.free = [layout.seq_len] * self.count
    self.segments = [0] * self.count

  def place(self, b: int, g: int, n: int, sid: int) -> tuple[int, int, int]:
    """Row, offset and segment number (1-based) for sample b of rank g with n tokens."""
    L = self.layout.seq_len
    if not self.packed:
      self.free[b] -= n
      return b, 0, 1
    for r in range(g * self.per_group, (g + 1) * self.per_group):
      if self.free[r] >= n:
        offset, self.free[r] = L - self.free[r], self.free[r] - n
        self.segments[r] += 1
        return r, offset, self.segments[r]
    raise ValueError(
        f"sample {sid} ({n} tokens) does not fit in the {self.per_group} packed rows of language "
        f"dp rank {g}; raise data.pack_rows (now {self.count} per microbatch) or data.seq_len.")


def layout_microbatch(samples: list[dict], ids: list[int], layout: Layout,
                      tok: Tokenizer) -> dict[str, np.ndarray]:
  """Lays out one microbatch (see the module docstring). Empty samples (None) have id -1.

  Row arrays (`_bl`) have one row per sample, or `pack_rows` rows holding several samples as
  segments (ids 1, 2, ...; 0 = padding) whose positions restart at 0. Per-sample arrays (`_b`)
  keep one entry per sample in both cases.

  A sample given only as `{"meta": (images, text tokens, loss tokens, h, w, ...)}` (data/meta.py)
  takes its row and slots like the full sample would, but they stay empty: scalable data
  parallelism passes such stubs for samples whose rows and slots live on other processes' devices.
  `tokens`, `target_tokens`, `images`, `image_tokens`, `patches`, `patches_sq` (sum of squared
  patch counts, for attention FLOPs), `slots_used_g` (image slots each language dp rank fills) and
  `rows_used_g` (rows it fills) count the whole microbatch, stubs included.
  """
  bsz, L, G = len(samples), layout.seq_len, layout.groups
  if bsz % G:
    raise ValueError(f"microbatch of {bsz} samples does not split over {G} language dp ranks")
  per_group, S, T = bsz // G, layout.slots_per_group, layout.slot_tokens
  rows = _Rows(layout, bsz)
  R, N = rows.count, layout.slots
  out = {
      "tokens_bl": np.full((R, L), PAD, np.int32),
      "targets_bl": np.full((R, L), PAD, np.int32),
      "loss_mask_bl": np.zeros((R, L), np.float32),
      "img_pos_bl": np.full((R, L), -1, np.int32),
      "positions_bl": np.broadcast_to(np.arange(L, dtype=np.int32), (R, L)).copy(),
      "segment_ids_bl": np.zeros((R, L), np.int32),
      "token_sample_bl": np.full((R, L), -1, np.int32),
      "colon_b": np.zeros((bsz,), np.int32),
      "num_images_b": np.zeros((bsz,), np.int32),
      "tokens_b": np.zeros((bsz,), np.int32),  # positions the sample takes in its row
      "sample_ids_b": np.full((bsz,), -1, np.int32),
      "image_owner_nt": np.full((N, T), -1, np.int32),
  }
  P, s, (_, W, C) = layout.patch_size, layout.downsample, layout.image_shape
  if layout.packed_images:
    out.update(patches_npk=np.zeros((N, layout.slot_patches, P * P * C), np.uint8),
               patch_pos_np=np.zeros((N, layout.slot_patches), np.int32),
               patch_seg_np=np.zeros((N, layout.slot_patches), np.int32))
    images_in_slot = [0] * N
  else:
    out["images_nhwc"] = np.zeros((N,) + layout.image_shape, np.uint8)
  sizes = [image_sizes(x) if x is not None else [] for x in samples]
  image_tokens = [[layout.image_tokens(h, w, sid) for h, w in hw] for hw, sid in zip(sizes, ids)]
  places = place_images(image_tokens, ids, layout)
  out["slots_used_g"] = np.zeros((G,), np.int32)
  for b, placed in enumerate(places):
    for slot, _ in placed:
      g = b // per_group
      out["slots_used_g"][g] = max(out["slots_used_g"][g], slot - g * S + 1)
  totals = {"tokens": 0, "target_tokens": 0, "images": 0, "image_tokens": 0, "patches": 0,
            "patches_sq": 0}
  for b, (sample, sid) in enumerate(zip(samples, ids)):
    if sample is None:
      continue
    g, n_img, n_tok = b // per_group, len(sizes[b]), sum(image_tokens[b])
    if "meta" in sample:
      _, text_tokens, loss_tokens = (int(v) for v in sample["meta"][:3])
      seq, n = None, text_tokens + n_tok - 1
      colon = n - loss_tokens
    else:
      try:
        seq, colon = sample_tokens(tok, sample, image_tokens[b])
      except ValueError as e:
        raise ValueError(f"sample {sid}: {e}") from None
      n = len(seq) - 1
    if n > L:
      raise ValueError(f"sample {sid} needs {n} tokens but data.seq_len is {L}; "
                       "raise data.seq_len.")
    r, o, segment = rows.place(b, g, n, sid)
    patches = [(h // P) * (w // P) for h, w in sizes[b]]
    totals["tokens"] += n
    totals["target_tokens"] += n - colon
    totals["images"] += n_img
    totals["image_tokens"] += n_tok
    totals["patches"] += sum(patches)
    totals["patches_sq"] += sum(p * p for p in patches)
    out["colon_b"][b] = colon
    out["num_images_b"][b] = n_img
    out["tokens_b"][b] = n
    out["sample_ids_b"][b] = sid
    if seq is None:  # a stub: its row and slots belong to another process
      continue
    span = slice(o, o + n)
    out["tokens_bl"][r, span] = seq[:-1]
    out["targets_bl"][r, span] = seq[1:]
    out["loss_mask_bl"][r, o + colon:o + n] = 1.0  # predict the answer words and eos
    out["positions_bl"][r, span] = np.arange(n)
    out["segment_ids_bl"][r, span] = segment
    out["token_sample_bl"][r, span] = sid
    placeholder = o + np.flatnonzero(np.asarray(seq[:-1]) == IMG)
    out["img_pos_bl"][r, placeholder] = np.concatenate(
        [(slot - g * S) * T + start + np.arange(t)
         for (slot, start), t in zip(places[b], image_tokens[b])] or [np.zeros(0, np.int32)])
    for img, (h, w), (slot, start), t in zip(sample["images"], sizes[b], places[b],
                                             image_tokens[b]):
      out["image_owner_nt"][slot, start:start + t] = sid
      img = np.asarray(img).reshape(h, w, C)
      if not layout.packed_images:
        out["images_nhwc"][slot] = img
        continue
      span = slice(start * s * s, (start + t) * s * s)
      images_in_slot[slot] += 1
      out["patches_npk"][slot, span] = patchify(img[None], P, s)[0]
      out["patch_pos_np"][slot, span] = grid_positions(h // P, w // P, s, W // P)
      out["patch_seg_np"][slot, span] = images_in_slot[slot]
  out.update({k: np.int32(v) for k, v in totals.items()})
  # Rows each rank fills: its samples, or its packed rows holding any (first fit fills a prefix).
  out["rows_used_g"] = np.asarray([sum(n > 0 for n in rows.segments[g * rows.per_group:
                                                                    (g + 1) * rows.per_group])
                                   if rows.packed else per_group for g in range(G)], np.int32)
  return out


def stack(microbatches: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
  """Stacks microbatches on a new leading axis [M, ...]."""
  return {k: np.stack([mb[k] for mb in microbatches]) for k in microbatches[0]}
