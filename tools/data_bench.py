"""Data pipeline benchmark on the synthetic VLM set: throughput, scalable reads, reorder, padding.

  python -m tools.data_bench [--config=configs/vlm.py] [--workers=0,2,4,8] [--processes=0,4]
                             [--dps=2,4,8] [--record]

Prints up to five tables (the fifth with buckets set):

1. **samples/s vs grain worker processes and read threads** (`data.worker_processes`,
   `data.workers`): the training loader (read, decode, layout, stack), all records read, timed
   from its start over `--steps` steps or 20 per thread and process, whichever is more (each thread
   and process prefetches 2 steps).
2. **records read per rank**: per microbatch, by one language dp rank when every rank reads the
   whole microbatch (before scalable data parallelism) and when it reads only its share.
3. **per-rank cost spread** (max / mean of the ranks' summed sample costs, `data.image_token_cost`
   and `data.text_token_cost`) in stream order and after `data.reorder=balance`, for each dp.
4. **padding efficiency**: real image tokens / image slot tokens, where the slots per rank are the
   fewest that hold every measured microbatch, in stream order and after the reorder (with one
   image a slot: real images / slots; with dynamic resolution the slots are packed).
5. **padding sent** (with `data.row_buckets` or `data.slot_buckets` set, one language rank):
   real text tokens / the packed rows' positions the microbatches send (row fill) and real image
   tokens / the image slots' tokens they send (image fill), with `data.microbatch_fill` stream
   and pack, over `--fill_steps` steps, and the loader's time a step for each (one thread).

Tables 3 and 4 need only the per-record metadata (data/meta.py), so they read no record at all.
`--set field=value` overrides config fields; `--record` appends the tables to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from mimo_jax.data import loader
from mimo_jax.encoders.vision import slot_tokens
from tools.common import load_config, record


def _ints(s: str) -> list[int]:
  return [int(v) for v in s.split(",") if v]


def throughput(cfg, path: str, workers: int, processes: int, steps: int) -> float:
  """Timed from the iterator's creation (worker start-up included), over enough steps that the
  prefetch buffers (2 steps a thread or process) are a small part of them."""
  cfg.data.workers, cfg.data.worker_processes = workers, processes
  steps = max(steps, 20 * max(workers, 1) * max(processes, 1))
  start = time.perf_counter()
  it = loader.train_iterator(cfg, path, 1)
  for _ in range(steps):
    next(it)
  took = time.perf_counter() - start
  it.close()
  return steps * cfg.data.global_batch / took


def reads(cfg, path: str, dp: int, steps: int) -> tuple[float, float]:
  """Records a language dp rank reads per microbatch: the whole microbatch, and its share."""
  ds = loader.train_dataset(cfg, path, dp, loader.Locality(groups=frozenset({0}), slots={}))
  share = np.mean([ds[s].stats.records_read.mean() for s in range(steps)])
  return float(cfg.data.micro_batch), float(share)


def balance_stats(cfg, path: str, dp: int, steps: int) -> dict:
  """Cost spread and the slots a rank needs, in stream order and balanced (metadata only)."""
  out = {}
  for mode in ("none", "balance"):
    cfg.data.reorder = mode
    ds = loader.train_dataset(cfg, path, dp, loader.Locality(groups=frozenset(), slots={}))
    batches = [ds[s] for s in range(steps)]
    spread = np.mean([b.stats.cost_spread.mean() for b in batches])
    # The fewest slots a rank needs for every measured microbatch, and the image tokens they hold.
    slots = max(int(b.slots["vision"].used_g.max()) for b in batches)
    real = sum(int(b.stats.item_tokens["vision"].sum()) for b in batches)
    microbatches = sum(b.slots["vision"].used_g.shape[0] for b in batches)
    out[mode] = {"spread": float(spread), "slots": slots,
                 "efficiency": real / (microbatches * dp * slots * slot_tokens(cfg))}
  return out


def fill_stats(cfg, path: str, steps: int) -> dict:
  """Row fill and image fill of what the microbatches send, and the loader's seconds a step."""
  ds = loader.train_dataset(cfg, path, 1, loader.Locality(groups=frozenset(), slots={}))
  layout = loader.make_layout(cfg, 1)
  tokens = rows = items = slots = 0
  start = time.perf_counter()
  for s in range(steps):
    b = ds[s]
    tokens += int(b.stats.tokens.sum())
    rows += int(b.text.rows_sent.sum() if cfg.data.pack_rows else
                b.text.tokens_rl.shape[0] * b.text.tokens_rl.shape[1]) * cfg.data.seq_len
    for e in layout.encoders:
      items += int(b.stats.item_tokens[e.name].sum())
      slots += int(b.slots[e.name].sent.sum()) * e.slot_tokens
  return {"row_fill": tokens / max(rows, 1), "image_fill": items / max(slots, 1),
          "seconds": (time.perf_counter() - start) / steps}


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(prog="python -m tools.data_bench", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", default="configs/vlm.py", help="config file[:variant]")
  parser.add_argument("--set", action="append", default=[], help="field=value override")
  parser.add_argument("--workers", default="0,2,4,8", help="grain read threads to try")
  parser.add_argument("--processes", default="0", help="grain worker processes to try")
  parser.add_argument("--dps", default="2,4,8", help="language dp sizes for tables 2-4")
  parser.add_argument("--steps", type=int, default=4, help="steps per measurement")
  parser.add_argument("--balance_batch", type=int, default=64,
                      help="microbatch size for tables 3-4 (several samples a rank)")
  parser.add_argument("--fill_steps", type=int, default=60, help="steps for table 5")
  parser.add_argument("--record", action="store_true", help="append to docs/benchmarks.md")
  args = parser.parse_args(argv)

  def config():
    return load_config("data_bench", args.config, args.set)

  cfg = config()
  path = loader.build_paths(cfg, progress=lambda s: print(s, flush=True))["train"]
  tables = []
  rows = [f"| {p} | {w} | {throughput(config(), path, w, p, args.steps):.1f} |"
          for p in _ints(args.processes) for w in _ints(args.workers)]
  tables.append("| worker processes | read threads each | samples/s |\n|---:|---:|---:|\n" +
                "\n".join(rows))
  rows, spread, padding = [], [], []
  def unpacked():  # tables 2-4 count records and slots: one sample a row, every dp fits
    c = config()
    c.data.pack_rows = c.data.row_buckets = 0
    c.data.microbatch_fill = "stream"
    return c

  for dp in _ints(args.dps):
    c = unpacked()
    c.data.global_batch = c.data.microbatches * max(c.data.micro_batch, dp)
    c.model.vision.image_slots = 0  # every dp fits (the table counts records, not slots)
    whole, share = reads(c, path, dp, args.steps)
    rows.append(f"| {dp} | {whole:.0f} | {share:.1f} | {whole / dp:.1f} |")
    c = unpacked()
    c.data.global_batch = c.data.microbatches * args.balance_batch
    c.model.vision.image_slots = 0  # as many as could be needed: the table measures how many are
    st = balance_stats(c, path, dp, args.steps)
    spread.append(f"| {dp} | {args.balance_batch // dp} | {st['none']['spread']:.3f} | "
                  f"{st['balance']['spread']:.3f} |")
    padding.append(f"| {dp} | {st['none']['slots']} | {st['none']['efficiency']:.1%} | "
                   f"{st['balance']['slots']} | {st['balance']['efficiency']:.1%} |")
  tables.append("| language dp | records read a microbatch, whole | scalable | expected share |"
                "\n|---:|---:|---:|---:|\n" + "\n".join(rows))
  tables.append("| dp | samples a rank | cost spread in order | after balance |\n"
                "|---:|---:|---:|---:|\n" + "\n".join(spread))
  tables.append("| dp | slots a rank, in order | padding efficiency | slots a rank, balanced | "
                "padding efficiency |\n|---:|---:|---:|---:|---:|\n" + "\n".join(padding))
  if cfg.data.row_buckets or cfg.data.slot_buckets:
    rows = []
    for fill in ("stream", "pack"):
      c = config()
      c.data.microbatch_fill = fill
      f = fill_stats(c, path, args.fill_steps)
      rows.append(f"| {fill} | {f['row_fill']:.1%} | {f['image_fill']:.1%} | "
                  f"{f['seconds'] * 1e3:.0f} |")
    tables.append("| data.microbatch_fill | row fill | image fill | loader ms a step |\n"
                  "|---|---:|---:|---:|\n" + "\n".join(rows))
  text = "\n\n".join(tables)
  print(text)
  if args.record:
    record(f"Data pipeline, {args.config}", "data_bench", argv, text, device=False)


if __name__ == "__main__":
  main()
