"""Small LLaVA-format data for trying the two-stage recipe on a CPU (README, "The LLaVA recipe").

  python -m tools.recipe_data --out data/recipe [--pretrain 200] [--instruct 200]

Writes, from scikit-learn's bundled handwritten digits (8x8 grayscale, saved as PNG files):
  OUT/images/NNNN.png   one image per record (pretraining and instruction records use disjoint
                        images)
  OUT/pretrain.json     stage 1: a caption a record, as LLaVA's pretraining data
                        (`<image>` + an instruction to describe it; the answer names the digit)
  OUT/instruct.json     stage 2: multi-turn conversations about the image, as LLaVA's instruction
                        data (which digit; the next or previous digit; its parity)
Both are JSON lists of `{"id", "image", "conversations": [{"from", "value"}]}` records that
`tools.convert --images OUT/images` reads. The output is written whole or not at all (a failed
write is one line; Ctrl-C exits 130, SIGTERM 143).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys

import numpy as np

from mimo_jax import output
from mimo_jax.config import ConfigError
from mimo_jax.data.digits import pixels
from mimo_jax.data.tokenizer import DIGIT_WORDS

CAPTION_PROMPTS = ("Describe the image briefly.", "What is shown here?",
                   "Write a short caption for this picture.")


def _caption(rng, label: int) -> list[dict]:
  prompt = CAPTION_PROMPTS[int(rng.integers(len(CAPTION_PROMPTS)))]
  return [{"from": "human", "value": f"<image>\n{prompt}"},
          {"from": "gpt", "value": f"A handwritten digit {DIGIT_WORDS[label]}."}]


def _conversation(rng, label: int) -> list[dict]:
  turns = [{"from": "human", "value": "<image>\nWhich digit is written here?"},
           {"from": "gpt", "value": f"It is a {DIGIT_WORDS[label]}."}]
  follow = int(rng.integers(3))
  if follow == 0:
    turns += [{"from": "human", "value": "Which digit comes after it?"},
              {"from": "gpt", "value": f"{DIGIT_WORDS[(label + 1) % 10].capitalize()}."}]
  elif follow == 1:
    turns += [{"from": "human", "value": "Which digit comes before it?"},
              {"from": "gpt", "value": f"{DIGIT_WORDS[(label - 1) % 10].capitalize()}."}]
  else:
    turns += [{"from": "human", "value": "Is it even or odd?"},
              {"from": "gpt", "value": "Even." if label % 2 == 0 else "Odd."}]
  return turns


def write(out: str, pretrain: int, instruct: int, seed: int = 0) -> None:
  from PIL import Image  # pylint: disable=import-outside-toplevel
  from sklearn.datasets import load_digits  # pylint: disable=import-outside-toplevel
  digits = load_digits()
  if pretrain + instruct > len(digits.images):
    raise ConfigError(f"--pretrain {pretrain} + --instruct {instruct} records need more images "
                      f"than the {len(digits.images)} digits; ask for fewer.")
  rng = np.random.default_rng(seed)
  order = rng.permutation(len(digits.images))[:pretrain + instruct]
  with output.interrupts_as_exceptions(), output.write_errors(f"--out={out!r}"), \
      output.staged(out, what="recipe data set", complete="instruct.json") as tmp:
    (tmp / "images").mkdir()
    sets = {"pretrain.json": [], "instruct.json": []}
    for n, j in enumerate(order):
      name = f"{n:04d}.png"
      Image.fromarray(pixels(digits.images[j].astype(np.uint8)), mode="L").save(
          tmp / "images" / name)
      label = int(digits.target[j])
      stage = "pretrain.json" if n < pretrain else "instruct.json"
      turns = _caption(rng, label) if n < pretrain else _conversation(rng, label)
      sets[stage].append({"id": f"{stage.split('.')[0]}-{n:04d}", "image": name,
                          "conversations": turns})
    for name, records in sets.items():  # instruct.json last: it marks the set complete
      (tmp / name).write_text(json.dumps(records, indent=1) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m tools.recipe_data", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", required=True, help="folder to write (absent or empty)")
  parser.add_argument("--pretrain", type=int, default=200, help="stage-1 caption records")
  parser.add_argument("--instruct", type=int, default=200, help="stage-2 conversation records")
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  try:
    if args.pretrain < 1 or args.instruct < 1:
      raise ConfigError("--pretrain and --instruct need at least one record each.")
    if args.seed < 0:
      raise ConfigError(f"--seed {args.seed}: give a seed of 0 or more.")
    write(args.out, args.pretrain, args.instruct, args.seed)
  except ConfigError as e:
    output.fail("tools.recipe_data", str(e))
  except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM / SIGHUP (output.Interrupted)
    print("tools.recipe_data: interrupted; nothing written", file=sys.stderr)
    return 128 + getattr(e, "signum", signal.SIGINT)
  print(f"wrote {args.out}: {args.pretrain} caption records (pretrain.json), {args.instruct} "
        f"conversations (instruct.json), images in {args.out}/images")
  return 0


if __name__ == "__main__":
  output.run_main(main)
