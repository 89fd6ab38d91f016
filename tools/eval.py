"""Answer an eval set with a trained or imported model and score the answers: `python -m tools.eval
WORKDIR --data DIR_OR_JSON [--metric NAME ...] [--out PREDS.jsonl]`.

  python -m tools.eval runs/llava --data data/vqa_val.json --images data/coco --metric vqa
  python -m tools.eval runs/llava --data data/llava_conv --metric exact_match --metric contains

`--data` is a directory `tools.convert` wrote (its `--split`, eval by default) or a LLaVA-format
JSON/JSONL file (images under `--images`, default the file's folder; tokenized with the run's
tokenizer and prepared by its processor, found as `tools.generate` finds them). A record's clips
(`"audio"`/`"audios"`, under `--audio`, default the file's folder; each marked by `<audio>`) are
read as tools.convert reads them (but a path leading out of `--images` or `--audio` is read too: the
eval set is the user's own, so no --allow_outside_images is asked): decoded, resampled, log-mel
features of the model's model.audio.mel_bins, each `<audio>` as `--audio_markers` whose
`--audio_token` stands for the clip's tokens; a bad clip is one error naming the record and file.
Each sample's prompt is its conversation before its last assistant turn; its references are its
record's `answers` (a list of strings, as VQA's ten) or else that turn's text. The samples are
answered greedily in batches of `--batch`, on the run's meshes (or `--layout`'s): each encoder on
its own devices, the language model decoding on its dp ranks with a key-value cache, every prompt
left-padded (mimo_jax/evaluate.py), until the tokenizer's end token or `--max_new_tokens`. On
stderr, a line as it reads the samples, as it loads the step and as it starts answering, then a
progress bar where stderr is a terminal, else a line every 10 s (samples done, rate, time left);
while it reads the records of a JSON file and lays out the batches, a line every 10 s too.

Writes `--out` (default WORKDIR/eval/<data name>[.<split>].step<N>.jsonl, the split a converted
directory's; where that holds an eval of other settings (metrics, --max_new_tokens), the first of
<...>.2.jsonl, .3.jsonl, ... holding this eval's rows or none; `--samples` is none of them: a larger
N goes on from the rows of a smaller one): one JSON row a sample (`id`: the record's, or its index
in the file where it has none; a converted split's rows add `position`, the sample's index in it;
`prompt`, `reference`, `prediction`, `score` by metric), appended and synced batch by batch under a
lock, once every batch is laid out (a sample the layout refuses stops the eval with nothing
written); an interrupted eval (Ctrl-C, SIGTERM) keeps its rows, as does one whose write fails (a
full disk: one line naming `--out`, status 2), and the same command goes on after the samples they
hold. Then `<out without .jsonl>.summary.json` (written whole, at once): each metric's mean (a
per-item metric's over the items) over this command's samples (`--out` may hold more, from a larger
`--samples`), the sample count, the step and the settings (`split`: a converted directory's, null
for a JSON). Metrics: mimo_jax/scoring.py.

Beside a run that is saving into WORKDIR, the eval reads committed steps only; a step that the
run rotates away (checkpoint.keep) while it is read is gone, not damaged: the newest step is
read instead (with a note), or, when every read lost its step, the eval stops with status 75:
run it again.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import logging
import os
import pathlib
import re
import sys
import time

from tqdm import tqdm

from mimo_jax import checkpoint_reader, output, scoring
from mimo_jax.config import Config, ConfigError, RunConfig
from mimo_jax.config_run import MAX_CPU_DEVICES
from tools import eval_samples
from tools.eval_rows import Rows, default_out, earlier_speed, key, summary_path
from tools import generate as generate_tool
from tools.common import Parser, run_folder
from tools.display import count

TOOL = "tools.eval"
DEFAULT_NEW_TOKENS = 32
PROGRESS_SECONDS = 10.0  # between the answering's lines where stderr is no terminal (no bar)


def _args(argv: list[str] | None) -> argparse.Namespace:
  parser = Parser(TOOL, prog="python -m tools.eval", sep=" ", allow_abbrev=False,
                  description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("workdir")
  parser.add_argument("--data", required=True, help="a converted directory or a LLaVA JSON(L)")
  parser.add_argument("--metric", action="append", default=[],
                      help=f"repeatable; one of {', '.join(sorted(scoring.METRICS))} "
                      "(default exact_match)")
  parser.add_argument("--out", default="", help="predictions JSONL")
  parser.add_argument("--split", default="eval", help="of a converted directory: eval or train")
  parser.add_argument("--images", default="", help="image folder of a JSON (default its folder)")
  parser.add_argument("--audio", default="", help="audio folder of a JSON (default its folder)")
  parser.add_argument("--audio_token", default="",
                      help="the audio placeholder token (default: the data's, else <|AUDIO|>)")
  parser.add_argument("--audio_markers", default="", help="what each <audio> of a JSON becomes, "
                      "--audio_token inside (default: <|audio_bos|><|AUDIO|><|audio_eos|> for "
                      "<|AUDIO|>, else the token alone)")
  parser.add_argument("--samples", type=int, default=0, help="the first N samples (0 = all)")
  parser.add_argument("--batch", type=int, default=None,
                      help="samples a batch, at least 1 (default eval.batch of the run; at most "
                      "the samples, rounded up to the language dp ranks)")
  parser.add_argument("--max_new_tokens", type=int, default=DEFAULT_NEW_TOKENS,
                      help=f"at least 1 (default {DEFAULT_NEW_TOKENS})")
  parser.add_argument("--seq_len", type=int, default=None,
                      help="positions of a prompt row, at least 1 (default the run's "
                      "data.seq_len)")
  parser.add_argument("--layout", default="",
                      help="module=offset/dp/tp,... instead of the run's topology")
  parser.add_argument("--step", type=int, default=None, help="default: the newest")
  parser.add_argument("--cpu_devices", type=int, default=None,
                      help="on CPUs: devices to create, at least 1 (default those the run's "
                      "topology, or --layout, spans, and at least its run.cpu_devices)")
  parser.add_argument("--tokenizer", default="")
  parser.add_argument("--processor", default="")
  parser.add_argument("--image_token", default="")
  parser.add_argument("--pad_to_square", action=argparse.BooleanOptionalAction, default=None)
  args = parser.parse_args(argv)
  args.metric = args.metric or ["exact_match"]
  return args


def check_flags(args: argparse.Namespace) -> None:
  """Flags that are wrong whatever the run, before anything is read."""
  for m in args.metric:
    if m not in scoring.METRICS:
      raise ConfigError(f"--metric {m}: no such metric; registered: "
                        f"{', '.join(sorted(scoring.METRICS))}.")
  if not os.path.exists(args.data):
    raise ConfigError(f"--data {args.data}: not found; give a directory tools.convert wrote or a "
                      "LLaVA-format JSON file.")
  for flag in ("max_new_tokens", "batch", "seq_len", "cpu_devices"):
    if getattr(args, flag) is not None and getattr(args, flag) < 1:  # None: the run's
      raise ConfigError(f"--{flag} {getattr(args, flag)}: give a positive number.")
  if (args.cpu_devices or 0) > MAX_CPU_DEVICES:
    raise ConfigError(f"--cpu_devices {args.cpu_devices}: at most {MAX_CPU_DEVICES} (each device "
                      "costs memory and threads); give the devices the layout spans.")
  if args.samples < 0:
    raise ConfigError(f"--samples {args.samples}: give a positive number (0: all samples).")
  if args.step is not None and args.step < 0:
    raise ConfigError(f"--step {args.step}: give a step of the run, 0 or more.")
  if args.out:
    output.refuse_place(args.out)
  if args.out and os.path.isdir(args.out):
    raise ConfigError(f"--out {args.out} is a directory; give the predictions' file "
                      "(PREDS.jsonl).")
  run_folder(args.workdir)


# The run.

def cpu_devices(args) -> int:
  """The CPU devices the CPU backend creates: --cpu_devices, else those the newest step's config
  (read before JAX starts) spans, its topology's (or --layout's) and at least its run.cpu_devices
  (a run of several processes records one process's), else the default."""
  if getattr(args, "cpu_devices", 0):
    return args.cpu_devices
  # pylint: disable-next=import-outside-toplevel
  from mimo_jax.config import from_dict, set_layout
  root = pathlib.Path(args.workdir) / "checkpoints"
  steps = sorted((int(p.name) for p in root.iterdir() if p.name.isdigit()), reverse=True) \
      if root.is_dir() else []
  for step in ([args.step] if args.step is not None else []) + steps:
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError, ConfigError):
      cfg = from_dict(json.loads((root / str(step) / "meta" / "metadata").read_text())["config"])
      if getattr(args, "layout", ""):
        set_layout(cfg, args.layout)
      spans = max(t.offset + t.dp * t.tp * t.pp for t in cfg.topology.modules().values())
      return max(cfg.run.cpu_devices, spans)
  return RunConfig().cpu_devices


