"""Hugging Face checkpoints in and out of mimo_jax.

  python -m tools.hf import --hf DIR [--hf DIR] --out WORKDIR [--config=FILE[:ARG]] [--config.a.b=v ...]
  python -m tools.hf export WORKDIR [--step N] --out DIR [--model llava|qwen2_audio] [--module vision|audio|language] [--tokenizer DIR] [--peft] [--overwrite]
  python -m tools.hf check --hf DIR [--dtype float32|bfloat16]

`import` reads an HF model directory (config.json and safetensors, sharded with an index or not):
a SigLIP or CLIP vision tower, a Llama-3.x or Qwen2 language model, or a LLaVA checkpoint (both);
`--hf` twice takes a tower and a language model from two directories.
It takes the model fields of the modules it holds from config.json (and the pixel mean and std
from preprocessor_config.json), the rest from `--config` (default configs/vlm.py, sized for GPUs;
configs/llava_cpu.py for a run on CPUs) and the `--config.a.b=v` overrides, and writes
WORKDIR/config.py (with WORKDIR/config.json, and hf_import.json with the directories' absolute
paths) and a step-0 checkpoint, each tensor streamed from its file into its devices. It prints
the launch command, with placeholders for the data the run still needs (data.dir, and
data.image_token unless a LLaVA's config.json gives it), and a note when the default base is used
on a machine with CPUs only.
An override that contradicts config.json is an error naming both values; so is a config.json
field that is missing, null or of another type, a tensor holding NaN or infinity (refused as it
is read), an --out that is a file or a non-empty directory (a WORKDIR that holds checkpoints
among them), or too little free space: each before anything is written. The workdir is written
in a staging directory beside it that becomes WORKDIR in one rename with config.py in it; an
import that fails, is interrupted (Ctrl-C) or killed (SIGTERM) leaves nothing (exit status
130 or 143).

`export` writes a checkpoint as a complete HF directory that transformers loads with its own
classes: the whole model as LlavaForConditionalGeneration (vision and language) or as
Qwen2AudioForConditionalGeneration (`--model qwen2_audio`: audio and language, the default for
a run without a vision encoder or whose language model came from a Qwen2-Audio directory; with
WhisperFeatureExtractor's preprocessor_config.json, Qwen2AudioProcessor's processor_config.json,
the audio token `--audio_token_index`, else model.audio.audio_token), or one module:
SiglipVisionModel / CLIPVisionModel (`--module vision`), a WhisperModel holding the audio encoder
(`--module audio`, with WhisperFeatureExtractor's preprocessor_config.json; its decoder is not the
run's: transformers initialises it on loading), LlamaForCausalLM / Qwen2ForCausalLM
(`--module language`). Float32 weights, sharded at 5 GB with an index; config.json with the
source's max_position_embeddings; the image processor the run's images were prepared with
(preprocessor_config.json); LlavaProcessor's processor_config.json; the tokenizer's files with
its chat template (the run's data's tokenizer, else the language model's source's, else
`--tokenizer DIR`) and generation_config.json with its bos, eos and pad. The image token is
`--image_token_index`, else the run's data.image_token, else the imported LLaVA's, else the
tokenizer's <image>. A tower imported beside a language model (`--hf` twice) is read as LLaVA
reads one (no final norm; a projector as wide as the language model), so it exports as LLaVA.
Written staged and renamed into place (a failed write, Ctrl-C or SIGTERM leaves nothing: one
line, exit status 2, 130 or 143); a non-empty --out is refused unless it holds a complete
export and `--overwrite` is given; NaN or Inf weights are refused. A module with LoRA adapters
(model.<module>.lora) is written merged: the plain model.

`export --peft` writes the run's LoRA adapters instead, as a PEFT adapter directory
(adapter_config.json, adapter_model.safetensors with PEFT's names; mimo_jax/hf/peft.py) that
`peft.PeftModel.from_pretrained(base, DIR)` loads over the base the export without --peft would
write from the step the run started from: LLaVA's tower and language model adapters (the
default), or `--module language` / `--module vision` alone; a trained projector goes with them
whole (PEFT's modules_to_save). A module that trains its own weights has no place in an adapter:
the export is refused, naming it.

`check` (needs torch and transformers: `pip install -e '.[hf]'`) runs the same random inputs
through transformers and mimo_jax and prints the largest absolute and relative differences of the
logits (language models, LLaVA) or hidden states (towers).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import math
import os
import pathlib
import resource
import shutil
import signal
import sys
import time

import numpy as np

from mimo_jax import checkpoint_reader, configfile, hf, output, run_paths
from mimo_jax.hf import export as hf_export
from mimo_jax.hf import audio as hf_audio
from mimo_jax.hf import vision as hf_vision
from mimo_jax.config import DIGITS_VOCAB, Config, ConfigError, from_dict

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_BASE = "configs/vlm.py"
CPU_BASE = "configs/llava_cpu.py"  # the base for a run on CPUs
SHARD_BYTES = 5 * 1024**3
SAVE_HOST_GB = 2  # GB a save copies to the host at a time, raised to the largest array's size


def _fail(message: str) -> None:
  print(f"tools.hf: error: {message}", file=sys.stderr)
  sys.exit(2)


def import_(args, extra: list[str]) -> None:
  out = pathlib.Path(args.out).resolve()
  try:
    with output.interrupts_as_exceptions():
      report = _import(args, extra, out)
  except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM / SIGHUP (output.Interrupted)
    print(f"tools.hf: import interrupted; nothing was written to {out}", file=sys.stderr)
    sys.exit(128 + getattr(e, "signum", signal.SIGINT))
  print("\n".join(report), flush=True)  # once `out` is in place


def _import(args, extra: list[str], out: pathlib.Path) -> list[str]:
  """The import into workdir `out`: checked before any tensor is read, written through a staging
  directory that becomes `out` in one rename once config.py is in it. Returns what to print."""
  from mimo_jax.checkpoint import Checkpointer, compact_nbytes, complete_steps, directory  # pylint: disable=import-outside-toplevel
  ckpts = directory(str(out))
  if os.path.isdir(ckpts) and complete_steps(ckpts):
    _fail(f"{out} already holds checkpoints ({ckpts}); choose a new --out.")
  output.check_target(out, "workdir", "--out")
  sources = [hf.Source.open(d) for d in args.hf]
  overrides = dict(map(configfile.parse_override, extra))
  cfg = configfile.load(args.config or DEFAULT_BASE, extra,
                        hint=f"{DEFAULT_BASE} (GPU-sized) or {CPU_BASE} (CPU-sized)")
  contradictions, taken = [], {}
  for src in sources:
    for module in src.modules:
      if module in taken:
        _fail(f"--hf {taken[module]} and --hf {src.path} both hold the {module} module; pass one.")
      taken[module] = src.path.resolve()
      if module not in cfg.model.encoders and module != "language":
        _fail(f"--hf {src.path} holds the {module} encoder, which the config "
              f"({args.config or DEFAULT_BASE}) has no model.{module} for; use a config that "
              f"adds it (e.g. configs/avlm.py).")
      section = cfg.model.module(module)
      for k, v in hf.fields(src, module).items():
        given = overrides.get(f"model.{module}.{k}")
        if given is not None and hf.check_fields(src, module, {k: v}, section):
          contradictions.append(f"--config.model.{module}.{k}={given} (config.json: {v!r})")
        setattr(section, k, v)
      section.init_from = str(src.path.resolve())
  if contradictions:
    _fail(f"the HF config.json contradicts {'; '.join(contradictions)}; drop those overrides.")
  if len(taken) == 2 and not any(s.kind == "llava" for s in sources):
    # A tower beside a language model is read as LLaVA reads one (a LlavaForConditionalGeneration
    # on export): its last layer's hidden states without a post-layernorm, into a projector as
    # wide as the language model.
    v = cfg.model.vision
    if "model.vision.final_norm" not in overrides:
      v.final_norm = False
    if "model.vision.projector_hidden" not in overrides:
      v.projector_hidden = cfg.model.language.dim
    print(f"model.vision: read as LLaVA reads a tower: final_norm={str(v.final_norm).lower()} "
          f"(no post_layernorm), projector_hidden={v.projector_hidden}", flush=True)
  cfg.run.workdir = str(out)
  record = _record(sources, taken)
  import jax  # pylint: disable=import-outside-toplevel
  from mimo_jax.state import host_gib  # pylint: disable=import-outside-toplevel
  from mimo_jax.step import Step  # pylint: disable=import-outside-toplevel
  from mimo_jax.validation import validate  # pylint: disable=import-outside-toplevel
  validate(_without_launch_fields(cfg), len(jax.devices()))
  # What the save stores of the HF tensors (the seed's parameters come on top; checked again
  # before the save, exactly).
  output.check_space(out, sum(hf.stored_bytes(s, m, cfg) for s in sources for m in s.modules),
                     "the import's step-0 checkpoint")
  with output.staged(out, "workdir", "--out") as tmp:
    started, base = time.time(), host_gib()  # the process with its backend, before any tensor
    for module, path in taken.items():
      print(f"importing model.{module} from {path}", flush=True)
    step = Step.build(cfg)
    # Parameters only: the optimizer's state at step 0 is its fresh one, built again on restore.
    state = step.init_state(cfg.train.seed, optimizer=False)
    jax.block_until_ready(state)
    read_peak = _peak_gib()
    canonical = step.canonical(state)
    sizes = [compact_nbytes(x) for m in canonical.values() for x in jax.tree.leaves(m.params)]
    output.check_space(tmp, sum(sizes), "the import's step-0 checkpoint")
    # The save copies the parameters to the host a few GB at a time, not all at once; orbax
    # refuses an array larger than that limit (an 8B model's stacked MLP kernels are 3.8 GB in
    # bfloat16).
    limit = max(SAVE_HOST_GB, math.ceil(max(sizes) / 1e9))
    ckpt = Checkpointer(directory(str(tmp)), list(step.modules), async_save=False, host_gb=limit)
    if not ckpt.host_batched:
      print("note: this orbax version has no transfer callback to batch the save: it copies all "
            "parameters to the host at once (about their size in host memory)", flush=True)
    # Weights read from bfloat16 tensors are stored as bfloat16: half the bytes to copy and
    # write. The metadata names `out` (cfg.run.workdir), where the staging directory goes.
    _save(ckpt, f"--out={str(out)!r}", 0, canonical, cfg, force=True, params_only=True,
          compact=True)
    counts = ", ".join(f"{n}: {_count(state[n].params):,} parameters" for n in step.modules)
    report = [f"wrote step 0 ({counts}) in {time.time() - started:.1f} s; peak host memory "
              f"{read_peak:.2f} GiB reading, {_peak_gib():.2f} GiB with the checkpoint save "
              f"({base:.2f} GiB before reading)"] + _launch_lines(args, cfg, out, record)
    with output.write_errors(f"--out={str(out)!r}"):
      (tmp / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2) + "\n")
      (tmp / "hf_import.json").write_text(json.dumps(record, indent=2) + "\n")
      (tmp / "config.py").write_text(CONFIG_PY.format(  # last: the workdir is complete
          source=" --hf ".join(dict.fromkeys(record["sources"].values()))))
  return report  # printed once `out` is in place: an interrupt until then leaves nothing


def _save(ckpt, where: str, *args, **kwargs) -> None:
  """`ckpt.save(*args, **kwargs)` (the import's step 0), then `ckpt` closed. A write that fails
  (a full disk, a file size limit) is one line naming `where` (output.write_errors): orbax's
  writer threads report that failure with tracebacks as it happens, which are held back and
  dropped then (shown for any other failure), as are the reports of its closed event loop."""
  import logging  # pylint: disable=import-outside-toplevel
  import threading  # pylint: disable=import-outside-toplevel
  from mimo_jax.checkpoint import drop_closed_loop_reports  # pylint: disable=import-outside-toplevel
  held, absl = [], logging.getLogger("absl")

  def hold(record) -> bool:
    held.append(record)
    return False
  absl.addFilter(hold)
  running, hook = set(threading.enumerate()), drop_closed_loop_reports()
  try:
    with output.write_errors(where):
      try:
        ckpt.save(*args, **kwargs)
      except BaseException:
        with contextlib.suppress(Exception):
          ckpt.close()  # its writer threads stop before the staging directory is removed
        raise
  except output.OutputError:
    for thread in set(threading.enumerate()) - running:  # other modules' writes, failing too
      with contextlib.suppress(Exception):  # orbax's threads raise their error on join
        thread.join(timeout=60)
    held.clear()
    raise  # the closed event loop's reports stay dropped: its leftovers end later
  except BaseException:
    sys.unraisablehook = hook
    raise
  finally:
    absl.removeFilter(hold)
    for record in held:
      absl.handle(record)
  sys.unraisablehook = hook
  ckpt.close()


def _record(sources: list, taken: dict) -> dict:
  """hf_import.json: the directories (absolute: readers run elsewhere), the module each gave, and
  what the export writes back (LLaVA's image token, the language model's context)."""
  token = next((s.config.get("image_token_index") for s in sources if s.kind == "llava"), None)
  if token is not None and (not isinstance(token, int) or isinstance(token, bool) or token < 0):
    _fail(f"{next(s for s in sources if s.kind == 'llava').path / 'config.json'}: field "
          f"image_token_index is {json.dumps(token)}; set it to the tokenizer's <image> id.")
  context = next((hf.field(hf.text_config(s), "max_position_embeddings",
                           str(s.path / "config.json"), int, None,
                           "text_config" if s.kind == "llava" else "", nullable=True)
                  for s in sources if "language" in s.modules), None)
  return {"sources": {m: str(p) for m, p in taken.items()}, "image_token_index": token,
          "max_position_embeddings": context}


def _without_launch_fields(cfg: Config) -> Config:
  """`cfg` to validate at import: converted data (data.task=conversations) is named at launch
  (data.dir, data.image_token), so a base config without it (configs/llava_cpu.py) imports."""
  if cfg.data.task != "conversations" or (cfg.data.dir and cfg.data.image_token >= 0):
    return cfg
  checked = copy.deepcopy(cfg)
  checked.data.dir = checked.data.dir or "(named at launch)"
  if checked.data.image_token < 0:
    checked.data.image_token = 0
  return checked


def _launch_lines(args, cfg: Config, out: pathlib.Path, record: dict) -> list[str]:
  """How to train from the workdir: the launch command with every field the workdir's config
  leaves to the user (the data: a tools.convert directory and its image token), and a note when
  the base config is the GPU-sized default and this machine has CPUs only."""
  import jax  # pylint: disable=import-outside-toplevel
  d, flags, notes = cfg.data, [f"--config={out / 'config.py'}"], []
  if d.task != "conversations":
    flags.append("--config.data.task=conversations")
  if d.task != "conversations" or not d.dir:
    flags.append("--config.data.dir=DATA")
    notes.append("DATA: the directory `python -m tools.convert` wrote with this model's "
                 "tokenizer")
  if d.task != "conversations" or d.image_token < 0:
    token = record["image_token_index"]
    flags.append(f"--config.data.image_token={'ID' if token is None else token}")
    notes.append("ID: the image token id tools.convert reports" if token is None else
                 f"{token}: the image_token_index of {record['sources']['vision']}; "
                 "tools.convert reports the same id for the same tokenizer")
  lines = [f"train with: python -m mimo_jax.launch {' '.join(flags)}"]
  lines += [f"  {n}" for n in notes]
  if d.task != "conversations":
    lines.append(f"  (without the data flags the run trains on the base config's data.task="
                 f"{d.task})")
  if args.config is None and jax.default_backend() == "cpu":
    cpu = (f"; for a CPU run, import with --config={CPU_BASE} (float32, smaller rows and batches)"
           if (ROOT / CPU_BASE).is_file() else "")
    lines.append(
        f"note: the fields config.json does not set came from {DEFAULT_BASE}, sized for GPUs "
        f"(model.dtype={cfg.model.dtype}, data.seq_len={d.seq_len}, data.global_batch="
        f"{d.global_batch}): on this machine's CPUs a step of it takes minutes{cpu}, or set "
        "those fields at launch")
  return lines


def _peak_gib() -> float:
  """The most resident host memory this process has held (GiB): VmHWM, which starts afresh with
  the program (ru_maxrss carries over a parent's peak through fork and exec)."""
  from mimo_jax.state import host_gib  # pylint: disable=import-outside-toplevel
  return host_gib("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2


CONFIG_PY = '''"""The config of this workdir, written by `python -m tools.hf import --hf {source}`.

  python -m mimo_jax.launch --config=<this file> [--config.a.b=value ...]
"""

import json
import pathlib

from mimo_jax.config import from_dict


def get_config(arg=None):
  del arg
  return from_dict(json.loads((pathlib.Path(__file__).parent / "config.json").read_text()))
'''


def _count(tree) -> int:
  import jax  # pylint: disable=import-outside-toplevel
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))


def _read_checkpoint(workdir: str, step: int | None) -> tuple[Config, dict, int, dict]:
  """(config, parameters by module on the host, step, import record) of a workdir's step, read
  as tools.ckpt reads it: committed steps only, beside a live run, checked against the
  fingerprints saved with it."""
  reader = checkpoint_reader.Reader(workdir)
  reader.note("tools.hf")

  def read(s: int) -> tuple[dict, dict]:
    meta = reader.meta(s)
    return meta, reader.params_tree(s, meta)
  try:
    step, (meta, params) = checkpoint_reader.newest(reader, step, read, tool="tools.hf")
  finally:
    reader.close()
  record_file = pathlib.Path(workdir) / "hf_import.json"
  record = json.loads(record_file.read_text()) if record_file.is_file() else {}
  return from_dict(meta["config"]), params, step, record


def export(args) -> None:
  from absl import logging  # pylint: disable=import-outside-toplevel
  logging.set_verbosity(logging.ERROR)  # orbax's notes on opening a checkpoint read-only
  try:
    with output.interrupts_as_exceptions():
      _export(args)
  except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM / SIGHUP (output.Interrupted)
    print(f"tools.hf: export interrupted; nothing was written to {args.out}", file=sys.stderr)
    sys.exit(128 + getattr(e, "signum", signal.SIGINT))


def _run_data(workdir: str, cfg: Config) -> dict:
  """What the run's converted data (data.task conversations or digits: its manifest) says of the
  tokenizer, the image processor, the image token and pad to square; {} without one. A relative
  data.dir (a run saved before checkpoints stored it absolute) is looked for where the run was
  launched from, in the workdir, then here."""
  from mimo_jax.data import conversations, digits  # pylint: disable=import-outside-toplevel
  d, where = cfg.data, run_paths.bases(run_paths.launch_dir(workdir, cfg), workdir)
  if d.task == "conversations":
    directory = pathlib.Path(run_paths.resolve(d.dir, conversations.MANIFEST, where) or d.dir)
  elif d.task == "digits":
    root = (run_paths.resolve(d.dir, "", where) or d.dir) if d.dir else ""
    directory = digits.directory(root, d.train_samples, d.eval_samples, d.probs())
  else:
    return {}
  if not (directory / conversations.MANIFEST).is_file():
    return {}
  m = conversations.manifest(str(directory))
  return {"tokenizer": conversations.source_path(str(directory), m["tokenizer"]),
          "processor": conversations.source_path(str(directory), m["processor"]),
          "image_token": m.get("image_token"), "pad_to_square": bool(m.get("pad_to_square")),
          "where": str(directory / conversations.MANIFEST)}


def history(workdir: str, cfg: Config, record: dict) -> tuple[dict, dict[str, list[str]]]:
  """The import record (hf_import.json) and the HF directories each module came from (nearest
  first), of this run and of the runs it started from (init_from=WORKDIR: training stages).
  Relative paths (of runs and imports saved before they were stored absolute) are looked for
  where each run was launched from, in its workdir, then here."""
  from mimo_jax.checkpoint import Checkpointer, complete_steps  # pylint: disable=import-outside-toplevel
  from mimo_jax.config import run_source  # pylint: disable=import-outside-toplevel
  sources: dict[str, list[str]] = {"vision": [], "language": []}
  todo, seen = [(pathlib.Path(workdir), cfg, record)], set()
  while todo:
    path, c, rec = todo.pop(0)
    if path.resolve() in seen:
      continue
    seen.add(path.resolve())
    record = record or rec
    where = run_paths.bases(run_paths.launch_dir(str(path), c), path)
    for module, p in rec.get("sources", {}).items():
      sources.setdefault(module, []).append(run_paths.resolve(p, "", where) or p)
    for module in ("vision", "language"):
      spec = run_paths.resolve_spec(c.model.module(module).init_from or c.model.init_from, where)
      run = run_source(spec)
      if run is None:
        if spec:
          sources[module].append(spec)
        continue
      try:  # an earlier stage: its config and record, if it can still be read
        ckpt = Checkpointer(run[0], [], read_only=True)
        meta = ckpt.read_meta(run[1] if run[1] is not None else max(complete_steps(run[0])))
        earlier = pathlib.Path(run[0]).parent
        rec_file = earlier / "hf_import.json"
        todo.append((earlier, from_dict(meta["config"]),
                     json.loads(rec_file.read_text()) if rec_file.is_file() else {}))
      except Exception:  # pylint: disable=broad-except
        continue
  return record, {m: list(dict.fromkeys(p)) for m, p in sources.items()}


def source_context(record: dict, sources: dict[str, list[str]]) -> int | None:
  """The language model's max_position_embeddings: the import's record, else its source's."""
  if record.get("max_position_embeddings"):
    return int(record["max_position_embeddings"])
  for path in sources["language"]:
    try:
      c = json.loads((pathlib.Path(path) / "config.json").read_text())
    except (OSError, ValueError):
      continue
    c = c.get("text_config", {}) if c.get("model_type") in ("llava", "qwen2_audio") else c
    if isinstance(c.get("max_position_embeddings"), int):
      return c["max_position_embeddings"]
  return None


def _image_processor(sources: dict[str, list[str]], data: dict) -> tuple[dict | None, str]:
  """The image processor config the run's images were prepared with, and its file: the data's,
  else the tower's source directory's (preprocessor_config.json, or processor_config.json's
  image_processor as transformers 5 writes it)."""
  for path in ([data["processor"]] if data.get("processor") else []) + sources["vision"]:
    for name, key in (("preprocessor_config.json", None), ("processor_config.json",
                                                           "image_processor")):
      f = pathlib.Path(path) / name
      if f.is_file():
        try:
          c = json.loads(f.read_text())
        except ValueError as e:
          _fail(f"{f}: not JSON ({e}).")
        c = c.get(key) if key else c
        if isinstance(c, dict) and "image_processor_type" in c:
          return c, str(f)
  return None, ""


def _tokenizer(args, sources: dict[str, list[str]], data: dict) -> "hf_export.Tokenizer":
  """The tokenizer the run used: --tokenizer, the data's, else the language model's source's."""
  if args.tokenizer:
    return hf_export.Tokenizer(args.tokenizer)
  for path in ([data["tokenizer"]] if data.get("tokenizer") else []) + sources["language"]:
    if (pathlib.Path(path) / "tokenizer.json").is_file():
      return hf_export.Tokenizer(path)
  _fail(f"{args.workdir}: neither its run's data nor an import names a directory with the "
        "tokenizer's tokenizer.json; pass --tokenizer DIR (the tokenizer the model was trained "
        "with).")


def _image_token(args, cfg: Config, record: dict, data: dict, tok) -> tuple[int, str]:
  """LLaVA's image token (id, text): --image_token_index, the run's data (data.image_token), the
  import's record (a LLaVA's image_token_index), else the tokenizer's <image>."""
  if args.image_token_index is not None:
    token, where = args.image_token_index, "--image_token_index"
  elif cfg.data.task in ("conversations", "digits"):
    token, where = cfg.data.placeholder, f"config.data.image_token ({data.get('where', 'run')})"
  elif record.get("image_token_index") is not None:
    token, where = int(record["image_token_index"]), "hf_import.json's image_token_index"
  else:
    token, where = tok.tokenizer.token_to_id("<image>"), f"{tok.path}'s <image>"
    if token is None:
      _fail(f"LLaVA needs the id of its image token and {tok.path / 'tokenizer.json'} has no "
            "<image> token: pass --image_token_index ID.")
  text = tok.tokenizer.id_to_token(token)
  if text is None or token >= cfg.model.language.vocab_size:
    _fail(f"image token {token} (from {where}) is not a token of {tok.path / 'tokenizer.json'} "
          f"and of the model's {cfg.model.language.vocab_size}; pass --image_token_index ID.")
  return token, text


def _default_model(cfg: Config, sources: dict[str, list[str]]) -> str:
  """The whole model's HF class by default: Qwen2-Audio for a run without a vision encoder, or
  whose language model came from a Qwen2-Audio directory; LLaVA otherwise."""
  if "audio" in cfg.model.encoders and "vision" not in cfg.model.encoders:
    return "qwen2_audio"
  for path in sources.get("language", [])[:1]:
    with contextlib.suppress(OSError, ValueError):
      c = json.loads((pathlib.Path(path) / "config.json").read_text())
      if c.get("model_type") == "qwen2_audio" and "audio" in cfg.model.encoders:
        return "qwen2_audio"
  return "llava"


def _audio_token(args, cfg: Config, tok) -> tuple[int, str]:
  """Qwen2-Audio's audio token (id, text): --audio_token_index, else model.audio.audio_token;
  one token of the tokenizer."""
  token = cfg.model.audio.audio_token if args.audio_token_index is None \
      else args.audio_token_index
  where = "--audio_token_index" if args.audio_token_index is not None \
      else "config.model.audio.audio_token"
  text = tok.tokenizer.id_to_token(token)
  if text is None or token >= cfg.model.language.vocab_size:
    _fail(f"audio token {token} (from {where}) is not a token of {tok.path / 'tokenizer.json'} "
          f"and of the model's {cfg.model.language.vocab_size}; pass --audio_token_index ID.")
  return token, text


def _export_peft(args) -> None:
  """`export --peft`: the run's adapters (and a trained projector) as a PEFT adapter."""
  from mimo_jax.hf import peft  # pylint: disable=import-outside-toplevel
  out = pathlib.Path(args.out)
  output.check_target(out, "PEFT adapter", "--out", complete=peft.WEIGHTS, replace=args.overwrite)
  cfg, params, step, record = _read_checkpoint(args.workdir, args.step)
  if not cfg.model.language.vocab_size:  # 0: the digits task's own vocabulary
    cfg.model.language.vocab_size = DIGITS_VOCAB
  modules = ((args.module,) if args.module else
             ("vision", "language") if "vision" in cfg.model.encoders else ("language",))
  _, sources = history(args.workdir, cfg, record)
  base = next(iter(sources.get(modules[-1]) or []), "")
  peft.write(out, cfg, params, base=base, replace=args.overwrite, modules=modules)
  print(f"wrote {out}: a PEFT adapter of {' and '.join(modules)} from step {step}"
        f"{f' over {base}' if base else ''}")


def _export(args) -> None:
  if args.peft:
    _export_peft(args)
    return
  out = pathlib.Path(args.out)
  if (out / "config.json").is_file() and not args.overwrite:
    _fail(f"--out={args.out} holds an export already (config.json); pass --overwrite to replace "
          "it, or choose another --out.")
  output.check_target(out, "HF export", "--out", complete="config.json", replace=args.overwrite)
  cfg, params, step, record = _read_checkpoint(args.workdir, args.step)
  if not cfg.model.language.vocab_size:  # 0: the digits task's own vocabulary
    cfg.model.language.vocab_size = DIGITS_VOCAB
  record, sources = history(args.workdir, cfg, record)
  whole = args.model or _default_model(cfg, sources)
  kind = {"vision": "tower", "audio": "audio", "language": "language", None: whole}[args.module]
  if args.module is not None and args.model:
    _fail(f"--model {args.model} is the whole model; --module {args.module} exports one module: "
          "give one of them.")
  wanted = {"llava": "vision", "qwen2_audio": "audio"}.get(kind, args.module)
  if wanted is not None and wanted not in cfg.model.encoders and wanted != "language":
    _fail(f"{args.workdir}: the run has no {wanted} module (model.{wanted}); export one "
          f"of {', '.join([*cfg.model.encoders, 'language'])}.")
  data = _run_data(args.workdir, cfg)
  tok = _tokenizer(args, sources, data) if kind not in ("tower", "audio") else None
  if tok is not None and tok.vocab_size > cfg.model.language.vocab_size:
    _fail(f"{tok.path / 'tokenizer.json'}: {tok.vocab_size} tokens, more than the model's "
          f"vocabulary of {cfg.model.language.vocab_size}; pass the run's --tokenizer DIR.")
  context = source_context(record, sources)
  files: dict[str, dict] = {}
  if kind == "llava":
    token, text = _image_token(args, cfg, record, data, tok)
    config = hf_vision.llava_config_json(cfg, token, context)
    files["processor_config.json"] = hf_vision.llava_processor_json(cfg.model.vision, text)
  elif kind == "qwen2_audio":
    token, text = _audio_token(args, cfg, tok)
    config = hf_audio.qwen2_audio_config_json(cfg, token, context)
    known = lambda t: t if tok.tokenizer.token_to_id(t) is not None else None
    files["processor_config.json"] = hf_audio.qwen2_audio_processor_json(
        text, known("<|audio_bos|>"), known("<|audio_eos|>"))
    extractor = hf_audio.feature_extractor_json(cfg.model.audio)
    if extractor is None:
      _fail(f"model.audio: windows of {cfg.model.audio.frames} frames are no whole number of "
            "seconds, which Qwen2-Audio's WhisperFeatureExtractor needs.")
    files["preprocessor_config.json"] = extractor
  elif kind == "tower":
    config = hf_vision.vision_config_json(cfg.model.vision)
  elif kind == "audio":
    config = hf_audio.whisper_config_json(cfg.model.audio)
    extractor = hf_audio.feature_extractor_json(cfg.model.audio)
    if extractor is None:
      print(f"note: no preprocessor_config.json: a window of {cfg.model.audio.frames} frames is "
            "no whole number of seconds, which WhisperFeatureExtractor needs", flush=True)
    else:
      files["preprocessor_config.json"] = extractor
  else:
    config = hf_export.language_config_json(cfg.model.language, context)
  if kind in ("llava", "tower"):
    base, where = _image_processor(sources, data)
    files["preprocessor_config.json"] = hf_vision.preprocessor_json(
        cfg.model.vision, base, data.get("pad_to_square", False), where)
  if tok is not None:
    files["tokenizer_config.json"] = tok.config_json(
        {"llava": "LlavaProcessor", "qwen2_audio": "Qwen2AudioProcessor"}.get(kind))
    files["generation_config.json"] = hf_export.generation_json(tok)
  modules = (args.module,) if args.module else (wanted, "language")
  tensors = dict(hf_export.export_tensors(modules, cfg, params))
  bad = [k for k, x in tensors.items() if not np.isfinite(x).all()]
  if bad:
    _fail(f"{args.workdir} step {step}: {len(bad)} tensors hold NaN or Inf ({', '.join(bad[:3])}"
          f"{', ...' if len(bad) > 3 else ''}); export an earlier step with --step N.")
  total = sum(x.nbytes for x in tensors.values())
  output.check_space(out, total + sum(f.stat().st_size for f in (tok.files if tok else [])),
                     "the export")
  # A full disk or a file size limit midway (safetensors' SafetensorError, a copy's OSError): one
  # line, and the staging directory removed.
  with output.write_errors(f"--out={args.out!r}"), \
      output.staged(out, "HF export", "--out", complete="config.json",
                    replace=args.overwrite) as tmp:
    _write_safetensors(tmp, tensors)
    for f in tok.files if tok else []:
      if f.name not in files:
        shutil.copyfile(f, tmp / f.name)
    for name, content in files.items():
      (tmp / name).write_text(json.dumps(content, indent=2) + "\n")
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")  # last: complete
  extra = f"; tokenizer from {tok.path}" if tok else ""
  if kind in ("llava", "qwen2_audio"):
    extra += f"; {'image' if kind == 'llava' else 'audio'} token {token} ({text})"
  print(f"wrote {out}: {config['architectures'][0]} from step {step}, {len(tensors)} tensors, "
        f"{total / 1e6:.1f} MB{extra}")


def _write_safetensors(out: pathlib.Path, tensors: dict[str, np.ndarray]) -> None:
  """One model.safetensors, or shards of at most SHARD_BYTES with model.safetensors.index.json."""
  from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel
  shards, current, size = [], {}, 0
  for name in sorted(tensors):
    x = tensors[name]
    if current and size + x.nbytes > SHARD_BYTES:
      shards.append(current)
      current, size = {}, 0
    current[name] = x
    size += x.nbytes
  shards.append(current)
  if len(shards) == 1:
    save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
    return
  weight_map = {}
  for i, shard in enumerate(shards):
    file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    save_file(shard, str(out / file), metadata={"format": "pt"})
    weight_map.update({name: file for name in shard})
  (out / "model.safetensors.index.json").write_text(json.dumps(
      {"metadata": {"total_size": sum(x.nbytes for x in tensors.values())},
       "weight_map": weight_map}, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(prog="python -m tools.hf", description=__doc__.split("\n\n")[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter,
                                   epilog=__doc__.split("\n\n", 1)[1])
  verbs = parser.add_subparsers(dest="verb", required=True)
  p = verbs.add_parser("import", help="an HF directory -> a workdir with a step-0 checkpoint")
  p.add_argument("--hf", required=True, action="append",
                 help="an HF model directory; repeat for a tower and a language model")
  p.add_argument("--out", required=True,
                 help="the workdir to write: absent or an empty directory")
  p.add_argument("--config", default=None,
                 help="config file[:variant] for the fields config.json does not set (default "
                 f"{DEFAULT_BASE}, sized for GPUs; {CPU_BASE} for a run on CPUs)")
  p = verbs.add_parser("export", help="a checkpoint -> an HF directory")
  p.add_argument("workdir")
  p.add_argument("--step", type=int, default=None, help="default: the newest")
  p.add_argument("--out", required=True)
  p.add_argument("--module", choices=("vision", "audio", "language"), default=None,
                 help="one module alone (default: the whole model, as --model)")
  p.add_argument("--model", choices=("llava", "qwen2_audio"), default=None,
                 help="the whole model's class: LLaVA (the vision encoder) or Qwen2-Audio (the "
                 "audio encoder) with the language model (default: Qwen2-Audio for a run "
                 "without a vision encoder or imported from Qwen2-Audio, else LLaVA)")
  p.add_argument("--image_token_index", type=int, default=None,
                 help="LLaVA's image token id (default: the run's data.image_token, else the "
                 "imported LLaVA's, else the tokenizer's <image>)")
  p.add_argument("--audio_token_index", type=int, default=None,
                 help="Qwen2-Audio's audio token id (default: model.audio.audio_token)")
  p.add_argument("--tokenizer", default="",
                 help="the tokenizer directory to copy (default: the run's data's, else the "
                 "language model's source)")
  p.add_argument("--peft", action="store_true",
                 help="write the run's LoRA adapters as a PEFT adapter directory (default: the "
                 "merged model)")
  p.add_argument("--overwrite", action="store_true",
                 help="replace --out if it holds a complete export")
  p = verbs.add_parser("check", help="transformers vs mimo_jax on the same random inputs")
  p.add_argument("--hf", required=True)
  p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
  args, extra = parser.parse_known_args(argv)
  try:
    if args.verb == "import":
      import_(args, extra)
    elif extra:
      _fail(f"unexpected arguments {extra}.")
    elif args.verb == "export":
      export(args)
    else:
      from tools import hf_check  # pylint: disable=import-outside-toplevel
      hf_check.check(args.hf, args.dtype)
  except ConfigError as e:
    _fail(str(e))


if __name__ == "__main__":
  output.run_main(main)
