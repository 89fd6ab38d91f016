"""Shared helpers of the benchmark tools: their config from `--config` and `--set a.b=value`,
their flags and input files checked in one line each, timing, and recording results in
docs/benchmarks.md."""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import pathlib
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import NoReturn

import jax
import numpy as np

from mimo_jax import configfile, output, workdir
from mimo_jax.config import Config, ConfigError, set_layout

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "docs" / "benchmarks.md"


def fail(tool: str, message: str) -> NoReturn:
  """Bad input, as launch and tools.convert report it: one line `tool: error: message` on stderr
  and exit status 2 (the SystemExit's text is the message, for a caller in the same process)."""
  print(f"{tool}: error: {message}", file=sys.stderr, flush=True)
  stop = SystemExit(message)
  stop.code = 2
  raise stop


class Parser(argparse.ArgumentParser):
  """argparse's own errors (a value that is not a number, a missing or unknown flag) as the tool's
  others: one line `TOOL: error: ...`, exit status 2, without the usage block. An unknown flag is
  named before a missing required one (a typo of the flag is the likelier fault). `sep` shows a
  flag with its value (`--gpus=x`, or `--gpus x` with " "); `takes` tells the flags the caller
  reads from `parse_known_args`'s leftovers itself (tools.hf import's `--config.a.b=v`)."""

  def __init__(self, tool: str, sep: str = "=", takes=None, **kw):
    kw.setdefault("prog", f"python -m tools.{tool}")
    kw.setdefault("allow_abbrev", False)  # `--st` is not taken for `--step`
    super().__init__(**kw)
    self.tool, self.sep, self.takes = tool, sep, takes
    self.given: list[str] = []

  def parse_known_args(self, args=None, namespace=None):
    self.given = list(sys.argv[1:] if args is None else args)
    return super().parse_known_args(args, namespace)

  def unknown(self, args: Sequence[str]) -> list[str]:
    """The flags among `args` that are none of this parser's (as argparse tells a flag from a
    value: a leading dash, not a negative number, no space) and that `takes` does not take."""
    out = []
    for a in args:
      if a == "--":
        break
      if (a.startswith("-") and a != "-" and " " not in a and not re.fullmatch(r"-\d*\.?\d+", a)
          and a.split("=", 1)[0] not in self._option_string_actions
          and not (self.takes and self.takes(a))):
        out.append(a)
    return out

  def error(self, message: str) -> NoReturn:
    if message.startswith("the following arguments are required") and self.unknown(self.given):
      message = f"unrecognized arguments: {' '.join(self.unknown(self.given))}"
    flag = r"(--[\w-]+(?:/--[\w-]+)*)"
    m = re.fullmatch(rf"argument {flag}: invalid (int|float) value: '(.*)'", message, re.DOTALL)
    if m:  # `--gpus x`: the flag with the value given, as `--gpus=x`
      kind = "an integer" if m.group(2) == "int" else "a number"
      message = f"{m.group(1)}{self.sep}{m.group(3)}: not {kind}."
    elif (m := re.fullmatch(rf"argument {flag}: (.*)", message, re.DOTALL)):
      # A `number` type's refusal starts `=VALUE: `; argparse's own (a choice) does not.
      rest = m.group(2)
      message = f"{m.group(1)}{self.sep + rest[1:] if rest.startswith('=') else ': ' + rest}."
    else:
      message = f"{message} (--help lists the flags)."
    fail(self.tool, message)


def number(kind: type = int, least: float | None = None, above: float | None = None,
           most: float | None = None):
  """An argparse type: a finite `kind` (int or float) at least `least` or more than `above`, and
  at most `most`; a value that is not is one line naming the flag and the value (Parser)."""

  def parse(text: str):
    try:
      value = kind(text)
    except ValueError:
      raise argparse.ArgumentTypeError(
          f"={text}: not {'an integer' if kind is int else 'a number'}") from None
    if not math.isfinite(value):
      raise argparse.ArgumentTypeError(f"={text}: not a finite number")
    if least is not None and value < least:
      raise argparse.ArgumentTypeError(f"={text}: must be at least {least}")
    if above is not None and value <= above:
      raise argparse.ArgumentTypeError(f"={text}: must be more than {above}")
    if most is not None and value > most:
      raise argparse.ArgumentTypeError(f"={text}: must be at most {most}")
    return value
  return parse


