"""The modules applied in one piece on one device, without meshes, pipeline or slots: what a
check against another implementation of the same architecture runs (tools.hf check, the tests
against transformers' outputs). An encoder's own one-piece forward is its plug-in's (the image
encoder's `image_tokens`); its tokens are merged here."""

import jax
import jax.numpy as jnp
import numpy as np

from mimo_jax.config import LANGUAGE, Config
from mimo_jax.modules import build_modules


def language_logits(cfg: Config, params: dict, ids_bl, embeds_bld=None) -> jax.Array:
  """Token ids [b, l] -> float32 logits [b, l, vocab]; `embeds_bld` replaces the embedding."""
  module = build_modules(cfg)[LANGUAGE]
  model = module.bind(params)
  ids_bl = jnp.asarray(ids_bl)
  x = model.embed(ids_bl) if embeds_bld is None else embeds_bld
  positions = jnp.broadcast_to(jnp.arange(ids_bl.shape[1]), ids_bl.shape)
  return model.logits(module.apply_blocks(params, x, positions))


def merged_embeddings(cfg: Config, language: dict, ids_bl, tokens_ntd, placeholder: int,
                      base_bld=None) -> jax.Array:
  """Token embeddings [b, l, d] with an encoder's tokens [n, t, d] (one item's a row, in order)
  written over the `placeholder` ids: the next item's tokens at each run, as LLaVA merges.
  `base_bld`: the embeddings to write into (another encoder's merged), else the ids'."""
  ids = np.asarray(ids_bl)
  flat = tokens_ntd.reshape(-1, tokens_ntd.shape[-1])
  where = ids == placeholder
  if int(where.sum()) != flat.shape[0]:
    raise ValueError(f"{int(where.sum())} placeholder ids for {flat.shape[0]} item tokens.")
  index = np.where(where, np.cumsum(where).reshape(ids.shape) - 1, 0)
  if base_bld is None:
    base_bld = build_modules(cfg)[LANGUAGE].bind(language).embed(jnp.asarray(ids))
  x = jnp.asarray(base_bld)
  return jnp.where(jnp.asarray(where)[..., None], flat[jnp.asarray(index)].astype(x.dtype), x)


def merged_logits(cfg: Config, language: dict, ids_bl, tokens_ntd,
                  placeholder: int) -> jax.Array:
  """LLaVA's forward: the language model over `merged_embeddings` -> float32 logits
  [b, l, vocab]."""
  x = merged_embeddings(cfg, language, ids_bl, tokens_ntd, placeholder)
  return language_logits(cfg, language, ids_bl, x)


def next_token_loss(logits_blv, labels_bl, ignore: int = -100) -> float:
  """Mean cross-entropy of each position's logits against the next label (transformers' causal
  LM loss): labels equal to `ignore` do not count."""
  logits = np.asarray(logits_blv, np.float64)[:, :-1]
  labels = np.asarray(labels_bl)[:, 1:]
  keep = labels != ignore
  logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
  picked = np.take_along_axis(logits, np.maximum(labels, 0)[..., None], -1)[..., 0]
  return float(((logz - picked) * keep).sum() / keep.sum())
