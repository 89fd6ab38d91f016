"""The reference answers of the eval's parity test: transformers' greedy `generate` on the LLaVA
fixtures for a batch of prompts of different lengths with 0, 1, 2 and 3 images.

  python -m tools.eval_fixtures [--root tests/fixtures/hf]

Needs torch and transformers; the test that reads the result does not. Beside each LLaVA fixture
(read as `tools.hf_fixtures` saved it, weights unchanged) writes `eval_generate.npz`: `rows` (the
prompts' ids, each image as its 16 image tokens, concatenated; `lengths` splits them), `images`
(uint8 [n, h, w, c], in the order the rows name them), `image_counts` and `generated`
(GENERATE new tokens a row, no end-of-sequence stop), for a left-padded batch with an attention
mask.
"""

from __future__ import annotations

import argparse
import pathlib

import numpy as np

from tools.hf_fixtures import CHANNELS, CLIP_NORM, IMAGE, PATCH, ROOT, SIGLIP_NORM, VOCAB

GENERATE = 8
IMAGE_COUNTS = (0, 2, 1, 3)  # a row's images
TEXT = ((5, 2), (1, 1), (3, 6), (2, 1))  # text tokens before and after a row's images


def build(root: pathlib.Path) -> None:
  # pylint: disable=import-outside-toplevel
  import torch
  from transformers import LlavaForConditionalGeneration
  rng = np.random.default_rng(4)
  for name, norm in (("llava15", CLIP_NORM), ("llava_siglip", SIGLIP_NORM)):
    model = LlavaForConditionalGeneration.from_pretrained(root / name).eval()
    image = model.config.image_token_index
    tokens = (IMAGE // PATCH) ** 2
    rows = [[*rng.integers(4, VOCAB - 1, before), *[image] * (tokens * n),
             *rng.integers(4, VOCAB - 1, after)] for n, (before, after) in zip(IMAGE_COUNTS, TEXT)]
    width = max(map(len, rows))
    ids = np.zeros((len(rows), width), np.int64)
    mask = np.zeros((len(rows), width), np.int64)
    for r, row in enumerate(rows):
      ids[r, width - len(row):], mask[r, width - len(row):] = row, 1
    images = rng.integers(0, 256, (sum(IMAGE_COUNTS), IMAGE, IMAGE, CHANNELS)).astype(np.uint8)
    mean, std = (torch.tensor(v, dtype=torch.float32).reshape(1, -1, 1, 1) for v in norm)
    pixels = (torch.from_numpy(images.astype(np.float32) / 255).permute(0, 3, 1, 2) - mean) / std
    with torch.no_grad():
      out = model.generate(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                           pixel_values=pixels, do_sample=False, max_new_tokens=GENERATE,
                           min_new_tokens=GENERATE, eos_token_id=None, pad_token_id=0)
    generated = out.numpy()[:, width:]
    np.savez(root / name / "eval_generate.npz", rows=np.concatenate(rows).astype(np.int32),
             lengths=np.asarray(list(map(len, rows)), np.int32), images=images,
             image_counts=np.asarray(IMAGE_COUNTS, np.int32), generated=generated)
    print(f"{name}: generated {generated.tolist()}")


def main() -> None:
  parser = argparse.ArgumentParser(prog="python -m tools.eval_fixtures",
                                   description=__doc__.split("\n\n")[0])
  parser.add_argument("--root", default=str(ROOT / "tests" / "fixtures" / "hf"),
                      help="the folder of the LLaVA fixtures (llava15, llava_siglip)")
  build(pathlib.Path(parser.parse_args().root))


if __name__ == "__main__":
  main()
