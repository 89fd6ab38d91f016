"""Hugging Face checkpoints: config.json <-> our config fields, safetensors <-> our parameters.

Supported: language models of the Llama (Llama-3, 3.1, 3.2) and Qwen2 (Qwen2, 2.5)
architectures, SigLIP and CLIP vision towers, and LLaVA checkpoints (`LlavaForConditionalGeneration`:
a tower, the projector and a language model). Names are matched after the prefixes that
transformers' versions and the model classes put in front of them (`vision_model.`,
`model.language_model.`, `language_model.model.`, ...), so files written by `save_pretrained` of
any of those classes read alike.

Tensors are read one at a time (`safe_open`), converted to float32 and to our layout (kernels
[in, out], a module's layers stacked on a leading axis); `leaves` yields them leaf by leaf, so
the caller can place each on its devices before the next is read (state.py, for `init_from`).
One table per module (`Tensor`: our leaf, the HF name and shape, the layout map) serves reading
and writing (`export_tensors`, with the config.json writers, for tools/hf.py export).

Every problem is one `HFError` naming the file or tensor and the fix.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Callable, Iterator

import numpy as np

from mimo_jax.config import ConfigError

LANGUAGE_TYPES = ("llama", "qwen2")
VISION_TYPES = {"siglip_vision_model": "siglip", "siglip": "siglip",
                "clip_vision_model": "clip", "clip": "clip"}
ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "gelu": "gelu",
               "quick_gelu": "quick_gelu"}
# Name prefixes of each part, most specific first (transformers 4.x and 5.x, each model class).
PREFIXES = {
    "vision": ("model.vision_tower.vision_model.", "vision_tower.vision_model.",
               "model.vision_tower.", "vision_tower.", "vision_model.", ""),
    "language": ("model.language_model.model.", "model.language_model.", "language_model.model.",
                 "language_model.", "model.", ""),
    "projector": ("model.multi_modal_projector.", "multi_modal_projector."),
}
HEADS = ("lm_head.weight", "language_model.lm_head.weight", "model.lm_head.weight")


class HFError(ConfigError):
  """A Hugging Face directory that cannot be read; the message names the file or tensor."""


def _json(path: pathlib.Path) -> dict:
  try:
    return json.loads(path.read_text())
  except FileNotFoundError:
    raise HFError(f"{path}: not found; an HF model directory has a config.json (as "
                  "save_pretrained writes it).") from None
  except (OSError, ValueError) as e:
    raise HFError(f"{path}: cannot be read as JSON ({e}).") from None


@dataclasses.dataclass
class Source:
  """An HF model directory: its config.json, and where each tensor is."""
  path: pathlib.Path
  config: dict
  files: dict[str, pathlib.Path]  # tensor name -> safetensors file

  @classmethod
  def open(cls, path: str | pathlib.Path) -> "Source":
    path = pathlib.Path(path)
    if not path.is_dir():
      raise HFError(f"{path}: not a directory; pass an HF model directory (config.json and "
                    "*.safetensors).")
    config = _json(path / "config.json")
    index = path / "model.safetensors.index.json"
    if index.exists():
      weight_map = _json(index).get("weight_map")
      if not isinstance(weight_map, dict):
        raise HFError(f"{index}: has no weight_map; rewrite it with save_pretrained.")
      files = {k: path / v for k, v in weight_map.items()}
      for f in sorted(set(files.values())):
        if not f.is_file():
          raise HFError(f"{f}: missing; {index.name} lists it (tensors "
                        f"{', '.join(sorted(k for k, v in files.items() if v == f)[:3])}...). "
                        "Copy the whole model directory.")
    else:
      found = sorted(path.glob("*.safetensors"))
      if not found:
        raise HFError(f"{path}: no *.safetensors files (PyTorch .bin checkpoints are not read; "
                      "convert them with save_pretrained(..., safe_serialization=True)).")
      files = {}
      for f in found:
        for k in _keys(f):
          files[k] = f
    return cls(path, config, files)

  @property
  def kind(self) -> str:
    """llava, llama, qwen2, siglip or clip."""
    t = self.config.get("model_type", "")
    if t == "llava":
      return "llava"
    if t in LANGUAGE_TYPES:
      return t
    if t in VISION_TYPES:
      return VISION_TYPES[t]
    raise HFError(f"{self.path / 'config.json'}: model_type {t!r} is not supported; supported: "
                  f"llava, {', '.join(LANGUAGE_TYPES)}, siglip, clip.")

  def has(self, name: str) -> bool:
    return name in self.files

  def read(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Tensor `name` as float32, checked against the `shape` config.json implies."""
    if name not in self.files:
      raise HFError(f"{self.path}: tensor {name} is missing (config.json says it exists); the "
                    "checkpoint is incomplete or of another architecture.")
    f = self.files[name]
    from safetensors import safe_open  # pylint: disable=import-outside-toplevel
    try:
      with safe_open(str(f), "np") as st:
        x = st.get_tensor(name)
    except Exception as e:  # pylint: disable=broad-except
      if "bf16" in str(e).lower() or "bfloat16" in str(e).lower():
        x = _read_bf16(f, name)
      else:
        raise HFError(f"{f}: tensor {name} cannot be read ({e}); the file is damaged or not "
                      "safetensors.") from None
    if x.dtype.kind != "f" and str(x.dtype) != "bfloat16":
      raise HFError(f"{f}: tensor {name} has dtype {x.dtype}, expected a floating point type.")
    if tuple(x.shape) != tuple(shape):
      raise HFError(f"{f}: tensor {name} has shape {tuple(x.shape)}, but config.json implies "
                    f"{tuple(shape)}.")
    return np.asarray(x, np.float32)