def path_flag(text: str) -> str:
  """An argparse type of a path flag that a tool writes to or reads a folder from: an empty value
  (what an unset shell variable gives, `--out "$OUT"`), which would mean the current folder, is
  one line naming the flag (Parser)."""
  if not text.strip():
    raise argparse.ArgumentTypeError(f"={text!r}: empty; give a path (an unset shell variable "
                                     "gives an empty one)")
  return text


def read_json(tool: str, flag: str, path: str, rows: tuple[str, ...] = ()) -> dict:
  """The JSON object in file `path` given as `flag`; with `rows`, one whose `rows` list holds
  objects with those keys (a tools/bench.py --json file). Anything else is one line (`fail`)."""
  what = f"{flag}={path}"
  try:
    with open(path, encoding="utf-8") as f:
      data = json.load(f)
  except OSError as e:
    fail(tool, f"{what}: {e.strerror or e}; give a file that exists and can be read.")
  except (ValueError, UnicodeDecodeError) as e:
    fail(tool, f"{what}: not JSON ({str(e).splitlines()[0]}).")
  if not isinstance(data, dict):
    fail(tool, f"{what}: not a JSON object.")
  if rows:
    listed = data.get("rows")
    if not isinstance(listed, list) or not all(
        isinstance(r, dict) and all(k in r for k in rows) for r in listed):
      fail(tool, f"{what}: not a tools/bench.py --json file (a 'rows' list of objects with "
           f"{', '.join(rows)}); make one with python -m tools.bench --json=NEW_FILE.")
  return data


def overrides(cfg: Config, sets: Sequence[str]) -> Config:
  """Applies `--set a.b=value` overrides (`a.b=value` each, typed as configfile types
  `--config.a.b=value`) in order; ConfigError naming the flag as typed (`--set a.b=value: ...`)."""
  for s in sets:
    flag = f"--set {s}"
    try:
      name, text = configfile.parse_override(f"--config.{s}")
    except ConfigError:
      raise ConfigError(f"{flag}: overrides look like --set a.b=value.") from None
    try:
      configfile.set_field(cfg, name, text)
    except ConfigError as e:
      said = str(e).replace(f"--config.{name}=", f"--set {name}=")
      raise ConfigError(f"{flag}: {said}") from None
  return cfg


def cpu_devices(cfg: Config) -> bool:
  """Has JAX's CPU backend create `run.cpu_devices` devices, as `mimo_jax.launch` does
  (`jax_num_cpu_devices`, which beats XLA_FLAGS' --xla_force_host_platform_device_count; a GPU
  backend's devices are its own). False where the process chose another count before (a caller
  that set jax_num_cpu_devices, as the tests' conftest does) or the backends started with
  another: their devices stay."""
  chosen = jax.config.jax_num_cpu_devices
  if chosen == cfg.run.cpu_devices:
    return True
  if chosen != -1:  # -1: JAX's default, nobody chose
    return False
  try:
    jax.config.update("jax_num_cpu_devices", cfg.run.cpu_devices)
  except RuntimeError:  # started already
    return False
  return True


def _short_of_cpus(cfg: Config, applied: bool, e: ConfigError) -> ConfigError:
  """`e` (a layout checked against the devices), with how to get the devices it needs where the
  CPU backend has fewer than the layout spans."""
  need = max(t.offset + t.size for t in cfg.topology.modules().values())
  have = len(jax.devices())
  if jax.default_backend() != "cpu" or need <= have:
    return e
  how = (f"--set run.cpu_devices={need} makes that many on CPU" if applied else
         f"this process's CPU backend has {have}, chosen before run.cpu_devices="
         f"{cfg.run.cpu_devices} could apply: start JAX with jax_num_cpu_devices={need}")
  return ConfigError(f"{str(e).rstrip('.')}; the layout spans {need} devices: {how}.")


def config(spec: str, sets: Sequence[str], layout: str = "", check: bool = True,
           devices: bool = False) -> Config:
  """A measuring tool's config: the file `spec` (`--config`), the `--set` overrides `sets`, the
  layout (`config.set_layout`'s form) if given, checked as launch checks a run's before anything
  compiles: `validate` (`check`), with `devices` against jax's devices and backend as well
  (`validate_backend`), the CPU backend started with `run.cpu_devices` devices as launch starts
  it (`cpu_devices`). ConfigError, one line, for a bad file, flag or field; a layout past the CPU
  devices says how to get more."""
  # pylint: disable-next=import-outside-toplevel
  from mimo_jax.validation import validate, validate_backend  # imports the models: not at the top
  cfg = overrides(configfile.load_file(spec), sets)
  if layout:
    set_layout(cfg, layout)
  if devices:
    validate(cfg)  # run.cpu_devices checked (at least 1) before JAX starts with it
    applied = cpu_devices(cfg)
    try:
      validate(cfg, len(jax.devices()))
    except ConfigError as e:
      raise _short_of_cpus(cfg, applied, e) from None
    validate_backend(cfg, jax.default_backend(), jax.process_count())
  elif check:
    validate(cfg)
  return cfg


