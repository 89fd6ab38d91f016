"""The audio encoder's HF mapping (mapping.py): Whisper encoders (WhisperModel or
WhisperForConditionalGeneration: the encoder is read, the decoder left) and
Qwen2AudioForConditionalGeneration (its audio tower, linear projector and Qwen2 language model)
<-> model.audio: its config fields, its tensor table and the files of a Whisper export
(config.json, the feature extractor's preprocessor_config.json) and of a Qwen2-Audio export
(its config.json and Qwen2AudioProcessor's processor_config.json)."""

from __future__ import annotations

import json

from mimo_jax.hf.export import ACTIVATION_NAMES, language_config_json
from mimo_jax.hf.fields import reader
from mimo_jax.hf.mapping import Mapping
from mimo_jax.hf.source import ACTIVATIONS, HFError, Source, field
from mimo_jax.hf.tensors import Tensor

TYPES = {"whisper": "whisper"}  # config.json model_type -> the tower
COMBINED = "qwen2_audio"
SECTION = "audio_config"  # Qwen2-Audio's config.json section of the tower
PREFIXES = {
    "audio": ("model.audio_tower.", "audio_tower.", "model.encoder.", "encoder."),
    "projector": ("model.multi_modal_projector.", "multi_modal_projector."),
}
NAMES = {
    "alone": {"audio": "encoder."},  # WhisperModel's
    "combined": {"audio": "audio_tower.", "projector": "multi_modal_projector.",
                 "language": "language_model.model.", "head": "language_model.lm_head.weight"},
}


def fields(src: Source) -> dict:
  """model.audio fields from config.json (a Whisper model, or Qwen2-Audio's audio_config)."""
  where, get = str(src.path / "config.json"), reader(src, SECTION)
  model_type = get("model_type", str, "")
  expected = "qwen2_audio_encoder" if src.combined else "whisper"
  if model_type != expected:
    raise HFError(f"{where}: audio model_type {model_type!r} is not supported here; expected "
                  f"{expected!r}.")
  act = get("activation_function", str, "gelu")
  if act not in ACTIVATIONS:
    raise HFError(f"{where}: activation_function {act!r} is not supported "
                  f"({', '.join(ACTIVATIONS)}).")
  if get("scale_embedding", bool, False):
    raise HFError(f"{where}: scale_embedding=true is not supported (the encoder never scales).")
  out = dict(mel_bins=get("num_mel_bins", int), positions=get("max_source_positions", int),
             dim=get("d_model", int), layers=get("encoder_layers", int),
             heads=get("encoder_attention_heads", int), mlp_dim=get("encoder_ffn_dim", int),
             norm_eps=1e-5, activation=ACTIVATIONS[act])
  if src.combined:  # Qwen2-Audio: pooled by 2, padding masked, a linear projector
    token = field(src.config, "audio_token_index", where, int, 151646)
    out.update(pool=2, mask_padding=True, projector="linear", audio_token=token)
  else:
    out.update(pool=1, mask_padding=False)
  return out


def tensors(a, projector_out: int | None = None) -> list[Tensor]:
  """Our audio parameters (a models/whisper.WhisperConfig `a`) and their HF tensors: the tower,
  and with `projector_out` (the language width) Qwen2-Audio's linear projector."""
  d, f, m, L = a.dim, a.mlp_dim, a.mel_bins, a.layers
  one = lambda path, name, shape, how="copy": Tensor(path, "audio", name, shape, how)
  block = lambda path, name, shape, how="copy": Tensor(("blocks",) + path, "audio",
                                                       "layers.{i}." + name, shape, how, L)
  out = [one(("conv1", "kernel"), "conv1.weight", (d, m, 3), "conv1d"),
         one(("conv1", "bias"), "conv1.bias", (d,)),
         one(("conv2", "kernel"), "conv2.weight", (d, d, 3), "conv1d"),
         one(("conv2", "bias"), "conv2.bias", (d,)),
         one(("pos",), "embed_positions.weight", (a.positions, d))]
  for ours, theirs in (("norm1", "self_attn_layer_norm"), ("norm2", "final_layer_norm")):
    out += [block((ours, "scale"), f"{theirs}.weight", (d,)),
            block((ours, "bias"), f"{theirs}.bias", (d,))]
  for n, theirs in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("o", "out_proj")):
    out.append(block(("attn", n, "kernel"), f"self_attn.{theirs}.weight", (d, d), "T"))
    if n != "k":
      out.append(block(("attn", n, "bias"), f"self_attn.{theirs}.bias", (d,)))
  out += [block(("mlp", "up", "kernel"), "fc1.weight", (f, d), "T"),
          block(("mlp", "up", "bias"), "fc1.bias", (f,)),
          block(("mlp", "down", "kernel"), "fc2.weight", (d, f), "T"),
          block(("mlp", "down", "bias"), "fc2.bias", (d,)),
          one(("norm", "scale"), "layer_norm.weight", (d,)),
          one(("norm", "bias"), "layer_norm.bias", (d,))]
  if projector_out is not None:
    if a.projector != "linear":
      raise HFError(f"model.audio.projector={a.projector!r}: Qwen2-Audio's projector is linear.")
    out += [Tensor(("projector", "kernel"), "projector", "linear.weight", (projector_out, d), "T"),
            Tensor(("projector", "bias"), "projector", "linear.bias", (projector_out,))]
  return out


