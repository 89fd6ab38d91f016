"""Tiny random Hugging Face checkpoints and their reference outputs, for the interop tests.

  python -m tools.hf_fixtures [--out tests/fixtures/hf]

Needs torch and transformers (`pip install -e '.[hf]'`); the tests that read the fixtures do not.
Each fixture is a directory as `save_pretrained` writes it (config.json, safetensors; one of them
sharded with an index) plus `reference.npz`: the inputs and transformers' float32 outputs on them
(logits of language models and LLaVA, with LLaVA's loss; `last_hidden_state` of vision towers,
also at image sizes off the position table's grid, `interpolate_pos_encoding=True`:
`pixels_HxW`, `last_hidden_state_HxW`); beside each LLaVA, `generate.npz`: transformers' greedy
`generate` for two left-padded prompts of different lengths with an image each (`--only generate`
writes just these, from the saved LLaVAs). Pixels are stored in [0, 1] (`pixels`, NHWC), each a byte
/ 255 as a run's loader makes them, with the mean and std transformers' inputs were normalised with. Rerun after changing a fixture; the whole set stays well under a megabyte.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
VOCAB, DIM, LAYERS, SEQ, BATCH = 64, 32, 2, 12, 2
IMAGE, PATCH, CHANNELS = 16, 4, 3
RESIZED = ((8, 12), (24, 20))  # a smaller, non-square grid and a larger one (grid 4 -> 2x3, 6x5)
SIGLIP_NORM = ([0.5, 0.5, 0.5], [0.5, 0.5, 0.5])
CLIP_NORM = ([0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711])


def _text(**kw) -> dict:
  return dict(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=48, num_hidden_layers=LAYERS,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, **kw)


def _vision(**kw) -> dict:
  return dict(hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2,
              image_size=IMAGE, patch_size=PATCH, num_channels=CHANNELS, **kw)


def _language_models():
  # pylint: disable=import-outside-toplevel
  from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
  llama31_rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 256}
  return {
      "llama3": lambda: LlamaForCausalLM(LlamaConfig(**_text(
          rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 500000.0}))),
      "llama31": lambda: LlamaForCausalLM(LlamaConfig(**_text(
          rms_norm_eps=1e-5, rope_parameters=llama31_rope))),
      "llama32_tied": lambda: LlamaForCausalLM(LlamaConfig(**_text(
          rms_norm_eps=1e-5, rope_parameters=llama31_rope, tie_word_embeddings=True))),
      "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**_text(
          rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
          tie_word_embeddings=False))),
  }


def _vision_towers():
  # pylint: disable=import-outside-toplevel
  from transformers import CLIPVisionConfig, CLIPVisionModel, SiglipVisionConfig, SiglipVisionModel
  return {
      "siglip": (lambda: SiglipVisionModel(SiglipVisionConfig(**_vision(vision_use_head=False))), SIGLIP_NORM),
      "clip": (lambda: CLIPVisionModel(CLIPVisionConfig(**_vision(hidden_act="quick_gelu"))),
               CLIP_NORM),
  }


def _llavas():
  # pylint: disable=import-outside-toplevel
  from transformers import (CLIPVisionConfig, LlamaConfig, LlavaConfig,
                            LlavaForConditionalGeneration, SiglipVisionConfig)
  text = LlamaConfig(**_text(rms_norm_eps=1e-5,
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0}))
  return {
      # LLaVA-1.5: CLIP read at layer -2 without its class token, GELU projector, Llama.
      "llava15": (lambda: LlavaForConditionalGeneration(LlavaConfig(
          vision_config=CLIPVisionConfig(**_vision(hidden_act="quick_gelu")), text_config=text,
          image_token_index=VOCAB - 1, vision_feature_layer=-2,
          vision_feature_select_strategy="default", projector_hidden_act="gelu")), CLIP_NORM),
      # A SigLIP-based LLaVA: the last layer's hidden states, every patch.
      "llava_siglip": (lambda: LlavaForConditionalGeneration(LlavaConfig(
          vision_config=SiglipVisionConfig(**_vision(vision_use_head=False)), text_config=text,
          image_token_index=VOCAB - 1, vision_feature_layer=-1,
          vision_feature_select_strategy="full", projector_hidden_act="gelu")), SIGLIP_NORM),
  }


def _pixels(rng, n: int, h: int = IMAGE, w: int = IMAGE) -> np.ndarray:
  return rng.integers(0, 256, (n, h, w, CHANNELS)).astype(np.float32) / np.float32(255)


def normalised(torch, pixels, norm):
  """Pixels [b, h, w, c] in [0, 1] as transformers' vision models take them: a float tensor
  [b, c, h, w] normalised by `norm` (mean, std per channel), made with the given `torch` module."""
  mean, std = (torch.tensor(v, dtype=torch.float32).reshape(1, -1, 1, 1) for v in norm)
  return (torch.from_numpy(pixels).permute(0, 3, 1, 2) - mean) / std


def _save(model, out: pathlib.Path, shard: bool = False) -> None:
  if out.exists():
    shutil.rmtree(out)
  # A small shard size makes transformers write several files and an index.
  model.save_pretrained(out, max_shard_size="40KB" if shard else "50GB")
  for junk in ("generation_config.json",):
    (out / junk).unlink(missing_ok=True)


def build(root: pathlib.Path) -> None:
  import torch  # pylint: disable=import-outside-toplevel
  torch.manual_seed(0)
  rng = np.random.default_rng(0)
  for name, make in _language_models().items():
    model = make().eval().to(torch.float32)
    ids = rng.integers(0, VOCAB, (BATCH, SEQ)).astype(np.int64)
    with torch.no_grad():
      logits = model(input_ids=torch.from_numpy(ids)).logits.numpy()
    _save(model, root / name, shard=name == "llama3")
    np.savez(root / name / "reference.npz", input_ids=ids, logits=logits)
    print(f"{name}: logits {logits.shape}")
  for name, (make, norm) in _vision_towers().items():
    model = make().eval()
    pixels = _pixels(rng, BATCH)
    with torch.no_grad():
      hidden = model(pixel_values=normalised(torch, pixels, norm)).last_hidden_state.numpy()
      resized = {}
      for h, w in RESIZED:
        px = _pixels(rng, BATCH, h, w)
        resized[f"pixels_{h}x{w}"] = px
        resized[f"last_hidden_state_{h}x{w}"] = model(
            pixel_values=normalised(torch, px, norm),
            interpolate_pos_encoding=True).last_hidden_state.numpy()
    _save(model, root / name)
    _preprocessor(root / name, norm)
    np.savez(root / name / "reference.npz", pixels=pixels, last_hidden_state=hidden, **resized)
    print(f"{name}: last_hidden_state {hidden.shape}, also at {RESIZED}")
  for name, (make, norm) in _llavas().items():
    model = make().eval()
    cfg = model.config
    tokens = (IMAGE // PATCH) ** 2
    # Text ids from 4 on: the same rows are laid out as training samples by the tests, whose image
    # placeholder is id 3 (pad, bos, eos and the placeholder are 0-3 in mimo_jax's layout).
    ids = rng.integers(4, VOCAB - 1, (BATCH, SEQ + tokens)).astype(np.int64)
    ids[:, 2:2 + tokens] = cfg.image_token_index  # one image a sample, after two text tokens
    labels = np.where(ids == cfg.image_token_index, -100, ids)
    labels[:, 2 + tokens:5 + tokens] = -100  # a prompt after the image without loss, as in training
    pixels = _pixels(rng, BATCH)
    with torch.no_grad():
      out = model(input_ids=torch.from_numpy(ids), labels=torch.from_numpy(labels),
                  pixel_values=normalised(torch, pixels, norm))
    _save(model, root / name)
    _preprocessor(root / name, norm)
    np.savez(root / name / "reference.npz", input_ids=ids, labels=labels, pixels=pixels,
             logits=out.logits.numpy(), loss=np.float32(out.loss.item()))
    print(f"{name}: logits {tuple(out.logits.shape)}, loss {out.loss.item():.6f}")
  total = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
  print(f"{root}: {total / 1e6:.2f} MB in all")


GENERATE = 10  # new tokens of the greedy generation references


def generations(root: pathlib.Path) -> None:
  """`generate.npz` beside each LLaVA fixture: transformers' greedy `generate` of GENERATE tokens
  (no end-of-sequence stop) for a batch of two prompts of different lengths, left-padded with an
  attention mask, one image each; read from the saved fixture, so the weights stay as they are."""
  import torch  # pylint: disable=import-outside-toplevel
  from transformers import LlavaForConditionalGeneration  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(1)
  norms = {"llava15": CLIP_NORM, "llava_siglip": SIGLIP_NORM}
  for name, norm in norms.items():
    model = LlavaForConditionalGeneration.from_pretrained(root / name).eval()
    image = model.config.image_token_index
    tokens = (IMAGE // PATCH) ** 2
    rows = [[*rng.integers(4, VOCAB - 1, 3), *[image] * tokens, *rng.integers(4, VOCAB - 1, 4)],
            [*rng.integers(4, VOCAB - 1, 1), *[image] * tokens, *rng.integers(4, VOCAB - 1, 2)]]
    width = max(map(len, rows))
    ids = np.zeros((len(rows), width), np.int64)
    mask = np.zeros((len(rows), width), np.int64)
    for r, row in enumerate(rows):
      ids[r, width - len(row):], mask[r, width - len(row):] = row, 1
    pixels = _pixels(rng, len(rows))
    with torch.no_grad():
      out = model.generate(input_ids=torch.from_numpy(ids),
                           attention_mask=torch.from_numpy(mask),
                           pixel_values=normalised(torch, pixels, norm), do_sample=False,
                           max_new_tokens=GENERATE, min_new_tokens=GENERATE, eos_token_id=None,
                           pad_token_id=0)
    generated = out.numpy()[:, width:]
    np.savez(root / name / "generate.npz", input_ids=ids, attention_mask=mask, pixels=pixels,
             generated=generated)
    print(f"{name}: generated {generated.tolist()}")


def _preprocessor(out: pathlib.Path, norm) -> None:
  """The two fields of an image processor's config that the import reads."""
  (out / "preprocessor_config.json").write_text(json.dumps(
      {"image_mean": norm[0], "image_std": norm[1]}, indent=2) + "\n")


def main() -> None:
  parser = argparse.ArgumentParser(prog="python -m tools.hf_fixtures",
                                   description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", default=str(ROOT / "tests" / "fixtures" / "hf"))
  parser.add_argument("--only", choices=("all", "generate"), default="all",
                      help="generate: only the generation references of the saved LLaVAs")
  args = parser.parse_args()
  root = pathlib.Path(args.out)
  root.mkdir(parents=True, exist_ok=True)
  if args.only == "all":
    build(root)
  generations(root)


if __name__ == "__main__":
  main()
