"""Our parameters and HF tensors, one table per module (`Tensor`: our leaf, the HF name and
shape, the layout map), for reading (`leaves`, `load`) and writing (export.py): the language
model's here, an encoder's from its mapping (mapping.py)."""

from __future__ import annotations

import dataclasses
from typing import Iterator

import numpy as np

from mimo_jax.config import LANGUAGE
from mimo_jax.hf import mapping
from mimo_jax.hf.fields import text_config
from mimo_jax.hf.source import HEADS, LANGUAGE_PREFIXES, HFError, Source, _find, _int
from mimo_jax.words import count


@dataclasses.dataclass(frozen=True)
class Tensor:
  """One of our leaves and the HF tensor(s) it comes from: `name` under the prefixes of `part`
  (the language model's "language" and "head", or a part of an encoder's mapping), with "{i}"
  for each of the `layers` stacked layers; `shape` is the HF tensor's; `how` maps it to ours:
  "copy", "T" (a linear weight [out, in] -> our kernel [in, out]), "conv" (a patch-embedding
  convolution [d, c, p, p] -> our kernel [p*p*c, d], channels fastest) or "conv1d" (a 1-D
  convolution [out, in, k] -> our kernel [k, in, out])."""
  path: tuple[str, ...]
  part: str
  name: str
  shape: tuple[int, ...]
  how: str = "copy"
  layers: int = 0  # 0 = not stacked

  def to_ours(self, x: np.ndarray) -> np.ndarray:
    if self.how in ("T", "conv1d"):
      return x.T
    if self.how == "conv":
      d, c, p, _ = x.shape
      return x.transpose(2, 3, 1, 0).reshape(p * p * c, d)
    return x

  def to_theirs(self, x: np.ndarray) -> np.ndarray:
    if self.how in ("T", "conv1d"):
      return x.T
    if self.how == "conv":
      d, c, p, _ = self.shape
      return x.reshape(p, p, c, d).transpose(3, 2, 0, 1)
    return x

  def our_shape(self) -> tuple[int, ...]:
    """The shape `to_ours` gives (of one layer)."""
    if self.how in ("T", "conv1d"):
      return tuple(reversed(self.shape))
    if self.how == "conv":
      d, c, p, _ = self.shape
      return (p * p * c, d)
    return tuple(self.shape)

  def names(self) -> list[str]:
    return [self.name.format(i=i) for i in range(self.layers)] if self.layers else [self.name]


def language_tensors(lm) -> list[Tensor]:
  """Our language parameters (a LanguageConfig `lm`) and their HF tensors."""
  d, hd, f, L = lm.dim, lm.dim // lm.heads, lm.mlp_dim, lm.layers
  q, kv = lm.heads * hd, lm.kv_heads * hd
  block = lambda path, name, shape, how="copy": Tensor(("blocks",) + path, "language",
                                                       "layers.{i}." + name, shape, how, L)
  out = [Tensor(("embedding",), "language", "embed_tokens.weight", (lm.vocab_size, d)),
         block(("norm1", "scale"), "input_layernorm.weight", (d,)),
         block(("norm2", "scale"), "post_attention_layernorm.weight", (d,)),
         block(("attn", "q", "kernel"), "self_attn.q_proj.weight", (q, d), "T"),
         block(("attn", "k", "kernel"), "self_attn.k_proj.weight", (kv, d), "T"),
         block(("attn", "v", "kernel"), "self_attn.v_proj.weight", (kv, d), "T"),
         block(("attn", "o", "kernel"), "self_attn.o_proj.weight", (d, q), "T"),
         block(("mlp", "gate", "kernel"), "mlp.gate_proj.weight", (f, d), "T"),
         block(("mlp", "up", "kernel"), "mlp.up_proj.weight", (f, d), "T"),
         block(("mlp", "down", "kernel"), "mlp.down_proj.weight", (d, f), "T")]
  if lm.qkv_bias:
    out += [block(("attn", n, "bias"), f"self_attn.{n}_proj.bias", (s,))
            for n, s in (("q", q), ("k", kv), ("v", kv))]
  out.append(Tensor(("norm", "scale"), "language", "norm.weight", (d,)))
  if not lm.tie_embeddings:
    out.append(Tensor(("head", "kernel"), "head", "lm_head.weight", (lm.vocab_size, d), "T"))
  return out


def tensors(src: Source, module: str, cfg) -> list[Tensor]:
  """`module`'s tensors a directory holds, for a run config `cfg`; an encoder's projector with
  them where the directory holds the language model too."""
  if module == LANGUAGE:
    return language_tensors(cfg.model.language)
  width = _int(text_config(src), "hidden_size", str(src.path / "config.json"),
               "text_config") if src.combined else None
  return mapping.get(module).tensors(cfg.model.module(module), width)


