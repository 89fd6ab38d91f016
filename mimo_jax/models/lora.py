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
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
from flax import nnx

from mimo_jax.config import ConfigError, LoraConfig, lora_of

A, B = "lora_a", "lora_b"


class LoRALinear(nnx.Linear):
  """An `nnx.Linear` with adapters `lora_a`, `lora_b` and their `lora_scale` (alpha / rank)."""

  def __call__(self, x: jax.Array) -> jax.Array:
    return super().__call__(x) + delta(self, x)


def delta(layer: nnx.Module, x: jax.Array) -> jax.Array:
  """The adapters' term for input x [..., in] (zero for a layer without adapters)."""
  if not isinstance(layer, LoRALinear):
    return jnp.zeros((), x.dtype)
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