def load_config(tool: str, spec: str, sets: Sequence[str], layout: str = "",
                check: bool = True, devices: bool = False) -> Config:
  """`config`, with its ConfigError as `fail` reports it: one line `tool: error: ...`, exit
  status 2."""
  try:
    return config(spec, sets, layout, check, devices)
  except ConfigError as e:
    fail(tool, str(e))


def run_config(tool: str, spec: str, sets: Sequence[str], runs: str = "") -> Config:
  """The config a `mimo_jax.launch` run of `spec` reads with `--config.a.b=value` for each of
  `sets` (`a.b=value`), checked as launch checks it before it starts (its data directory, then
  `validate`): a tool that spawns runs calls it first. A bad one is one line (`fail`), said of
  `runs` (e.g. `the fp8 runs`) where given."""
  from mimo_jax.validation import data_source, validate  # pylint: disable=import-outside-toplevel
  try:
    cfg = overrides(configfile.load_file(spec), sets)
    data_source(cfg)
    validate(cfg)
  except ConfigError as e:
    fail(tool, f"{runs}: {e}" if runs else str(e))
  return cfg


def own_fields(tool: str, sets: Sequence[str], fields: Sequence[str], how: str) -> None:
  """Refuses (`fail`) a `--set` of a field in `fields` (`a.b`, an encoder's written
  `model.<name>.x`), which the tool sets in each run itself; `how` says how to choose it."""
  for s in sets:
    name = s.split("=", 1)[0].strip()
    for section in ("model", "topology"):
      name = name.replace(f"{section}.encoders.", f"{section}.", 1)
    if name in fields:
      fail(tool, f"--set {s}: this tool sets that field itself ({how}).")


def run_folder(path: str) -> None:
  """ConfigError, naming `path`, unless it is a folder that holds checkpoints/ (a run's workdir
  or an import's), for the tools that read a run's steps."""
  p = pathlib.Path(path)
  if not p.exists():
    raise ConfigError(f"{path}: no such directory; give a run's workdir or an import's.")
  if not p.is_dir():
    raise ConfigError(f"{path}: a file, not a directory; give a run's workdir or an import's.")
  if not (p / "checkpoints").is_dir():
    raise ConfigError(f"{path}: no checkpoints/; give a run's workdir or an import's (a run "
                      "makes checkpoints/ at its first save: checkpoint.every, or its end).")


def output_file(tool: str, flag: str, path: str) -> None:
  """Checks before any work that `path` (a file the tool writes at the end, given as `flag`) can
  be written: not a directory, in a directory that exists and is writable; else `fail`."""
  folder = os.path.dirname(os.path.abspath(path))
  if os.path.isdir(path):
    fail(tool, f"{flag}={path}: a directory; name a file.")
  try:
    output.refuse_place(path, flag)
  except output.OutputError as e:
    fail(tool, str(e))
  why = output.not_a_folder(folder)
  if why is not None:
    fail(tool, f"{flag}={path}: {why[0]}; {'make it or name' if why[1] else 'name'} another file.")
  if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
    fail(tool, workdir.describe_os_error(PermissionError(13, os.strerror(13)), f"{flag}={path}"))


_FIGURES = {"bench": {"config", "set", "rows"}, "restart_bench": {"config", "set", "runs"},
            "kernels": {"steps", "wall_s"}}  # the keys each tool's --json file holds


def figures_file(tool: str, flag: str, path: str) -> None:
  """`output_file`'s checks for a file of figures `tool` writes (`write_figures`), and one
  more: a file already there is replaced only if it holds `tool`'s figures (any other file, a
  config or the user's own, is refused: one line)."""
  output_file(tool, flag, path)
  if os.path.lexists(path):
    try:
      held = json.loads(pathlib.Path(path).read_text(encoding="utf-8"))
      # Figures written before they named their tool: known by their keys.
      ours = held.get("tool", tool) == tool and set(held) >= _FIGURES[tool]
    except (OSError, ValueError, AttributeError):
      ours = False
    if not ours:
      fail(tool, f"{flag}={path}: exists and holds no figures of tools.{tool}; choose another "
           f"{flag} or remove it.")


