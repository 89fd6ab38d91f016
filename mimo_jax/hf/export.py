"""Our checkpoints as Hugging Face directories: config.json of transformers' own classes
(LlavaForConditionalGeneration, SiglipVisionModel / CLIPVisionModel, LlamaForCausalLM /
Qwen2ForCausalLM) and their tensors, named as save_pretrained names them, from the tables of
mimo_jax/hf/tensors.py; the image processor's preprocessor_config.json, LlavaProcessor's
processor_config.json, the tokenizer's files and generation_config.json beside them, so that
transformers' Auto classes load the directory as a model with its processor (tools/hf.py export
writes them)."""

from __future__ import annotations

import json
import pathlib
from typing import Iterator

import numpy as np

from mimo_jax.hf.source import HFError
from mimo_jax.hf.tensors import Tensor, flatten, language_tensors, vision_tensors


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


def language_config_json(lm, context: int | None = None) -> dict:
  """config.json of a LlamaForCausalLM (or Qwen2ForCausalLM with q, k, v biases); `context` is
  max_position_embeddings (the source model's; our config has no field for it)."""
  kind = "qwen2" if lm.qkv_bias else "llama"
  out = {"architectures": ["Qwen2ForCausalLM" if lm.qkv_bias else "LlamaForCausalLM"],
         "model_type": kind, "hidden_size": lm.dim, "intermediate_size": lm.mlp_dim,
         "num_hidden_layers": lm.layers, "num_attention_heads": lm.heads,
         "num_key_value_heads": lm.kv_heads, "head_dim": lm.dim // lm.heads,
         "vocab_size": lm.vocab_size, "rms_norm_eps": lm.norm_eps, "hidden_act": "silu",
         "max_position_embeddings": context or max(lm.rope_original_positions, 8192),
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


def llava_config_json(cfg, image_token: int, context: int | None = None) -> dict:
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


# A tokenizer directory's files as save_pretrained writes them (fast and slow tokenizers).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "chat_template.jinja", "chat_template.json",
                   "tokenizer.model", "vocab.json", "merges.txt")


class Tokenizer:
  """A tokenizer directory as the export copies it: its files, special tokens and vocabulary."""

  def __init__(self, path: str | pathlib.Path):
    self.path = pathlib.Path(path)
    self.files = [self.path / f for f in TOKENIZER_FILES if (self.path / f).is_file()]
    if not (self.path / "tokenizer.json").is_file():
      raise HFError(f"{self.path}: no tokenizer.json; pass --tokenizer DIR, a directory with the "
                    "tokenizer's files as save_pretrained writes them.")
    import tokenizers  # pylint: disable=import-outside-toplevel
    try:
      self.tokenizer = tokenizers.Tokenizer.from_file(str(self.path / "tokenizer.json"))
    except Exception as e:  # pylint: disable=broad-except
      raise HFError(f"{self.path / 'tokenizer.json'}: not a tokenizers file ({e}).") from None
    config_file = self.path / "tokenizer_config.json"
    try:
      self.config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    except ValueError as e:
      raise HFError(f"{config_file}: not JSON ({e}).") from None

  def special(self, key: str) -> int | None:
    """The id of tokenizer_config.json's `key` (bos_token, eos_token, pad_token), if any."""
    text = self.config.get(key)
    text = text.get("content") if isinstance(text, dict) else text
    return None if text is None else self.tokenizer.token_to_id(text)

  @property
  def vocab_size(self) -> int:
    return self.tokenizer.get_vocab_size()

  def config_json(self, processor: str | None) -> dict:
    """tokenizer_config.json as the export writes it: naming the processor class, if any."""
    out = {k: x for k, x in self.config.items() if k != "processor_class"}
    if processor:
      out["processor_class"] = processor
    return out


def generation_json(tok: Tokenizer) -> dict:
  """generation_config.json with the tokenizer's bos, eos and pad tokens: the tokenizer
  directory's own generation_config.json (sampling defaults, further eos ids) with the
  tokenizer's tokens put in; eos lists the tokenizer's first; pad defaults to the eos."""
  out: dict = {}
  own = tok.path / "generation_config.json"
  if own.is_file():
    try:
      out = {k: x for k, x in json.loads(own.read_text()).items() if k != "transformers_version"}
    except ValueError as e:
      raise HFError(f"{own}: not JSON ({e}).") from None
  bos, eos, pad = tok.special("bos_token"), tok.special("eos_token"), tok.special("pad_token")
  if bos is not None:
    out["bos_token_id"] = bos
  if eos is not None:
    listed = out.get("eos_token_id")
    listed = [] if listed is None else listed if isinstance(listed, list) else [listed]
    out["eos_token_id"] = [eos] + [i for i in listed if i != eos]
  if pad is not None:
    out["pad_token_id"] = pad
  elif out.get("pad_token_id") is None and out.get("eos_token_id"):
    out["pad_token_id"] = out["eos_token_id"][0]
  return out


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
    flat = dict(flatten(params[module]))
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
