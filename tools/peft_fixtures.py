"""A PEFT LoRA adapter on the tiny Llama-3 fixture and its outputs, for the adapter interop tests.

Run with an environment that has torch, transformers and peft (no GPU needed):

  python -m tools.peft_fixtures [--out tests/fixtures/peft]

writes `<out>/llama3/`: the adapter directory as `PeftModel.save_pretrained` writes it
(adapter_config.json, adapter_model.safetensors; rank 4, alpha 8, attention and MLP projections,
A and B both random so that the adapter changes the outputs), and `reference.npz`: the input ids
of tests/fixtures/hf/llama3/reference.npz and the adapted model's float32 logits on them, plus
`names`: every tensor name and shape the adapter file holds (the expected names of an export).
"""

from __future__ import annotations

import argparse
import json
import pathlib

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
BASE = ROOT / "tests" / "fixtures" / "hf" / "llama3"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


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
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=str(ROOT / "tests" / "fixtures" / "peft"))
  build(pathlib.Path(parser.parse_args().out) / "llama3")


if __name__ == "__main__":
  main()
