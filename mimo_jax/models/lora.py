"""Low-rank adapters (LoRA) on a module's linear layers, as PEFT defines them.

A targeted layer computes `base(x) + (x @ A) @ B * alpha / rank`, with A [in, rank] drawn
uniformly in ±1/sqrt(in) (PEFT's kaiming-uniform with a = sqrt(5)) and B [rank, out] zero, so
that a fresh adapter leaves the model exactly as it was. The adapters are attached after the
module is built, from keys drawn after the base's own: the base weights are the seed's whatever
the adapters. They are named `<layer>/lora_a` and `<layer>/lora_b` beside the layer's kernel (a
stacked layer's adapters stacked on the same leading axes), so the sharding rules place them
with their base (sharding.TP_RULES: B split on the output of a column-split kernel, A on the
input of a row-split one).

`merge` folds trained adapters into the kernels (an HF export of the merged model).

**Dropout** (`lora.dropout` = p, PEFT's lora_dropout): in training a targeted layer computes
`base(x) + B(A(dropout(x))) * alpha / rank`, dropping each input feature with probability p and
scaling the rest by 1 / (1 - p). The mask of an element is a hash (not `jax.random`) of the run's
seed, the sample id and position of its token, the layer's index in the stack, the projection's
name and the feature's index: these name the same element on every layout (a sample id is its
place in the data stream, so a resumed run draws the masks an uninterrupted one draws), whereas
random bits drawn inside `shard_map` (a dp rank's rows, a pipeline stage's layers) follow the
local shapes. The block stack passes each layer its index (`pipeline.Stack(indexed=True)`) and
`dropping` opens a `Dropout` scope for the layer, which `delta` reads; outside a scope (evaluation,
generation, export) nothing is dropped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
import threading
import zlib
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mimo_jax.config import ConfigError, LoraConfig, lora_of

A, B = "lora_a", "lora_b"


class LoRALinear(nnx.Linear):
  """An `nnx.Linear` with adapters `lora_a`, `lora_b` and their `lora_scale` (alpha / rank)."""

  def __call__(self, x: jax.Array) -> jax.Array:
    return super().__call__(x) + delta(self, x)


def delta(layer: nnx.Module, x: jax.Array) -> jax.Array:
  """The adapters' term for input x [..., in] (zero for a layer without adapters), its input
  dropped where a `Dropout` scope is open."""
  if not isinstance(layer, LoRALinear):
    return jnp.zeros((), x.dtype)
  scopes = _scopes()
  if scopes and scopes[-1] is not None:
    x = scopes[-1].apply(x, layer.lora_salt)
  dtype = layer.dtype or x.dtype
  h = jnp.dot(x.astype(dtype), layer.lora_a[...].astype(dtype))
  return (jnp.dot(h, layer.lora_b[...].astype(dtype)) * layer.lora_scale).astype(dtype)


def patterns(lora: LoraConfig, field: str = "model.<module>.lora") -> list[str]:
  """`targets` as regular expressions; one that does not compile is an error naming it."""
  out = [t.strip() for t in lora.targets.split(",") if t.strip()]
  if not out:
    raise ConfigError(f"config.{field}.targets: empty; name the layers to adapt, e.g. "
                      f"attn/(q|v)$.")
  for p in out:
    try:
      re.compile(p)
    except re.error as e:
      raise ConfigError(f"config.{field}.targets: {p!r} is not a regular expression ({e}).") \
          from None
  return out


def attach(model: nnx.Module, lora: LoraConfig, rngs: nnx.Rngs, field: str = "") -> list[str]:
  """Adds adapters to every linear layer of `model` whose path a target pattern matches; returns
  those paths. `field` (model.<name>.lora) names errors: a pattern that matches no layer."""
  linears = [(path, m) for path, m in nnx.iter_graph(model) if type(m) is nnx.Linear]
  names = ["/".join(str(k) for k in path) for path, _ in linears]
  pats = patterns(lora, field or "model.<module>.lora")
  hit = [any(re.search(p, n) for p in pats) for n in names]
  for p in pats:
    if field and not any(re.search(p, n) for n in names):
      raise ConfigError(f"config.{field}.targets: {p!r} matches no linear layer; layers: "
                        f"{', '.join(sorted(set(names)))}.")
  key = rngs.params()
  for i, ((_, layer), name, h) in enumerate(zip(linears, names, hit)):
    if not h:
      continue
    kernel = layer.kernel[...]
    lead, (d_in, d_out) = kernel.shape[:-2], kernel.shape[-2:]
    bound = 1.0 / math.sqrt(d_in)
    a = jax.random.uniform(jax.random.fold_in(key, i), lead + (d_in, lora.rank), jnp.float32,
                           -bound, bound)
    layer.__class__ = LoRALinear
    layer.lora_a = nnx.Param(a)
    layer.lora_b = nnx.Param(jnp.zeros(lead + (lora.rank, d_out), jnp.float32))
    layer.lora_scale = lora.alpha / lora.rank
    layer.lora_salt = zlib.crc32(name.encode())  # the projection's part of its dropout masks
  if field and lora.dropout:
    outside = [n for n, h in zip(names, hit) if h and not n.startswith("blocks/")]
    if outside:
      raise ConfigError(f"config.{field}.dropout: applies to the blocks' layers, and targets "
                        f"match {', '.join(outside)} outside them; narrow the targets or set "
                        f"dropout to 0.")
  return [n for n, h in zip(names, hit) if h]


def with_adapters(module, lora: LoraConfig, field: str):
  """A models/mimo.Module whose model and stacked layer carry adapters (`attach`)."""
  def wrap(ctor, check: bool):
    def build(rngs: nnx.Rngs) -> nnx.Module:
      model = ctor(rngs)
      attach(model, lora, rngs, field if check else "")
      return model
    return build
  return dataclasses.replace(module, ctor=wrap(module.ctor, True),
                             layer_ctor=wrap(module.layer_ctor, False), lora=lora)


def adapted(module, cfg, name: str):
  """Module `name` (a models/mimo.Module) with the adapters `model.<name>.lora` asks for, if any:
  as the run builds it (modules.build_modules) and the one-piece checks must too."""
  lora = lora_of(cfg, name)
  return with_adapters(module, lora, f"model.{name}.lora") if lora else module


def is_adapter(path: str) -> bool:
  return path.endswith("/" + A) or path.endswith("/" + B)


def merge(params: dict, lora: LoraConfig) -> dict:
  """Parameters with every adapter folded into its kernel (kernel + scale · A @ B, in float32)
  and the adapters removed: the plain module's parameters."""
  scale = lora.alpha / lora.rank

  def fold(node):
    if not isinstance(node, dict):
      return node
    out = {k: fold(v) for k, v in node.items() if k not in (A, B)}
    if A in node:
      ab = jnp.matmul(jnp.asarray(node[A], jnp.float32), jnp.asarray(node[B], jnp.float32))
      out["kernel"] = (jnp.asarray(node["kernel"], jnp.float32) + scale * ab)
    return out
  return fold(params)


