"""PEFT LoRA adapters on tiny HF fixtures and their outputs, for the adapter interop tests.

Run with an environment that has torch, transformers and peft (no GPU needed):

  python -m tools.peft_fixtures [--out tests/fixtures/peft]

writes `<out>/llama3/`: the adapter directory as `PeftModel.save_pretrained` writes it
(adapter_config.json, adapter_model.safetensors; rank 4, alpha 8, attention and MLP projections,
A and B both random so that the adapter changes the outputs), and `reference.npz`: the input ids
of tests/fixtures/hf/llama3/reference.npz and the adapted model's float32 logits on them, plus
`names`: every tensor name and shape the adapter file holds (the expected names of an export).
`<out>/llava15/` is the same on the tiny LLaVA-1.5 fixture with adapters on the tower (rank 2,
alpha 4: `rank_pattern`, `alpha_pattern`) and the language model (rank 4, alpha 8), and the
projector trained beside them (`modules_to_save`, moved off the base's values); its reference
holds the logits on the LLaVA fixture's ids and pixels.
"""

from __future__ import annotations

import argparse
import json
import pathlib

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
BASE = ROOT / "tests" / "fixtures" / "hf" / "llama3"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LLAVA = ROOT / "tests" / "fixtures" / "hf" / "llava15"
TOWER = r"model\.vision_tower\..*"
# The tower's layers LLaVA reads (its features are the second-to-last layer's output: the last
# layer is not part of mimo_jax's tower).
LLAVA_TARGETS = (r"model\.vision_tower\.encoder\.layers\.[01]\.(self_attn\.(q|k|v|out)_proj|mlp\.fc[12])|"
                 r"model\.language_model\.layers\.\d+\.(self_attn\.[qkvo]_proj|"
                 r"mlp\.(gate|up|down)_proj)")


def _finish(out: pathlib.Path, base: pathlib.Path, **reference) -> None:
  """reference.npz (with the adapter file's names and shapes), and the config naming the base
  as the repository does; save_pretrained's model card removed."""
  import safetensors.numpy  # pylint: disable=import-outside-toplevel
  saved = safetensors.numpy.load_file(out / "adapter_model.safetensors")
  names = {k: list(v.shape) for k, v in sorted(saved.items())}
  np.savez(out / "reference.npz", names=np.asarray(json.dumps(names)), **reference)
  (out / "README.md").unlink(missing_ok=True)
  config_json = out / "adapter_config.json"
  written = json.loads(config_json.read_text(encoding="utf-8"))
  written["base_model_name_or_path"] = str(base.relative_to(ROOT))
  config_json.write_text(json.dumps(written, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def build_llava(out: pathlib.Path) -> None:
  import peft  # pylint: disable=import-outside-toplevel
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  from tools.hf_fixtures import CLIP_NORM, normalised  # pylint: disable=import-outside-toplevel
  torch.manual_seed(0)
  base = transformers.LlavaForConditionalGeneration.from_pretrained(LLAVA,
                                                                    torch_dtype=torch.float32)
  config = peft.LoraConfig(r=4, lora_alpha=8, rank_pattern={TOWER: 2}, alpha_pattern={TOWER: 4},
                           lora_dropout=0.0, target_modules=LLAVA_TARGETS,
                           modules_to_save=["multi_modal_projector"], init_lora_weights=False)
  model = peft.get_peft_model(base, config).eval()
  with torch.no_grad():  # the projector trained: its saved copy moved off the base's
    for name, p in model.named_parameters():
      if "modules_to_save" in name:
        p.add_(0.05 * torch.randn_like(p))
  out.mkdir(parents=True, exist_ok=True)
  model.save_pretrained(out)
  ref = np.load(LLAVA / "reference.npz")
  with torch.no_grad():
    logits = model(input_ids=torch.from_numpy(ref["input_ids"]),
                   pixel_values=normalised(torch, ref["pixels"], CLIP_NORM)).logits.numpy()
  _finish(out, LLAVA, input_ids=ref["input_ids"], pixels=ref["pixels"], logits=logits)


def build(out: pathlib.Path) -> None:
  import peft  # pylint: disable=import-outside-toplevel
  import safetensors.numpy  # pylint: disable=import-outside-toplevel
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  torch.manual_seed(0)
  base = transformers.AutoModelForCausalLM.from_pretrained(BASE, torch_dtype=torch.float32)
  config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS,
                           init_lora_weights=False, task_type="CAUSAL_LM")
  model = peft.get_peft_model(base, config).eval()
  out.mkdir(parents=True, exist_ok=True)
  model.save_pretrained(out)
  ids = np.load(BASE / "reference.npz")["input_ids"]
  with torch.no_grad():
    logits = model(input_ids=torch.from_numpy(ids)).logits.numpy()
  saved = safetensors.numpy.load_file(out / "adapter_model.safetensors")
  names = {k: list(v.shape) for k, v in sorted(saved.items())}
  np.savez(out / "reference.npz", input_ids=ids, logits=logits,
           names=np.asarray(json.dumps(names)))
  (out / "README.md").unlink(missing_ok=True)  # save_pretrained's model card: not needed
  config_json = out / "adapter_config.json"  # the base as the repository names it
  written = json.loads(config_json.read_text(encoding="utf-8"))
  written["base_model_name_or_path"] = str(BASE.relative_to(ROOT))
  config_json.write_text(json.dumps(written, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def main() -> None:
  parser = argparse.ArgumentParser(prog="python -m tools.peft_fixtures",
                                   description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=str(ROOT / "tests" / "fixtures" / "peft"))
  out = pathlib.Path(parser.parse_args().out)
  build(out / "llama3")
  build_llava(out / "llava15")


if __name__ == "__main__":
  main()