def run_config(args) -> tuple[int, Config]:
  """(step, the run's config as that step stored it, --layout and --seq_len applied: its
  init_from fields still lead to the imports it descends from, whose tokenizer and processor
  `tools.generate`'s defaults find; `from_step` sets the parameters to come from the step);
  `args` holds the flags workdir, step, layout and seq_len."""
  # pylint: disable=import-outside-toplevel
  import jax
  from mimo_jax.config import from_dict, set_layout
  with contextlib.suppress(RuntimeError):  # a backend already started keeps its devices
    jax.config.update("jax_num_cpu_devices", cpu_devices(args))  # before the reader starts it
  reader = checkpoint_reader.Reader(args.workdir)
  reader.note(TOOL)
  step, meta = checkpoint_reader.newest(reader, args.step, reader.meta, tool=TOOL)
  reader.close()
  cfg = from_dict(meta["config"])
  for name in cfg.topology.modules():  # an eval never drops out (a run of rank 0 may name a rate)
    if getattr(cfg.model.module(name), "lora", None) is not None:
      cfg.model.module(name).lora.dropout = 0.0
  if args.layout:
    from mimo_jax.validation_topology import validate_topology
    try:  # the layout's devices checked before the samples are read
      set_layout(cfg, args.layout)
      validate_topology(cfg, len(jax.devices()))
    except ConfigError as e:
      raise layout_error(args.layout, e) from None
  if args.seq_len:
    cfg.data.seq_len = args.seq_len
  return step, cfg


