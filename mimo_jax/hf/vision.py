"""The vision encoder's HF mapping (mapping.py): SigLIP and CLIP towers (SiglipVisionModel,
CLIPVisionModel, or the vision half of SiglipModel / CLIPModel) and LLaVA checkpoints
(LlavaForConditionalGeneration: a tower, its projector and a language model) <-> model.vision:
its config fields (config.json, and preprocessor_config.json's pixel mean and std), its tensor
table, and the files of an export (the tower's config.json, LLaVA's, the image processor's
preprocessor_config.json and LlavaProcessor's processor_config.json)."""

from __future__ import annotations

import json

import numpy as np

from mimo_jax.hf.export import ACTIVATION_NAMES, language_config_json
from mimo_jax.hf.fields import reader
from mimo_jax.hf.mapping import Mapping
from mimo_jax.hf.source import ACTIVATIONS, HFError, Source, _json, field
from mimo_jax.hf.tensors import Tensor

TYPES = {"siglip_vision_model": "siglip", "siglip": "siglip",
         "clip_vision_model": "clip", "clip": "clip"}  # config.json model_type -> the tower
SECTION = "vision_config"  # LLaVA's config.json section of the tower
# Name prefixes of each part, most specific first (transformers 4.x and 5.x, each model class).
PREFIXES = {
    "vision": ("model.vision_tower.vision_model.", "vision_tower.vision_model.",
               "model.vision_tower.", "vision_tower.", "vision_model.", ""),
    "projector": ("model.multi_modal_projector.", "multi_modal_projector."),
}
# Names the export writes: those transformers' save_pretrained writes for each class.
NAMES = {
    "alone": {"vision": ""},
    "combined": {"vision": "vision_tower.", "projector": "multi_modal_projector.",
                 "language": "language_model.model.", "head": "language_model.lm_head.weight"},
}
# PEFT's module paths: the tower's own class as save_pretrained names it, LLaVA's parts under
# `model.` (transformers 5's LlavaForConditionalGeneration).
PEFT = {
    "alone": {"vision": ""},
    "combined": {"vision": "model.vision_tower.", "language": "model.language_model.",
                 "projector": "model.multi_modal_projector."},
}


def feature_layers(src: Source) -> int:
  """Tower layers whose output is the features: all of a lone tower; LLaVA's
  `vision_feature_layer` (hidden_states[k], k = 0 the embeddings) counted from the end if < 0."""
  layers = reader(src, SECTION)("num_hidden_layers", int)
  if not src.combined:
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


def _projector_fields(src: Source, kind: str) -> dict:
  """LLaVA's projector fields (and its checks of how the tower's features are taken)."""
  where = str(src.path / "config.json")
  top = lambda key, kind, default: field(src.config, key, where, kind, default)
  strategy = top("vision_feature_select_strategy", str, "default")
  if (kind, strategy) not in (("clip", "default"), ("siglip", "full")):
    raise HFError(f"{where}: vision_feature_select_strategy {strategy!r} with a {kind} tower "
                  "is not supported (clip: default, dropping the class token; siglip: full).")
  act = top("projector_hidden_act", str, "gelu")
  if act not in ACTIVATIONS or not top("multimodal_projector_bias", bool, True):
    raise HFError(f"{where}: the projector (projector_hidden_act {act!r}, "
                  "multimodal_projector_bias) is not supported: gelu with biases is.")
  return dict(projector_activation=ACTIVATIONS[act],
              projector_hidden=reader(src, "text_config")("hidden_size", int))


def fields(src: Source) -> dict:
  """model.vision fields from config.json (a tower, or a LLaVA's vision_config) and
  preprocessor_config.json (pixel mean and std) if present; a lone tower leaves the projector
  to the config."""
  where, get = str(src.path / "config.json"), reader(src, SECTION)
  model_type = get("model_type", str, "")
  kind = TYPES.get(model_type)
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
  out = dict(image_size=get("image_size", int) // patch * patch, patch_size=patch,
             channels=get("num_channels", int, 3), dim=get("hidden_size", int),
             layers=feature_layers(src), heads=get("num_attention_heads", int),
             mlp_dim=get("intermediate_size", int), downsample=1,
             class_token=kind == "clip", patch_bias=kind == "siglip",
             pre_norm=kind == "clip", final_norm=kind == "siglip" and not src.combined,
             norm_eps=get("layer_norm_eps", float, 1e-6 if kind == "siglip" else 1e-5),
             activation=ACTIVATIONS[act], position_resize="bicubic")
  if src.combined:
    out.update(_projector_fields(src, kind))
  pre = src.path / "preprocessor_config.json"
  if pre.exists():
    out.update(_pixel_stats(pre, out["channels"]))
  return out


def agrees(src: Source, key: str, ours, theirs) -> bool:
  """Whether model.vision's `key` agrees with the checkpoint's: pixel statistics as numbers,
  however written; a lone tower read without its post-layernorm, as LLaVA reads one."""
  if key in ("pixel_mean", "pixel_std"):
    try:
      return [float(x) for x in str(ours).split(",") if x.strip()] == [
          float(x) for x in theirs.split(",")]
    except ValueError:
      return False
  if key == "final_norm" and not src.combined and not ours:
    return True
  return ours == theirs


