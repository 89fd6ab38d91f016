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
gather that never leaves the rank. `slot_ids_n` records which sample owns each slot (-1 = empty);
it travels through the bridge beside the embeddings so the language side can verify that every
placeholder receives an image of its own sample.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from mimo_jax.data.tokenizer import BOS, EOS, IMG, PAD, Tokenizer


@dataclasses.dataclass(frozen=True)
class Layout:
  seq_len: int  # L, tokens fed to the language model per row
  tokens_per_image: int  # T
  groups: int  # G, language dp ranks
  slots: int  # G*S, image slots in the whole microbatch
  image_shape: tuple[int, ...] = (8, 8, 1)
  pack_rows: int = 0  # rows per microbatch when packing several samples a row; 0 = one per row

  @property
  def slots_per_group(self) -> int:
    return self.slots // self.groups


def sample_tokens(tok: Tokenizer, sample: dict, tokens_per_image: int) -> tuple[list[int], int]:
  """bos + the sample's tokens (each <img> expanded to T placeholders) + eos, and the position
  whose target starts the loss: ':' for a digits sample (`text`), the last image placeholder (or
  bos) for a sample given as token ids (`tokens`, images first, as data/synthetic.py writes)."""
  ids = tok.encode(sample["text"]) if "text" in sample else list(sample["tokens"])
  words = [BOS]
  for w in ids:
    words.extend([IMG] * tokens_per_image if w == IMG else [w])
  words.append(EOS)
  if "text" in sample:
    return words, words.index(tok.colon)
  return words, tokens_per_image * int(np.sum(np.asarray(ids) == IMG))


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

  A sample given only as `{"meta": (images, text tokens, loss tokens)}` (data/meta.py) takes its
  row and slots like the full sample would, but they stay empty: scalable data parallelism passes
  such stubs for samples whose rows and slots live on other processes' devices. `tokens`,
  `target_tokens` and `images` count the whole microbatch, stubs included.
  """
  bsz, L, T, G = len(samples), layout.seq_len, layout.tokens_per_image, layout.groups
  if bsz % G:
    raise ValueError(f"microbatch of {bsz} samples does not split over {G} language dp ranks")
  per_group, S = bsz // G, layout.slots_per_group
  rows = _Rows(layout, bsz)
  R = rows.count
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
      "images_nhwc": np.zeros((layout.slots,) + layout.image_shape, np.uint8),
      "slot_ids_n": np.full((layout.slots,), -1, np.int32),
  }
  used = [0] * G
  totals = {"tokens": 0, "target_tokens": 0, "images": 0}
  for b, (sample, sid) in enumerate(zip(samples, ids)):
    if sample is None:
      continue
    g = b // per_group
    if "meta" in sample:
      n_img, text_tokens, loss_tokens = (int(v) for v in sample["meta"])
      seq, n = None, text_tokens + n_img * T - 1
      colon = n - loss_tokens
    else:
      seq, colon = sample_tokens(tok, sample, T)
      n_img, n = len(sample["images"]), len(seq) - 1
      if seq.count(IMG) != n_img * T:
        raise ValueError(f"sample {sid}: text has {seq.count(IMG) // T} <img> placeholders but "
                         f"{n_img} images.")
    if n > L:
      raise ValueError(f"sample {sid} needs {n} tokens but data.seq_len is {L}; "
                       "raise data.seq_len.")
    if used[g] + n_img > S:
      raise ValueError(
          f"sample {sid} needs {n_img} image slots but language dp rank {g} has only "
          f"{S - used[g]} of its {S} left in this microbatch; raise data.image_slots "
          f"(now {layout.slots} per microbatch).")
    r, o, segment = rows.place(b, g, n, sid)
    totals["tokens"] += n
    totals["target_tokens"] += n - colon
    totals["images"] += n_img
    out["colon_b"][b] = colon
    out["num_images_b"][b] = n_img
    out["tokens_b"][b] = n
    out["sample_ids_b"][b] = sid
    if seq is None:  # a stub: its row and slots belong to another process
      used[g] += n_img
      continue
    span = slice(o, o + n)
    out["tokens_bl"][r, span] = seq[:-1]
    out["targets_bl"][r, span] = seq[1:]
    out["loss_mask_bl"][r, o + colon:o + n] = 1.0  # predict the answer words and eos
    out["positions_bl"][r, span] = np.arange(n)
    out["segment_ids_bl"][r, span] = segment
    out["token_sample_bl"][r, span] = sid
    placeholder = o + np.flatnonzero(np.asarray(seq[:-1]) == IMG)
    out["img_pos_bl"][r, placeholder] = used[g] * T + np.arange(n_img * T)
    for img in sample["images"]:
      slot = g * S + used[g]
      out["images_nhwc"][slot] = img.reshape(layout.image_shape)
      out["slot_ids_n"][slot] = sid
      used[g] += 1
  out.update({k: np.int32(v) for k, v in totals.items()})
  return out


def slot_starts(images: list[int], groups: int, slots_per_group: int) -> list[int]:
  """The first image slot of each sample of a microbatch (as `layout_microbatch` assigns them)."""
  per_group = len(images) // groups
  used, out = [0] * groups, []
  for b, k in enumerate(images):
    g = b // per_group
    out.append(g * slots_per_group + used[g])
    used[g] += k
  return out


def stack(microbatches: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
  """Stacks microbatches on a new leading axis [M, ...]."""
  return {k: np.stack([mb[k] for mb in microbatches]) for k in microbatches[0]}
