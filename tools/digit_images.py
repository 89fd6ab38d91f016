"""Writes held-out digits as PNG files for the README's generation example:
`python -m tools.digit_images [--out docs/digits] [--count 2] [--scale 8]`.

Each is an eval-set image (never trained on) as the digits task stores it (0..255 grayscale),
enlarged `--scale` times with nearest-neighbour pixels so that it is visible; the task's image
processor (an 8x8 box-filter resize) turns it back into the stored 8x8 pixels exactly.
"""

from __future__ import annotations

import argparse
import pathlib

from mimo_jax.data import digits
from mimo_jax.data.tokenizer import DIGIT_WORDS


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(prog="python -m tools.digit_images", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", default="docs/digits")
  parser.add_argument("--count", type=int, default=2)
  parser.add_argument("--scale", type=int, default=8)
  args = parser.parse_args(argv)
  from PIL import Image  # pylint: disable=import-outside-toplevel
  _, _, images, labels = digits.split_images()
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  for i in range(args.count):
    image = Image.fromarray(digits.pixels(images[i]), mode="L")
    path = out / f"eval-{i:04d}-{DIGIT_WORDS[int(labels[i])]}.png"
    image.resize((8 * args.scale,) * 2, Image.Resampling.NEAREST).save(path, optimize=True)
    print(path)


if __name__ == "__main__":
  main()
