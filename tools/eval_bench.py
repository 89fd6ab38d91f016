"""Generation throughput of the eval beside HF transformers' `generate`, on the same checkpoint,
batch and lengths, in one call.

  python -m tools.eval_bench [--batch 16] [--prompt 128] [--new 128] [--record]
  python -m tools.eval_bench --tiny --hf_python /path/to/python   # a CPU check of the script

A randomly initialised LLaVA-shaped model (the 1B-class shape of tools/hf_llava_bench.py: CLIP
ViT-L/14 at 336 px, LLaVA's GELU projector, a Llama of 16 layers of width 2048; `--tiny`: a few
thousand parameters) is saved by transformers to a temporary directory, which `tools.hf import`
imports. A batch of `--batch` prompts, one image each and text of `--prompt` tokens in all
(shorter by up to 3 tokens a row, so that rows are left-padded), is answered greedily with
`--new` new tokens (no end token) twice:

- by transformers' `generate` (bfloat16, SDPA, on the GPU; float32 with `--tiny`), in a process of
  `--hf_python` (default this interpreter: it needs torch and transformers), which runs first and
  exits before JAX takes the GPU;
- by mimo_jax's eval program (mimo_jax/evaluate.py, what `tools.eval` runs: the run's meshes, the
  encoder, then prefill and decode with a key-value cache), on one device;
- by `tools.generate`'s programs (mimo_jax/generate.py: prefill, then decoding in chunks of
  `generate.CHUNK` new tokens a program), on the same ids as text (the image's placeholder ids
  read as tokens: no encoder), for the decoding's speed alone.

Prints each side's median seconds over `--reps` calls after one untimed call, new tokens per
second, and the share of new tokens the two agree on (random weights in bfloat16: near-ties of
the logits may go either way). `--record` appends the table to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

VOCAB = 32_000


def shapes(tiny: bool) -> dict:
  """The HF configs' fields: the 1B-class model, or a tiny one for a CPU check."""
  if tiny:
    return {"vision": dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=2, image_size=16, patch_size=4),
            "text": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=48, vocab_size=64),
            "image_tokens": 16}
  return {"vision": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                         num_attention_heads=16, image_size=336, patch_size=14),
          "text": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                       num_key_value_heads=8, intermediate_size=8192, vocab_size=VOCAB),
          "image_tokens": 576}


