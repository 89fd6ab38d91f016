"""Text generation with a key-value cache: a batch of prompts (token ids, or embeddings with
images merged at their image tokens) answered greedily or by temperature and top-p sampling.

`decode` is the one decoder: `generate` runs it for tools.generate, evaluation (evaluate.py) runs
it inside its own program to name the digits. Prompts are left-padded to one length: row b's
tokens take positions 0, 1, ... from its first real token, and no query attends to its padding.
The prompt runs through the language model once (prefill), filling each layer's keys and values
into a cache of `prompt + steps` slots; each new token then runs alone, attending to the cache.
Both go through the model's own blocks (`LanguageModel.decode`, attention in
`models/layers.cached_attention`); the loop runs on the device and ends early once every row has
produced its end token. `generate` runs that loop in chunks of `CHUNK` new tokens, one device
program each time on the state the last one left (the same steps as one loop, token for token),
and between two chunks asks its caller whether to stop: a caller's stop (tools.generate's
signals) waits for the chunk under way, not for the whole answer.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mimo_jax import modules
from mimo_jax.config import Config
from mimo_jax.models.llm import LanguageModel

CHUNK = 32  # new tokens `generate` decodes a device program, between two asks whether to stop


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


class Stopped(Exception):
  """`generate` was asked to stop between two chunks; `decoded` of its `steps` new tokens of each
  row were decoded, and are dropped."""

  def __init__(self, decoded: int, steps: int):
    super().__init__(f"after {decoded} of {steps} new tokens")
    self.decoded, self.steps = decoded, steps


class _Carry(NamedTuple):
  """The decoder's state between two new tokens."""
  i: jax.Array  # tokens [0, i) of each row are picked
  token_b: jax.Array  # token i - 1, which runs next
  cache: Any  # the model's key-value cache
  out_bs: jax.Array  # the new tokens [b, steps], `eos` (or 0) from i on
  done_b: jax.Array  # rows that produced `eos`
  next_b: jax.Array  # each row's position of its first new token
  key: jax.Array  # the sampling's random key


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


def _next(i, logits_bv, done_b, key, sampling: Sampling, eos: int | None):
  """Token i of each row and the rows done after it: a done row repeats `eos`."""
  token_b = _pick(logits_bv, jax.random.fold_in(key, i), sampling).astype(jnp.int32)
  if eos is None:
    return token_b, done_b
  token_b = jnp.where(done_b, eos, token_b)
  return token_b, done_b | (token_b == eos)


def _start(model: LanguageModel, x_bld: jax.Array, mask_bl: jax.Array, steps: int,
           sampling: Sampling, eos: int | None, key: jax.Array) -> _Carry:
  """The prefill of the prompts and their first new token."""
  b = x_bld.shape[0]
  mask_bl = mask_bl.astype(bool)
  valid_bt = jnp.concatenate([mask_bl, jnp.ones((b, steps), bool)], axis=1)
  positions_bl = jnp.maximum(jnp.cumsum(mask_bl, axis=1) - 1, 0)
  h_bld, cache = model.decode(x_bld, positions_bl, model.init_cache(valid_bt, x_bld.dtype))
  token_b, done_b = _next(0, model.logits(h_bld[:, -1:])[:, 0], jnp.zeros((b,), bool), key,
                          sampling, eos)
  out_bs = jnp.full((b, steps), 0 if eos is None else eos, jnp.int32).at[:, 0].set(token_b)
  return _Carry(jnp.int32(1), token_b, cache, out_bs, done_b, positions_bl[:, -1] + 1, key)


def _advance(model: LanguageModel, carry: _Carry, until, sampling: Sampling,
             eos: int | None) -> _Carry:
  """New tokens up to index `until` (or until every row is done), one at a time."""
  model = _kernels_cast(model)
  layers = model.split_layers()  # apart once, before the loop: no copy of them at every token

  def more(c: _Carry) -> jax.Array:
    return (c.i < until) & ~jnp.all(c.done_b)

  def step(c: _Carry) -> _Carry:
    h_b1d, cache = model.decode(model.embed(c.token_b[:, None]), (c.next_b + c.i - 1)[:, None],
                                c.cache, layers)
    token_b, done_b = _next(c.i, model.logits(h_b1d)[:, 0], c.done_b, c.key, sampling, eos)
    return c._replace(i=c.i + 1, token_b=token_b, cache=cache,
                      out_bs=c.out_bs.at[:, c.i].set(token_b), done_b=done_b)

  return jax.lax.while_loop(more, step, carry)