def _keys(f: pathlib.Path) -> list[str]:
  from safetensors import safe_open  # pylint: disable=import-outside-toplevel
  try:
    with safe_open(str(f), "np") as st:
      return list(st.keys())
  except Exception as e:  # pylint: disable=broad-except
    raise HFError(f"{f}: cannot be read as safetensors ({e}).") from None


def _read_bf16(f: pathlib.Path, name: str) -> np.ndarray:
  """numpy has no bfloat16: read the raw bits (safetensors' header gives the layout)."""
  import ml_dtypes  # pylint: disable=import-outside-toplevel
  with open(f, "rb") as fh:
    n = int.from_bytes(fh.read(8), "little")
    header = json.loads(fh.read(n))
    info = header[name]
    start, end = info["data_offsets"]
    fh.seek(8 + n + start)
    raw = fh.read(end - start)
  return np.frombuffer(raw, ml_dtypes.bfloat16).reshape(info["shape"])


def _find(src: Source, part: str, suffix: str) -> str:
  """The full name of `suffix` under the first of `part`'s prefixes that has it."""
  for p in PREFIXES[part]:
    if src.has(p + suffix):
      return p + suffix
  return PREFIXES[part][0] + suffix  # missing: read() names it


def _int(cfg: dict, key: str, where: str) -> int:
  if not isinstance(cfg.get(key), int):
    raise HFError(f"{where}: field {key} is missing or not an integer.")
  return cfg[key]


# ---------------------------------------------------------------------------------------------
# config.json -> config fields


def text_config(src: Source) -> dict:
  return src.config.get("text_config", {}) if src.kind == "llava" else src.config


def vision_config(src: Source) -> dict:
  return src.config.get("vision_config", {}) if src.kind == "llava" else src.config


