"""Answer prompts with a trained or imported model: `python -m tools.generate WORKDIR --prompt TEXT
[--prompt TEXT ...] [--image FILE ...]`.

  python -m tools.generate runs/llava --image cat.jpg --prompt "What is in the picture?"
  python -m tools.generate runs/llava --prompt "Hello" --prompt "Name three colours." \\
      --temperature 0.7 --top_p 0.9 --max_new_tokens 64

Loads WORKDIR's newest checkpoint (or `--step N`: ours or a `tools.hf import`'s step 0) onto one
device, renders each prompt as a user turn with the language model's chat template and the
generation prompt (`--tokenizer`: tokenizer.json and tokenizer_config.json), every `--image`
given to every prompt (as `<image>` lines before its text unless the prompt places them itself),
prepared by the tower's processor (`--processor`: preprocessor_config.json) and expanded to the
tower's image tokens. Defaults for `--tokenizer`, `--processor` and `--image_token`: those of the
run's converted data (data.task=conversations or digits: the manifest in its data directory), else
the directories `tools.hf import` read. The prompts run as one batch, left-padded, with a key-value cache
(mimo_jax/generate.py): greedy by default, or sampled at `--temperature` among the `--top_p`
mass, until the tokenizer's end-of-turn token or `--max_new_tokens`. Each answer is printed after
its prompt.
"""

from __future__ import annotations

import argparse
import json
import logging
import pathlib
import sys

import numpy as np

from mimo_jax.config import ConfigError


def defaults(workdir: str, cfg) -> dict[str, str]:
  """`tokenizer`, `processor` and `image_token`: those of the run's conversation data, else of the
  import that made the workdir, else of the digits task's build."""
  # pylint: disable-next=import-outside-toplevel
  from mimo_jax.data import conversations, digits
  d = cfg.data
  record = pathlib.Path(workdir) / "hf_import.json"
  if d.task != "conversations" and record.is_file():
    sources = json.loads(record.read_text()).get("sources", {})
    return {"tokenizer": sources.get("language", ""), "processor": sources.get("vision", ""),
            "image_token": "<image>"}
  directory = (pathlib.Path(d.dir) if d.task == "conversations" else
               digits.directory(d.dir, d.train_samples, d.eval_samples, d.probs()))
  if d.task == "synthetic" or not (directory / conversations.MANIFEST).is_file():
    return {"tokenizer": "", "processor": "", "image_token": "<image>"}
  m = conversations.manifest(str(directory))
  return {"tokenizer": conversations.source_path(str(directory), m["tokenizer"]),
          "processor": conversations.source_path(str(directory), m["processor"]),
          "image_token": m.get("image_token_text", "<image>")}


def _default_dir(path: str, wanted: str, flag: str, workdir: str) -> str:
  if path and (pathlib.Path(path) / wanted).is_file():
    return path
  raise ConfigError(f"{workdir}: neither its run's data nor an import names a directory with "
                    f"{wanted}; give {flag} DIR.")


