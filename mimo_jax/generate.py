"""Text generation with a key-value cache: a batch of prompts (token ids, or embeddings with
images merged at their image tokens) answered greedily or by temperature and top-p sampling.

`decode` is the one decoder: `generate` runs it for tools.generate, evaluation (evaluate.py) runs
it inside its own program to name the digits. Prompts are left-padded to one length: row b's
tokens take positions 0, 1, ... from its first real token, and no query attends to its padding.
The prompt runs through the language model once (prefill), filling each layer's keys and values
into a cache of `prompt + steps` slots; each new token then runs alone, attending to the cache.
Both go through the model's own blocks (`LanguageModel.decode`, attention in
`models/layers.cached_attention`); the loop runs on the device and ends early once every row has
produced its end token.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mimo_jax import modules
from mimo_jax.config import Config
from mimo_jax.models.llm import LanguageModel


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


def decode(model: LanguageModel, x_bld: jax.Array, mask_bl: jax.Array, steps: int,
           sampling: Sampling = Sampling(), eos: int | None = None,
           key: jax.Array | None = None) -> jax.Array:
  """New token ids [b, steps] (int32) after left-padded prompt embeddings `x_bld` (`mask_bl` true
  on real tokens); traceable, for a caller's jitted program. A row that produced `eos` stops: its
  later entries are `eos`. `key`: the sampling's random key, `sampling.seed`'s by default."""
  b = x_bld.shape[0]
  mask_bl = mask_bl.astype(bool)
  valid_bt = jnp.concatenate([mask_bl, jnp.ones((b, steps), bool)], axis=1)
  positions_bl = jnp.maximum(jnp.cumsum(mask_bl, axis=1) - 1, 0)
  h_bld, cache = model.decode(x_bld, positions_bl, model.init_cache(valid_bt, x_bld.dtype))
  key = jax.random.key(sampling.seed) if key is None else key

  def pick(i, logits_bv, done_b):
    token_b = _pick(logits_bv, jax.random.fold_in(key, i), sampling).astype(jnp.int32)
    if eos is None:
      return token_b, done_b
    token_b = jnp.where(done_b, eos, token_b)
    return token_b, done_b | (token_b == eos)

  token_b, done_b = pick(0, model.logits(h_bld[:, -1:])[:, 0], jnp.zeros((b,), bool))
  out_bs = jnp.full((b, steps), 0 if eos is None else eos, jnp.int32).at[:, 0].set(token_b)
  next_b = positions_bl[:, -1] + 1  # the first new token's position

  def more(carry) -> jax.Array:
    i, _, _, _, done_b = carry
    return (i < steps) & ~jnp.all(done_b)

  def step(carry):
    i, token_b, cache, out_bs, done_b = carry  # token i - 1 runs, token i is picked
    h_b1d, cache = model.decode(model.embed(token_b[:, None]), (next_b + i - 1)[:, None], cache)
    token_b, done_b = pick(i, model.logits(h_b1d)[:, 0], done_b)
    return i + 1, token_b, cache, out_bs.at[:, i].set(token_b), done_b

  return jax.lax.while_loop(more, step, (jnp.int32(1), token_b, cache, out_bs, done_b))[3]


@functools.partial(jax.jit, static_argnames=("graphdef", "steps", "sampling", "eos"))
def _generate(graphdef: nnx.GraphDef, state: nnx.State, ids_bl: jax.Array, mask_bl: jax.Array,
              embeds_bld: jax.Array | None, key: jax.Array, *, steps: int, sampling: Sampling,
              eos: int | None) -> jax.Array:
  """`generate`'s program: compiled once for a model, shapes and settings (the key, which holds
  the seed, is an input)."""
  model = nnx.merge(graphdef, state)
  x_bld = model.embed(ids_bl) if embeds_bld is None else embeds_bld
  return decode(model, x_bld, mask_bl, steps, sampling, eos, key)


def generate(cfg: Config, language: dict, ids_bl, mask_bl, steps: int,
             sampling: Sampling = Sampling(), embeds_bld=None, eos: int | None = None) -> np.ndarray:
  """New token ids [b, steps] after left-padded prompts `ids_bl` (`mask_bl` 1 on real tokens), on
  one device; `embeds_bld` replaces the prompt's embedding (images merged). A row that produced
  `eos` stops: its later entries are `eos`."""
  if steps < 1:
    raise ValueError(f"{steps} new tokens asked for; at least 1.")
  graphdef, state = nnx.split(modules.build_modules(cfg)["language"].bind(language))
  embeds = None if embeds_bld is None else jnp.asarray(embeds_bld)
  return np.asarray(_generate(graphdef, state, jnp.asarray(ids_bl), jnp.asarray(mask_bl, bool),
                              embeds, jax.random.key(sampling.seed), steps=steps,
                              sampling=dataclasses.replace(sampling, seed=0), eos=eos))