def language_fields(src: Source) -> dict:
  """model.language fields from config.json (a language model, or a LLaVA's text_config)."""
  c, where = text_config(src), str(src.path / "config.json")
  kind = c.get("model_type", "llama")
  if kind not in LANGUAGE_TYPES:
    raise HFError(f"{where}: language model_type {kind!r} is not supported; supported: "
                  f"{', '.join(LANGUAGE_TYPES)}.")
  dim, heads = _int(c, "hidden_size", where), _int(c, "num_attention_heads", where)
  if c.get("head_dim") not in (None, dim // heads):
    raise HFError(f"{where}: head_dim {c['head_dim']} differs from hidden_size / "
                  f"num_attention_heads = {dim // heads}, which is the only layout supported.")
  for flag in ("mlp_bias",) + (("attention_bias",) if kind == "llama" else ()):
    if c.get(flag):
      raise HFError(f"{where}: {flag}=true is not supported (Llama without biases; Qwen2's q, "
                    "k, v biases).")
  if c.get("hidden_act", "silu") != "silu":
    raise HFError(f"{where}: hidden_act {c['hidden_act']!r} is not supported (silu).")
  if kind == "qwen2" and c.get("use_sliding_window"):
    raise HFError(f"{where}: use_sliding_window=true is not supported.")
  rope = dict(c.get("rope_parameters") or {})
  rope.update(c.get("rope_scaling") or {})  # transformers 4.x names
  theta = c.get("rope_theta", rope.get("rope_theta", 10000.0))
  rope_type = rope.get("rope_type", rope.get("type", "default"))
  fields = dict(dim=dim, layers=_int(c, "num_hidden_layers", where), heads=heads,
                kv_heads=c.get("num_key_value_heads") or heads,
                mlp_dim=_int(c, "intermediate_size", where), rope_theta=float(theta),
                vocab_size=_int(c, "vocab_size", where),
                norm_eps=float(c.get("rms_norm_eps", 1e-6)), qkv_bias=kind == "qwen2",
                tie_embeddings=bool(c.get("tie_word_embeddings",
                                          src.config.get("tie_word_embeddings", False))))
  if rope_type == "llama3":
    fields.update(rope_scaling="llama3", rope_factor=float(rope["factor"]),
                  rope_low_freq_factor=float(rope["low_freq_factor"]),
                  rope_high_freq_factor=float(rope["high_freq_factor"]),
                  rope_original_positions=int(rope["original_max_position_embeddings"]))
  elif rope_type != "default":
    raise HFError(f"{where}: RoPE type {rope_type!r} is not supported (default, llama3).")
  return fields


def feature_layers(src: Source) -> int:
  """Tower layers whose output is the features: all of a lone tower; LLaVA's
  `vision_feature_layer` (hidden_states[k], k = 0 the embeddings) counted from the end if < 0."""
  layers = _int(vision_config(src), "num_hidden_layers", str(src.path / "config.json"))
  if src.kind != "llava":
    return layers
  k = src.config.get("vision_feature_layer", -2)
  if not isinstance(k, int):
    raise HFError(f"{src.path / 'config.json'}: vision_feature_layer {k!r} (several layers) is "
                  "not supported; one layer index is.")
  used = k if k >= 0 else layers + 1 + k
  if not 1 <= used <= layers:
    raise HFError(f"{src.path / 'config.json'}: vision_feature_layer {k} is outside the tower's "
                  f"{layers} layers.")
  return used


def vision_fields(src: Source) -> dict:
  """model.vision fields from config.json (a tower, or a LLaVA's vision_config) and
  preprocessor_config.json (pixel mean and std) if present."""
  c, where = vision_config(src), str(src.path / "config.json")
  kind = VISION_TYPES.get(c.get("model_type", ""))
  if kind is None:
    raise HFError(f"{where}: vision model_type {c.get('model_type')!r} is not supported; "
                  "supported: siglip_vision_model, clip_vision_model.")
  act = c.get("hidden_act", "gelu_pytorch_tanh" if kind == "siglip" else "quick_gelu")
  if act not in ACTIVATIONS:
    raise HFError(f"{where}: vision hidden_act {act!r} is not supported "
                  f"({', '.join(ACTIVATIONS)}).")
  # A side that is no multiple of the patch (SigLIP-so400m: 384 with patches of 14) loses its
  # last pixels to HF's strided convolution: the same as cropping it to the patches (378).
  patch = _int(c, "patch_size", where)
  fields = dict(image_size=_int(c, "image_size", where) // patch * patch, patch_size=patch,
                channels=c.get("num_channels", 3), dim=_int(c, "hidden_size", where),
                layers=feature_layers(src), heads=_int(c, "num_attention_heads", where),
                mlp_dim=_int(c, "intermediate_size", where), downsample=1,
                class_token=kind == "clip", patch_bias=kind == "siglip",
                pre_norm=kind == "clip", final_norm=kind == "siglip" and src.kind != "llava",
                norm_eps=float(c.get("layer_norm_eps", 1e-6 if kind == "siglip" else 1e-5)),
                activation=ACTIVATIONS[act])
  if src.kind == "llava":
    strategy = src.config.get("vision_feature_select_strategy", "default")
    if (kind, strategy) not in (("clip", "default"), ("siglip", "full")):
      raise HFError(f"{where}: vision_feature_select_strategy {strategy!r} with a {kind} tower "
                    "is not supported (clip: default, dropping the class token; siglip: full).")
    act = src.config.get("projector_hidden_act", "gelu")
    if act not in ACTIVATIONS or not src.config.get("multimodal_projector_bias", True):
      raise HFError(f"{where}: the projector (projector_hidden_act {act!r}, "
                    "multimodal_projector_bias) is not supported: gelu with biases is.")
    fields.update(projector_activation=ACTIVATIONS[act],
                  projector_hidden=_int(text_config(src), "hidden_size", where))
  pre = src.path / "preprocessor_config.json"
  if pre.exists():
    p = _json(pre)
    if "image_mean" in p and "image_std" in p:
      fields.update(pixel_mean=",".join(repr(float(x)) for x in p["image_mean"]),
                    pixel_std=",".join(repr(float(x)) for x in p["image_std"]))
  return fields


# ---------------------------------------------------------------------------------------------
# safetensors -> parameters


@dataclasses.dataclass(frozen=True)
class Tensor:
  """One of our leaves and the HF tensor(s) it comes from: `name` under `part`'s prefixes, with
  "{i}" for each of the `layers` stacked layers; `shape` is the HF tensor's; `how` maps it to ours:
  "copy", "T" (a linear weight [out, in] -> our kernel [in, out]) or "conv" (a patch-embedding
  convolution [d, c, p, p] -> our kernel [p*p*c, d], channels fastest)."""
  path: tuple[str, ...]
  part: str
  name: str
  shape: tuple[int, ...]
  how: str = "copy"
  layers: int = 0  # 0 = not stacked

  def to_ours(self, x: np.ndarray) -> np.ndarray:
    if self.how == "T":
      return x.T
    if self.how == "conv":
      d, c, p, _ = x.shape
      return x.transpose(2, 3, 1, 0).reshape(p * p * c, d)
    return x

  def to_theirs(self, x: np.ndarray) -> np.ndarray:
    if self.how == "T":
      return x.T
    if self.how == "conv":
      d, c, p, _ = self.shape
      return x.reshape(p, p, c, d).transpose(3, 2, 0, 1)
    return x

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


def vision_tensors(v, projector_out: int | None = None) -> list[Tensor]:
  """Our vision parameters (a VisionConfig `v`) and their HF tensors: the tower, and with
  `projector_out` (the language width) LLaVA's projector."""
  d, f, p, c, L = v.dim, v.mlp_dim, v.patch_size, v.channels, v.layers
  one = lambda path, name, shape, how="copy": Tensor(path, "vision", name, shape, how)
  block = lambda path, name, shape, how="copy": Tensor(("blocks",) + path, "vision",
                                                       "encoder.layers.{i}." + name, shape, how, L)
  norm = lambda ours, theirs: [one((ours, "scale"), f"{theirs}.weight", (d,)),
                               one((ours, "bias"), f"{theirs}.bias", (d,))]
  out = [one(("embed", "kernel"), "embeddings.patch_embedding.weight", (d, c, p, p), "conv")]
  if v.patch_bias:
    out.append(one(("embed", "bias"), "embeddings.patch_embedding.bias", (d,)))
  if v.class_token:
    out.append(one(("cls",), "embeddings.class_embedding", (d,)))
  out.append(one(("pos",), "embeddings.position_embedding.weight", (v.positions, d)))
  if v.pre_norm:
    out += norm("pre_norm", "pre_layrnorm")
  for ours, theirs in (("norm1", "layer_norm1"), ("norm2", "layer_norm2")):
    out += [block((ours, "scale"), f"{theirs}.weight", (d,)),
            block((ours, "bias"), f"{theirs}.bias", (d,))]
  for n, theirs in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("o", "out_proj")):
    out += [block(("attn", n, "kernel"), f"self_attn.{theirs}.weight", (d, d), "T"),
            block(("attn", n, "bias"), f"self_attn.{theirs}.bias", (d,))]
  out += [block(("mlp", "up", "kernel"), "mlp.fc1.weight", (f, d), "T"),
          block(("mlp", "up", "bias"), "mlp.fc1.bias", (f,)),
          block(("mlp", "down", "kernel"), "mlp.fc2.weight", (d, f), "T"),
          block(("mlp", "down", "bias"), "mlp.fc2.bias", (d,))]
  if v.final_norm:
    out += norm("norm", "post_layernorm")
  if projector_out is not None:
    h = v.projector_hidden
    for ours, theirs, n_in, n_out in (("up", "linear_1", d * v.downsample**2, h),
                                      ("down", "linear_2", h, projector_out)):
      out += [Tensor(("projector", ours, "kernel"), "projector", f"{theirs}.weight",
                     (n_out, n_in), "T"),
              Tensor(("projector", ours, "bias"), "projector", f"{theirs}.bias", (n_out,))]
  return out


