"""Our checkpoints as Hugging Face directories: the tensors of an export (the language model
alone, an encoder alone, or both as the encoder mapping's combined class), named as
save_pretrained names them, from the tables of tensors.py and each encoder's mapping; the
language model's config.json (LlamaForCausalLM / Qwen2ForCausalLM), the tokenizer's files and
generation_config.json beside them, so that transformers' Auto classes load the directory. An
encoder's own files (its config.json, its combined class's, its processor's) are its mapping
module's (tools/hf.py export writes them all)."""

from __future__ import annotations

import json
import pathlib
from typing import Iterator

import numpy as np

from mimo_jax.config import LANGUAGE, lora_of
from mimo_jax.hf import mapping
from mimo_jax.hf.source import HFError
from mimo_jax.hf.tensors import Tensor, flatten, language_tensors
from mimo_jax.models import lora


# The prefixes `export` writes before the names of a language model's parts when it is alone
# (transformers' save_pretrained of LlamaForCausalLM, Qwen2ForCausalLM; a head's is its name).
LANGUAGE_NAMES = {LANGUAGE: "model.", "head": "lm_head.weight"}
ACTIVATION_NAMES = {"gelu_tanh": "gelu_pytorch_tanh", "gelu": "gelu", "quick_gelu": "quick_gelu"}


def export_name(names: dict[str, str], t: Tensor, name: str) -> str:
  """`t`'s HF name `name` (one layer's) under the prefix `names` gives its part."""
  prefix = names[t.part]
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


def export_tensors(modules: tuple[str, ...], cfg,
                   params: dict[str, dict]) -> Iterator[tuple[str, np.ndarray]]:
  """(HF name, float32 array) of every tensor of an export of `modules` from our parameters by
  module (host arrays): ("language",), an encoder alone ((name,)), or an encoder with the
  language model ((name, "language"), its mapping's combined class with the projector)."""
  # A module with LoRA adapters is written merged (models/lora.merge): the plain model.
  params = {n: lora.merge(p, lora_of(cfg, n)) if n in modules and lora_of(cfg, n) else p
            for n, p in params.items()}
  encoder = next((n for n in modules if n != LANGUAGE), None)
  m = mapping.get(encoder) if encoder is not None else None
  combined = m is not None and LANGUAGE in modules
  names = LANGUAGE_NAMES if m is None else m.names["combined" if combined else "alone"]
  lm = cfg.model.language
  for module in modules:
    if module == LANGUAGE:
      specs, extra = language_tensors(lm), {}
    else:
      section = cfg.model.module(module)
      specs, extra = m.tensors(section, lm.dim if combined else None), m.extra_tensors(section)
    flat = dict(flatten(params[module]))
    for t in specs:
      x = np.asarray(flat[t.path], np.float32)
      for i, name in enumerate(t.names()):
        yield export_name(names, t, name), np.ascontiguousarray(
            t.to_theirs(x[i] if t.layers else x))
    for name, x in extra.items():
      yield names[module] + name, x
