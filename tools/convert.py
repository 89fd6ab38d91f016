"""LLaVA-format conversations -> the shards `data.task=conversations` trains on.

  python -m tools.convert --json llava_instruct.json --images coco/ --tokenizer llava-1.5-7b-hf \\
      --out data/llava [--processor DIR] [--eval 1000] [--seq_len 2048] [--image_tokens 576] \\
      [--image_token "<image>"] [--pad_to_square] [--on_error skip|fail] [--workers N]

Input: a JSON list or JSONL file of records `{"id", "image": path | [paths] | absent,
"conversations": [{"from": "human" | "gpt" | "system", "value": "...<image>..."}]}`, image paths
relative to `--images`. Each record is rendered with the language model's chat template
(`--tokenizer`: tokenizer.json and tokenizer_config.json; mimo_jax/data/chat.py), each `<image>`
becoming the image token, with a loss mask on the assistant turns; each image is prepared by the
vision tower's processor (`--processor`, default the tokenizer's directory:
preprocessor_config.json; mimo_jax/data/images.py) and stored decoded, as uint8 pixels at the
processor's size (no decoding while training).

Output in `--out`: `train.array_record` and `eval.array_record` (`--eval` records drawn at random
go to eval) with their metadata sidecars, and `conversations.json` (the manifest: image token id,
image size, vocabulary, counts). Records are converted in parallel (`--workers` processes, default
every core) with a progress bar; each shard is written under a temporary name and renamed when
complete, and the manifest last, so an interrupted run leaves no shard behind. An existing
conversion in `--out` is refused.

Bad records (a missing or corrupt image file, an `<image>` count other than the images listed, a
sample longer than `--seq_len` once each image takes `--image_tokens`, an unknown role, no
assistant turn) are skipped and counted by reason, each reported with its record id and file
(`--on_error skip`, the default), or stop the conversion with that message and exit status 2,
writing nothing (`--on_error fail`). The last lines give the counts and the flags to train with.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

from mimo_jax.config import ConfigError
from mimo_jax.data import conversations


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m tools.convert", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--json", required=True, help="LLaVA-format JSON or JSONL file")
  parser.add_argument("--images", required=True, help="the folder image paths are relative to")
  parser.add_argument("--tokenizer", required=True, help="HF directory: tokenizer.json and "
                      "tokenizer_config.json with the chat template")
  parser.add_argument("--processor", default="", help="HF directory with the vision tower's "
                      "preprocessor_config.json (default: --tokenizer)")
  parser.add_argument("--out", required=True, help="folder for the shards and manifest")
  parser.add_argument("--eval", type=int, default=0, help="records held out for eval")
  parser.add_argument("--seq_len", type=int, default=0, help="longest sample in tokens "
                      "(0 = no limit)")
  parser.add_argument("--image_tokens", type=int, default=1,
                      help="tokens an image takes in the sequence, for --seq_len")
  parser.add_argument("--image_token", default="<image>", help="the text that marks an image, "
                      "one special token of the tokenizer")
  parser.add_argument("--pad_to_square", action="store_true",
                      help="LLaVA's pad to square (on the processor's mean colour)")
  parser.add_argument("--on_error", choices=("skip", "fail"), default="skip")
  parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
  parser.add_argument("--seed", type=int, default=0, help="seed of the eval draw")
  args = parser.parse_args(argv)
  opts = conversations.Options(
      tokenizer=args.tokenizer, images=args.images, processor=args.processor,
      image_token=args.image_token, pad_to_square=args.pad_to_square, seq_len=args.seq_len,
      image_tokens=args.image_tokens, on_error=args.on_error, workers=args.workers)
  out = pathlib.Path(args.out)
  try:
    m = conversations.convert(pathlib.Path(args.json), out, opts, args.eval, args.seed)
  except ConfigError as e:
    print(f"convert: error: {e}", file=sys.stderr)
    return 2
  counts, skipped, took = m["samples"], m["skipped"], m["seconds"]
  print(f"converted {m['records']} records in {took:.1f} s ({m['records'] / took:.1f} "
        f"records/s, {args.workers} workers): {counts['train']} train and {counts['eval']} eval "
        f"samples, {m['images']} images, {sum(skipped.values())} skipped"
        + (f" ({', '.join(f'{k}: {v}' for k, v in sorted(skipped.items()))})" if skipped
           else ""))
  print(f"train with: --config.data.task=conversations --config.data.dir={out} "
        f"--config.data.image_token={m['image_token']} "
        f"--config.model.vision.image_size={m['image_size'][0]} "
        f"--config.model.language.vocab_size={m['vocab_size']} (or the model's larger vocabulary)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
