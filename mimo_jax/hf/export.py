"""Our checkpoints as Hugging Face directories: config.json of transformers' own classes
(LlavaForConditionalGeneration, SiglipVisionModel / CLIPVisionModel, LlamaForCausalLM /
Qwen2ForCausalLM) and their tensors, named as save_pretrained names them, from the tables of
mimo_jax/hf/tensors.py (tools/hf.py export writes them)."""

from __future__ import annotations

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
