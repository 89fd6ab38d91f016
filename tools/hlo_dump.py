"""XLA's optimized HLO, dumped as text while programs compile (`dump_hlo`) and read back
(`read_hlo`): each instruction's shape, operation, source frames and the bytes a kernel of it
reads and writes, so that tools.kernels can trace a kernel to the line that made it."""

from __future__ import annotations

import glob
import os
import re
from typing import NamedTuple

import jax

# A kernel of no instruction in the dump: a library's (cuBLAS, cuDNN), or one of a program that
# was not compiled while dumping (loaded from a compilation cache).
UNTRACED = "(no instruction: a library kernel)"
# Model files that hold shared layers: a kernel of theirs belongs to the model file that calls them.
SHARED_MODEL_FILES = ("layers.py", "fp8.py", "lora.py")


class Instruction(NamedTuple):
  shape: str
  op: str  # its metadata's op_name
  frames: tuple[str, ...]  # "path:line function", innermost first
  bytes: int = 0  # its operands' and results' sizes: what a kernel of it reads and writes once


# Bytes an element of each HLO element type (the types a shape is written with, e.g. bf16[8,4]).
_ELEMENT_BYTES = {"pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2,
                  "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8,
                  "c64": 8, "c128": 16}
_ARRAY = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,]*)\]")


def shape_bytes(shape: str) -> list[int]:
  """The sizes of the arrays a shape names (one, or a tuple's elements in order); an FP8 type
  (f8e4m3fn, ...) takes a byte an element."""
  sizes = []
  for dtype, dims in _ARRAY.findall(shape):
    n = 1
    for d in filter(None, dims.split(",")):
      n *= int(d)
    sizes.append(n * (1 if dtype.startswith("f8") else _ELEMENT_BYTES.get(dtype, 0)))
  return sizes


def _operands(rest: str) -> list[tuple[str, int | None]]:
  """An instruction's operands from the text after its opcode's '(': (name, tuple index or
  None), to the parenthesis that closes the list."""
  depth, end = 1, len(rest)
  for i, ch in enumerate(rest):
    depth += {"(": 1, ")": -1}.get(ch, 0)
    if depth == 0:
      end = i
      break
  return [(name, int(index) if index else None)
          for name, index in re.findall(r"%([\w.\-]+)(?:#(\d+))?", rest[:end])]


def read_hlo(directory: str) -> dict[str, dict[str, Instruction]]:
  """The optimized HLO that XLA dumped as text into `directory`: program name -> instruction
  name -> Instruction. Programs of one name are merged (a trace names a kernel's program by
  name only); an instruction name that two of them give different shapes keeps the first's
  source but no bytes, as the trace cannot say which it ran."""
  programs: dict[str, dict[str, Instruction]] = {}
  for path in sorted(glob.glob(os.path.join(directory, "*after_optimizations.txt"))):
    with open(path, encoding="utf-8") as f:
      text = f.read()
    head = re.match(r"HloModule ([^\s,]+)", text)
    if not head:
      continue
    merged = programs.setdefault(head.group(1), {})
    for name, found in _instructions(text).items():
      known = merged.setdefault(name, found)
      if (known.shape, known.bytes) != (found.shape, found.bytes):
        merged[name] = known._replace(bytes=0)
  return programs


def _tables(text: str) -> dict[str, dict[int, str]]:
  """The HLO text's stack-frame tables (FileNames, FunctionNames, FileLocations, StackFrames):
  table -> id -> its entry as written."""
  tables: dict[str, dict[int, str]] = {}
  current = None
  for line in text.splitlines():
    if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
      current = tables.setdefault(line, {})
    elif current is not None and (entry := re.match(r"(\d+) (.*)$", line)):
      current[int(entry.group(1))] = entry.group(2)
    elif not line.strip():
      current = None
  return tables


def _frames(tables: dict[str, dict[int, str]]) -> dict[int, tuple[str, ...]]:
  """Stack frame id -> its frames, innermost first, each "path:line function". A frame's
  parent_frame_id is written one above the parent's id (so 1 is no parent)."""
  files, functions = tables.get("FileNames", {}), tables.get("FunctionNames", {})
  locations = {}
  for i, entry in tables.get("FileLocations", {}).items():
    fields = dict(re.findall(r"(\w+)=(\d+)", entry))
    file = files.get(int(fields["file_name_id"]), "?").strip('"')
    function = functions.get(int(fields["function_name_id"]), "?").strip('"')
    locations[i] = f"{file}:{fields['line']} {function}"
  frames: dict[int, tuple[str, ...]] = {}
  for i in sorted(tables.get("StackFrames", {})):
    fields = dict(re.findall(r"(\w+)=(\d+)", tables["StackFrames"][i]))
    parent = int(fields["parent_frame_id"]) - 1
    frames[i] = (locations.get(int(fields["file_location_id"]), "?"),) + frames.get(parent, ())
  return frames


