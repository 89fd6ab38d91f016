"""Images of awkward sizes and modes, CLIP and SigLIP processor configs, and transformers' pixel
values for them, for the image preprocessing tests.

  python -m tools.image_fixtures [--out tests/fixtures/images]

Needs transformers and Pillow (`pip install -e '.[hf]'`); the tests that read the fixtures do not.
The images are random pixels saved as PNG: portrait, landscape, tiny (smaller than the crop),
RGBA with varying transparency, grayscale and a palette image with a transparent colour. Each
processor is saved with `save_pretrained` (CLIP: shortest edge 24, centre crop 24; SigLIP: 20 x 20,
both bicubic) and `reference.npz` holds its `pixel_values` for every image, from transformers' PIL
backend (`CLIPImageProcessorPil`, `SiglipImageProcessorPil`: the processors without torchvision).
"""

from __future__ import annotations

import argparse
import pathlib
import shutil

import numpy as np
from PIL import Image

ROOT = pathlib.Path(__file__).resolve().parents[1]


def images(rng: np.random.Generator) -> dict[str, Image.Image]:
  def noise(h, w, c):
    return rng.integers(0, 256, (h, w, c), dtype=np.uint8)
  rgba = noise(29, 41, 4)
  rgba[..., 3] = np.linspace(0, 255, 41, dtype=np.uint8)[None]  # transparent to opaque
  palette = Image.fromarray(noise(17, 26, 3)).quantize(colors=16)
  palette.info["transparency"] = 0
  return {"portrait": Image.fromarray(noise(53, 31, 3)),
          "landscape": Image.fromarray(noise(27, 64, 3)),
          "tiny": Image.fromarray(noise(5, 3, 3)),
          "rgba": Image.fromarray(rgba, "RGBA"),
          "grayscale": Image.fromarray(noise(33, 21, 1)[..., 0], "L"),
          "palette": palette}


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(prog="python -m tools.image_fixtures", description=__doc__)
  parser.add_argument("--out", default=str(ROOT / "tests" / "fixtures" / "images"),
                      help="the folder to write (replaced whole)")
  out = pathlib.Path(parser.parse_args(argv).out)
  from transformers import CLIPImageProcessorPil, SiglipImageProcessorPil  # pylint: disable=import-outside-toplevel
  shutil.rmtree(out, ignore_errors=True)
  out.mkdir(parents=True)
  processors = {
      "clip": CLIPImageProcessorPil(size={"shortest_edge": 24},
                                    crop_size={"height": 24, "width": 24}),
      "siglip": SiglipImageProcessorPil(size={"height": 20, "width": 20}),
  }
  reference = {}
  for name, image in images(np.random.default_rng(0)).items():
    image.save(out / f"{name}.png")
    image = Image.open(out / f"{name}.png")  # as a user's file is read
    for kind, proc in processors.items():
      reference[f"{kind}/{name}"] = proc(images=image, return_tensors="np")["pixel_values"][0]
  for kind, proc in processors.items():
    proc.save_pretrained(out / kind)
  np.savez_compressed(out / "reference.npz", **reference)
  total = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
  print(f"wrote {out} ({total / 1e3:.0f} kB)")


if __name__ == "__main__":
  main()