def tensors(src: Source, module: str, cfg) -> list[Tensor]:
  """`module`'s tensors ("vision" or "language") a directory holds, for a run config `cfg`."""
  if module == "language":
    return language_tensors(cfg.model.language)
  return vision_tensors(cfg.model.vision,
                        text_config(src)["hidden_size"] if src.kind == "llava" else None)


def _full_name(src: Source, t: Tensor, name: str) -> str:
  if t.part == "head":
    return next((h for h in HEADS if src.has(h)), HEADS[0])
  return _find(src, t.part, name)


Leaf = tuple[tuple[str, ...], Callable[[], np.ndarray]]  # (path in our tree, read it)


def leaves(src: Source, module: str, cfg) -> Iterator[Leaf]:
  """`module`'s leaves, each with a function that reads it (float32, our layout; stacked layers
  [L, ...]): one leaf in host memory at a time."""
  for t in tensors(src, module, cfg):
    def read(t=t):
      names = t.names()
      out = None
      for i, name in enumerate(names):
        x = t.to_ours(src.read(_full_name(src, t, name), t.shape))
        if not t.layers:
          return x
        if out is None:
          out = np.empty((len(names),) + x.shape, np.float32)
        out[i] = x
      return out
    yield t.path, read


def nest(flat: dict[tuple[str, ...], np.ndarray]) -> dict:
  out: dict = {}
  for path, x in flat.items():
    node = out
    for k in path[:-1]:
      node = node.setdefault(k, {})
    node[path[-1]] = x
  return out


