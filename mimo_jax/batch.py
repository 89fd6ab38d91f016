"""The typed batch, from the loader to the devices: one `Batch` of pytree dataclasses.

Shape letters (every array's name ends in its axes; no letter means two things):

  m  microbatches of a step (a step's batch stacks its microbatches on a leading m axis)
  b  samples of a microbatch
  r  text rows of a microbatch: one a sample, or `data.pack_rows` rows holding several samples
  l  positions in a row (`data.seq_len`)
  g  language dp ranks (groups): a microbatch's samples, rows and slots split contiguously over them
  n  an encoder's item slots in a microbatch (every rank owns n / g of them)
  t  tokens a slot yields to the language model
  h, w, c  an image's height, width and channels
  q  patches of a packed image slot (the image encoder's `slot_patches`)
  k  values of one patch (patch_size² · channels)

The language model reads `Text` (its rows) and each encoder's `Slots.pos_rl`; each encoder reads its
own `Slots.inputs`. `Stats` are counts over the whole microbatch (samples whose records other
processes read included), computed once, by the layout.

On device the step's programs (programs.py) take a placed microbatch as typed values: an
encoder's forward takes `EncoderIn` (its inputs and owners, on its mesh), the language model's
step `LanguageIn` (its `Text` and, per encoder, a `Merge`: the tokens, their owners and each
placeholder's token, on its mesh), and a fused step's one program the placed `Slots` and `Text`.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np


def _pytree(cls):
  fields = [f.name for f in dataclasses.fields(cls)]
  return jax.tree_util.register_dataclass(cls, data_fields=fields, meta_fields=[])


@_pytree
@dataclasses.dataclass
class Text:
  """Text rows on the language mesh."""
  tokens_rl: np.ndarray  # input token ids
  targets_rl: np.ndarray  # the next token of each position
  loss_mask_rl: np.ndarray  # 1.0 where the target carries loss
  positions_rl: np.ndarray  # position ids, restarting at every sample of a packed row
  segment_ids_rl: np.ndarray  # 1, 2, ... per sample of a row, 0 = padding
  token_sample_rl: np.ndarray  # sample id of each position (-1 = padding)
  rows_sent: np.ndarray  # rows of each rank the microbatch sends (data.row_buckets), scalar


@_pytree
@dataclasses.dataclass
class Samples:
  """Per sample, in row order (a packed row's samples are still one entry each)."""
  ids_b: np.ndarray  # sample id (-1 = empty)
  # tokens - loss tokens: where the loss starts when it is one run at the end (digits: the ':')
  answer_b: np.ndarray
  items_b: np.ndarray  # items of every encoder (the digits task: images = digits to name)
  tokens_b: np.ndarray  # positions the sample takes in its row


@_pytree
@dataclasses.dataclass
class Slots:
  """One encoder's part of a microbatch."""
  inputs: dict  # the encoder's device inputs, [n, ...] each (encoders/*.py say which)
  owner_nt: np.ndarray  # sample id owning each token of each slot (-1 = empty)
  pos_rl: np.ndarray  # a placeholder's token in its rank's slots (slot · t + token), or -1
  used_g: np.ndarray  # slots each language rank fills (a prefix of its own)
  sent: np.ndarray  # slots of each rank the microbatch sends to the encoder (data.slot_buckets)


@_pytree
@dataclasses.dataclass
class Stats:
  """Counts over the whole microbatch."""
  tokens: np.ndarray  # non-padding text positions (placeholders included)
  target_tokens: np.ndarray  # positions that carry loss
  items: dict  # per encoder: items (images)
  item_tokens: dict  # per encoder: tokens its items yield
  work: dict  # per encoder: what its FLOP model counts (encoders/*.py)
  rows_used_g: np.ndarray  # rows each language rank fills
  records_read: np.ndarray  # records this process read (scalable reads)
  cost_spread: np.ndarray  # most over mean rank cost after reordering
  cost_spread_in_order: np.ndarray  # ... and in stream order


@_pytree
@dataclasses.dataclass
class Batch:
  """A microbatch, or a step's microbatches stacked on a leading m axis."""
  text: Text
  samples: Samples
  slots: dict  # encoder name -> Slots
  stats: Stats

  def microbatch(self, m: int) -> "Batch":
    return jax.tree.map(lambda a: a[m], self)

  @property
  def microbatches(self) -> int:
    return self.text.tokens_rl.shape[0]


@_pytree
@dataclasses.dataclass
class EncoderIn:
  """One encoder's part of a placed microbatch where the encoder runs: what its forward takes."""
  inputs: dict  # the encoder's device inputs, [n, ...] each (`Slots.inputs`)
  owner_nt: jax.Array  # sample id owning each token of each slot (-1 = empty)

  @classmethod
  def of(cls, slots: Slots) -> "EncoderIn":
    return cls(slots.inputs, slots.owner_nt)


@_pytree
@dataclasses.dataclass
class Merge:
  """One encoder's part of a placed microbatch where the language model runs: what it merges into
  the rows. Tokens and owners arrive from the encoder's mesh (a `bridge.Parts` where the bridge
  leaves a fan-in to its consumer); a fused step's encoders make the tokens in the same program
  (None until then)."""
  tokens_ntd: jax.Array | None  # the encoder's tokens for the language model
  owner_nt: jax.Array  # sample id owning each token of each slot (-1 = empty)
  pos_rl: jax.Array  # a placeholder's token in its rank's slots (`Slots.pos_rl`)


@_pytree
@dataclasses.dataclass
class LanguageIn:
  """A placed microbatch (or stacked microbatches) as the language model's programs take it."""
  text: Text
  merges: dict  # encoder name -> Merge

  @property
  def tokens(self) -> dict:
    return {n: m.tokens_ntd for n, m in self.merges.items()}

  @property
  def positions(self) -> dict:
    return {n: m.pos_rl for n, m in self.merges.items()}

  def with_tokens(self, tokens: dict) -> "LanguageIn":
    """The same microbatch with every encoder's tokens replaced by `tokens` (name -> tokens)."""
    return dataclasses.replace(self, merges={
        n: dataclasses.replace(m, tokens_ntd=tokens[n]) for n, m in self.merges.items()})

  def without_owners(self) -> "LanguageIn":
    """What the loss reads (the owners only check the merge: `programs.mismatches`)."""
    return dataclasses.replace(self, merges={
        n: dataclasses.replace(m, owner_nt=None) for n, m in self.merges.items()})


def stack(microbatches: list[Batch]) -> Batch:
  """Microbatches stacked on a new leading axis [m, ...]."""
  return jax.tree.map(lambda *xs: np.stack(xs), *microbatches)


def total(batch: Batch, pick) -> int:
  """The sum over a batch's microbatches of `pick(batch.stats)`."""
  return int(np.sum(pick(batch.stats)))