# ---- dropout ---------------------------------------------------------------------------------

# The open `Dropout` scopes, innermost last, of the thread tracing (programs compile ahead in
# threads of their own: precompile.py).
_LOCAL = threading.local()


def _scopes() -> list:
  if not hasattr(_LOCAL, "scopes"):
    _LOCAL.scopes = []
  return _LOCAL.scopes


def _mix(h: jax.Array) -> jax.Array:
  """murmur3's 32-bit finaliser: each input bit flips each output bit with probability ~1/2."""
  h = h ^ (h >> 16)
  h = h * np.uint32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * np.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


def _combine(h: jax.Array, v) -> jax.Array:
  """A hash of (h, v), both uint32 (order matters)."""
  v = _mix(jnp.asarray(v).astype(jnp.uint32) + np.uint32(0x9E3779B9))
  return _mix(h ^ (v + np.uint32(0x7F4A7C15) + (h << 6) + (h >> 2)))


def token_seeds(seed: int, module: str, sample_ids: jax.Array, positions: jax.Array) -> jax.Array:
  """A 32-bit seed per row [...] of the run's `seed`, the module's name, each row's sample id and
  its position (a token's in its sample, a patch's among its sample's images)."""
  h = _mix(jnp.uint32(seed & 0xFFFFFFFF) ^ np.uint32(zlib.crc32(module.encode())))
  return _combine(_combine(jnp.full(sample_ids.shape, h, jnp.uint32), sample_ids), positions)


def item_places(owner_nt: jax.Array) -> jax.Array:
  """For slots of one item each (`owner_nt` [n, t]: the sample owning each token): each item's
  place among its sample's items [n], as its sample's items in earlier slots. A rank fills its
  slots in sample order, a sample's all on its rank, so the place is the same on every layout
  (an encoder's `dropout_rows`)."""
  owner_n = owner_nt[:, 0]
  slot = jnp.arange(owner_n.shape[0])
  before = (owner_n[None, :] == owner_n[:, None]) & (slot[None, :] < slot[:, None])
  return jnp.sum(before, axis=1, dtype=jnp.int32)


@dataclasses.dataclass(frozen=True)
class Dropout:
  """The adapters' input dropout in one call of a block: `rate` and the block's token seeds
  [..., tokens] (`token_seeds` combined with the layer's index)."""
  rate: float
  seeds: jax.Array

  def keep(self, salt: int, features: int) -> jax.Array:
    """The mask [..., features] of a projection (`salt`: a hash of its name)."""
    h = _combine(self.seeds, np.uint32(salt))[..., None]
    bits = _combine(h, jnp.arange(features, dtype=jnp.uint32))
    return bits >= np.uint32(min(round(self.rate * 2.0**32), 2**32 - 1))

  def apply(self, x: jax.Array, salt: int) -> jax.Array:
    """x [..., features] dropped and the rest scaled by 1 / (1 - rate), as torch's Dropout."""
    if self.seeds.shape != x.shape[:-1]:
      raise ValueError(f"dropout seeds {self.seeds.shape} do not match the input {x.shape}")
    # Scaled in float32, then rounded once (a bfloat16 1 / (1 - rate) would bias every value).
    kept = (x.astype(jnp.float32) * np.float32(1.0 / (1.0 - self.rate))).astype(x.dtype)
    return jnp.where(self.keep(salt, x.shape[-1]), kept, jnp.zeros((), x.dtype))


@contextlib.contextmanager
def scope(dropout: Dropout | None):
  """Within it (a layer being traced), `delta` drops the adapters' input as `dropout` says."""
  _scopes().append(dropout)
  try:
    yield
  finally:
    _scopes().pop()


def dropping(layer: Callable, rate: float) -> Callable:
  """`layer(params, x, *side)` as an indexed Stack calls it with token seeds as the last side
  input: `(params, x, index, *side, seeds)`, the layer run in a `Dropout` scope of its own."""
  def run(params, x, index, *side):
    *side, seeds = side
    with scope(Dropout(rate, _combine(seeds, index))):
      return layer(params, x, *side)
  return run
