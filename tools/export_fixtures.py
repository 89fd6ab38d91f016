"""Tiny Hugging Face model directories, complete as a user downloads them, and transformers'
outputs on their exports, for the export tests and the two-stage recipe (tests/fixtures/recipe).

  python -m tools.export_fixtures [--out tests/fixtures/recipe] [--only models|references]

Needs torch and transformers (`pip install -e '.[hf]'`); the tests that read the fixtures do not.

- `llava/`: a LLaVA-1.5-style LlavaForConditionalGeneration (a CLIP tower read at layer -2
  without its class token, the GELU projector, a Llama-3.1-style language model with llama3 RoPE
  scaling and a context of 131072) with everything `save_pretrained` of the model and of its
  LlavaProcessor write: config.json, model.safetensors, generation_config.json, tokenizer.json and
  tokenizer_config.json (tests/fixtures/chat/llama3: Llama-3's chat template, `<image>` a special
  token), preprocessor_config.json (CLIPImageProcessor: shortest edge, center crop, bicubic) and
  processor_config.json.
- `siglip/`: a SiglipVisionModel with its preprocessor_config.json (SiglipImageProcessor: a
  square resize); `qwen2/`: a Qwen2ForCausalLM with its tokenizer (tests/fixtures/chat/qwen2:
  ChatML, `<image>` a special token) and generation_config.json. `tools.hf import --hf siglip
  --hf qwen2` makes a LLaVA of them (its projector from the seed).
- `reference.json` and `reference.npz`: for each pair (`llava`; `siglip_qwen2`) the
  processor's pixel values of the odd-sized images in tests/fixtures/images (`<pair>/<image>`,
  [3, h, w] float32, from the source directories' processors) and the greedy `generate` tokens
  of a prompt with one image (the chat template's user turn with `<image>` and the generation
  prompt). The LLaVA's are the source model's (its export holds the same weights); the SigLIP +
  Qwen2 pair's are those of its export (`tools.hf import` with IMPORT_FLAGS, then `tools.hf
  export`: the projector is the import's seed), whose tower and language tensors are checked
  against the sources first.

Rerun after changing a fixture (`--only references` keeps the model directories); each directory
stays under 300 KB.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import tempfile

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
CHAT = ROOT / "tests" / "fixtures" / "chat"
IMAGES = ROOT / "tests" / "fixtures" / "images"
IMAGE_FILES = ("portrait.png", "landscape.png", "tiny.png")  # odd sizes: 31x53, 64x27, 3x5
IMAGE, PATCH = 16, 4
CLIP_NORM = ([0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711])
SIGLIP_NORM = ([0.5, 0.5, 0.5], [0.5, 0.5, 0.5])
PROMPT = "What is shown in this picture?"
NEW_TOKENS = 8
# How the tests import the fixtures: a float32 config small enough for CPU tests (the pair's
# projector comes from this config's seed).
IMPORT_FLAGS = ["--config=tests/configs/tiny.py", "--config.data.task=synthetic",
                "--config.model.vision.max_images=1", "--config.data.image_probs=0.25,0.75",
                "--config.data.seq_len=40", "--config.data.text_len=12",
                "--config.eval.samples=16"]
PAIRS = {"llava": ("llava",), "siglip_qwen2": ("siglip", "qwen2")}


def _text(vocab: int, **kw) -> dict:
  return dict(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1, **kw)


def _vision(**kw) -> dict:
  return dict(hidden_size=16, intermediate_size=32, num_attention_heads=2, image_size=IMAGE,
              patch_size=PATCH, num_channels=3, **kw)


def _tokenizer(family: str):
  from transformers import AutoTokenizer  # pylint: disable=import-outside-toplevel
  tok = AutoTokenizer.from_pretrained(str(CHAT / family))
  if family == "qwen2":
    tok.pad_token = "<|endoftext|>"  # Qwen2's
  else:
    tok.pad_token = "<|end_of_text|>"
  return tok


def _ids(tok, *names) -> list[int]:
  return [tok.convert_tokens_to_ids(n) for n in names]


def _save(model, out: pathlib.Path, tok, eos: list[int]) -> None:
  from transformers import GenerationConfig  # pylint: disable=import-outside-toplevel
  model.generation_config = GenerationConfig(
      bos_token_id=tok.bos_token_id, eos_token_id=eos, pad_token_id=tok.pad_token_id)
  model.save_pretrained(out)


def llava(out: pathlib.Path) -> None:
  # pylint: disable=import-outside-toplevel
  from transformers import (CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                            LlavaForConditionalGeneration, LlavaProcessor)
  tok = _tokenizer("llama3")
  image_token = tok.convert_tokens_to_ids("<image>")
  text = LlamaConfig(**_text(
      len(tok), rms_norm_eps=1e-5, max_position_embeddings=131072,
      bos_token_id=tok.bos_token_id, eos_token_id=_ids(tok, "<|end_of_text|>", "<|eot_id|>"),
      rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8192}))
  model = LlavaForConditionalGeneration(LlavaConfig(
      vision_config=CLIPVisionConfig(**_vision(num_hidden_layers=3, hidden_act="quick_gelu")),
      text_config=text, image_token_index=image_token, vision_feature_layer=-2,
      vision_feature_select_strategy="default", projector_hidden_act="gelu",
      image_seq_length=(IMAGE // PATCH) ** 2)).eval()
  _save(model, out, tok, _ids(tok, "<|end_of_text|>", "<|eot_id|>"))
  images = CLIPImageProcessor(size={"shortest_edge": IMAGE},
                              crop_size={"height": IMAGE, "width": IMAGE}, resample=3,
                              image_mean=CLIP_NORM[0], image_std=CLIP_NORM[1])
  LlavaProcessor(image_processor=images, tokenizer=tok, patch_size=PATCH,
                 vision_feature_select_strategy="default", num_additional_image_tokens=1,
                 image_token="<image>", chat_template=tok.chat_template).save_pretrained(out)
  # As the Hub's LLaVA directories hold it (and transformers 4.x writes it): the image processor
  # in its own preprocessor_config.json, processor_config.json with the processor's fields only.
  processor = json.loads((out / "processor_config.json").read_text())
  processor.pop("image_processor")
  (out / "processor_config.json").write_text(json.dumps(processor, indent=2) + "\n")
  images.save_pretrained(out)


def siglip(out: pathlib.Path) -> None:
  # pylint: disable=import-outside-toplevel
  from transformers import SiglipImageProcessor, SiglipVisionConfig, SiglipVisionModel
  SiglipVisionModel(SiglipVisionConfig(**_vision(num_hidden_layers=2, vision_use_head=False))
                    ).eval().save_pretrained(out)
  SiglipImageProcessor(size={"height": IMAGE, "width": IMAGE}, resample=3,
                       image_mean=SIGLIP_NORM[0], image_std=SIGLIP_NORM[1]).save_pretrained(out)


def qwen2(out: pathlib.Path) -> None:
  from transformers import Qwen2Config, Qwen2ForCausalLM  # pylint: disable=import-outside-toplevel
  tok = _tokenizer("qwen2")
  model = Qwen2ForCausalLM(Qwen2Config(**_text(
      len(tok), rms_norm_eps=1e-6, max_position_embeddings=32768, tie_word_embeddings=False,
      rope_parameters={"rope_type": "default", "rope_theta": 1e6},
      bos_token_id=None, eos_token_id=tok.eos_token_id))).eval()
  _save(model, out, tok, [tok.eos_token_id])
  tok.save_pretrained(out)


def models(root: pathlib.Path) -> None:
  import torch  # pylint: disable=import-outside-toplevel
  for name, build in (("llava", llava), ("siglip", siglip), ("qwen2", qwen2)):
    torch.manual_seed({"llava": 0, "siglip": 1, "qwen2": 2}[name])
    out = root / name
    if out.exists():
      shutil.rmtree(out)
    build(out)
    size = sum(p.stat().st_size for p in out.iterdir())
    print(f"{out}: {', '.join(sorted(p.name for p in out.iterdir()))} ({size / 1e3:.0f} KB)")


def _generate(model, processor, image) -> tuple[list[int], float]:
  """Greedy tokens of PROMPT with `image`, and the smallest gap between the chosen token's logit
  and the next one's (how far each choice is from a tie)."""
  import torch  # pylint: disable=import-outside-toplevel
  tok = processor.tokenizer
  text = tok.apply_chat_template([{"role": "user", "content": f"<image>\n{PROMPT}"}],
                                 add_generation_prompt=True, tokenize=False)
  inputs = processor(text=text, images=image, return_tensors="pt", add_special_tokens=False)
  with torch.no_grad():
    out = model.generate(**inputs, do_sample=False, max_new_tokens=NEW_TOKENS,
                         output_scores=True, return_dict_in_generate=True)
  tokens = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
  gap = min(float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores)
  return tokens, gap