def from_step(args, cfg: Config, step: int) -> None:
  """`cfg`'s parameters set to come from `step` of the run (`run_config`'s; `_parameters` names
  the one it loads), through the modules' own start-from-a-run path."""
  for name in cfg.topology.names():
    module = cfg.model.module(name)
    if hasattr(module, "init_from"):
      module.init_from = ""
    if getattr(module, "lora", None) is not None:  # the step holds the adapters it trained
      module.lora.init_from = ""
  cfg.model.init_from = f"{os.path.abspath(args.workdir)}:{step}"


def layout_error(layout: str, e: ConfigError) -> ConfigError:
  """`e`, an error of the topology fields that `--layout` set, as the flag's: "--layout 'X':
  <module>: <reason>" (not the config.topology field the user never typed)."""
  field, _, reason = str(e).partition(": ")
  if not field.startswith("config.topology"):
    return e
  whole = repr(layout)
  if reason.startswith(f"{whole}: "):  # set_layout names the item: here, the whole flag
    reason = reason.removeprefix(f"{whole}: ")
  elif reason.startswith(f"{whole} is "):
    reason = reason.removeprefix(f"{whole} is ")
  module = field.removeprefix("config.topology").lstrip(".").split(".")[0]
  named = f"{module}: " if module and not reason.startswith("'") else ""
  return ConfigError(f"--layout {whole}: {named}{reason}")