def prompts(args) -> dict:
  """Token ids (left-padded [b, l], with the image's tokens), mask and uint8 images."""
  s = shapes(args.tiny)
  vocab, size = s["text"]["vocab_size"], s["vision"]["image_size"]
  rng = np.random.default_rng(0)
  rows = []
  for b in range(args.batch):
    text = max(args.prompt - (b % 4), 2)
    rows.append([*rng.integers(4, vocab - 1, text // 2), *[vocab - 1] * s["image_tokens"],
                 *rng.integers(4, vocab - 1, text - text // 2)])
  width = max(map(len, rows))
  ids = np.zeros((len(rows), width), np.int64)
  mask = np.zeros((len(rows), width), np.int64)
  for r, row in enumerate(rows):
    ids[r, width - len(row):], mask[r, width - len(row):] = row, 1
  images = rng.integers(0, 256, (len(rows), size, size, 3)).astype(np.uint8)
  return {"ids": ids, "mask": mask, "images": images}


def hf_stage(args) -> None:
  """Makes and saves the HF model, then times its `generate` (in the `--hf_python` process)."""
  # pylint: disable=import-outside-toplevel
  import torch
  from transformers import (CLIPVisionConfig, LlamaConfig, LlavaConfig,
                            LlavaForConditionalGeneration)
  s, out = shapes(args.tiny), pathlib.Path(args.dir)
  vision = CLIPVisionConfig(**s["vision"])
  text = LlamaConfig(**s["text"], rope_theta=500_000.0, max_position_embeddings=4096,
                     tie_word_embeddings=False)
  config = LlavaConfig(vision_config=vision, text_config=text,
                       image_token_index=s["text"]["vocab_size"] - 1, projector_hidden_act="gelu",
                       vision_feature_layer=-2, vision_feature_select_strategy="default",
                       image_seq_length=s["image_tokens"])
  torch.manual_seed(0)
  model = LlavaForConditionalGeneration(config).eval()
  model.save_pretrained(out / "hf")
  norm = ([0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711])
  (out / "hf" / "preprocessor_config.json").write_text(json.dumps(
      {"image_mean": norm[0], "image_std": norm[1]}))
  gpu = torch.cuda.is_available() and not args.tiny
  dtype = torch.bfloat16 if gpu else torch.float32
  device = "cuda" if gpu else "cpu"
  model = model.to(device=device, dtype=dtype)
  p = prompts(args)
  mean, std = (torch.tensor(v).reshape(1, -1, 1, 1) for v in norm)
  pixels = ((torch.from_numpy(p["images"]).float().permute(0, 3, 1, 2) / 255 - mean) / std)
  inputs = {"input_ids": torch.from_numpy(p["ids"]).to(device),
            "attention_mask": torch.from_numpy(p["mask"]).to(device),
            "pixel_values": pixels.to(device=device, dtype=dtype)}

  def run():
    with torch.no_grad():
      got = model.generate(**inputs, do_sample=False, max_new_tokens=args.new,
                           min_new_tokens=args.new, eos_token_id=None, pad_token_id=0)
    if gpu:
      torch.cuda.synchronize()
    return got
  generated = run()[:, p["ids"].shape[1]:].cpu().numpy()
  times = []
  for _ in range(args.reps):
    t = time.perf_counter()
    run()
    times.append(time.perf_counter() - t)
  np.save(out / "hf_generated.npy", generated)
  (out / "hf.json").write_text(json.dumps({
      "seconds": statistics.median(times), "device": torch.cuda.get_device_name() if gpu
      else "cpu", "torch": torch.__version__, "dtype": str(dtype).removeprefix("torch."),
      "parameters": sum(x.numel() for x in model.parameters())}))


def jax_stage(args, work: pathlib.Path) -> dict:
  """Imports the saved model and times the eval's answers program on the same prompts, and
  tools.generate's programs on their ids."""
  # pylint: disable=import-outside-toplevel
  import jax
  from mimo_jax import eval_set, generate
  from mimo_jax.evaluate import Evaluator
  from tools.common import median_time
  from tools import eval as eval_tool
  from tools import hf as hf_tool
  config = ["--config=configs/llava_cpu.py"] if args.tiny else []
  if hf_tool.main(["import", "--hf", str(work / "hf"), "--out", str(work / "run"), *config]):
    raise SystemExit("eval_bench: the import failed")
  p = prompts(args)
  image_id = shapes(args.tiny)["text"]["vocab_size"] - 1
  tokens = shapes(args.tiny)["image_tokens"]
  ns = argparse.Namespace(workdir=str(work / "run"), step=None, layout="",
                          seq_len=p["ids"].shape[1] + 1, data=str(work / "run"))
  step, cfg = eval_tool.run_config(ns)
  eval_tool.from_step(ns, cfg, step)
  cfg.model.vision.max_images = 1  # one image a prompt: rows need not hold the config's three
  cfg.data.image_probs = "0,1"
  cfg.data.task, cfg.data.image_token = "conversations", image_id  # as an imported run's eval
  trainer = eval_tool.build_step(ns, cfg, image_id)
  samples = []
  for row, m, image in zip(p["ids"], p["mask"], p["images"]):
    ids = row[m == 1].tolist()
    at = ids.index(image_id)
    ids = ids[:at] + [image_id] + ids[at + tokens:]  # one placeholder, as converted data has
    samples.append({"sample": eval_set.eval_sample(ids, [4], {"images": [image]})})
  layout = eval_set.layout_for(cfg, 1, len(samples), samples)
  [batch] = eval_set.batches(samples, layout, len(samples), "eval_bench")
  evaluator = Evaluator(trainer)
  state = trainer.init_state(0, optimizer=False)
  got = evaluator.answers(state, [batch], args.new)
  language = state["language"].params
  text = lambda: generate.generate(cfg, language, p["ids"], p["mask"], args.new)
  return {"seconds": median_time(lambda: evaluator.answers(state, [batch], args.new), args.reps),
          "text_seconds": median_time(text, args.reps), "dtype": cfg.model.dtype,
          "generated": np.stack([got[i] for i in range(len(samples))]),
          "device": f"{jax.devices()[0].device_kind}"}


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m tools.eval_bench", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--batch", type=int, default=16)
  parser.add_argument("--prompt", type=int, default=128, help="text tokens a prompt (the longest)")
  parser.add_argument("--new", type=int, default=128, help="new tokens a row")
  parser.add_argument("--reps", type=int, default=3)
  parser.add_argument("--tiny", action="store_true", help="a tiny model on the CPU")
  parser.add_argument("--hf_python", default=sys.executable,
                      help="a Python with torch and transformers")
  parser.add_argument("--record", action="store_true", help="append to docs/benchmarks.md")
  parser.add_argument("--stage", default="", help=argparse.SUPPRESS)
  parser.add_argument("--dir", default="", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.stage == "hf":
    hf_stage(args)
    return 0
  with tempfile.TemporaryDirectory(prefix="eval_bench-") as tmp:
    work = pathlib.Path(tmp)
    own = [a for a in (argv if argv is not None else sys.argv[1:])
           if not a.startswith("--record")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(pathlib.Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]))
    subprocess.run([args.hf_python, "-m", "tools.eval_bench", *own, "--stage", "hf", "--dir",
                    str(work)], check=True, env=env)
    hf = json.loads((work / "hf.json").read_text())
    ours = jax_stage(args, work)
    agree = float((np.load(work / "hf_generated.npy") == ours["generated"]).mean())
  new = args.batch * args.new
  row = lambda name, dtype, seconds: f"| {name} | {dtype} | {seconds:.3f} | {new / seconds:,.0f} |"
  rows = [row(f"HF transformers `generate` (torch {hf['torch']})", hf["dtype"], hf["seconds"]),
          row("mimo_jax eval (`tools.eval`'s program)", ours["dtype"], ours["seconds"]),
          row("mimo_jax `tools.generate`'s programs, the ids as text", ours["dtype"],
              ours["text_seconds"])]
  body = "\n".join(["| generate | dtype | s (median) | new tokens/s |", "|---|---|---:|---:|",
                    *rows, "", f"new tokens equal in HF's and the eval's: {agree:.1%}"])
  print(body)
  if args.record:
    from tools import common  # pylint: disable=import-outside-toplevel
    common.record(
        "Generation: the eval's batched greedy decoding beside HF `generate`", "eval_bench",
        argv, body, notes=(f"{hf['parameters']:,} parameters (LLaVA-shaped, random weights); "
                           f"batch {args.batch}, one image and up to {args.prompt} text tokens a "
                           f"prompt, {args.new} new tokens a row; HF on {hf['device']}",))
  return 0


if __name__ == "__main__":
  sys.exit(main())
