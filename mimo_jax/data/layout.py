"""The slot layout: how a microbatch's images and text are laid out for two meshes.

A microbatch of B samples is split contiguously over the language model's G = dp ranks, b = B / G
samples each. Every rank gets S image *slots*; slots are numbered globally, rank g owning slots
[g*S, (g+1)*S). The images of rank g's samples fill its slots in sample order, the rest stay zero.
So the image array `images_nhwc` [G*S, ...] is already in the order the language model needs: the
encoder runs on it with any dp that divides G*S, and moving its output to the language mesh is a
reshard of one array split on its first axis (fan-in and fan-out fall out of the shapes).

For every text position that holds an image placeholder, `img_pos_bl` gives the index of the image
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

  @property
  def slots_per_group(self) -> int:
    return self.slots // self.groups


def encode_text(tok: Tokenizer, text: str, tokens_per_image: int) -> tuple[list[int], int]:
  """Returns bos + words (each <img> expanded to T placeholders) + eos, and the index of ':'."""
  words = [BOS]
  for w in tok.encode(text):
    words.extend([IMG] * tokens_per_image if w == IMG else [w])
  words.append(EOS)
  return words, words.index(tok.colon)


def layout_microbatch(samples: list[dict], ids: list[int], layout: Layout,
                      tok: Tokenizer) -> dict[str, np.ndarray]:
  """Lays out one microbatch (see the module docstring). Padding rows have sample id -1."""
  bsz, L, T, G = len(samples), layout.seq_len, layout.tokens_per_image, layout.groups
  if bsz % G:
    raise ValueError(f"microbatch of {bsz} samples does not split over {G} language dp ranks")
  per_group, S = bsz // G, layout.slots_per_group
  out = {
      "tokens_bl": np.full((bsz, L), PAD, np.int32),
      "targets_bl": np.full((bsz, L), PAD, np.int32),
      "loss_mask_bl": np.zeros((bsz, L), np.float32),
      "img_pos_bl": np.full((bsz, L), -1, np.int32),
      "colon_b": np.zeros((bsz,), np.int32),
      "num_images_b": np.zeros((bsz,), np.int32),
      "sample_ids_b": np.full((bsz,), -1, np.int32),
      "images_nhwc": np.zeros((layout.slots,) + layout.image_shape, np.float32),
      "slot_ids_n": np.full((layout.slots,), -1, np.int32),
  }
  used = [0] * G
  for b, (sample, sid) in enumerate(zip(samples, ids)):
    if sample is None:
      continue
    g = b // per_group
    seq, colon = encode_text(tok, sample["text"], T)
    if len(seq) - 1 > L:
      raise ValueError(f"sample {sid} needs {len(seq) - 1} tokens but data.seq_len is {L}; "
                       "raise data.seq_len.")
    images = sample["images"]
    n_img = len(images)
    if seq.count(IMG) != n_img * T:
      raise ValueError(f"sample {sid}: text has {seq.count(IMG) // T} <img> placeholders but "
                       f"{n_img} images.")
    if used[g] + n_img > S:
      raise ValueError(
          f"sample {sid} needs {n_img} image slots but language dp rank {g} has only "
          f"{S - used[g]} of its {S} left in this microbatch; raise data.image_slots "
          f"(now {layout.slots} per microbatch).")
    n = len(seq) - 1
    out["tokens_bl"][b, :n] = seq[:-1]
    out["targets_bl"][b, :n] = seq[1:]
    out["loss_mask_bl"][b, colon:n] = 1.0  # predict the answer words and eos
    placeholder = np.flatnonzero(np.asarray(seq[:-1]) == IMG)
    out["img_pos_bl"][b, placeholder] = used[g] * T + np.arange(n_img * T)
    for img in images:
      slot = g * S + used[g]
      out["images_nhwc"][slot] = img.reshape(layout.image_shape).astype(np.float32) / 16.0
      out["slot_ids_n"][slot] = sid
      used[g] += 1
    out["colon_b"][b] = colon
    out["num_images_b"][b] = n_img
    out["sample_ids_b"][b] = sid
  return out


def stack(microbatches: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
  """Stacks microbatches on a new leading axis [M, ...]."""
  return {k: np.stack([mb[k] for mb in microbatches]) for k in microbatches[0]}