def _parameters(args, trainer) -> tuple[int, dict]:
  """(step, the eval's state holding its parameters): the step `run_config` read, or the newest
  one. A step that a live run's rotation (checkpoint.keep) removes between its metadata read and
  its weights load, or during the load, is gone, not damaged: the newest step is loaded instead
  (checkpoint_reader.newest; a given --step names the steps there are now)."""
  cfg, reader = trainer.cfg, checkpoint_reader.Reader(args.workdir)

  def load(step: int) -> dict:
    cfg.model.init_from = f"{os.path.abspath(args.workdir)}:{step}"
    try:
      return trainer.init_state(cfg.train.seed, optimizer=False)
    except Exception:
      if reader.gone(step):
        raise checkpoint_reader.StepGone(step) from None
      raise
  try:
    return checkpoint_reader.newest(reader, args.step, load, tool=TOOL)
  finally:
    reader.close()


def _unused_id(samples: list[dict], vocab: int) -> int:
  """The vision encoder's placeholder for samples without images whose tokenizer has no image
  token (an audio model's): the largest id no prompt holds, since the built-in one may be a
  word of theirs."""
  used = {i for s in samples for i in s["sample"]["tokens"]}
  return next(i for i in range(vocab - 1, -1, -1) if i not in used)


def build_step(args, cfg: Config, image_id: int | None):
  """The eval's Step (meshes and programs), after checking the config (`run_config`'s, its
  parameters set to come from the run's step by `from_step`) against the flag data."""
  # pylint: disable=import-outside-toplevel
  import jax
  from mimo_jax.step import Step
  from mimo_jax.validation import manifest_field, validate
  if cfg.data.task == "synthetic":  # an import of configs/vlm.py: --data's image token, not <img>
    cfg.data.task, cfg.data.dir, cfg.data.image_token = "conversations", "", -1
  without = cfg.data.task == "conversations" and manifest_field(cfg, "image_token") == -1
  if cfg.data.task == "conversations" and cfg.data.image_token < 0 and image_id is not None:
    cfg.data.image_token = image_id  # an import's run: the tokenizer's image token
  checked = copy.deepcopy(cfg)
  # The run's own data is not read: a converted run without data.dir (an import) is evaluated too.
  checked.data.dir = checked.data.dir or os.path.abspath(args.data)
  # The eval's rows hold each of --data's samples or name it with --seq_len
  # (eval_samples.check_lengths), whatever the run's longest training sample.
  checked.data.seq_len = max(checked.data.seq_len, manifest_field(checked, "longest") or 0)
  if without:  # a run of data without images; a JSON's samples get an unused placeholder id
    checked.data.image_token = -1
  try:
    validate(checked, len(jax.devices()))
  except ConfigError as e:
    field, _, reason = str(e).partition(": ")
    # The flag's rows, not a field never typed (where the data's longest sample set the rows,
    # the field's own words stand: the flag cannot help there).
    if field == "config.data.seq_len" and checked.data.seq_len == args.seq_len:
      raise ConfigError(f"--seq_len {args.seq_len}: {re.sub(r'^[0-9]+ (positions )?', '', reason)}"
                        ) from None
    raise layout_error(args.layout, e) if args.layout else e from None
  return Step.build(cfg)


def _say(line: str) -> None:
  """A line of progress on stderr, at once (a log shows the eval working before the bar)."""
  print(f"{TOOL}: {line}", file=sys.stderr, flush=True)


class _Lines:
  """Progress as a line every PROGRESS_SECONDS on stderr: "answering: 40 of 400 samples (10%),
  3.2 samples/s, about 112 s left". `bar`: a terminal shows a bar instead (no lines there)."""

  def __init__(self, doing: str, unit: str, total: int, done: int = 0, bar: bool = True):
    self.doing, self.unit = doing, unit
    self.total, self.done, self.first = total, done, done
    self.started = self.last = time.monotonic()
    self.on = not (bar and getattr(sys.stderr, "isatty", None) and sys.stderr.isatty())

  def update(self, n: int) -> None:
    self.done += n
    now = time.monotonic()
    if not self.on or now - self.last < PROGRESS_SECONDS or self.done >= self.total:
      return
    self.last = now
    rate = (self.done - self.first) / max(now - self.started, 1e-9)
    _say(f"{self.doing}: {self.done} of {count(self.total, self.unit)} "
         f"({100 * self.done / self.total:.0f}%), {rate:.1f} {self.unit}s/s, about "
         f"{(self.total - self.done) / rate:.0f} s left")


