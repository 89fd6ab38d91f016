"""config.json -> our config fields (model.vision, model.language), and the fields of a config
that contradict a directory."""

from __future__ import annotations

import json

from mimo_jax.hf.source import (ACTIVATIONS, LANGUAGE_TYPES, REQUIRED, VISION_TYPES, HFError,
                                Source, _json, field)


def _section(src: Source, name: str) -> tuple[dict, str]:
  """A LLaVA's text_config or vision_config (and its name), or a lone model's whole config."""
  if src.kind != "llava":
    return src.config, ""
  return field(src.config, name, str(src.path / "config.json"), dict, {}), name


def text_config(src: Source) -> dict:
  return _section(src, "text_config")[0]


def vision_config(src: Source) -> dict:
  return _section(src, "vision_config")[0]


def _reader(src: Source, name: str):
  """get(key, kind, default, nullable): a field of `src`'s section `name`, checked (`field`)."""
  c, section = _section(src, name)
  where = str(src.path / "config.json")
  return lambda key, kind, default=REQUIRED, nullable=False: field(c, key, where, kind, default,
                                                                    section, nullable)


def language_fields(src: Source) -> dict:
  """model.language fields from config.json (a language model, or a LLaVA's text_config)."""
  c, section = _section(src, "text_config")
  where, get = str(src.path / "config.json"), _reader(src, "text_config")
  kind = get("model_type", str, "llama")
  if kind not in LANGUAGE_TYPES:
    raise HFError(f"{where}: language model_type {kind!r} is not supported; supported: "
                  f"{', '.join(LANGUAGE_TYPES)}.")
  dim, heads = get("hidden_size", int), get("num_attention_heads", int)
  # transformers reads null as the default for these: head_dim, kv heads, biases, RoPE scaling.
  head_dim = get("head_dim", int, None, nullable=True)
  if head_dim not in (None, dim // heads):
    raise HFError(f"{where}: head_dim {head_dim} differs from hidden_size / "
                  f"num_attention_heads = {dim // heads}, which is the only layout supported.")
  for flag in ("mlp_bias",) + (("attention_bias",) if kind == "llama" else ()):
    if get(flag, bool, False, nullable=True):
      raise HFError(f"{where}: {flag}=true is not supported (Llama without biases; Qwen2's q, "
                    "k, v biases).")
  if get("hidden_act", str, "silu") != "silu":
    raise HFError(f"{where}: hidden_act {c['hidden_act']!r} is not supported (silu).")
  if kind == "qwen2" and get("use_sliding_window", bool, False, nullable=True):
    raise HFError(f"{where}: use_sliding_window=true is not supported.")
  rope, origin, last = {}, {}, "rope_scaling"  # RoPE fields, the section of each, the last one
  for name in ("rope_parameters", "rope_scaling"):  # the latter: transformers 4.x names
    r = get(name, dict, {}, nullable=True)
    rope.update(r)
    origin.update({k: name for k in r})
    last = name if r else last
  rope_get = lambda key, kind, default=REQUIRED: field(
      rope, key, where, kind, default, ".".join(filter(None, (section, origin.get(key, last)))))
  theta = get("rope_theta", float) if "rope_theta" in c else rope_get("rope_theta", float, 10000.0)
  rope_type = rope_get("rope_type", str, None) or rope_get("type", str, "default")
  fields = dict(dim=dim, layers=get("num_hidden_layers", int), heads=heads,
                kv_heads=get("num_key_value_heads", int, heads, nullable=True),
                mlp_dim=get("intermediate_size", int), rope_theta=theta,
                vocab_size=get("vocab_size", int), norm_eps=get("rms_norm_eps", float, 1e-6),
                qkv_bias=kind == "qwen2",
                tie_embeddings=get("tie_word_embeddings", bool, field(
                    src.config, "tie_word_embeddings", where, bool, False)))
  if rope_type == "llama3":
    fields.update(rope_scaling="llama3", rope_factor=rope_get("factor", float),
                  rope_low_freq_factor=rope_get("low_freq_factor", float),
                  rope_high_freq_factor=rope_get("high_freq_factor", float),
                  rope_original_positions=rope_get("original_max_position_embeddings", int))
  elif rope_type != "default":
    raise HFError(f"{where}: RoPE type {rope_type!r} is not supported (default, llama3).")
  return fields


def feature_layers(src: Source) -> int:
  """Tower layers whose output is the features: all of a lone tower; LLaVA's
  `vision_feature_layer` (hidden_states[k], k = 0 the embeddings) counted from the end if < 0."""
  layers = _reader(src, "vision_config")("num_hidden_layers", int)
  if src.kind != "llava":
    return layers
  where = src.path / "config.json"
  k = src.config.get("vision_feature_layer", -2)
  if isinstance(k, list):
    raise HFError(f"{where}: vision_feature_layer {k!r} (several layers) is not supported; one "
                  "layer index is.")
  if not isinstance(k, int) or isinstance(k, bool):
    raise HFError(f"{where}: field vision_feature_layer is {json.dumps(k)}; set it to a layer "
                  "index (an integer; -1 the last layer).")
  used = k if k >= 0 else layers + 1 + k
  if not 1 <= used <= layers:
    raise HFError(f"{where}: vision_feature_layer {k} is outside the tower's "
                  f"{layers} layers.")
  return used


def _pixel_stats(pre, channels: int) -> dict:
  """pixel_mean and pixel_std from preprocessor_config.json's image_mean and image_std (a number
  stands for every channel), if it has both."""
  p, where = _json(pre), str(pre)
  if "image_mean" not in p or "image_std" not in p:
    return {}
  out = {}
  for key, ours in (("image_mean", "pixel_mean"), ("image_std", "pixel_std")):
    value = p[key]
    values = value if isinstance(value, list) else [value] * channels
    if len(values) != channels:
      raise HFError(f"{where}: field {key} has {len(values)} values for the tower's {channels} "
                    "channels; give one a channel.")
    numbers = [field({key: x}, key, where, float) for x in values]
    out[ours] = ",".join(repr(x) for x in numbers)
  return out


def vision_fields(src: Source) -> dict:
  """model.vision fields from config.json (a tower, or a LLaVA's vision_config) and
  preprocessor_config.json (pixel mean and std) if present."""
  where, get = str(src.path / "config.json"), _reader(src, "vision_config")
  model_type = get("model_type", str, "")
  kind = VISION_TYPES.get(model_type)
  if kind is None:
    raise HFError(f"{where}: vision model_type {model_type!r} is not supported; "
                  "supported: siglip_vision_model, clip_vision_model.")
  act = get("hidden_act", str, "gelu_pytorch_tanh" if kind == "siglip" else "quick_gelu")
  if act not in ACTIVATIONS:
    raise HFError(f"{where}: vision hidden_act {act!r} is not supported "
                  f"({', '.join(ACTIVATIONS)}).")
  # A side that is no multiple of the patch (SigLIP-so400m: 384 with patches of 14) loses its
  # last pixels to HF's strided convolution: the same as cropping it to the patches (378).
  patch = get("patch_size", int)
  fields = dict(image_size=get("image_size", int) // patch * patch, patch_size=patch,
                channels=get("num_channels", int, 3), dim=get("hidden_size", int),
                layers=feature_layers(src), heads=get("num_attention_heads", int),
                mlp_dim=get("intermediate_size", int), downsample=1,
                class_token=kind == "clip", patch_bias=kind == "siglip",
                pre_norm=kind == "clip", final_norm=kind == "siglip" and src.kind != "llava",
                norm_eps=get("layer_norm_eps", float, 1e-6 if kind == "siglip" else 1e-5),
                activation=ACTIVATIONS[act], position_resize="bicubic")
  if src.kind == "llava":
    top = lambda key, kind, default: field(src.config, key, where, kind, default)
    strategy = top("vision_feature_select_strategy", str, "default")
    if (kind, strategy) not in (("clip", "default"), ("siglip", "full")):
      raise HFError(f"{where}: vision_feature_select_strategy {strategy!r} with a {kind} tower "
                    "is not supported (clip: default, dropping the class token; siglip: full).")
    act = top("projector_hidden_act", str, "gelu")
    if act not in ACTIVATIONS or not top("multimodal_projector_bias", bool, True):
      raise HFError(f"{where}: the projector (projector_hidden_act {act!r}, "
                    "multimodal_projector_bias) is not supported: gelu with biases is.")
    fields.update(projector_activation=ACTIVATIONS[act],
                  projector_hidden=_reader(src, "text_config")("hidden_size", int))
  pre = src.path / "preprocessor_config.json"
  if pre.exists():
    fields.update(_pixel_stats(pre, fields["channels"]))
  return fields


def fields(src: Source, module: str) -> dict:
  """model.<module> fields from the directory; a lone tower leaves the projector to the config."""
  if module == "language":
    return language_fields(src)
  out = vision_fields(src)
  if src.kind != "llava":
    out.pop("projector_hidden", None)
  return out


def configure(cfg, src: Source) -> None:
  """Sets the fields of every module the directory holds in `cfg`."""
  for module in src.modules:
    for k, v in fields(src, module).items():
      setattr(cfg.model.module(module), k, v)


def check_fields(src: Source, module: str, fields: dict, section) -> list[str]:
  """The fields of config section `section` (model.<module>) that contradict `fields`."""
  def same(k, ours, theirs):
    if k in ("pixel_mean", "pixel_std"):  # lists of numbers, however written
      try:
        return [float(x) for x in str(ours).split(",") if x.strip()] == [
            float(x) for x in theirs.split(",")]
      except ValueError:
        return False
    if k == "final_norm" and src.kind != "llava" and not ours:
      return True  # a lone tower read without its post-layernorm, as LLaVA reads one
    return ours == theirs
  return [f"model.{module}.{k}={getattr(section, k)!r} (the checkpoint has {v!r})"
          for k, v in fields.items() if not same(k, getattr(section, k), v)]
