"""`python -m tools.hf import` (tools/hf.py says what it does): HF directories read into a new
workdir with a step-0 checkpoint, staged and renamed into place."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import math
import os
import pathlib
import resource
import signal
import sys
import time

import numpy as np

from mimo_jax import configfile, hf, output
from mimo_jax.config import Config

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_BASE = "configs/vlm.py"
CPU_BASE = "configs/llava_cpu.py"  # the base for a run on CPUs
SAVE_HOST_GB = 2  # GB a save copies to the host at a time, raised to the largest array's size


def fail(message: str) -> None:
  """The tool's one line for bad input (`tools.hf: error: ...`), exit status 2."""
  print(f"tools.hf: error: {message}", file=sys.stderr)
  sys.exit(2)


def import_(args, extra: list[str]) -> None:
  out = pathlib.Path(args.out).resolve()
  try:
    with output.interrupts_as_exceptions():
      report = _import(args, extra, out)
    print("\n".join(report), flush=True)  # once `out` is in place
  except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM / SIGHUP (output.Interrupted)
    print("tools.hf: import interrupted; " + (
        f"{out} was complete before it came: the workdir is whole, its report cut short"
        if output.published(out) else f"nothing was written to {out}"), file=sys.stderr)
    sys.exit(128 + getattr(e, "signum", signal.SIGINT))


def _import(args, extra: list[str], out: pathlib.Path) -> list[str]:
  """The import into workdir `out`: checked before any tensor is read, written through a staging
  directory that becomes `out` in one rename once config.py is in it. Returns what to print."""
  # pylint: disable=import-outside-toplevel
  from mimo_jax.checkpoint import Checkpointer
  from mimo_jax.checkpoint_arrays import compact_nbytes
  from mimo_jax.checkpoint_steps import complete_steps, directory
  ckpts = directory(str(out))
  if os.path.isdir(ckpts) and complete_steps(ckpts):
    fail(f"{out} already holds checkpoints ({ckpts}); choose a new --out.")
  output.check_target(out, "workdir", "--out")
  sources = [hf.Source.open(d) for d in args.hf]
  overrides = dict(map(configfile.parse_override, extra))
  cfg = configfile.load(args.config or DEFAULT_BASE, extra,
                        hint=f"{DEFAULT_BASE} (GPU-sized) or {CPU_BASE} (CPU-sized)")
  contradictions, taken = [], {}
  for src in sources:
    for module in src.modules:
      if module in taken:
        fail(f"--hf {taken[module]} and --hf {src.path} both hold the {module} module; pass one.")
      taken[module] = src.path.resolve()
      if module not in cfg.model.encoders and module != "language":
        # Without a vision tower among the sources, a config with one would add an untrained one.
        vision = any("vision" in s.modules for s in sources)
        fail(f"--hf {src.path} holds the {module} encoder, which the config "
              f"({args.config or DEFAULT_BASE}) has no model.{module} for; use a config that "
              f"adds it (e.g. --config=configs/avlm.py"
              f"{' (GPU-sized)' if vision else ':audio (GPU-sized) or ' + CPU_BASE + ':audio'}).")
      section = cfg.model.module(module)
      for k, v in hf.fields(src, module).items():
        given = overrides.get(f"model.{module}.{k}")
        if given is not None and hf.check_fields(src, module, {k: v}, section):
          contradictions.append(f"--config.model.{module}.{k}={given} (config.json: {v!r})")
        setattr(section, k, v)
      section.init_from = str(src.path.resolve())
  if contradictions:
    fail(f"the HF config.json contradicts {'; '.join(contradictions)}; drop those overrides.")
  if set(taken) == {"vision", "language"} and taken["vision"] != taken["language"]:
    # A vision tower beside a language model (two directories) is read as LLaVA reads one (a
    # LlavaForConditionalGeneration on export): its last layer's hidden states without a
    # post-layernorm, into a projector as wide as the language model. Not a whole model of one
    # directory (LLaVA), nor an audio tower (Qwen2-Audio, Whisper) beside a language model.
    v = cfg.model.vision
    if "model.vision.final_norm" not in overrides:
      v.final_norm = False
    if "model.vision.projector_hidden" not in overrides:
      v.projector_hidden = cfg.model.language.dim
    print(f"model.vision: read as LLaVA reads a tower: final_norm={str(v.final_norm).lower()} "
          f"(no post_layernorm), projector_hidden={v.projector_hidden}", flush=True)
  if "vision" in taken and cfg.model.vision.pixel_norm() is None:
    print(f"model.vision: {taken['vision']} has no preprocessor_config.json with image_mean and "
          "image_std: images go into the tower unnormalised; put the tower's "
          "preprocessor_config.json beside its config.json and import again, or set "
          "--config.model.vision.pixel_mean and pixel_std", flush=True)
  cfg.run.workdir = str(out)
  record = _record(sources, taken, cfg.model.language.vocab_size)
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
  dropped then (shown for any other failure), as are the reports of its closed event loop. A
  signal during the save stops it alike: its writer threads end, silently, before it is raised."""
  import logging  # pylint: disable=import-outside-toplevel
  import threading  # pylint: disable=import-outside-toplevel
  # pylint: disable-next=import-outside-toplevel
  from mimo_jax.checkpoint_orbax import drop_closed_loop_reports, drop_lost_task_logs
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
  except (output.OutputError, KeyboardInterrupt):
    # A write failed, or a signal stopped the save: the other writes fail too, as their tasks
    # are collected (asyncio's logs of them dropped), and end before the staging directory goes.
    drop_lost_task_logs()
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


def _record(sources: list, taken: dict, vocab: int) -> dict:
  """hf_import.json: the directories (absolute: readers run elsewhere), the module each gave, and
  what the export writes back (LLaVA's image token, which must be an id of the language model's
  `vocab`, and the language model's context)."""
  token = next((s.config.get("image_token_index") for s in sources if s.kind == "llava"), None)
  if token is not None:
    where = next(s for s in sources if s.kind == "llava").path / "config.json"
    if not isinstance(token, int) or isinstance(token, bool) or token < 0:
      fail(f"{where}: field image_token_index is {json.dumps(token)}; set it to the tokenizer's "
           "<image> id.")
    if vocab and token >= vocab:
      fail(f"{where}: field image_token_index is {token}, past the vocabulary (text_config."
           f"vocab_size {vocab}: ids 0 to {vocab - 1}); set it to the tokenizer's <image> id.")
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
  if "vision" in cfg.model.encoders and (d.task != "conversations" or d.image_token < 0):
    token = record["image_token_index"]  # a model without a vision encoder reads no image
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
Its run.workdir is the folder this file is in, wherever that folder is moved or copied.

  python -m mimo_jax.launch --config=<this file> [--config.a.b=value ...]
"""

import json
import pathlib

from mimo_jax.config import ConfigError, from_dict


def get_config(arg=None):
  here = pathlib.Path(__file__).resolve().parent
  if arg:
    raise ConfigError(f"{{here / 'config.py'}}: no variant {{arg!r}}; an import's config has none.")
  cfg = from_dict(json.loads((here / "config.json").read_text()))
  cfg.run.workdir = str(here)
  return cfg
'''


def _count(tree) -> int:
  import jax  # pylint: disable=import-outside-toplevel
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))