def _kernels_cast(model: LanguageModel) -> LanguageModel:
  """`model` with its matmul kernels in its compute dtype, cast once before a decoding loop: the
  layers cast a kernel at each use, which inside the loop is at every new token (float32 master
  weights read whole each time). The same values: a kernel is cast before it multiplies."""
  graphdef, state = nnx.split(model)
  kernel = lambda path: any(getattr(k, "key", None) == "kernel" for k in path)
  state = jax.tree_util.tree_map_with_path(
      lambda path, x: x.astype(model.dtype) if kernel(path) and x.dtype != model.dtype and
      jnp.issubdtype(x.dtype, jnp.floating) else x, state)
  return nnx.merge(graphdef, state)


def decode(model: LanguageModel, x_bld: jax.Array, mask_bl: jax.Array, steps: int,
           sampling: Sampling = Sampling(), eos: int | None = None,
           key: jax.Array | None = None) -> jax.Array:
  """New token ids [b, steps] (int32) after left-padded prompt embeddings `x_bld` (`mask_bl` true
  on real tokens); traceable, for a caller's jitted program. A row that produced `eos` stops: its
  later entries are `eos`. `key`: the sampling's random key, `sampling.seed`'s by default."""
  key = jax.random.key(sampling.seed) if key is None else key
  carry = _start(model, x_bld, mask_bl, steps, sampling, eos, key)
  return _advance(model, carry, steps, sampling, eos).out_bs


@functools.partial(jax.jit, static_argnames=("graphdef", "steps", "sampling", "eos"))
def _prefill(graphdef: nnx.GraphDef, state: nnx.State, ids_bl: jax.Array, mask_bl: jax.Array,
             embeds_bld: jax.Array | None, key: jax.Array, *, steps: int, sampling: Sampling,
             eos: int | None) -> _Carry:
  """`generate`'s first program: the prefill and the first new token (the key, which holds the
  seed, is an input)."""
  model = nnx.merge(graphdef, state)
  x_bld = model.embed(ids_bl) if embeds_bld is None else embeds_bld
  return _start(model, x_bld, mask_bl, steps, sampling, eos, key)


@functools.partial(jax.jit, static_argnames=("graphdef", "sampling", "eos"),
                   donate_argnames=("carry",))
def _chunk(graphdef: nnx.GraphDef, state: nnx.State, carry: _Carry, until: jax.Array, *,
           sampling: Sampling, eos: int | None) -> tuple[_Carry, jax.Array, jax.Array]:
  """`generate`'s chunk: new tokens up to index `until` (an input: one program for every chunk),
  the carry's buffers reused; with the index reached and whether every row is done."""
  carry = _advance(nnx.merge(graphdef, state), carry, until, sampling, eos)
  return carry, carry.i, jnp.all(carry.done_b)


def generate(cfg: Config, language: dict, ids_bl, mask_bl, steps: int,
             sampling: Sampling = Sampling(), embeds_bld=None, eos: int | None = None,
             chunk: int | None = None, stop: Callable[[], bool] | None = None,
             progress: Callable[[int, int], None] | None = None) -> np.ndarray:
  """New token ids [b, steps] after left-padded prompts `ids_bl` (`mask_bl` 1 on real tokens), on
  one device; `embeds_bld` replaces the prompt's embedding (images merged). A row that produced
  `eos` stops: its later entries are `eos`. Decoded `chunk` tokens (CHUNK) a device program;
  `stop` is asked before each, and `Stopped` raised when it says so; `progress(decoded, steps)`
  is told after each."""
  chunk = CHUNK if chunk is None else chunk
  if steps < 1:
    raise ValueError(f"{steps} new tokens asked for; at least 1.")
  if chunk < 1:
    raise ValueError(f"chunks of {chunk} new tokens asked for; at least 1.")
  graphdef, state = nnx.split(modules.build_modules(cfg)["language"].bind(language))
  embeds = None if embeds_bld is None else jnp.asarray(embeds_bld)
  settings = dict(sampling=dataclasses.replace(sampling, seed=0), eos=eos)
  carry = _prefill(graphdef, state, jnp.asarray(ids_bl), jnp.asarray(mask_bl, bool), embeds,
                   jax.random.key(sampling.seed), steps=steps, **settings)
  i, decoded, finished = 1, 0, False  # i: the next token's index; decoded: as last fetched
  while i < steps and not finished:
    if stop is not None and stop():
      raise Stopped(decoded, steps)
    until = np.int32(min(i - i % chunk + chunk, steps))  # chunks end at multiples of `chunk`
    carry, i, finished = _chunk(graphdef, state, carry, until, **settings)
    i, finished = jax.device_get((i, finished))  # the chunk's one wait
    decoded = i = int(i)
    if progress is not None:
      progress(decoded, steps)
  return np.asarray(carry.out_bs)
