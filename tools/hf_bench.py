"""Pretrained-size HF checkpoints through tools.hf on a GPU host: import, check, train.

  python -m tools.hf_bench [--phases make,import,check,train] [--steps 20] [--work .hf_bench]

Needs torch and transformers (`pip install -e '.[hf]'`). `make` saves two randomly initialised
models with `save_pretrained` in bfloat16: a Llama of Llama-3.2-1B's shape (1.24 B parameters,
tied embeddings, llama3 RoPE scaling; `--llama 8b`: Llama-3.1-8B's, 8.03 B, for the import's
host memory at that size) and a SigLIP tower of so400m's shape (0.43 B; 384 px, patches of 14).
`import` runs `tools.hf import --hf SIGLIP --hf LLAMA` (wall time and peak host memory), `check`
runs `tools.hf check` on each in bfloat16 and float32, `train` trains from the imported step 0 for
`--steps` steps on synthetic data. The figures go to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import shutil
import subprocess
import sys
import time

from tools.common import ROOT, record

LLAMA = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
             num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
             rms_norm_eps=1e-5, tie_word_embeddings=True, max_position_embeddings=131072,
             rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 8192})
# Llama-3.1-8B's shape (8.03 B parameters; `--llama 8b`): for the import's host memory at 7-8B.
LLAMA_8B = dict(LLAMA, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                tie_word_embeddings=False,
                rope_parameters=dict(LLAMA["rope_parameters"], factor=8.0))
SIGLIP = dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27,
              num_attention_heads=16, image_size=384, patch_size=14, vision_use_head=False)
RUN = ["--config=configs/vlm.py", "--config.model.vision.max_images=1",
       "--config.data.image_probs=0,1",
       "--config.data.seq_len=1024", "--config.data.text_len=200",
       "--config.data.train_samples=1000", "--config.data.eval_samples=64",
       "--config.model.vision.projector_hidden=2048"]


TINY = (dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=512),
        dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
             image_size=48, patch_size=14))


def make(work: pathlib.Path, tiny: bool = False, llama_shape: dict = LLAMA) -> dict:
  # pylint: disable=import-outside-toplevel
  import torch
  from transformers import LlamaConfig, LlamaForCausalLM, SiglipVisionConfig, SiglipVisionModel
  out = {}
  torch.manual_seed(0)
  llama, siglip = ({**llama_shape, **TINY[0]}, {**SIGLIP, **TINY[1]}) if tiny else (llama_shape,
                                                                                      SIGLIP)
  for name, build in (("llama", lambda: LlamaForCausalLM(LlamaConfig(**llama))),
                      ("siglip", lambda: SiglipVisionModel(SiglipVisionConfig(**siglip)))):
    t = time.time()
    model = build().to(torch.bfloat16)
    model.save_pretrained(work / name, max_shard_size="1GB")
    n = sum(p.numel() for p in model.parameters())
    out[name] = {"parameters": n, "seconds": time.time() - t}
    print(f"{name}: {n / 1e9:.2f} B parameters saved in {time.time() - t:.0f} s", flush=True)
    del model
  (work / "siglip" / "preprocessor_config.json").write_text(json.dumps(
      {"image_mean": [0.5] * 3, "image_std": [0.5] * 3}))
  return out


def _run(args: list[str]) -> str:
  print("$", " ".join(args), flush=True)
  proc = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True)
  print(proc.stdout[-4000:], proc.stderr[-4000:] if proc.returncode else "", flush=True)
  if proc.returncode:
    raise SystemExit(f"{args[0]} failed with status {proc.returncode}")
  return proc.stdout


def main() -> None:
  parser = argparse.ArgumentParser(prog="python -m tools.hf_bench",
                                   description=__doc__.split("\n\n")[0])
  parser.add_argument("--phases", default="make,import,check,train",
                      help="which phases to run, in order (comma-separated)")
  parser.add_argument("--steps", type=int, default=20,
                      help="training steps from the import (train)")
  parser.add_argument("--work", default=str(ROOT / ".hf_bench"),
                      help="where the models, the import and the figures go")
  parser.add_argument("--record", action="store_true",
                      help="append the figures (of this call or of --results) to docs")
  parser.add_argument("--results", default=None,
                      help="where the figures are kept (default WORK/results.json)")
  parser.add_argument("--check_dtypes", default="bfloat16,float32",
                      help="the dtypes tools.hf check runs in (check)")
  parser.add_argument("--llama", choices=("1b", "8b"), default="1b",
                      help="the Llama's shape: Llama-3.2-1B's or Llama-3.1-8B's (make)")
  parser.add_argument("--tiny", action="store_true",
                      help="small shapes on one CPU: a smoke test of the phases")
  args = parser.parse_args()
  work = pathlib.Path(args.work)
  work.mkdir(parents=True, exist_ok=True)
  results_file = pathlib.Path(args.results or work / "results.json")
  results = json.loads(results_file.read_text()) if results_file.exists() else {}
  phases = [p for p in args.phases.split(",") if p]
  if phases:  # not through jax here: its backend would take the GPU the phases need
    gpus = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                          capture_output=True, text=True, check=False) if shutil.which(
                              "nvidia-smi") else None
    names = gpus.stdout.split("\n") if gpus and gpus.returncode == 0 else []
    names = [n.strip() for n in names if n.strip()]
    results["device"] = f"{len(names)} x {names[0]}" if names else "CPU"
  save = lambda: results_file.write_text(json.dumps(results, indent=2))
  if "make" in phases:
    results["make"] = make(work, args.tiny, LLAMA_8B if args.llama == "8b" else LLAMA)
    save()
  run = work / "run"
  if "import" in phases:
    t = time.time()
    tiny = ["--config.model.dtype=float32", "--config.model.vision.projector_hidden=64",
            "--config.data.global_batch=8", "--config.data.microbatches=2",
            "--config.data.seq_len=64", "--config.data.text_len=20", "--config.eval.samples=8",
            "--config.eval.batch=8", "--config.data.workers=0"] if args.tiny else []
    out = _run(["tools.hf", "import", "--hf", str(work / "siglip"), "--hf", str(work / "llama"),
                "--out", str(run), *RUN, f"--config.data.dir={work / 'data'}", *tiny])
    peak = re.search(r"peak host memory ([\d.]+) GiB reading, ([\d.]+) GiB with the checkpoint "
                     r"save \(([\d.]+) GiB before reading\)", out)
    results["import"] = {"seconds": time.time() - t, "peak_read_gib": float(peak.group(1)),
                         "peak_gib": float(peak.group(2)), "base_gib": float(peak.group(3)),
                         "report": out.strip().splitlines()[-1]}
    save()
  if "check" in phases:
    results["check"] = {}
    for name in ("llama", "siglip"):
      for dtype in args.check_dtypes.split(","):
        out = _run(["tools.hf", "check", "--hf", str(work / name), "--dtype", dtype])
        results["check"][f"{name} {dtype}"] = out.strip().splitlines()[-1]
        save()
  if "train" in phases:
    t = time.time()
    out = _run(["mimo_jax.launch", f"--config={run / 'config.py'}",
                f"--config.train.steps={args.steps}", "--config.run.log_every=5",
                "--config.checkpoint.every=0", "--config.eval.samples=8", "--config.eval.batch=8"])
    losses = re.findall(r"step (\d+) \| loss ([\d.]+)", out)
    results["train"] = {"seconds": time.time() - t, "losses": losses,
                        "last": out.strip().splitlines()[-1]}
  save()
  print(json.dumps(results, indent=2))
  if args.record:
    _record(results, args)


def _record(results: dict, args) -> None:
  m, i, c, t = (results.get(k, {}) for k in ("make", "import", "check", "train"))
  rows = ["| what | figure |", "|---|---|"]
  for name, r in m.items():
    rows.append(f"| {name}: parameters (save_pretrained, bfloat16) | {r['parameters'] / 1e9:.3f} B |")
  if i:
    rows.append(f"| import SigLIP + Llama (wall, incl. start-up and compile) | {i['seconds']:.0f} s |")
    rows.append(f"| import: host memory of the process before reading (its backend) | "
                f"{i['base_gib']:.1f} GiB |")
    rows.append(f"| import: peak host memory reading the tensors into the devices | "
                f"{i['peak_read_gib']:.1f} GiB |")
    rows.append(f"| import: peak host memory with the step-0 save (the parameters) | "
                f"{i['peak_gib']:.1f} GiB |")
  for k, line in c.items():
    rows.append(f"| check {k} | {line.split(': ', 1)[-1]} |")
  if t:
    losses = ", ".join(f"{s}: {l}" for s, l in t["losses"])
    rows.append(f"| train {args.steps} steps from the import (wall, incl. compile) | "
                f"{t['seconds']:.0f} s; loss by step {losses} |")
  record("Hugging Face import, check and training at pretrained sizes", "hf_bench",
         ["--phases", "make,import,check,train", f"--steps={args.steps}",
          *(["--llama", args.llama] if args.llama != "1b" else [])], "\n".join(rows),
         notes=(f"device: {results.get('device')}",
                f"random weights of {'Llama-3.1-8B' if args.llama == '8b' else 'Llama-3.2-1B'}'s "
                "and SigLIP-so400m's shapes, saved by transformers; check runs transformers on "
                "the CPU"), device=False)


if __name__ == "__main__":
  main()