def _export(root: pathlib.Path, pair: str, tmp: pathlib.Path) -> pathlib.Path:
  """The pair imported with IMPORT_FLAGS and exported (tools.hf, in this process)."""
  from tools import hf as hf_tool  # pylint: disable=import-outside-toplevel
  dirs = [a for name in PAIRS[pair] for a in ("--hf", str(root / name))]
  hf_tool.main(["import", *dirs, "--out", str(tmp / "run"), *IMPORT_FLAGS])
  hf_tool.main(["export", str(tmp / "run"), "--out", str(tmp / "export")])
  return tmp / "export"


def _same_tensors(export: pathlib.Path, sources: list[pathlib.Path]) -> None:
  """Every tower and language tensor of the export is its source's, bit for bit."""
  from safetensors.numpy import load_file  # pylint: disable=import-outside-toplevel
  ours = load_file(str(export / "model.safetensors"))
  checked = 0
  for src in sources:
    prefix = "vision_tower." if (src / "preprocessor_config.json").exists() else "language_model."
    for k, x in load_file(str(src / "model.safetensors")).items():
      name = prefix + k.removeprefix("vision_model.")
      if "post_layernorm" in name:
        continue  # LLaVA reads the tower without it: the export's is the identity
      np.testing.assert_array_equal(ours[name], x, err_msg=name)
      checked += 1
  print(f"{export}: {checked} tensors equal their sources'")


