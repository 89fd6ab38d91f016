"""One optimizer step across module meshes: the host schedule around the programs (programs.py).

Each module works through the step's microbatches in chunks: one microbatch at a time, or all of
them in one call when the module is pipelined (`topology.<module>.pp > 1`). With one microbatch a
chunk on both sides, per microbatch m:

  encoder forward (m) -> bridge (m) -> language forward+backward (m) -> bridge back -> encoder
  backward (m)

The encoder runs ahead of the language model (`Ahead`): its forwards for the next chunks are
dispatched before the language model's work for m, and each forward's output is sent to the
language mesh at once, so that the copy is not queued behind the encoder's next backward. On
disjoint meshes the modules then overlap. After the last microbatch each module computes the
squared norm of its gradients, the scalars are exchanged, and each module applies one clip factor
and its own optax update (optim.py). When every encoder shares the language model's dp-only mesh,
a microbatch is one program instead (`programs.fused_step`): nothing to bridge.

Build a step with `Step.build(cfg)`; benchmark tools observe it through a `Probe` argument.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import numpy as np
from jax.sharding import NamedSharding

from mimo_jax import bridge, encoders, init_from, state, topology
from mimo_jax.batch import Batch, EncoderIn, LanguageIn, Merge
from mimo_jax.config import Config
from mimo_jax.context import Context, GradMode
from mimo_jax.modules import build_modules
from mimo_jax.programs import Programs
from mimo_jax.sharding import REPLICATED, Plan
from mimo_jax.state import ModuleState


@dataclasses.dataclass(frozen=True)
class Ahead:
  """The encoder-ahead policy: chunks an encoder's forwards run ahead of the language model's
  work, on a mesh shared with it (memory: each holds residuals) and on a disjoint one (so that
  the encoder's next forward is queued before its backward waits)."""
  shared: int = 1
  disjoint: int = 2

  def of(self, colocated: bool) -> int:
    return self.shared if colocated else self.disjoint


@dataclasses.dataclass
class Probe:
  """What a benchmark observes or replaces in a step: `phase(name, outputs)` after each phase
  (module name, "bridge" or "step"), how arrays cross between meshes (`send(x, dst)` returns a
  function giving the array on dst, as `bridge.send`), and whether the fused program may run."""
  phase: Callable | None = None
  send: Callable = functools.partial(bridge.send, parts=True)
  fused: bool = True

  def __call__(self, name: str, tree) -> None:
    if self.phase is not None:
      self.phase(name, tree)


TRAINING = Probe()


def put(x: np.ndarray, sharding: NamedSharding) -> jax.Array:
  """Host array -> global array; each process fills only the shards of its own devices."""
  x = np.asarray(x)
  return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index], dtype=x.dtype)


def _chunks(microbatches: int, whole: bool) -> list[list[int]]:
  return [list(range(microbatches))] if whole else [[m] for m in range(microbatches)]


def _first(x: np.ndarray, groups: int, n: int | None) -> np.ndarray:
  """The first n entries of each rank's share of x (all of them for None)."""
  if n is None:
    return x
  return x.reshape((groups, -1) + x.shape[1:])[:, :n].reshape((-1,) + x.shape[1:])


