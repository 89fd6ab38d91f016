"""Text generation with a key-value cache: a batch of prompts (token ids, images merged at their
image tokens) answered greedily or by temperature and top-p sampling, on one device.

Prompts are left-padded to one length: row b's tokens take positions 0, 1, ... from its first
real token, and no query attends to its padding. The prompt runs through the language model once
(prefill), filling each layer's keys and values into a cache of `prompt + steps` positions; each
new token then runs alone, attending to the cache. Attention is computed in float32 (softmax of
the scaled scores over the allowed keys), as transformers' eager attention does; RoPE, norms, MLPs
and the output head are the model's own layers (models/llm.py).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from mimo_jax.config import Config
from mimo_jax.models import mimo
from mimo_jax.models.layers import rope, rope_frequencies


@dataclasses.dataclass(frozen=True)
class Sampling:
  temperature: float = 0.0  # 0 = greedy
  top_p: float = 1.0  # nucleus: sample among the most likely tokens whose mass reaches top_p
  seed: int = 0

  def __post_init__(self):
    # A nucleus of no mass keeps no token, a NaN temperature makes NaN logits: either samples
    # garbage silently.
    if not 0 < self.top_p <= 1:
      raise ValueError(f"top_p {self.top_p} is not in (0, 1].")
    if not (math.isfinite(self.temperature) and self.temperature >= 0):
      raise ValueError(f"temperature {self.temperature} is not 0 or a positive finite number.")


def _attention_layer(module: mimo.Module, h, params, k_cache, v_cache, positions, start,
                     key_valid):
  """One decoder block on h [b, n, d] whose tokens sit at cache index start.. (RoPE positions
  `positions` [b, n]), writing their keys and values into the caches [b, T, kv, hd]."""
  block = module.bind_layer(params)
  a = block.attn
  b, n, _ = h.shape
  y = block.norm1(h)
  q = a.q(y).reshape(b, n, a.heads, a.head_dim)
  k = a.k(y).reshape(b, n, a.kv_heads, a.head_dim)
  v = a.v(y).reshape(b, n, a.kv_heads, a.head_dim)
  freq = rope_frequencies(a.head_dim, a.rope_theta, a.rope_scaling)
  q, k = rope(q, positions, freq), rope(k, positions, freq)
  k_cache = jax.lax.dynamic_update_slice(k_cache, k.astype(k_cache.dtype), (0, start, 0, 0))
  v_cache = jax.lax.dynamic_update_slice(v_cache, v.astype(v_cache.dtype), (0, start, 0, 0))
  groups = a.heads // a.kv_heads
  qg = q.reshape(b, n, a.kv_heads, groups, a.head_dim).astype(jnp.float32)
  scores = jnp.einsum("bnkgd,btkd->bkgnt", qg, k_cache.astype(jnp.float32)) * a.head_dim**-0.5
  t = jnp.arange(k_cache.shape[1])
  query = start + jnp.arange(n)
  allowed = key_valid[:, None, None, None, :] & (t[None, :] <= query[:, None])[None, None, None]
  # Finite, as transformers masks: a padding query, which allows no key, stays finite.
  scores = jnp.where(allowed, scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1)
  out = jnp.einsum("bkgnt,btkd->bnkgd", probs, v_cache.astype(jnp.float32))
  h = h + a.o(out.reshape(b, n, a.heads * a.head_dim).astype(h.dtype))
  return h + block.mlp(block.norm2(h)), k_cache, v_cache


def _forward(module, params, x, positions, cache, start, key_valid):
  """x [b, n, d] through every block with the cache -> (last position's logits [b, vocab],
  cache)."""
  def body(h, layer):
    p, kc, vc = layer
    h, kc, vc = _attention_layer(module, h, p, kc, vc, positions, start, key_valid)
    return h, (kc, vc)
  h, (k, v) = jax.lax.scan(body, x, (params["blocks"], cache[0], cache[1]))
  return module.bind(params).logits(h[:, -1:])[:, 0], (k, v)


def _pick(logits, key, sampling: Sampling):
  """The next token of each row: argmax, or a sample at `temperature` among the top-p mass."""
  if sampling.temperature <= 0:
    return jnp.argmax(logits, axis=-1)
  logits = logits / sampling.temperature
  if sampling.top_p < 1.0:
    order = jnp.argsort(-logits, axis=-1)
    sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
    mass = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1)
    keep_sorted = mass - jax.nn.softmax(sorted_logits, axis=-1) < sampling.top_p  # first in
    keep = jnp.zeros_like(keep_sorted).at[
        jnp.arange(logits.shape[0])[:, None], order].set(keep_sorted)
    logits = jnp.where(keep, logits, -jnp.inf)
  return jax.random.categorical(key, logits, axis=-1)


def generate(cfg: Config, language: dict, ids_bl, mask_bl, steps: int,
             sampling: Sampling = Sampling(), embeds_bld=None, eos: int | None = None) -> np.ndarray:
  """New token ids [b, steps] after left-padded prompts `ids_bl` (`mask_bl` 1 on real tokens);
  `embeds_bld` replaces the prompt's embedding (images merged). A row that produced `eos` stops:
  its later entries are `eos`."""
  if steps < 1:
    raise ValueError(f"{steps} new tokens asked for; at least 1.")
  module = mimo.build_modules(cfg)["language"]
  ids_bl, mask = jnp.asarray(ids_bl), jnp.asarray(mask_bl, bool)
  b, length = ids_bl.shape
  model = module.bind(language)
  x = model.embed(ids_bl) if embeds_bld is None else jnp.asarray(embeds_bld)
  a = module.bind_layer(jax.tree.map(lambda p: p[0], language["blocks"])).attn
  layers = jax.tree.leaves(language["blocks"])[0].shape[0]
  shape = (layers, b, length + steps, a.kv_heads, a.head_dim)
  cache = (jnp.zeros(shape, x.dtype), jnp.zeros(shape, x.dtype))
  key_valid = jnp.concatenate([mask, jnp.ones((b, steps), bool)], axis=1)
  positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)
  forward = functools.partial(_forward, module)
  logits, cache = jax.jit(forward)(language, x, positions, cache, 0, key_valid)
  step = jax.jit(lambda params, token, pos, cache, start: forward(
      params, model.embed(token[:, None]), pos[:, None], cache, start, key_valid))
  key = jax.random.key(sampling.seed)
  out, done = [], np.zeros(b, bool)
  next_pos = positions[:, -1] + 1
  for i in range(steps):
    token = np.asarray(_pick(logits, jax.random.fold_in(key, i), sampling))
    if eos is not None:
      token = np.where(done, eos, token)
      done |= token == eos
    out.append(token)
    if i + 1 == steps or (eos is not None and done.all()):
      break
    logits, cache = step(language, jnp.asarray(token), next_pos + i, cache, length + i)
  generated = np.stack(out, axis=1)
  if generated.shape[1] < steps:  # every row ended early
    generated = np.pad(generated, ((0, 0), (0, steps - generated.shape[1])),
                       constant_values=eos if eos is not None else 0)
  return generated
