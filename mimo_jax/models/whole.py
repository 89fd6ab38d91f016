"""The modules applied in one piece on one device, without meshes, pipeline or slots: what a
check against another implementation of the same architecture runs (tools.hf check, the tests
against transformers' outputs)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from mimo_jax.config import Config
from mimo_jax.models import mimo


def blocks(module: mimo.Module, params: dict, x: jax.Array, *side: jax.Array) -> jax.Array:
  """`params["blocks"]` (stacked [L, ...]) applied one layer after another."""
  layers = jax.tree.leaves(params["blocks"])[0].shape[0]
  for i in range(layers):
    x = module.layer(jax.tree.map(lambda a, i=i: a[i], params["blocks"]), x, *side)
  return x


def language_logits(cfg: Config, params: dict, ids_bl, embeds_bld=None) -> jax.Array:
  """Token ids [b, l] -> float32 logits [b, l, vocab]; `embeds_bld` replaces the embedding."""
  module = mimo.build_modules(cfg)["language"]
  model = module.bind(params)
  ids_bl = jnp.asarray(ids_bl)
  x = model.embed(ids_bl) if embeds_bld is None else embeds_bld
  positions = jnp.broadcast_to(jnp.arange(ids_bl.shape[1]), ids_bl.shape)
  return model.logits(blocks(module, params, x, positions))


def vision_hidden(cfg: Config, params: dict, images_nhwc) -> jax.Array:
  """Images [n, h, w, c] in [0, 1] -> the last block's output [n, tokens, dim] (the class token
  first if any; no final norm), patches in block order (row-major without a pixel shuffle)."""
  module = mimo.build_modules(cfg)["vision"]
  model = module.bind(params)
  return blocks(module, params, model.patches(jnp.asarray(images_nhwc, jnp.float32)))


def vision_tokens(cfg: Config, params: dict, images_nhwc) -> jax.Array:
  """Images [n, h, w, c] in [0, 1] -> projected image tokens [n, t, language dim]."""
  model = mimo.build_modules(cfg)["vision"].bind(params)
  return model.finish(vision_hidden(cfg, params, images_nhwc))


def vlm_logits(cfg: Config, vision: dict, language: dict, ids_bl, images_nhwc,
               image_token: int) -> jax.Array:
  """LLaVA's forward: each run of `image_token` ids in [b, l] takes the next image's tokens (one
  image per run, in order) -> float32 logits [b, l, vocab]."""
  x = merged_embeddings(cfg, vision, language, ids_bl, images_nhwc, image_token)
  return language_logits(cfg, language, ids_bl, x)


def merged_embeddings(cfg: Config, vision: dict, language: dict, ids_bl, images_nhwc,
                      image_token: int) -> jax.Array:
  """Token embeddings [b, l, d] with the images' tokens written over the `image_token` ids, the
  next image's tokens at each run (in order)."""
  ids = np.asarray(ids_bl)
  tokens = vision_tokens(cfg, vision, images_nhwc)
  flat = tokens.reshape(-1, tokens.shape[-1])
  where = ids == image_token
  if int(where.sum()) != flat.shape[0]:
    raise ValueError(f"{int(where.sum())} image-token ids for {flat.shape[0]} image tokens.")
  index = np.where(where, np.cumsum(where).reshape(ids.shape) - 1, 0)
  model = mimo.build_modules(cfg)["language"].bind(language)
  x = model.embed(jnp.asarray(ids))
  return jnp.where(jnp.asarray(where)[..., None], flat[jnp.asarray(index)].astype(x.dtype), x)


def next_token_loss(logits_blv, labels_bl, ignore: int = -100) -> float:
  """Mean cross-entropy of each position's logits against the next label (transformers' causal
  LM loss): labels equal to `ignore` do not count."""
  logits = np.asarray(logits_blv, np.float64)[:, :-1]
  labels = np.asarray(labels_bl)[:, 1:]
  keep = labels != ignore
  logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
  picked = np.take_along_axis(logits, np.maximum(labels, 0)[..., None], -1)[..., 0]
  return float(((logz - picked) * keep).sum() / keep.sum())