@dataclasses.dataclass
class Step:
  cfg: Config
  topo: topology.Topology
  modules: dict
  plan: Plan
  ctx: Context
  programs: Programs
  ahead: Ahead = Ahead()

  @classmethod
  def build(cls, cfg: Config, devices: list | None = None, ahead: Ahead = Ahead()) -> "Step":
    topo = topology.build(cfg, devices)
    modules = build_modules(cfg)
    plan = Plan.build(cfg, topo.meshes, modules)
    ctx = Context.build(cfg, plan, modules, encoders.of(cfg))
    return cls(cfg, topo, modules, plan, ctx, Programs.build(ctx), ahead)

  @property
  def encoders(self) -> list[str]:
    return self.plan.encoders

  def init_state(self, seed: int, optimizer: bool = True) -> dict[str, ModuleState]:
    abstract = {n: self.plan[n].canonical_params for n in self.modules}
    made = state.init_state(self.plan, self.modules, seed, optimizer,
                            init_from.starts(self.cfg, abstract))
    return init_from.adapters(self.cfg, self.plan, made)

  def place(self, batch: Batch, put: Callable = put) -> Batch:
    """A microbatch (or a whole eval batch) on device: text on the language mesh, each encoder's
    inputs and owners on its mesh. Of each language rank's slots only the first `Slots.sent`
    travel (data.slot_buckets), and of its rows the first `Text.rows_sent` (data.row_buckets):
    ranks fill their slots and packed rows from the first, and a placeholder indexes its rank's
    slots from the first, so the rest are empty and nothing else changes. `put(host array,
    sharding)` makes each array (precompile.py passes one that makes only its shape)."""
    g, lang = self.ctx.groups, self.plan.sharding("language")
    rows = lambda x: put(_first(x, g, int(batch.text.rows_sent)), lang)
    text = jax.tree.map(rows, dataclasses.replace(batch.text, rows_sent=None))
    slots = {}
    for n, s in batch.slots.items():
      mesh = self.plan.sharding(n)
      first = lambda x, s=s: _first(x, g, int(s.sent))
      slots[n] = dataclasses.replace(
          s, inputs={k: put(first(v), mesh) for k, v in s.inputs.items()},
          owner_nt=put(first(s.owner_nt), mesh), pos_rl=rows(s.pos_rl), used_g=None, sent=None)
    samples = jax.tree.map(lambda x: put(x, lang), batch.samples)
    return dataclasses.replace(batch, text=text, samples=samples, slots=slots, stats=None)

  def place_step(self, batch: Batch) -> tuple[list[Batch], jax.Array]:
    """All microbatches of a step on device, and 1 / the step's target tokens."""
    inputs = [self.place(batch.microbatch(m)) for m in range(batch.microbatches)]
    # From the layout's counts, which cover the samples other processes read (scalable reads).
    inv_tokens = np.float32(1.0 / max(float(batch.stats.target_tokens.sum()), 1.0))
    return inputs, put(inv_tokens, self.plan.sharding("language", REPLICATED))

  def train_step(self, state_: dict[str, ModuleState], batch: Batch):
    """Dispatches one optimizer step; returns the new state and device-side metrics."""
    return self.dispatch(state_, *self.place_step(batch))

  def encode(self, state_: dict[str, ModuleState], x: Batch) -> dict[str, jax.Array]:
    """Forward of every encoder (no backward), delivered to the language mesh."""
    dst = self.plan.sharding("language")
    return {n: bridge.transfer(self.programs.encoder_tokens[n](
        state_[n].params, [x.slots[n].inputs])[0], dst) for n in self.encoders}

  def dispatch(self, state_: dict[str, ModuleState], inputs: list[Batch], inv_tokens: jax.Array,
               probe: Probe = TRAINING):
    """The step on already-placed inputs: device work only, no host transfer."""
    if self.ctx.mode.fused and probe.fused:
      return self._dispatch_fused(state_, inputs, inv_tokens, probe)
    pr, plan = self.programs, self.plan
    num = len(inputs)
    acc = {n: pr.zeros[n](state_[n].params) for n in self.encoders}
    lang_acc = pr.language_accumulator({"language": state_["language"].params})
    chunks = {n: _chunks(num, self.ctx.whole_step(n)) for n in self.encoders}
    fwd = {n: [] for n in self.encoders}  # per encoder chunk: (tokens, owners, vjp or None)
    d_tokens = {n: {} for n in self.encoders}  # microbatch -> gradient on the encoder mesh
    ahead = {n: self.ahead.of(self.topo.colocated(n, "language")) for n in self.encoders}
    delivered = {n: {} for n in self.encoders}  # microbatch -> (tokens, owners) on language
    lang = plan.sharding("language")

    def encode_next(n):
      c = len(fwd[n])
      if c == len(chunks[n]):
        return
      p, slots = state_[n].params, [inputs[m].slots[n] for m in chunks[n][c]]
      if plan[n].trainable:
        fwd[n].append(pr.encoder_forward[n](p, [EncoderIn.of(s) for s in slots]))
      else:
        fwd[n].append((pr.encoder_tokens[n](p, [s.inputs for s in slots]),
                       [s.owner_nt for s in slots], None))
      probe(n, fwd[n][-1][0])
      # Sent at once: a copy queued on the encoder's devices after its next backward would make
      # the language model wait for that backward too. Assembled on the language mesh only when
      # the language model takes it (`encoded`): a join of pieces there, queued now, would wait
      # for those copies ahead of the language model's earlier microbatches.
      sent = jax.tree.map(lambda x: probe.send(x, lang), fwd[n][-1][:2], is_leaf=bridge.is_array)
      for i, m in enumerate(chunks[n][c]):
        delivered[n][m] = (sent[0][i], sent[1][i])
      if probe.phase is not None:
        probe("bridge", jax.tree.map(lambda get: get(), sent))

    def encoded(n, m):
      """Microbatch m's tokens and owners on the language mesh, dispatching the encoder's chunks
      up to the one that holds m and `ahead` more."""
      c = next(i for i, ms in enumerate(chunks[n]) if m in ms)
      while len(fwd[n]) <= c + ahead[n] and len(fwd[n]) < len(chunks[n]):
        encode_next(n)
      tokens, owners = delivered[n].pop(m)
      return tokens(), owners()

    for ms in _chunks(num, self.ctx.whole_step("language")):
      xs = [LanguageIn(inputs[m].text, {n: Merge(*encoded(n, m), inputs[m].slots[n].pos_rl)
                                        for n in self.encoders}) for m in ms]
      lang_acc, grads_back = pr.language_step(state_["language"].params, lang_acc, xs, inv_tokens)
      probe("language", lang_acc)
      for n in self.encoders:
        if not plan[n].trainable:
          continue
        for m, g in zip(ms, grads_back[n]):
          d_tokens[n][m] = probe.send(g, plan.sharding(n))()
        probe("bridge", d_tokens[n])
        for c, chunk in enumerate(chunks[n]):  # backward of every chunk now complete
          if c < len(fwd[n]) and fwd[n][c] is not None and all(m in d_tokens[n] for m in chunk):
            acc[n] = pr.encoder_backward[n](fwd[n][c][2], [d_tokens[n][m] for m in chunk], acc[n])
            fwd[n][c] = None
            probe(n, acc[n])
    acc.update(self._summed(self.ctx.split_mode, lang_acc["grads"]))
    return self._apply(state_, acc, lang_acc, probe)

  def _dispatch_fused(self, state_, inputs: list[Batch], inv_tokens: jax.Array, probe: Probe):
    """`dispatch` when every module shares one dp-only mesh: one program a microbatch, each
    module's gradients summed over ranks once at the end."""
    pr = self.programs
    params = {n: state_[n].params for n in self.plan.modules}
    acc = pr.fused_accumulator(params)
    for x in inputs:
      acc = pr.fused_step(params, acc, x.slots, x.text, inv_tokens)
    probe("step", acc)
    return self._apply(state_, self._summed(self.ctx.mode, acc["grads"]), acc, probe)

  def _summed(self, mode: GradMode, grads: dict) -> dict:
    """Module name -> gradients, summed over ranks where `mode` kept them per rank (`reduce`)."""
    return {n: self.programs.reduce[n](g) if mode.keeps_per_rank(n) else g
            for n, g in grads.items()}

  def _apply(self, state_, grads, lang_acc, probe: Probe):
    pr = self.programs
    sq = {n: pr.sq_norm[n](grads[n]) for n in self.plan.modules}
    new_state, metrics = {}, {}
    for n in self.plan.modules:
      here = self.plan.sharding(n, REPLICATED)
      sq_here = [bridge.transfer(sq[k], here) for k in self.plan.modules]
      p = self.plan[n]  # the update takes and returns the trained leaves; the frozen stay
      trained, opt_state, norm, scale = pr.update[n](p.trained(state_[n].params),
                                                     state_[n].opt_state, grads[n], sq_here)
      params = p.join(trained, p.frozen(state_[n].params))
      new_state[n] = ModuleState(params, opt_state)
      probe(n, params)
      metrics[f"clip_scale/{n}"] = scale
    metrics.update(loss=lang_acc["loss"], grad_norm=norm, mismatches=lang_acc["mismatches"])
    return new_state, metrics

  def lower_after_microbatches(self, params, acc) -> list:
    """The programs `_summed` and `_apply` run after a fused step's microbatches (its
    accumulator, each module's gradient sum over ranks where kept, squared norm and update),
    lowered for abstract parameters (the plan's layout) and accumulator: what they compile for."""
    pr, plan = self.programs, self.plan
    lowered = [pr.fused_accumulator.lower(params)]
    grads = {}
    for n in plan.modules:
      grads[n] = acc["grads"][n]
      if self.ctx.mode.keeps_per_rank(n):
        lowered.append(pr.reduce[n].lower(grads[n]))
        grads[n] = lowered[-1].out_info
    sq = {}
    for n in plan.modules:
      lowered.append(pr.sq_norm[n].lower(grads[n]))
      sq[n] = lowered[-1].out_info
    opt = self.abstract_state()
    for n, p in plan.modules.items():
      here = plan.sharding(n, REPLICATED)  # as `_apply` transfers each module's norm
      sq_here = [jax.ShapeDtypeStruct(sq[k].shape, sq[k].dtype, sharding=here)
                 for k in plan.modules]
      lowered.append(pr.update[n].lower(p.trained(params[n]), opt[n]["opt_state"], grads[n],
                                        sq_here))
    return lowered

  # The state's layout for checkpoints (state.py).
  def abstract_state(self, canonical: bool = False) -> dict[str, dict]:
    return state.abstract_state(self.plan, canonical)

  def fresh_opt_state(self, name: str, canonical_params):
    """Module `name`'s optimizer state as its transform starts it, for parameters in the
    checkpoint layout (a step saved with parameters only)."""
    p = self.plan[name]
    target = self.abstract_state(canonical=True)[name]["opt_state"]
    return jax.jit(p.tx.init, out_shardings=jax.tree.map(lambda a: a.sharding, target))(
        p.trained(canonical_params))

  def canonical(self, state_: dict[str, ModuleState]) -> dict[str, ModuleState]:
    return state.canonical(self.plan, state_)

  def from_canonical(self, state_: dict[str, ModuleState]) -> dict[str, ModuleState]:
    return state.from_canonical(self.plan, state_)