def check_fields(src: Source, module: str, fields: dict, section) -> list[str]:
  """The fields of config section `section` (model.<module>) that contradict `fields`."""
  def same(k, ours, theirs):
    if k in ("pixel_mean", "pixel_std"):  # lists of numbers, however written
      try:
        return [float(x) for x in str(ours).split(",") if x.strip()] == [
            float(x) for x in theirs.split(",")]
      except ValueError:
        return False
    return ours == theirs
  return [f"model.{module}.{k}={getattr(section, k)!r} (the checkpoint has {v!r})"
          for k, v in fields.items() if not same(k, getattr(section, k), v)]


def load(src: Source, module: str, cfg, base: dict) -> tuple[dict, list[tuple[str, ...]]]:
  """`base` (our parameter tree of `module`, e.g. its init) with every leaf the checkpoint has
  replaced by it; also the paths replaced. All on the host; tools/hf.py places leaf by leaf."""
  flat = {path: x for path, x in _flatten(base)}
  replaced = []
  for path, read in leaves(src, module, cfg):
    if path not in flat:
      raise HFError(f"{src.path}: {'/'.join(path)} has no place in model.{module} (a config "
                    "field differs from the checkpoint's).")
    x = read()
    if tuple(x.shape) != tuple(flat[path].shape):
      raise HFError(f"{src.path}: {'/'.join(path)} has shape {x.shape} where model.{module} "
                    f"has {tuple(flat[path].shape)}.")
    flat[path] = x
    replaced.append(path)
  return nest(flat), replaced