def prompt_ids(tok, text: str, images: int, image_token: str, tokens_per_image: int) -> list[int]:
  """A user turn with `images` images (as `<image>` lines before the text unless it has them)
  and the generation prompt, tokenized, each image token repeated `tokens_per_image` times."""
  if images and image_token not in text:
    text = f"{image_token}\n" * images + text
  if text.count(image_token) != images:
    raise ConfigError(f"the prompt {text!r} has {text.count(image_token)} {image_token} for "
                      f"{images} --image files.")
  rendered = tok.render([{"role": "user", "content": text}], add_generation_prompt=True)
  image_id = tok.token_id(image_token) if images else None
  out = []
  for i in tok.tokenizer.encode(rendered, add_special_tokens=False).ids:
    out.extend([i] * (tokens_per_image if i == image_id else 1))
  return out


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m tools.generate", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("workdir")
  parser.add_argument("--prompt", action="append", default=[],
                      help="repeatable: a batch (default with --image: one empty prompt)")
  parser.add_argument("--image", action="append", default=[], help="repeatable")
  parser.add_argument("--step", type=int, default=None)
  parser.add_argument("--tokenizer", default="")
  parser.add_argument("--processor", default="")
  parser.add_argument("--image_token", default="", help="default: the data's, else <image>")
  parser.add_argument("--max_new_tokens", type=int, default=64)
  parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
  parser.add_argument("--top_p", type=float, default=1.0)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  if not args.prompt:
    if not args.image:
      parser.error("give --prompt TEXT, or --image FILE")
    args.prompt = [""]
  logging.getLogger("absl").setLevel(logging.ERROR)  # orbax's notes on reading a checkpoint
  try:
    answers = run(args)
  except (ConfigError, ValueError) as e:
    print(f"generate: error: {e}", file=sys.stderr)
    return 2
  shown = " ".join(f"[{pathlib.Path(f).name}]" for f in args.image)
  for prompt, answer in zip(args.prompt, answers):
    print(f"> {' '.join(x for x in (shown, prompt) if x)}\n{answer}")
  return 0


def run(args) -> list[str]:
  # pylint: disable=import-outside-toplevel
  import jax
  from PIL import Image
  from mimo_jax import generate
  from mimo_jax.data.chat import ChatTokenizer
  from mimo_jax.data.images import ImageProcessor
  from mimo_jax.models import whole
  from tools.hf import _read_checkpoint  # pylint: disable=protected-access
  if not (pathlib.Path(args.workdir) / "checkpoints").is_dir():
    raise ConfigError(f"{args.workdir}: no checkpoints/; give a run's workdir or an import's.")
  cfg, params, _, _ = _read_checkpoint(args.workdir, args.step)
  found = defaults(args.workdir, cfg)
  image_token = args.image_token or found["image_token"]
  tok = ChatTokenizer.open(args.tokenizer or _default_dir(found["tokenizer"], "tokenizer.json",
                                                          "--tokenizer", args.workdir))
  pixels = None
  if args.image:
    proc = ImageProcessor.open(args.processor or _default_dir(
        found["processor"], "preprocessor_config.json", "--processor", args.workdir))
    pixels = []
    for f in args.image:
      try:
        with Image.open(f) as image:
          pixels.append(proc(image))
      except OSError as e:
        raise ConfigError(f"{f}: cannot be read as an image ({e}).") from None
    size, channels = cfg.model.vision.image_size, cfg.model.vision.channels
    for f, p in zip(args.image, pixels):
      if p.shape != (size, size, channels):
        raise ConfigError(f"{f}: the processor makes it {'x'.join(map(str, p.shape))} (height x "
                          f"width x channels) where the model reads {size}x{size}x{channels}.")
  per_image = cfg.model.vision.tokens_per_image
  rows = [prompt_ids(tok, p, len(args.image), image_token, per_image) for p in args.prompt]
  width = max(map(len, rows))
  ids = np.zeros((len(rows), width), np.int32)
  mask = np.zeros((len(rows), width), np.int32)
  for r, row in enumerate(rows):
    ids[r, width - len(row):], mask[r, width - len(row):] = row, 1
  embeds = None
  if pixels is not None:
    images = np.stack([p for _ in rows for p in pixels]).astype(np.float32) / 255
    embeds = whole.merged_embeddings(cfg, params["vision"], params["language"], ids, images,
                                     tok.token_id(image_token))
  eos = tok.specials.get("eos_token")
  print(f"{args.workdir}: {len(rows)} prompts of up to {width} tokens on {jax.devices()[0]}",
        file=sys.stderr)
  out = generate.generate(cfg, params["language"], ids, mask, args.max_new_tokens,
                          generate.Sampling(args.temperature, args.top_p, args.seed),
                          embeds, eos=tok.token_id(eos) if eos else None)
  return [tok.tokenizer.decode([int(t) for t in row], skip_special_tokens=True).strip()
          for row in out]


if __name__ == "__main__":
  sys.exit(main())
