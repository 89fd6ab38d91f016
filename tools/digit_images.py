"""Writes held-out digits as PNG files for the README's generation example:
`python -m tools.digit_images [--out docs/digits] [--count 2] [--scale 8]`.

Each is an eval-set image (never trained on) as the digits task stores it (0..255 grayscale),
enlarged `--scale` times with nearest-neighbour pixels so that it is visible; the task's image
processor (an 8x8 box-filter resize) turns it back into the stored 8x8 pixels exactly. Files of
the same names in `--out` are replaced (each written whole: a temporary file renamed over it).
"""

from __future__ import annotations

import argparse
import os
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
  _, _, images, labels = digits.split_images()
  if not 1 <= args.count <= len(images):
    parser.error(f"--count {args.count}: the eval set has {len(images)} images; give 1 to "
                 f"{len(images)}.")
  if not 1 <= args.scale <= 256:  # 256: a 2048-pixel image; beyond, memory, not a picture
    parser.error(f"--scale {args.scale}: give a whole number of pixels an image pixel, 1 to 256.")
  out = pathlib.Path(args.out)
  if out.exists() and not out.is_dir():
    parser.error(f"--out {args.out} is a file; give a folder.")
  from PIL import Image  # pylint: disable=import-outside-toplevel
  try:
    out.mkdir(parents=True, exist_ok=True)
    for i in range(args.count):
      image = Image.fromarray(digits.pixels(images[i]), mode="L")
      path = out / f"eval-{i:04d}-{DIGIT_WORDS[int(labels[i])]}.png"
      tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
      try:
        image.resize((8 * args.scale,) * 2, Image.Resampling.NEAREST).save(tmp, format="PNG",
                                                                            optimize=True)
        os.replace(tmp, path)
      finally:
        tmp.unlink(missing_ok=True)
      print(path)
  except OSError as e:
    parser.exit(2, f"{parser.prog}: error: --out {args.out}: {e.strerror or e}; choose a "
                   "writable folder.\n")


if __name__ == "__main__":
  main()
