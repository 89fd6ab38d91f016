"""A tests-only second encoder over 1-D signals, registered beside the built-in ones
(mimo_jax/encoders).

A signal is `length` float samples; each chunk of `chunk` samples becomes one token: a linear
embedding, `layers` residual MLP blocks (stacked, so they pipeline like any module's) and a linear
projector into the language model's width (its own parameter group, `signal_projector`, as every
encoder's `projector` is). A sample lists its signals under `signals`, and its text marks each
with `PLACEHOLDER`. Its data settings are its own config's (`max_signals`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mimo_jax import encoders
from mimo_jax.config import Config, ModuleTopology, require
from mimo_jax.models.layers import GeluMLP, LayerNorm, linear, stacked
from mimo_jax.models.mimo import Module
from mimo_jax.trees import kernel_params

PLACEHOLDER = 4  # a token id the test's texts use for nothing else


@dataclasses.dataclass
class SignalConfig:
  length: int = 16
  chunk: int = 4
  dim: int = 32
  layers: int = 2
  max_signals: int = 2

  @property
  def tokens(self) -> int:
    return self.length // self.chunk


class SignalBlock(nnx.Module):

  def __init__(self, rngs: nnx.Rngs, cfg: SignalConfig, dtype):
    self.norm = LayerNorm(cfg.dim)
    self.mlp = GeluMLP(rngs, cfg.dim, 2 * cfg.dim, dtype)

  def __call__(self, x: jax.Array) -> jax.Array:
    return x + self.mlp(self.norm(x))


class SignalEncoder(nnx.Module):

  def __init__(self, rngs: nnx.Rngs, cfg: SignalConfig, lm_dim: int, dtype):
    self.chunk = cfg.chunk
    self.embed = linear(rngs, cfg.chunk, cfg.dim, dtype, bias=True)
    self.blocks = stacked(lambda r: SignalBlock(r, cfg, dtype), cfg.layers, rngs)
    self.projector = linear(rngs, cfg.dim, lm_dim, dtype, bias=True)

  def embed_chunks(self, x_ns: jax.Array) -> jax.Array:
    n, s = x_ns.shape
    return self.embed(x_ns.reshape(n, s // self.chunk, self.chunk))

  def finish(self, x_ntd: jax.Array) -> jax.Array:
    return self.projector(x_ntd)


@dataclasses.dataclass(frozen=True)
class SignalSlots(encoders.SlotLayout):
  noun = "signal"
  length: int = 16

  def items(self, sample: dict) -> list:
    return list(sample.get("signals", ()))

  def item_tokens(self, size, sid: int) -> int:
    if size[0] != self.length:
      raise ValueError(f"sample {sid} has a signal of {size[0]} samples, not {self.length}")
    return self.slot_tokens

  def empty(self) -> dict[str, np.ndarray]:
    return {"signals_ns": np.zeros((self.slots, self.length), np.float32)}

  def write(self, inputs, slot, start, tokens, item, size, nth) -> None:
    inputs["signals_ns"][slot] = item

  def work(self, sizes) -> dict[str, int]:
    return {"signals": len(sizes)}


class Signal(encoders.Encoder):
  name, sample_key, placeholder, size_fields, seed_salt = "signal", "signals", PLACEHOLDER, 1, 3
  noun, config_class, slots_field = "signal", SignalConfig, "model.signal.max_signals"
  data_settings = data_fields = ("max_signals",)

  def item_sizes(self, sample: dict) -> list[tuple[int]]:
    return [(len(s),) for s in sample.get("signals", ())]

  def validate(self, cfg: Config) -> None:
    s = self.config(cfg)
    require(s.length % s.chunk == 0, "model.signal.chunk", "must divide length.")

  def module(self, cfg: Config) -> Module:
    s, lm, dtype = self.config(cfg), cfg.model.language, jnp.dtype(cfg.model.dtype)
    return Module(self.name, lambda rngs: SignalEncoder(rngs, s, lm.dim, dtype),
                  lambda rngs: SignalBlock(rngs, s, dtype), seed_salt=self.seed_salt)

  def slot_layout(self, cfg: Config, groups: int, slots: int) -> SignalSlots:
    s = self.config(cfg)
    return SignalSlots(self.name, self.placeholder, groups, slots, s.tokens, 1, length=s.length)

  def slots(self, cfg: Config, eval_batch: int = 0) -> int:
    return (eval_batch or cfg.data.micro_batch) * self.config(cfg).max_signals

  def max_items(self, cfg: Config) -> int:
    return self.config(cfg).max_signals

  def tokens_per_item(self, cfg: Config) -> int:
    return self.config(cfg).tokens

  def activation_bytes(self, cfg: Config, t: ModuleTopology) -> int:
    """Each slot's tokens at the block's input and, unless remat=full, the MLP's hidden units."""
    s = self.config(cfg)
    kept = s.dim + (0 if t.remat == "full" else 2 * s.dim // t.tp)
    return self.slots(cfg) // t.dp * s.tokens * kept * np.dtype(cfg.model.dtype).itemsize

  def encode(self, model, run_blocks, inputs_m: dict) -> jax.Array:
    x = jax.vmap(model.embed_chunks)(inputs_m["signals_ns"])
    return jax.vmap(model.finish)(run_blocks(x, ()))

  def flops(self, cfg: Config, params, work: dict[str, int]) -> float:
    return 6.0 * kernel_params(params) * work["signals"] * self.config(cfg).tokens
