"""Converter throughput: LLaVA-style records with COCO-sized JPEG images through
`tools.convert`, per worker count.

  python -m tools.convert_bench [--records 400] [--workers 1,2] [--out /tmp/convert_bench]

Writes `--records` records (one random-noise JPEG of 640x480 or 480x640 each, a 2-4 turn
conversation of a few hundred characters) with the chat fixture's Llama-3 template and a CLIP
processor of LLaVA-1.5's settings (shortest edge 336, centre crop 336), converts them with each
worker count, and prints records/s. The tokenizer is the tests' small BPE (tests/fixtures/chat):
a real model's tokenizer.json of 128k entries costs more a token.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import time

import numpy as np
from PIL import Image

from tools import convert

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORDS = ("what is shown in this picture a red bus parked next to small tree two dogs are playing "
         "snow near fence how many people there three one holding an umbrella").split()


def make(out: pathlib.Path, records: int, seed: int = 0) -> pathlib.Path:
  rng = np.random.default_rng(seed)
  images = out / "images"
  images.mkdir(parents=True)
  rows = []
  for i in range(records):
    h, w = (480, 640) if i % 2 else (640, 480)
    pixels = rng.integers(0, 256, (h // 8, w // 8, 3), dtype=np.uint8)  # smooth after resize
    Image.fromarray(pixels).resize((w, h), Image.Resampling.BILINEAR).save(
        images / f"{i}.jpg", quality=90)
    say = lambda n: " ".join(rng.choice(WORDS, n))
    turns = [{"from": "human", "value": "<image>\n" + say(12)}, {"from": "gpt", "value": say(40)}]
    for _ in range(int(rng.integers(0, 2))):
      turns += [{"from": "human", "value": say(10)}, {"from": "gpt", "value": say(30)}]
    rows.append({"id": str(i), "image": f"{i}.jpg", "conversations": turns})
  (out / "data.json").write_text(json.dumps(rows))
  proc = out / "processor"
  proc.mkdir()
  shutil.copy(ROOT / "tests" / "fixtures" / "chat" / "llama3" / "tokenizer.json", proc)
  shutil.copy(ROOT / "tests" / "fixtures" / "chat" / "llama3" / "tokenizer_config.json", proc)
  (proc / "preprocessor_config.json").write_text(json.dumps({
      "image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": 336},
      "crop_size": {"height": 336, "width": 336}, "do_center_crop": True, "resample": 3,
      "image_mean": [0.48145466, 0.4578275, 0.40821073],
      "image_std": [0.26862954, 0.26130258, 0.27577711]}))
  return out


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(prog="python -m tools.convert_bench", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--records", type=int, default=400)
  parser.add_argument("--workers", default="1,2", help="comma-separated worker counts")
  parser.add_argument("--out", default="/tmp/convert_bench")
  parser.add_argument("--keep", action="store_true", help="keep the last conversion")
  args = parser.parse_args(argv)
  root = pathlib.Path(args.out)
  shutil.rmtree(root, ignore_errors=True)
  src = make(root / "source", args.records)
  rows = []
  for workers in (int(w) for w in args.workers.split(",")):
    out = root / f"converted_{workers}"
    started = time.perf_counter()
    code = convert.main(["--json", str(src / "data.json"), "--images", str(src / "images"),
                         "--tokenizer", str(src / "processor"), "--out", str(out),
                         "--eval", "16", "--seq_len", "2048", "--image_tokens", "576",
                         "--workers", str(workers)])
    took = time.perf_counter() - started
    if code:
      raise SystemExit(f"convert_bench: tools.convert exited {code}")
    rows.append((workers, took, args.records / took))
  print("| workers | seconds | records/s |\n|---:|---:|---:|")
  for workers, took, rate in rows:
    print(f"| {workers} | {took:.1f} | {rate:.1f} |")


if __name__ == "__main__":
  main()