def write_figures(tool: str, path: str, figures: dict) -> None:
  """`path` holds `figures` (with `"tool": tool`) as JSON, whole or not at all: a kill midway
  leaves the file before (output.write_whole)."""
  output.write_whole(path, {"tool": tool, **figures})


def new_folder(tool: str, flag: str, path: str, why: str) -> None:
  """Makes folder `path` (given as `flag`) that must be new or empty (`why` says why); a file, a
  folder holding anything, or one that cannot be made is one line (`fail`)."""
  if os.path.lexists(path) and not os.path.isdir(path):
    fail(tool, f"{flag}={path}: a file, not a folder; name a new folder.")
  if os.path.isdir(path) and os.listdir(path):
    fail(tool, f"{flag}={path}: not empty; name a new or empty folder ({why}).")
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    fail(tool, workdir.describe_os_error(e, f"{flag}={path}"))


def dims(tool: str, flag: str, text: str, what: str, example: str) -> tuple[int, ...]:
  """A kernel bench's shape flag, `AxBxC`, as positive integers, as many as `what` names (its
  parts " x "-separated, e.g. "images x positions x width"); else a one-line exit naming `tool`,
  the flag and `example`."""
  try:
    shape = tuple(int(v) for v in text.split("x"))
  except ValueError:
    shape = ()
  if len(shape) != len(what.split(" x ")) or min(shape) < 1:
    raise SystemExit(f"tools.{tool}: {flag} {text!r}: give {what} (e.g. {example}).")
  return shape


def gpu_timing(tool: str, repeat: int, needs: str) -> None:
  """A GPU kernel bench's checks before it times anything (`--repeat` at least 1, a GPU; each a
  one-line exit naming `tool`), then its device line."""
  if repeat < 1:
    raise SystemExit(f"{tool}: --repeat {repeat}: give 1 or more.")
  if jax.default_backend() != "gpu":
    raise SystemExit(f"{tool}: needs a GPU ({needs}); jax runs on {jax.default_backend()} here.")
  print(f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}")


def median_time(fn, reps: int = 5) -> float:
  """Median seconds of `fn()` (waited for) over `reps` calls, after one untimed call that
  compiles and allocates."""
  return median_times({"fn": fn}, reps)["fn"]


def median_times(fns: dict, reps: int = 5) -> dict:
  """`median_time` of several functions measured in turns (a, b, a, b, ...), so that a drift in
  the machine's speed during the measurement reaches every one of them alike."""
  for fn in fns.values():
    jax.block_until_ready(fn())
  times = {k: [] for k in fns}
  for _ in range(reps):
    for k, fn in fns.items():
      t = time.perf_counter()
      jax.block_until_ready(fn())
      times[k].append(time.perf_counter() - t)
  return {k: float(np.median(v)) for k, v in times.items()}


def record(title: str, tool: str, argv: list[str] | None, body: str, notes: tuple = (),
           device: bool = True) -> None:
  """Appends a section to docs/benchmarks.md: title, device (jax's devices), date, the commit
  measured, the command that produced it (`python -m tools.<tool>` with its arguments), `notes`
  lines, then `body`. The file keeps current figures only: remove the section this one replaces."""
  cmd = f"python -m tools.{tool} " + " ".join(sys.argv[1:] if argv is None else argv)
  lines = [f"## {title}", ""]
  if device:
    lines.append(f"- device: {len(jax.devices())} x {jax.devices()[0].device_kind}; "
                 f"jax {jax.__version__}")
  lines += [f"- date: {datetime.date.today().isoformat()}", f"- commit: {_commit()}",
            f"- command: `{cmd}`"]
  lines += [f"- {n}" for n in notes]
  if not BENCHMARKS.exists():
    BENCHMARKS.write_text("# Benchmarks\n\nCurrent figures, measured with the scripts in "
                          "`tools/`.\n")
  with open(BENCHMARKS, "a", encoding="utf-8") as f:
    f.write("\n" + "\n".join(lines) + f"\n\n{body}\n")
  print(f"appended to {BENCHMARKS}")


def _commit() -> str:
  """The checkout's commit (with "+ changes" if its tracked files differ), or "unknown"."""
  try:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout.strip()
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=ROOT).returncode != 0
  except (OSError, subprocess.CalledProcessError):
    return "unknown (not a git checkout)"
  return head + (" + uncommitted changes" if dirty else "")
