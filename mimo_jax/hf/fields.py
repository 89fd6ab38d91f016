"""config.json -> our config fields (model.vision, model.language), and the fields of a config
that contradict a directory."""

from __future__ import annotations

from mimo_jax.hf.source import (ACTIVATIONS, LANGUAGE_TYPES, VISION_TYPES, HFError, Source,
                                _int, _json)


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
                activation=ACTIVATIONS[act], position_resize="bicubic")
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