def references(root: pathlib.Path) -> None:
  # pylint: disable=import-outside-toplevel
  from PIL import Image
  from transformers import AutoImageProcessor, AutoProcessor, LlavaForConditionalGeneration
  pixels, refs = {}, {"prompt": PROMPT, "max_new_tokens": NEW_TOKENS, "images": IMAGE_FILES,
                      "import_flags": IMPORT_FLAGS, "generated": {}, "image": IMAGE_FILES[0]}
  for pair, dirs in PAIRS.items():
    processor = AutoImageProcessor.from_pretrained(str(root / dirs[0]))
    for f in IMAGE_FILES:
      with Image.open(IMAGES / f) as image:
        pixels[f"{pair}/{f}"] = np.asarray(
            processor(images=image, return_tensors="np")["pixel_values"][0], np.float32)
    with tempfile.TemporaryDirectory() as tmp:
      if pair == "llava":
        model_dir = root / "llava"
      else:
        model_dir = _export(root, pair, pathlib.Path(tmp))
        _same_tensors(model_dir, [root / d for d in dirs])
      model = LlavaForConditionalGeneration.from_pretrained(str(model_dir)).eval()
      proc = AutoProcessor.from_pretrained(str(model_dir))
      with Image.open(IMAGES / refs["image"]) as image:
        tokens, gap = _generate(model, proc, image.convert("RGB"))
    refs["generated"][pair] = tokens
    print(f"{pair}: generated {tokens} (smallest top-2 logit gap {gap:.4f})")
  np.savez(root / "reference.npz", **pixels)
  (root / "reference.json").write_text(json.dumps(refs, indent=1) + "\n")


def main() -> None:
  parser = argparse.ArgumentParser(prog="python -m tools.export_fixtures",
                                   description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", default=str(ROOT / "tests" / "fixtures" / "recipe"))
  parser.add_argument("--only", choices=("all", "models", "references"), default="all")
  args = parser.parse_args()
  root = pathlib.Path(args.out)
  root.mkdir(parents=True, exist_ok=True)
  if args.only in ("all", "models"):
    models(root)
  if args.only in ("all", "references"):
    references(root)


if __name__ == "__main__":
  main()