def run(args: argparse.Namespace) -> dict:
  # pylint: disable=import-outside-toplevel
  from mimo_jax import eval_set
  from mimo_jax.data import conversations
  from mimo_jax.data.chat import ChatTokenizer
  from mimo_jax.data.images import ImageProcessor
  from mimo_jax.evaluate import Evaluator
  began = time.monotonic()
  newest, cfg = run_config(args)  # the step: `_parameters`, which follows a live run's rotation
  found = generate_tool.defaults(args.workdir, cfg)
  tok = ChatTokenizer.open(args.tokenizer or generate_tool.default_dir(
      found, "tokenizer", "tokenizer.json", "--tokenizer", args.workdir))
  generate_tool.check_vocab(tok, cfg, found, bool(args.tokenizer))
  image_token = args.image_token or found["image_token"]
  if os.path.isdir(args.data):
    image_id = conversations.manifest(args.data, "--data")["image_token"]
  else:
    image_id = tok.token_id(image_token) if tok.tokenizer.token_to_id(image_token) is not None \
        else None
  read = f"--split {args.split} of " if os.path.isdir(args.data) else ""
  _say(f"reading the samples of {read}{args.data} ...")
  if os.path.isdir(args.data):
    samples = eval_samples.converted_samples(args, tok)
  else:
    pad = found["pad_to_square"] if args.pad_to_square is None else args.pad_to_square
    proc = lambda: ImageProcessor.open(args.processor or generate_tool.default_dir(
        found, "processor", "preprocessor_config.json", "--processor", args.workdir),
                                       pad_to_square=pad)
    samples = eval_samples.json_samples(
        args, cfg, tok, proc, image_token, eval_samples.audio_settings(args, cfg, tok, found),
        lambda total: _Lines("reading", "record", total, bar=False))
    if image_id is None and "vision" in cfg.model.encoders:
      image_id = _unused_id(samples, cfg.model.language.vocab_size)
  if not samples:
    raise ConfigError(f"--data {args.data}: no samples to answer.")
  eval_samples.fit_windows(cfg, samples, _say)
  _say(f"read {count(len(samples), 'sample')} in {time.monotonic() - began:.1f} s; loading step "
       f"{newest} of {args.workdir} ...")
  began = time.monotonic()
  from_step(args, cfg, newest)
  trainer = build_step(args, cfg, image_id)
  dp = trainer.topo.dp("language")
  bsz = eval_set.batch_size(cfg, dp, min(args.batch or cfg.eval.batch, len(samples)))
  layout = eval_set.layout_for(cfg, dp, bsz, samples)
  eval_samples.check_lengths(args, layout, samples)
  step, state = _parameters(args, trainer)
  settings = {"workdir": os.path.abspath(args.workdir), "step": step,
              "data": os.path.abspath(args.data),
              "split": args.split if os.path.isdir(args.data) else None,  # a JSON has none
              "max_new_tokens": args.max_new_tokens, "metrics": args.metric}
  out = pathlib.Path(args.out) if args.out else default_out(args, step, settings)
  rows = Rows(out, settings, "--out" if args.out else "the default --out (from --data's name)")
  try:
    todo = [s for s in samples if key(s) not in rows.done]
    checked = _Lines("laying out", "sample", len(todo), bar=False)
    for start in range(0, len(todo), bsz):  # every batch laid out first: a refusal writes nothing
      eval_samples.batch(todo[start:start + bsz], args, layout, bsz)
      checked.update(len(todo[start:start + bsz]))
    kept = len(samples) - len(todo)
    _say(f"loaded step {step} in {time.monotonic() - began:.1f} s; answering "
         f"{len(todo)} of {count(len(samples), 'sample')}"
         + (f" ({kept} answered already in {out})" if kept else ""))
    evaluator = Evaluator(trainer)
    lines = _Lines("answering", "sample", len(samples), kept)
    bar = tqdm(total=len(samples), initial=kept, unit="sample",
               desc=f"{pathlib.Path(args.data).name} step {step}", disable=None)
    started, generated, eos = time.time(), 0, eval_set.eos_id(tok)
    with bar:
      for start in range(0, len(todo), bsz):
        chunk = todo[start:start + bsz]
        batch = eval_samples.batch(chunk, args, layout, bsz)
        got = evaluator.answers(state, [batch], args.max_new_tokens, eos)
        answers = [got[k] for k in range(len(chunk))]
        generated += sum(list(a).index(eos) if eos in a else len(a) for a in answers)
        rows.append(eval_set.scored(chunk, answers, tok, args.metric, layout))
        bar.update(len(chunk))
        lines.update(len(chunk))
    took = time.time() - started
    scores = [rows.done[key(s)]["score"] for s in samples]
    items = [eval_set.item_count(layout, s) for s in samples]
    summary = dict(settings, samples=len(samples), out=os.path.abspath(out),
                   **{m: scoring.figure(m, [s[m] for s in scores], items)[0]
                      for m in args.metric},
                   answered_now=len(todo),
                   at_limit=sum(bool(rows.done[key(s)].get("at_limit")) for s in samples),
                   new_tokens_per_s=generated / took if todo else earlier_speed(out),
                   topology=trainer.topo.describe())
    with output.write_errors(f"--out={str(out)!r} (its summary, {summary_path(out).name})"):
      output.write_whole(summary_path(out), summary)
    return summary
  except BaseException as e:  # what main says: the rows in --out, and whether any are new
    e.rows, e.batch = (out, rows.earlier + rows.added, rows.added), bsz
    raise
  finally:
    rows.close()


