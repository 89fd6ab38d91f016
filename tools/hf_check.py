"""`python -m tools.hf check --hf DIR`: transformers and mimo_jax on the same random inputs.

Loads DIR with transformers' own class (torch, on the CPU) and with mimo_jax.hf, runs random
token ids (language models), random pixels (towers), random log-mel windows (Whisper encoders) or
both (LLaVA, one image a sample; Qwen2-Audio, a full and a part window) through both, and prints the largest absolute and relative (to the largest reference value) differences
of the logits or hidden states. In float32 they agree to about 1e-5 relative; bfloat16 runs both
sides in bfloat16 (compute), so expect about 1e-2.
"""

from __future__ import annotations

import jax
import numpy as np

from mimo_jax import hf
from mimo_jax.config import Config, ConfigError
from mimo_jax.encoders.audio import AudioConfig
from mimo_jax.encoders.vision import VisionConfig
from mimo_jax import modules
from mimo_jax import whole
from mimo_jax.encoders import audio as audio_encoder
from mimo_jax.encoders import vision as vision_encoder

BATCH, SEQ = 2, 16


def _config(src: hf.Source, dtype: str) -> Config:
  cfg = Config()
  cfg.add_encoder("vision", VisionConfig())
  cfg.add_encoder("audio", AudioConfig())
  cfg.model.dtype = dtype
  cfg.model.language.vocab_size = 32  # a lone tower's (unused) language model
  hf.configure(cfg, src)
  return cfg


def _report(what: str, ours, theirs) -> tuple[float, float]:
  ours, theirs = np.asarray(ours, np.float32), np.asarray(theirs, np.float32)
  err = float(np.abs(ours - theirs).max())
  rel = err / float(np.abs(theirs).max())
  print(f"{what} {tuple(theirs.shape)}: max abs difference {err:.3g}, relative {rel:.3g}")
  return err, rel


def check(path: str, dtype: str = "float32") -> tuple[float, float]:
  src = hf.Source.open(path)  # a bad directory is named before anything else
  # pylint: disable=import-outside-toplevel
  try:
    import torch
    import transformers
  except ImportError:
    raise ConfigError("check needs torch and transformers, which are not installed: "
                      "pip install -e '.[hf]'") from None
  cfg = _config(src, dtype)
  init = lambda name: modules.build_modules(cfg)[name].init(0)  # what the checkpoint lacks
  torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
  arch = src.config.get("architectures", [None])[0] or {
      "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "siglip": "SiglipVisionModel",
      "clip": "CLIPVisionModel", "llava": "LlavaForConditionalGeneration"}[src.kind]
  model = getattr(transformers, arch).from_pretrained(path, dtype=torch_dtype).eval()
  print(f"{path}: {arch} ({src.kind}), {dtype}")
  rng = np.random.default_rng(0)
  v = cfg.model.vision
  pixels = rng.random((BATCH, v.image_size, v.image_size, v.channels), dtype=np.float32)
  norm = v.pixel_norm() or ((0.0,) * v.channels, (1.0,) * v.channels)
  mean, std = (torch.tensor(x, dtype=torch.float32).reshape(1, -1, 1, 1) for x in norm)
  torch_pixels = ((torch.from_numpy(pixels).permute(0, 3, 1, 2) - mean) / std).to(torch_dtype)
  # float32 as written: XLA would otherwise run float32 matmuls on GPUs in TF32.
  precision = "highest" if dtype == "float32" else "default"
  with torch.no_grad(), jax.default_matmul_precision(precision):
    if src.kind in ("siglip", "clip"):
      theirs = model(pixel_values=torch_pixels).last_hidden_state.float().numpy()
      params = hf.load(src, "vision", cfg, init("vision"))
      ours = vision_encoder.hidden_states(cfg, params, pixels)
      if v.final_norm:
        ours = modules.build_modules(cfg)["vision"].bind(params).norm(ours)
      return _report("last_hidden_state", ours, theirs)
    if src.kind in ("whisper", "qwen2_audio"):
      return _audio(src, cfg, model, rng, torch_dtype, init)
    vocab = cfg.model.language.vocab_size
    if src.kind == "llava":
      token = src.config["image_token_index"]
      ids = rng.integers(0, vocab, (BATCH, SEQ + v.tokens_per_image))
      ids[ids == token] = (token + 1) % vocab
      ids[:, 1:1 + v.tokens_per_image] = token
      theirs = model(input_ids=torch.from_numpy(ids),
                     pixel_values=torch_pixels).logits.float().numpy()
      tokens = vision_encoder.image_tokens(cfg, hf.load(src, "vision", cfg, init("vision")), pixels)
      ours = whole.merged_logits(cfg, hf.load(src, "language", cfg, init("language")), ids, tokens,
                                 token)
    else:
      ids = rng.integers(0, vocab, (BATCH, SEQ))
      theirs = model(input_ids=torch.from_numpy(ids)).logits.float().numpy()
      ours = whole.language_logits(cfg, hf.load(src, "language", cfg, init("language")), ids)
  return _report("logits", ours, theirs)


def _audio(src: hf.Source, cfg: Config, model, rng, torch_dtype, init) -> tuple[float, float]:
  """A Whisper encoder's hidden states on full windows, or Qwen2-Audio's logits for a full and a
  part window (padding masked), each clip's tokens in a row of text."""
  import torch  # pylint: disable=import-outside-toplevel
  a = cfg.model.audio
  mel = rng.standard_normal((BATCH, a.frames, a.mel_bins)).astype(np.float32)
  torch_mel = torch.from_numpy(mel.transpose(0, 2, 1).copy()).to(torch_dtype)
  params = hf.load(src, "audio", cfg, init("audio"))
  if src.kind == "whisper":
    theirs = model.get_encoder()(torch_mel).last_hidden_state.float().numpy()
    return _report("last_hidden_state", audio_encoder.hidden_states(cfg, params, mel), theirs)
  frames = np.asarray([a.frames, a.frames // 2 + 1][:BATCH])
  kept = [a.window_tokens(int(f)) for f in frames]
  token, vocab = src.config["audio_token_index"], cfg.model.language.vocab_size
  ids = rng.integers(0, vocab, (BATCH, SEQ + max(kept)))
  ids[ids == token] = (token + 1) % vocab
  ids[0, 1:1 + kept[0]] = token
  ids[1, 1:1 + kept[1]] = token
  ids[1, 1 + kept[1]:1 + kept[0]] = (token + 1) % vocab
  feature_mask = torch.from_numpy((np.arange(a.frames)[None] < frames[:, None]).astype(np.int64))
  theirs = model(input_ids=torch.from_numpy(ids), input_features=torch_mel,
                 feature_attention_mask=feature_mask).logits.float().numpy()
  tokens = audio_encoder.audio_tokens(cfg, params, mel, frames)
  ours = whole.merged_logits(cfg, hf.load(src, "language", cfg, init("language")), ids, tokens,
                             token)
  return _report("logits", ours, theirs)