def tensors(v, projector_out: int | None = None) -> list[Tensor]:
  """Our vision parameters (a models/vit.ViTConfig `v`) and their HF tensors: the tower, and with
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


def extra_tensors(v) -> dict[str, np.ndarray]:
  """The HF classes have a post_layernorm: an identity where we have none."""
  if v.final_norm:
    return {}
  return {"post_layernorm.weight": np.ones((v.dim,), np.float32),
          "post_layernorm.bias": np.zeros((v.dim,), np.float32)}


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


def llava_config_json(cfg, image_token: int, context: int | None = None) -> dict:
  """config.json of a LlavaForConditionalGeneration: the tower's and the language model's
  (export.language_config_json; `context` its max_position_embeddings) configs inside."""
  v, lm = cfg.model.vision, cfg.model.language
  if v.final_norm:
    raise HFError("model.vision.final_norm=true: LLaVA reads the tower's hidden states without "
                  "a final norm, so this model is not a LlavaForConditionalGeneration; export "
                  "the modules alone (--module vision, --module language), or import the tower "
                  "beside its language model (tools.hf import --hf TOWER --hf LM), which leaves "
                  "the norm off.")
  if v.projector_hidden != lm.dim:
    raise HFError(f"model.vision.projector_hidden={v.projector_hidden}: LLaVA's projector is "
                  f"as wide as the language model ({lm.dim}); export the modules alone.")
  vision, text = vision_config_json(v), language_config_json(lm, context)
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


RESAMPLE_BICUBIC = 3  # PIL's code, as preprocessor_config.json writes it


def processor_output(p: dict) -> tuple[int, int] | None:
  """(height, width) of the images an image processor config (with its crop fields explicit)
  makes, or None when they keep their aspect ratio (a shortest-edge resize without a crop)."""
  if p.get("do_center_crop") and "height" in p.get("crop_size", {}):
    return p["crop_size"]["height"], p["crop_size"]["width"]
  size = p.get("size", {})
  if p.get("do_resize", True) and "height" in size and "width" in size:
    return size["height"], size["width"]
  return None


# Whether each class crops when its config does not say (transformers' defaults).
CROPS = {"CLIPImageProcessor": True, "LlavaImageProcessor": True, "SiglipImageProcessor": False}


def preprocessor_json(v, base: dict | None = None, pad_to_square: bool = False,
                      where: str = "") -> dict:
  """preprocessor_config.json of the tower's image processor: `base` (the config of the processor
  the run's images were prepared with, from `where`) or else the tower's own class
  (CLIPImageProcessor: shortest edge and center crop; SiglipImageProcessor: a square resize;
  bicubic), with the model's pixel mean and std. With `pad_to_square` (data converted with
  --pad_to_square) it is LlavaImageProcessor with do_pad: transformers pads to a square of the
  mean colour before resizing, as the conversion did."""
  size = v.image_size
  if base is None:
    clip = v.class_token
    out = {"image_processor_type": "CLIPImageProcessor" if clip else "SiglipImageProcessor",
           "do_resize": True, "resample": RESAMPLE_BICUBIC,
           "size": {"shortest_edge": size} if clip else {"height": size, "width": size},
           "do_center_crop": clip, "do_rescale": True, "rescale_factor": 1 / 255}
    if clip:
      out["crop_size"] = {"height": size, "width": size}
  else:
    out = {k: x for k, x in base.items() if k != "processor_class"}
    kind = str(out.get("image_processor_type", "")).removesuffix("Fast").removesuffix("Pil")
    out["do_center_crop"] = bool(out.get("do_center_crop", CROPS.get(kind, False)))
    if not out["do_center_crop"]:
      out.pop("crop_size", None)
    made = processor_output(out)
    if made != (size, size):
      raise HFError(f"{where}: the image processor makes "
                    f"{'x'.join(map(str, made)) if made else 'images of any aspect ratio'} "
                    f"where the tower reads {size}x{size}; no LLaVA processor reproduces the "
                    "run's images.")
  norm = v.pixel_norm()
  out["do_normalize"] = norm is not None
  if norm is not None:
    out["image_mean"], out["image_std"] = list(norm[0]), list(norm[1])
  out["do_convert_rgb"] = v.channels == 3
  if pad_to_square:
    out.update(image_processor_type="LlavaImageProcessor", do_pad=True)
  return dict(sorted(out.items()))


def llava_processor_json(v, image_token: str) -> dict:
  """processor_config.json of a LlavaProcessor: each `image_token` of a text becomes the tower's
  image tokens ((size / patch)^2, CLIP's class token dropped by the "default" strategy)."""
  return {"processor_class": "LlavaProcessor", "image_token": image_token,
          "patch_size": v.patch_size,
          "vision_feature_select_strategy": "default" if v.class_token else "full",
          "num_additional_image_tokens": int(v.class_token)}


MAPPING = Mapping(name="vision", types=TYPES, combined="llava", prefixes=PREFIXES, names=NAMES,
                  fields=fields, tensors=tensors, extra_tensors=extra_tensors, agrees=agrees,
                  peft=PEFT)