def _flatten(tree: dict, prefix: tuple = ()) -> Iterator[tuple[tuple[str, ...], object]]:
  for k, v in tree.items():
    if isinstance(v, dict):
      yield from _flatten(v, prefix + (k,))
    else:
      yield prefix + (k,), v


# ---------------------------------------------------------------------------------------------
# our config -> config.json (export)

# Names `export` writes: those transformers' save_pretrained writes for each class.
EXPORT_PREFIX = {
    "tower": {"vision": "", "projector": None, "language": None, "head": None},
    "language": {"vision": None, "projector": None, "language": "model.", "head": "lm_head.weight"},
    "llava": {"vision": "vision_tower.", "projector": "multi_modal_projector.",
              "language": "language_model.model.", "head": "language_model.lm_head.weight"},
}
ACTIVATION_NAMES = {"gelu_tanh": "gelu_pytorch_tanh", "gelu": "gelu", "quick_gelu": "quick_gelu"}


def export_name(kind: str, t: Tensor, name: str) -> str:
  prefix = EXPORT_PREFIX[kind][t.part]
  return prefix if t.part == "head" else prefix + name


def language_config_json(lm) -> dict:
  """config.json of a LlamaForCausalLM (or Qwen2ForCausalLM with q, k, v biases)."""
  kind = "qwen2" if lm.qkv_bias else "llama"
  out = {"architectures": ["Qwen2ForCausalLM" if lm.qkv_bias else "LlamaForCausalLM"],
         "model_type": kind, "hidden_size": lm.dim, "intermediate_size": lm.mlp_dim,
         "num_hidden_layers": lm.layers, "num_attention_heads": lm.heads,
         "num_key_value_heads": lm.kv_heads, "head_dim": lm.dim // lm.heads,
         "vocab_size": lm.vocab_size, "rms_norm_eps": lm.norm_eps, "hidden_act": "silu",
         "max_position_embeddings": max(lm.rope_original_positions, 8192),
         "tie_word_embeddings": lm.tie_embeddings, "rope_theta": lm.rope_theta,
         "torch_dtype": "float32"}
  if kind == "llama":
    out.update(attention_bias=False, mlp_bias=False)
  else:
    out.update(use_sliding_window=False)
  if lm.rope_scaling == "llama3":
    out["rope_scaling"] = {"rope_type": "llama3", "factor": lm.rope_factor,
                           "low_freq_factor": lm.rope_low_freq_factor,
                           "high_freq_factor": lm.rope_high_freq_factor,
                           "original_max_position_embeddings": lm.rope_original_positions}
  return out