def _encoder_json(a) -> dict:
  return {"num_mel_bins": a.mel_bins, "max_source_positions": a.positions, "d_model": a.dim,
          "encoder_layers": a.layers, "encoder_attention_heads": a.heads,
          "encoder_ffn_dim": a.mlp_dim, "activation_function": ACTIVATION_NAMES[a.activation],
          "scale_embedding": False}


def _fits(a, needs: dict, holder: str, instead: str) -> None:
  """HFError naming each field of model.audio `a` whose value `holder` has no place for, with
  the value it needs, and `instead`: what can be exported."""
  differ = [f"model.audio.{k} is {json.dumps(getattr(a, k))}, {holder} needs {json.dumps(v)}"
            for k, v in needs.items() if getattr(a, k) != v]
  if differ:
    raise HFError(f"{'; '.join(differ)}: no {holder} holds this audio tower; {instead}.")


def whisper_config_json(a) -> dict:
  """config.json of a WhisperModel holding this encoder (its decoder is not ours: transformers
  initialises it when loading; only the encoder is meant to be read)."""
  _fits(a, {"pool": 1, "mask_padding": False, "norm_eps": 1e-5}, "WhisperModel",
        "a tower of Qwen2-Audio's shape is exported with its language model (no --module); "
        "--module language exports the language model alone")
  # The decoder (initialised by transformers) takes the encoder's shape, as Whisper's do.
  decoder = {"decoder_layers": a.layers, "decoder_attention_heads": a.heads,
             "decoder_ffn_dim": a.mlp_dim}
  return {"architectures": ["WhisperModel"], "model_type": "whisper", **_encoder_json(a),
          **decoder, "torch_dtype": "float32"}


def feature_extractor_json(a) -> dict | None:
  """preprocessor_config.json of the WhisperFeatureExtractor whose log-mel frames the encoder
  reads: 16 kHz, hops of 160 samples (100 frames a second), windows of `frames` frames; None
  when a window is no whole number of seconds (the extractor's chunk_length is whole seconds)."""
  if a.frames % 100:
    return None
  return {"feature_extractor_type": "WhisperFeatureExtractor", "feature_size": a.mel_bins,
          "sampling_rate": 16000, "hop_length": 160, "n_fft": 400,
          "chunk_length": a.frames // 100, "n_samples": a.frames * 160,
          "nb_max_frames": a.frames, "padding_side": "right", "padding_value": 0.0,
          "return_attention_mask": False}


def qwen2_audio_config_json(cfg, token: int, context: int | None = None) -> dict:
  """config.json of a Qwen2AudioForConditionalGeneration: the tower (pooled by 2, padding
  masked, a linear projector), the language model's config as text_config, `token` the audio
  placeholder's id; `context` the language model's max_position_embeddings."""
  a, lm = cfg.model.audio, cfg.model.language
  _fits(a, {"pool": 2, "mask_padding": True, "projector": "linear", "norm_eps": 1e-5},
        "Qwen2AudioForConditionalGeneration",
        "--module language exports the language model alone, --module audio a Whisper-shaped "
        "tower (pool 1, mask_padding false) alone")
  text = language_config_json(lm, context)
  text.pop("architectures")
  return {"architectures": ["Qwen2AudioForConditionalGeneration"], "model_type": COMBINED,
          "audio_config": {"model_type": "qwen2_audio_encoder", **_encoder_json(a)},
          "text_config": text, "audio_token_index": token, "torch_dtype": "float32"}


def qwen2_audio_processor_json(audio_token: str, bos: str | None, eos: str | None) -> dict:
  """processor_config.json of a Qwen2AudioProcessor: `audio_token` becomes each clip's tokens,
  between `bos` and `eos` in its chat template (the processor's defaults where None)."""
  out = {"processor_class": "Qwen2AudioProcessor", "audio_token": audio_token}
  out.update({k: v for k, v in (("audio_bos_token", bos), ("audio_eos_token", eos)) if v})
  return out


MAPPING = Mapping(name="audio", types=TYPES, combined=COMBINED, prefixes=PREFIXES, names=NAMES,
                  fields=fields, tensors=tensors)