# An instruction: its name, its shape (a tuple's may hold /*index=N*/ marks), opcode, the rest.
_DEFINITION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (\((?:/\*index=\d+\*/|[^()=])*\)|\S+) "
                         r"([\w\-]+)\((.*)$", re.M)
# Ops that read only the part of their operand that they return.
_PART_READS = ("slice", "dynamic-slice")


def _instructions(text: str) -> dict[str, Instruction]:
  frames = _frames(_tables(text))
  found = list(_DEFINITION.finditer(text))
  sizes = {m.group(1): shape_bytes(m.group(2)) for m in found}
  reads = _fused_reads(text, sizes)
  out = {}
  for m in found:
    name, shape, rest = m.group(1), m.group(2), m.group(4)
    op = re.search(r'op_name="([^"]*)"', rest)
    frame = re.search(r"stack_frame_id=(\d+)", rest)
    fused = re.search(r"\bcalls=%([\w.\-]+)", rest)
    part_reads = reads.get(fused.group(1), {}) if fused else {}
    moved = sum(sizes[name])
    for k, (operand, index) in enumerate(_operands(rest)):
      parts = sizes.get(operand, [])
      whole = parts[index] if index is not None and index < len(parts) else sum(parts)
      moved += min(whole, part_reads.get(k, whole))
    out.setdefault(name, Instruction(shape, op.group(1) if op else "",
                                     frames.get(int(frame.group(1)), ()) if frame else (), moved))
  return out


def _fused_reads(text: str, sizes: dict[str, list[int]]) -> dict[str, dict[int, int]]:
  """Computation name -> {parameter number: bytes read} for the parameters that the
  computation only slices: a fusion reads those parts of its operand, not all of it."""
  reads: dict[str, dict[int, int]] = {}
  for body in re.finditer(r"^%([\w.\-]+) \(.*?\{\n(.*?)^\}", text, re.M | re.S):
    defs = list(_DEFINITION.finditer(body.group(2)))
    params = {m.group(1): int(re.match(r"(\d+)", m.group(4)).group(1))
              for m in defs if m.group(3) == "parameter"}
    users: dict[str, list[tuple[str, str]]] = {p: [] for p in params}
    for m in defs:
      for operand, _ in _operands(m.group(4)):
        if operand in users:
          users[operand].append((m.group(3), m.group(1)))
    reads[body.group(1)] = {
        params[p]: sum(sum(sizes.get(u, [])) for _, u in used)
        for p, used in users.items() if used and all(kind in _PART_READS for kind, _ in used)}
  return reads


def instruction(hlo: dict[str, dict[str, Instruction]], prog: str, name: str,
                op: str) -> Instruction | None:
  """The instruction a kernel ran for: its trace's HLO op, or the instruction its name is made
  from (XLA names an emitted kernel after its instruction, '.' written '_')."""
  found = hlo.get(prog, {})
  for key in (op, name, re.sub(r"_(\d+)$", r".\1", name)):
    if key in found:
      return found[key]
  return None


def _ours(frame: str) -> bool:
  """A frame outside installed packages and Python's own modules."""
  return not frame.startswith("<") and not re.search(
      r"[/\\](site|dist)-packages[/\\]|^/usr/lib/", frame)


def source(frames: tuple[str, ...]) -> str:
  """The innermost frame outside installed packages (and Python's own), or "?"."""
  return next((_short(frame) for frame in frames if _ours(frame)), "?")


def part(frames: tuple[str, ...]) -> str:
  """The model file a kernel belongs to (models/<file>.py, but not the shared layers'), else
  the file of its `source`."""
  for frame in filter(_ours, frames):
    path = frame.rsplit(":", 1)[0]
    if re.search(r"[/\\]models[/\\]", path) and os.path.basename(path) not in SHARED_MODEL_FILES:
      return _short(path)
  return source(frames).rsplit(":", 1)[0]


def _short(path: str) -> str:
  """A path from its mimo_jax/ or tools/ folder on, else its file name."""
  m = re.search(r"(?:^|[/\\])((?:mimo_jax|tools|tests)[/\\].*)$", path)
  return m.group(1) if m else os.path.basename(path)


def dump_hlo(directory: str) -> None:
  """Has XLA write every program it compiles from now on as optimized HLO text into
  `directory`, which must be new or empty (files of another run would be read as this one's);
  before JAX's backend starts."""
  if os.path.isdir(directory) and os.listdir(directory):
    raise SystemExit(f"kernels: --hlo {directory} holds files already; name a new or empty "
                     "directory")
  os.makedirs(directory, exist_ok=True)
  flags = f"--xla_dump_to={directory} --xla_dump_hlo_as_text"
  add_xla_flags(flags)
  jax.config.update("jax_enable_compilation_cache", False)  # a program loaded is not dumped


def add_xla_flags(flags: str) -> None:
  """`flags` after XLA_FLAGS' own (before JAX's backend starts: XLA reads them once)."""
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()