def prefixes(module: str) -> dict[str, tuple[str, ...]]:
  """The name prefixes of each part of `module`'s table (a head's are HEADS, whole names)."""
  return {LANGUAGE: LANGUAGE_PREFIXES} if module == LANGUAGE else mapping.get(module).prefixes


def stored_bytes(src: Source, module: str, cfg) -> int:
  """Bytes a compact save (checkpoint.py) stores of `module`'s tensors from `src`, from the
  files' headers: 2 an element of a bfloat16 tensor, 4 of any other (parameters the seed makes
  come on top)."""
  total, table = 0, prefixes(module)
  for t in tensors(src, module, cfg):
    n = int(np.prod(t.shape))
    total += sum(n * (2 if src.dtype(_full_name(src, table, t, name)) == "BF16" else 4)
                 for name in t.names())
  return total


def _full_name(src: Source, table: dict[str, tuple[str, ...]], t: Tensor, name: str) -> str:
  if t.part == "head":
    return next((h for h in HEADS if src.has(h)), HEADS[0])
  return _find(src, table[t.part], name)


class Reader:
  """Reads one leaf of our tree from the checkpoint (float32, our layout): all of it (`read()`;
  stacked layers [L, ...]) or, for a stacked leaf, one layer at a time (`layer(i)`, i < `layers`;
  `layers` is 0 for a leaf that is not stacked)."""

  def __init__(self, src: Source, t: Tensor, table: dict[str, tuple[str, ...]]):
    self._src, self._t, self._table = src, t, table
    self._names = t.names()
    self.layers = len(self._names) if t.layers else 0
    self.layer_shape = t.our_shape()

  def layer(self, i: int) -> np.ndarray:
    name = _full_name(self._src, self._table, self._t, self._names[i])
    return self._t.to_ours(self._src.read(name, self._t.shape))

  def __call__(self) -> np.ndarray:
    if not self.layers:
      return self.layer(0)
    out = None
    for i in range(self.layers):
      x = self.layer(i)
      if out is None:
        out = np.empty((self.layers,) + x.shape, np.float32)
      out[i] = x
    return out


Leaf = tuple[tuple[str, ...], Reader]  # (path in our tree, its reader)


def leaves(src: Source, module: str, cfg) -> Iterator[Leaf]:
  """`module`'s leaves, each with its reader: one leaf (or one layer of it) in host memory at a
  time."""
  table = prefixes(module)
  ts = tensors(src, module, cfg)
  # A language model's layer past the config's count would be left out: a smaller model, said
  # nowhere. (A tower's are left out where its feature layer is not the last: LLaVA's -2.)
  for t in ts if module == LANGUAGE else ():
    name = next((p + t.name.format(i=t.layers) for p in table.get(t.part, ())
                 if t.layers and src.has(p + t.name.format(i=t.layers))), None)
    if name is not None:
      raise HFError(f"{src.path / 'config.json'}: gives {module} {count(t.layers, 'layer')}, "
                    f"but the directory holds {name}, a layer past them; set the layer count to "
                    "the layers the tensors hold (or copy the whole model directory).")
  for t in ts:
    yield t.path, Reader(src, t, table)


def nest(flat: dict[tuple[str, ...], np.ndarray]) -> dict:
  out: dict = {}
  for path, x in flat.items():
    node = out
    for k in path[:-1]:
      node = node.setdefault(k, {})
    node[path[-1]] = x
  return out


def load(src: Source, module: str, cfg, base: dict) -> dict:
  """`base` (our parameter tree of `module`, e.g. its init from seed 0: models/mimo.Module.init)
  with every leaf the checkpoint has replaced by it, all on the host as numpy arrays (state.py
  places them leaf by leaf instead). The caller builds `base`: this package reads checkpoints and
  builds no model."""
  flat = {path: np.asarray(x) for path, x in flatten(base)}
  for path, read in leaves(src, module, cfg):
    if path not in flat:
      raise HFError(f"{src.path}: {'/'.join(path)} has no place in model.{module} (a config "
                    "field differs from the checkpoint's).")
    x = read()
    if tuple(x.shape) != tuple(flat[path].shape):
      raise HFError(f"{src.path}: {'/'.join(path)} has shape {x.shape} where model.{module} "
                    f"has {tuple(flat[path].shape)}.")
    flat[path] = x
  return nest(flat)


def flatten(tree: dict, prefix: tuple = ()) -> Iterator[tuple[tuple[str, ...], object]]:
  for k, v in tree.items():
    if isinstance(v, dict):
      yield from flatten(v, prefix + (k,))
    else:
      yield prefix + (k,), v