def vision_config_json(v) -> dict:
  """config.json of a SiglipVisionModel or CLIPVisionModel."""
  clip = v.class_token
  layout = (v.class_token, v.patch_bias, v.pre_norm)
  if layout not in ((False, True, False), (True, False, True)):
    raise HFError(f"model.vision: class_token={v.class_token}, patch_bias={v.patch_bias}, "
                  f"pre_norm={v.pre_norm} is neither SigLIP's (false, true, false) nor CLIP's "
                  "(true, false, true) layout; no HF class holds it.")
  if v.downsample != 1:
    raise HFError(f"model.vision.downsample={v.downsample}: HF towers have no pixel shuffle.")
  out = {"architectures": ["CLIPVisionModel" if clip else "SiglipVisionModel"],
         "model_type": "clip_vision_model" if clip else "siglip_vision_model",
         "hidden_size": v.dim, "intermediate_size": v.mlp_dim, "num_hidden_layers": v.layers,
         "num_attention_heads": v.heads, "image_size": v.image_size,
         "patch_size": v.patch_size, "num_channels": v.channels, "layer_norm_eps": v.norm_eps,
         "hidden_act": ACTIVATION_NAMES[v.activation], "torch_dtype": "float32"}
  if not clip:
    out["vision_use_head"] = False
  return out


def llava_config_json(cfg, image_token: int) -> dict:
  v, lm = cfg.model.vision, cfg.model.language
  if v.final_norm:
    raise HFError("model.vision.final_norm=true: LLaVA reads the tower's hidden states without "
                  "a final norm, so this model is not a LlavaForConditionalGeneration; export "
                  "the modules alone (--module vision, --module language).")
  if v.projector_hidden != lm.dim:
    raise HFError(f"model.vision.projector_hidden={v.projector_hidden}: LLaVA's projector is "
                  f"as wide as the language model ({lm.dim}); export the modules alone.")
  vision, text = vision_config_json(v), language_config_json(lm)
  for c in (vision, text):
    c.pop("architectures")
    c.pop("torch_dtype")
  return {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava",
          "vision_config": vision, "text_config": text, "image_token_index": image_token,
          "projector_hidden_act": ACTIVATION_NAMES[v.projector_activation],
          "multimodal_projector_bias": True, "vision_feature_layer": -1,
          "vision_feature_select_strategy": "default" if v.class_token else "full",
          "image_seq_length": v.patches, "tie_word_embeddings": lm.tie_embeddings,
          "torch_dtype": "float32"}


def preprocessor_json(v) -> dict | None:
  norm = v.pixel_norm()
  if norm is None:
    return None
  return {"image_mean": list(norm[0]), "image_std": list(norm[1]),
          "size": {"height": v.image_size, "width": v.image_size}, "do_rescale": True,
          "rescale_factor": 1 / 255, "do_normalize": True}


def export_tensors(kind: str, cfg, params: dict[str, dict]) -> Iterator[tuple[str, np.ndarray]]:
  """(HF name, float32 array) of every tensor of an export of `kind` (tower, language, llava)
  from our parameters by module (host arrays)."""
  v, lm = cfg.model.vision, cfg.model.language
  parts = []
  if kind in ("tower", "llava"):
    parts.append(("vision", vision_tensors(v, lm.dim if kind == "llava" else None)))
  if kind in ("language", "llava"):
    parts.append(("language", language_tensors(lm)))
  for module, specs in parts:
    flat = dict(_flatten(params[module]))
    for t in specs:
      x = np.asarray(flat[t.path], np.float32)
      for i, name in enumerate(t.names()):
        yield export_name(kind, t, name), np.ascontiguousarray(
            t.to_theirs(x[i] if t.layers else x))
    if module == "vision":  # the HF classes have a post_layernorm; an identity where we have none
      if not v.final_norm:
        prefix = EXPORT_PREFIX[kind]["vision"]
        yield prefix + "post_layernorm.weight", np.ones((v.dim,), np.float32)
        yield prefix + "post_layernorm.bias", np.zeros((v.dim,), np.float32)
