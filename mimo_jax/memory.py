"""Device memory a layout needs, known before anything compiles.

For every module, per device: its parameters (a frozen leaf in the compute dtype), optimizer
state and gradient accumulators (the trained leaves' alone), exactly, from the plan's shardings
(sharding.py: what `topology.<module>.shard` splits over dp) and the step's `context.GradMode`
(the modules that keep gradients per rank), and a lower bound on the activations its backward
keeps (one microbatch's layer inputs, the MLP's hidden units and the LoRA adapters' own
activations unless `remat=full`; one microbatch's logits and their gradient in the compute
dtype, or with `train.loss_chunk` one chunk's, every microbatch's stack outputs where a
pipelined language model runs its head after the stack (gpipe, circular; the schedules with
backward tasks run it inside, on each microbatch's output); a pipelined module holds all its
microbatches' internals under gpipe and circular, one chunk's and its microbatches in flight
under 1f1b and interleaved_1f1b: `in_flight`).
Modules that share devices add up. A layout whose bound exceeds the device's memory cannot run,
and `check` refuses it with one line naming the module; the true peak is higher (XLA's temporary
buffers, the optimizer update's, the gathered layers under FSDP), so a layout whose bound comes
within WARN of the memory gets a warning line: it may not fit. A device that runs out all the
same (XLA's error) is one line too (`out_of_memory`, `device_ran_out`): where, the bound of its
modules, and the fields that use less.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import jax
import numpy as np
from jax.sharding import AbstractMesh

from mimo_jax import encoders, xla_errors
from mimo_jax.config import LANGUAGE, Config, ConfigError
from mimo_jax.config_run import DIGITS_VOCAB
from mimo_jax.modules import build_modules
from mimo_jax.pipeline import Schedule
from mimo_jax.context import Context
from mimo_jax.models.lora import A
from mimo_jax.sharding import AXES, Plan, with_shardings
from mimo_jax.trees import paths

GiB = 1024**3
WARN = 0.85  # a bound above this share of the device's memory is warned about


def _bytes(tree) -> int:
  """Bytes of the largest shard of every array in `tree` (ShapeDtypeStructs with shardings)."""
  return sum(math.prod(a.sharding.shard_shape(a.shape)) * np.dtype(a.dtype).itemsize
             for a in jax.tree.leaves(tree) if hasattr(a, "sharding"))


def in_flight(cfg: Config, name: str) -> tuple[int, int]:
  """(microbatches whose layer internals a stage keeps for the backward at once, chunk inputs it
  keeps besides): a pipeline whose backward autodiff makes (gpipe, circular) keeps every
  microbatch's internals; one with backward tasks (1f1b, interleaved_1f1b) keeps its forward
  tasks' residuals (a chunk's internals under the remat policy, `Schedule.kept`: at most
  2(p − s) − 1 for 1f1b) and one chunk's more while a backward runs, and its chunk inputs until
  their forward (`Schedule.held`); under remat=full it keeps the chunk inputs of its
  microbatches in flight until their backward, which runs the chunk again (one chunk's
  internals, each layer keeping all it needs: `_activations`)."""
  t = cfg.topology.module(name)
  if t.pp == 1:
    return 1, 0
  schedule = Schedule(t.pp, t.virtual, t.schedule)
  micro = cfg.data.microbatches
  if not schedule.explicit(micro):
    return micro, 0
  return schedule.kept(micro, t.remat) + 1, schedule.held(micro, t.remat)


def _adapter_rank(abstract_params) -> int:
  """The ranks of a layer's LoRA adapters added up (models/lora.py): the width of the adapters'
  own activations (x·A) a block keeps a token, 0 without adapters."""
  blocks = abstract_params.get("blocks", {})
  return sum(int(a.shape[-1]) for path, a in paths(blocks).items() if path.endswith(A))


def _activations(cfg: Config, name: str, adapter_rank: int = 0, tail: bool = False) -> int:
  """A lower bound on the bytes of activations the backward keeps a device (`in_flight`);
  `adapter_rank`: the width of the LoRA adapters' own activations a block keeps a token
  (`_adapter_rank`; none under remat=full, which keeps each layer's input alone). `tail`: the
  language model's last block finishes in the loss (`Context.last_block_in_loss`), which keeps
  no MLP activations of it but its mixed heads' gradient."""
  t = cfg.topology.module(name)
  d = cfg.data
  width = np.dtype(cfg.model.dtype).itemsize
  internals, inputs = in_flight(cfg, name)
  if inputs and t.remat == "full":  # a backward task runs its chunk again, keeping all it needs
    t = dataclasses.replace(t, remat="none")
  layers = cfg.model.module(name).layers // t.pp
  chunk = layers // t.virtual if inputs else layers  # a backward task holds one chunk's
  # The stack's outputs, every microbatch's, for the head after it (none where the head runs
  # inside a schedule with backward tasks: `Stack.loss`).
  outputs = d.microbatches if t.pp > 1 and not inputs else 0
  adapters = 0 if t.remat == "full" else adapter_rank
  if name != LANGUAGE:
    enc = encoders.get(name)
    one_input = enc.activation_bytes(cfg, dataclasses.replace(t, remat="full"))
    per_layer = enc.activation_bytes(cfg, t) + one_input * adapters // cfg.model.module(name).dim
    return per_layer * chunk * internals + one_input * inputs
  m = cfg.model.language
  tokens = (d.pack_rows or d.micro_batch) // t.dp * d.seq_len  # a microbatch's on a device
  kept = m.dim + (0 if t.remat == "full" else 2 * m.mlp_dim // t.tp) + adapters
  vocab = m.vocab_size or DIGITS_VOCAB
  # A pipelined head takes the stack's outputs a microbatch at a time (Context.pipelined_loss):
  # one microbatch's logits and their gradient at once, every microbatch's outputs kept for it
  # under gpipe and circular; with train.loss_chunk, a chunk's logits and their gradient, beside
  # the gathered outputs' gradient (models/head_loss.py).
  positions = min(cfg.train.loss_chunk, tokens) if cfg.train.loss_chunk else tokens
  head = (positions * 2 * vocab // t.tp + (tokens * m.dim if cfg.train.loss_chunk else 0)) * width
  if tail:  # the mixed heads' gradient (split over tp as the heads); the last MLP keeps nothing
    head += tokens * (m.dim // t.tp - (0 if t.remat == "full" else 2 * m.mlp_dim // t.tp)) * width
  return tokens * (internals * chunk * kept + inputs * m.dim + outputs * m.dim) * width + head


def context(cfg: Config) -> Context:
  """The run's plan and programs' context on abstract meshes (no devices needed)."""
  modules = build_modules(cfg)
  meshes = {n: AbstractMesh((t.pp, t.dp, t.tp), AXES)
            for n, t in cfg.topology.modules().items()}
  return Context.build(cfg, Plan.build(cfg, meshes, modules), modules, encoders.of(cfg))


def module_bytes(cfg: Config) -> dict[str, dict[str, int]]:
  """Per module: bytes a device holds of parameters, optimizer state, gradients, activations."""
  ctx = context(cfg)
  out = {}
  for name, p in ctx.plan.modules.items():
    per_rank = ctx.mode.keeps_per_rank(name)  # as the training step keeps them (GradMode)
    acc_sh = p.per_rank_sh if per_rank else p.trained_sh  # as many bytes when folded (fold.py)
    trained = p.trained(p.abstract_params)  # a frozen leaf has no gradient (optim.trained)
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(((p.dp,) if per_rank else ()) + a.shape,
                                                         a.dtype), trained)
    grads = _bytes(with_shardings(shapes, acc_sh))
    if per_rank:  # the step's sum is made beside the per-rank accumulators
      grads += _bytes(with_shardings(trained, p.grad_sh))
    out[name] = {"parameters": _bytes(p.abstract_params),
                 "optimizer state": _bytes(with_shardings(p.opt_shapes, p.opt_sh)),
                 "gradients": grads if p.trainable else 0,
                 "activations": _activations(cfg, name, _adapter_rank(p.canonical_params),
                                             name == LANGUAGE and ctx.last_block_in_loss(True))}
  return out


def _devices(cfg: Config) -> dict[int, list[str]]:
  """Device index -> the modules placed on it (topology.<module>.offset and size)."""
  out = {}
  for name, t in cfg.topology.modules().items():
    for d in range(t.offset, t.offset + t.size):
      out.setdefault(d, []).append(name)
  return out


def per_device(cfg: Config, need: dict[str, dict[str, int]]) -> int:
  """The most bytes any one device needs: the modules placed on it added up."""
  return max(sum(sum(need[n].values()) for n in names) for names in _devices(cfg).values())


def device_memory(cfg: Config) -> int | None:
  """Bytes a device has: `run.device_memory_gb` if set, else what the device reports (GPUs; the
  CPU reports nothing, and then nothing is checked)."""
  if cfg.run.device_memory_gb > 0:
    return int(cfg.run.device_memory_gb * GiB)
  stats = jax.local_devices()[0].memory_stats() or {}
  return stats.get("bytes_limit")


def check(cfg: Config, limit: int | None = None, warn=None) -> dict[str, dict[str, int]]:
  """Raises a ConfigError naming the module whose devices cannot hold what it needs (with the
  modules it shares them with) in `limit` bytes (default `device_memory`); calls `warn(line)`
  where the bound comes within WARN of it. Returns `module_bytes`."""
  need = module_bytes(cfg)
  limit = limit or device_memory(cfg)
  if not limit:
    return need
  worst = per_device(cfg, need)
  if WARN * limit < worst <= limit and warn is not None:
    warn(f"warning: the layout needs at least {size(worst)} of a device's {size(limit)} "
         f"({worst / limit:.0%}; mimo_jax/memory.py counts no temporaries): it may run out of "
         "memory.")
  for names in _devices(cfg).values():
    total = sum(sum(need[n].values()) for n in names)
    if total <= limit:
      continue
    name = max(names, key=lambda n: sum(need[n].values()))
    parts = ", ".join(f"{k} {size(v)}" for k, v in need[name].items())
    others = [n for n in names if n != name]
    shared = (f"; {', '.join(others)} on the same devices "
              f"{size(sum(sum(need[n].values()) for n in others))}" if others else "")
    raise ConfigError(
        f"config.topology.{name}.shard: {name} needs at least {size(sum(need[name].values()))} "
        f"a device ({parts}{shared}) where a device has {size(limit)}; "
        f"{_either(_fixes(cfg, name, None))}.")
  return need


STATE, STEP, EVAL = "while placing the state", "in the training step", "in the evaluation"


def _fixes(cfg: Config, name: str, during: str | None) -> list[str]:
  """What takes memory off the devices of module `name` where it ran out `during` (STATE, STEP,
  EVAL), or (None) where `check`'s bound does not fit: only changes that validation takes."""
  t, d = cfg.topology.module(name), cfg.data
  fixes = []
  if during == EVAL and _valid(cfg, "eval", batch=cfg.eval.batch // 2):
    fixes.append(f"a smaller eval.batch (now {cfg.eval.batch})")
  if during == STEP and name == LANGUAGE and d.pack_rows:  # the rows, not the samples, count
    if _valid(cfg, "data", pack_rows=d.pack_rows // 2, microbatches=d.microbatches * 2):
      fixes.append(f"fewer data.pack_rows (now {d.pack_rows}) with more data.microbatches "
                   f"(now {d.microbatches})")
  elif during == STEP and _valid(cfg, "data", microbatches=d.microbatches * 2):
    fixes.append(f"more data.microbatches (now {d.microbatches}, {d.micro_batch} samples each)")
  if during == STEP and t.remat != "full":
    fixes.append(f"set topology.{name}.remat=full")
  if t.shard != "full" and t.dp > 1:
    fixes.append(f"shard its state over dp (topology.{name}.shard=full)")
  fixes.append("add dp, tp or pp")
  if during is None and t.remat != "full":
    fixes.append(f"set topology.{name}.remat=full")
  return fixes


def _valid(cfg: Config, section: str, **values) -> bool:
  """Whether `cfg` with `values` set in its `section` passes validation (validation.py)."""
  from mimo_jax.validation import validate  # pylint: disable=import-outside-toplevel  (a cycle)
  changed = copy.deepcopy(cfg)
  for k, v in values.items():
    setattr(getattr(changed, section), k, v)
  try:
    validate(changed)
  except ConfigError:
    return False
  return True


def _either(fixes: list[str]) -> str:
  return f"{', '.join(fixes[:-1]) + ' or ' if len(fixes) > 1 else ''}{fixes[-1]}"


class OutOfMemoryError(Exception):
  """A device's memory ran out: one line saying where, and what to change (`out_of_memory`)."""


def device_ran_out(e: BaseException, less: str) -> str | None:
  """A tool's line (without its end) for a device that ran out of memory, with what uses `less`;
  None for any other error."""
  xla = xla_errors.out_of_memory(e)
  return None if xla is None else f"a device ran out of memory (XLA: {xla}); to use less, {less}"


def _on_device(cfg: Config, xla: str, need: dict | None) -> list[str]:
  """The modules on the device XLA's sentence names (its ordinal among this process's devices);
  where it names none, those of the device that needs the most (or every module)."""
  ordinal, local, devices = xla_errors.device_ordinal(xla), jax.local_devices(), _devices(cfg)
  if ordinal is not None and ordinal < len(local) and local[ordinal].id in devices:
    return list(devices[local[ordinal].id])
  if need is None:
    return list(cfg.topology.modules())
  return list(max(devices.values(), key=lambda names: sum(sum(need[n].values()) for n in names)))


def out_of_memory(e: BaseException, cfg: Config, during: str) -> OutOfMemoryError | None:
  """For a device that ran out of memory (xla_errors.out_of_memory) `during` STATE, STEP or EVAL:
  an error of one line, with the bound of the modules on that device beside its memory and the
  fields that take memory off the one of them that needs the most; None for any other error."""
  xla = xla_errors.out_of_memory(e)
  if xla is None:
    return None
  try:
    need, limit = module_bytes(cfg), device_memory(cfg)
  except Exception:  # pylint: disable=broad-except  (the line goes without the bound)
    need, limit = None, None
  names, bound = _on_device(cfg, xla, need), ""
  if need is not None:
    names.sort(key=lambda n: -sum(need[n].values()))
    held = sum(sum(need[n].values()) for n in names)
    bound = (f"; mimo_jax/memory.py counts at least {size(held)} "
             f"{f'of its {size(limit)} ' if limit else ''}for {' and '.join(names)} there, "
             "without XLA's temporaries")
  return OutOfMemoryError(
      f"a device ran out of memory {during} (XLA: {xla}){bound}. To use less, "
      f"{_either(_fixes(cfg, names[0], during))}"
      f"{f' ({names[0]} needs the most)' if len(names) > 1 else ''}; then run the same "
      "command (a run resumes from its newest checkpoint).")


def size(nbytes: float) -> str:
  """Bytes as GiB, or MiB below one GiB."""
  return f"{nbytes / GiB:.1f} GiB" if nbytes >= GiB else f"{nbytes / 1024**2:.1f} MiB"