def _kept(e: KeyboardInterrupt) -> str:
  """What an interrupted eval leaves: the rows in --out, which the same command goes on from."""
  out, held, new = getattr(e, "rows", (None, 0, 0))
  said = f"{count(held, 'row')} in {out}, {new} written now" if held else "nothing was written"
  return f"{said}: run the same command to go on."


def main(argv: list[str] | None = None) -> int:
  args = _args(argv)
  logging.getLogger("absl").setLevel(logging.ERROR)
  try:
    check_flags(args)
    with output.interrupts_as_exceptions():
      summary = run(args)
  except (ConfigError, ValueError) as e:
    sys.stdout.flush()
    print(f"{TOOL}: error: {e}", file=sys.stderr)
    return 75 if isinstance(e, checkpoint_reader.TryAgain) else 2
  except KeyboardInterrupt as e:
    sys.stdout.flush()
    print(f"{TOOL}: interrupted ({output.said(e)[1]}); {_kept(e)}", file=sys.stderr)
    return 128 + output.said(e)[0]
  except Exception as e:  # pylint: disable=broad-except  (a device's memory is one line)
    from mimo_jax import memory  # pylint: disable=import-outside-toplevel
    now = f" (now {e.batch})" if hasattr(e, "batch") else ""
    if not (line := memory.device_ran_out(e, f"a smaller --batch{now}")):
      raise
    print(f"{TOOL}: error: {line}; {_kept(e)}", file=sys.stderr)
    return 1
  metrics = ", ".join(f"{m} {summary[m]:.4f}" for m in args.metric)
  if summary["at_limit"]:  # cut answers score as cut: said, not left to be found in the rows
    print(f"{TOOL}: note: {summary['at_limit']} of {count(summary['samples'], 'answer')} stopped "
          f"at --max_new_tokens {args.max_new_tokens} before an end token (rows with "
          "\"at_limit\": true); a larger --max_new_tokens lets them finish, and may score them "
          "otherwise.", file=sys.stderr)
  print(f"{count(summary['samples'], 'sample')} of {args.data} at step {summary['step']}: "
        f"{metrics}; "
        f"rows in {summary['out']}")
  return 0


if __name__ == "__main__":
  output.run_main(main)
