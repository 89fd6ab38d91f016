"""What the step's programs share besides their arrays: the config, the plan and the modules,
how a training step makes its gradients (`GradMode`), and the module calls every program makes
through it (`Context`: an encoder's tokens, the language model's hidden states and logits, the
gradients of the trained leaves alone). Built once a step (`Context.build`); programs.py's
functions take it first, and evaluation and the memory check read it too."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from mimo_jax import fold, optim
from mimo_jax.batch import Text
from mimo_jax.config import Config, lora_of
from mimo_jax.encoders import Encoder
from mimo_jax.models import head_loss, kernel_grads, lora
from mimo_jax.models.fp8 import history_length
from mimo_jax.models.mimo import Module, language_hidden, language_logits
from mimo_jax.pipeline import Stack, remat
from mimo_jax.pipeline_tasks import Head
from mimo_jax.sharding import BLOCKS, ModulePlan, Plan


def fusable(cfg: Config, plan: Plan) -> bool:
  """Every encoder shares the language model's dp-only mesh (same devices, no pipeline): a step
  can run as one program a microbatch."""
  tops = cfg.topology.modules()
  same = lambda a, b: (a.offset, a.pp, a.dp, a.tp) == (b.offset, b.pp, b.dp, b.tp)
  return not plan["language"].schedule.pipelined and plan["language"].tp == 1 and all(
      not plan[n].schedule.pipelined and same(tops[n], tops["language"]) for n in plan.encoders)


@dataclasses.dataclass(frozen=True)
class GradMode:
  """How a step makes its gradients: the programs (`fused`: every module in one program a
  microbatch, `fused_step`; else split: each module's own programs, chained by the host) and the
  modules whose gradients are kept per language dp rank [dp, ...] through the step and summed once
  by `reduce` (`per_rank`; every other module's are summed over ranks in each microbatch's
  program). Built once (`Context.build`); the programs and the memory check read it."""
  fused: bool
  per_rank: frozenset[str]
  # The modules whose trained stacked kernels accumulate layer by layer (fold.py).
  folded: frozenset[str] = frozenset()

  @classmethod
  def build(cls, plan: Plan, fused: bool, cfg: Config) -> "GradMode":
    """The modules differentiated rank by rank in one `each_rank` (every module in the fused
    program; the language model in the split ones, where it is dp only and not pipelined) keep
    their gradients per rank: all of them, unless one is FSDP-sharded (full per-rank copies would
    undo the sharding) or there is one rank (nothing to sum). The modules whose gradients
    `Context.value_and_grad` makes (every module in the fused program, the language model in the
    split ones) fold where `fold.eligible`."""
    lang = plan["language"]
    if fused:
      each = list(plan.modules)
    else:
      each = [] if lang.schedule.pipelined or lang.tp > 1 else ["language"]
    keep = lang.dp > 1 and not any(plan[n].sharded_params for n in each)
    per_rank = frozenset(each if keep else ())
    differentiated = list(plan.modules) if fused else ["language"]
    folded = frozenset(n for n in differentiated
                       if fold.eligible(cfg, plan[n], n, n in per_rank))
    return cls(fused, per_rank, folded)

  def keeps_per_rank(self, name: str) -> bool:
    return name in self.per_rank

  def folds(self, name: str, p: ModulePlan):
    """Which of module `name`'s trained leaves accumulate layer by layer (`fold.mask`), or None."""
    return fold.mask(p) if name in self.folded else None

  def acc_sh(self, name: str, p: ModulePlan):
    """Where module `name`'s gradient accumulators live (`p`: its plan): its trained leaves', per
    rank where kept so, layer by layer where folded (`fold.shardings`)."""
    if self.keeps_per_rank(name):
      return p.per_rank_sh
    return p.trained_sh if name not in self.folded else fold.shardings(p, fold.mask(p))


@dataclasses.dataclass(frozen=True)
class Context:
  """What the programs need besides their arrays. `mode` is how a training step makes its
  gradients; `split_mode` is the split programs' mode (the same unless `mode.fused`; a benchmark's
  `Probe(fused=False)` runs them on a fusable layout). `dropping` holds the block stacks that
  drop the LoRA adapters' input (training a module with `lora.dropout` > 0)."""
  cfg: Config
  plan: Plan
  modules: dict[str, Module]
  encoders: dict[str, Encoder]
  stacks: dict[str, Stack]
  mode: GradMode
  split_mode: GradMode
  dropping: dict[str, Stack] = dataclasses.field(default_factory=dict)

  @classmethod
  def build(cls, cfg: Config, plan: Plan, modules: dict[str, Module], encoders: dict) -> "Context":
    tops = cfg.topology.modules()
    stack = lambda n, layer, indexed=False: Stack(
        layer, plan[n].mesh, plan[n].schedule, tops[n].remat, tops[n].unroll, plan[n].gather,
        trained=_trained_blocks(plan[n]), indexed=indexed, dtype=jnp.dtype(cfg.model.dtype))
    mode = GradMode.build(plan, fusable(cfg, plan), cfg)
    split_mode = GradMode.build(plan, False, cfg) if mode.fused else mode
    # A folded module's layers make their kernels' gradients in float32 (fold.py).
    stacks = {n: stack(n, kernel_grads.wrap(m.layer) if n in mode.folded else m.layer)
              for n, m in modules.items()}
    rates = {n: lora_of(cfg, n).dropout for n in modules if lora_of(cfg, n)}
    # A module with nothing to train runs forward only (split layouts: `encoder_tokens`): no drop
    dropping = {n: stack(n, lora.dropping(modules[n].layer, r), indexed=True)
                for n, r in rates.items() if r > 0 and plan[n].trainable}
    return cls(cfg, plan, modules, encoders, stacks, mode, split_mode, dropping)

  @property
  def groups(self) -> int:
    """Language dp ranks: what a microbatch's rows and slots are split over."""
    return self.plan["language"].dp

  @property
  def packed(self) -> bool:
    return self.cfg.data.pack_rows > 0

  def whole_step(self, name: str) -> bool:
    """Whether `name` takes all microbatches of a step in one call (a pipelined module)."""
    return self.plan[name].schedule.pipelined

  def bind(self, name: str, params):
    """The NNX module; its `blocks` are not to be called directly (use `run_blocks`)."""
    return self.modules[name].bind(self.plan[name].unlayout(params))

  def run_blocks(self, name: str, params, seeds=None, head: Head | None = None):
    """The module's block stack on `params` as a `RunBlocks` callable; given LoRA dropout's
    seeds of its rows [M, ...] (`lora.token_seeds`), the stack that drops its adapters' input.
    With `head` (pipelined), it returns the head's loss summed over microbatches (`Stack.loss`)
    instead of the blocks' outputs."""
    stack, extra = (self.stacks[name], ()) if seeds is None else (self.dropping[name], (seeds,))
    if head is None:
      return lambda x_m, side_m: stack(params[BLOCKS], x_m, (*side_m, *extra))
    return lambda x_m, side_m: stack.loss(params[BLOCKS], x_m, (*side_m, *extra), head)

  def frozen_stopped(self, name: str, params):
    """`params` with the frozen groups' leaves behind `stop_gradient`: a backward through them
    computes no gradient of a frozen weight (a LoRA base, a frozen tower), only the gradients of
    its inputs that trained parameters before it need."""
    return jax.tree.map(lambda x, label: jax.lax.stop_gradient(x) if label == optim.FROZEN else x,
                        params, self.plan[name].labels)

  def value_and_grad(self, fn, params: dict, *args, mode: GradMode | None = None):
    """`fn(params, *args)` (params: module name -> parameters) and its gradients with respect to
    the trained leaves alone (per module, `ModulePlan.trained`; then the gradients with respect
    to `args`, if any): a frozen leaf enters as a constant, so no gradient or zeros of it is
    ever made. The modules `mode` folds are differentiated with respect to their stacked
    kernels' slices (`fold.unstack`): their gradients come back layer by layer."""
    plan = self.plan
    frozen = {n: plan[n].frozen(p) for n, p in params.items()}
    whole = lambda trained: {n: plan[n].join(fold.restack(t), frozen[n])
                             for n, t in trained.items()}
    trained = {n: plan[n].trained(p) for n, p in params.items()}
    folds = {n: mode.folds(n, plan[n]) if mode else None for n in params}
    trained = {n: t if folds[n] is None else fold.unstack(t, folds[n]) for n, t in trained.items()}
    argnums = tuple(range(1 + len(args))) if args else 0
    return jax.value_and_grad(lambda t, *a: fn(whole(t), *a), argnums=argnums)(trained, *args)

  def encode(self, name: str, params, inputs_m: dict, owners_m=None) -> jax.Array:
    """Encoder `name` on stacked microbatches of its device inputs -> tokens [M, n, t, d].
    `owners_m` (the slots' `owner_nt` [M, n, t], training only): its LoRA adapters' input is
    dropped, by the rows `Encoder.dropout_rows` names."""
    params = self.frozen_stopped(name, params)
    enc, seeds = self.encoders[name], None
    if owners_m is not None:
      ids = jax.vmap(enc.dropout_rows(self.cfg))(inputs_m, owners_m)
      seeds = lora.token_seeds(self.cfg.train.seed, name, *ids)
    return enc.encode(self.bind(name, params), self.run_blocks(name, params, seeds),
                      enc.prepare(self.cfg, inputs_m))

  def logits(self, params, text: Text, tokens: dict, pos: dict, groups: int,
             packed: bool, train: bool = False) -> jax.Array:
    """The language model on stacked microbatches of rows with every encoder's tokens merged
    (`packed`: rows hold several samples, attention is masked to each). `train`: its LoRA
    adapters' input dropped, if it has `lora.dropout` (evaluation never drops)."""
    return self._language(language_logits, params, text, tokens, pos, groups, packed, train)[1]

  def hidden(self, params, text: Text, tokens: dict, pos: dict, groups: int, packed: bool,
             train: bool = False):
    """As `logits`, up to the blocks' outputs: (the bound model, whose `logits` makes the
    logits of them, the outputs [M, rows, l, d], a `head_loss.Tail` or None). With a tail
    (`last_block_in_loss`), the outputs are those of every block but the last with the last
    one's mixed heads, (x [M, rows, l, d], mixed [M, rows, l, heads · head_dim]), and the
    tail makes the last block's outputs of them."""
    tail = self.last_block_in_loss(train)
    model, h = self._language(language_hidden, params, text, tokens, pos, groups, packed, train,
                              tail)
    return (model, h[0], h[1]) if tail else (model, h, None)

  def pipelined_loss(self, params, text: Text, tokens: dict, pos: dict, groups: int,
                     packed: bool) -> jax.Array:
    """The pipelined language model's training loss summed over its stacked microbatches: its
    final norm, head and cross-entropy (`head_loss.loss_sum`, chunked by `train.loss_chunk`) a
    `pipeline_tasks.Head` that the Stack runs on each microbatch's output, inside a schedule
    with backward tasks (so that its stack's forward does not run alone first)."""
    # The head's parameters: its final norm and output layer (with any adapters), or the
    # embedding when they are tied (whose gradient adds to the one of its lookup).
    keys = ("norm", "embedding" if self.cfg.model.language.tie_embeddings else "head")
    labels = {k: v for k, v in self.plan["language"].labels.items() if k in keys}
    chunk = self.cfg.train.loss_chunk

    def apply(trained, frozen, h, targets, weights):
      model = self.bind("language", optim.join(trained, frozen))  # the head's parameters alone
      return head_loss.loss_sum(model, h, targets, weights, groups, chunk)

    def head(params) -> Head:
      rest = {k: v for k, v in params.items() if k in keys}
      return Head(apply, optim.trained(rest, labels), optim.frozen(rest, labels),
                  (text.targets_rl, text.loss_mask_rl))
    return self._language(language_hidden, params, text, tokens, pos, groups, packed, True,
                          head=head)[1]

  def last_block_in_loss(self, train: bool) -> bool:
    """Whether the language model's last block runs its position-wise rest (output projection,
    MLP) inside the chunked loss, only where a target carries loss (`train.last_block_in_loss`,
    models/head_loss.py). Where the layout allows: a chunked loss (`train.loss_chunk`), blocks not
    pipelined and their loop unrolled (a rolled loop over the first L − 1 layers' slices would
    copy them), no FP8 histories (delayed scaling: their abs-maxima combine by maximum, not by
    sum), no LoRA dropout in training (its masks follow the rows' positions)."""
    cfg = self.cfg
    m = cfg.model.language
    return (cfg.train.last_block_in_loss and cfg.train.loss_chunk > 0
            and not self.plan["language"].schedule.pipelined
            and cfg.topology.modules()["language"].unroll and history_length(m) == 0
            and not (train and "language" in self.dropping))

  def _language(self, fn, params, text: Text, tokens: dict, pos: dict, groups: int, packed: bool,
                train: bool, tail: bool = False, head=None):
    """`fn(model, run_blocks, ...)`; `head(params) -> Head`: the blocks return its loss."""
    params = self.frozen_stopped("language", params)
    seeds = lora.token_seeds(self.cfg.train.seed, "language", text.token_sample_rl,
                             text.positions_rl) if train and "language" in self.dropping else None
    model = self.bind("language", params)
    run = self._with_tail(params) if tail else self.run_blocks(
        "language", params, seeds, None if head is None else head(params))
    return model, fn(model, run, text.tokens_rl, tokens, pos, groups, text.positions_rl,
                     text.segment_ids_rl if packed else None)

  def _with_tail(self, params):
    """A `RunBlocks` of every language block but the last, then the last one's `mix`: -> ((x,
    mixed), the `head_loss.Tail` that finishes the last block)."""
    module, p = self.modules["language"], self.plan["language"]
    first, last = _first_and_last(params[BLOCKS], p.labels.get(BLOCKS, {}))
    gather = p.gather or (lambda tree: tree)
    top = self.cfg.topology.modules()["language"]
    mix = remat(lambda q, x, *side: module.bind_layer(gather(q)).mix(x, *side), top.remat,
                gathered=p.gather is not None)

    def run(x_m, side_m):
      x_m = self.stacks["language"](first, x_m, side_m)
      if x_m.shape[0] == 1:  # as the Stack runs one microbatch: no vmap around the kernels
        mixed_m = mix(last, x_m[0], *(a[0] for a in side_m))[None]
      else:
        mixed_m = jax.vmap(lambda x, *side: mix(last, x, *side))(x_m, *side_m)
      tail_params = {k: v for k, v in gather(last).items() if k in TAIL}
      tail_params["attn"] = {"o": tail_params["attn"]["o"]}
      finish = lambda q, x, mixed: module.bind_layer(q).finish(x, mixed)
      return (x_m, mixed_m), head_loss.Tail(tail_params, finish)
    return run


def _first_and_last(blocks, labels):
  """Stacked blocks -> (every layer but the last, the last): the trained leaves through
  `_split_last`, the frozen ones sliced (no gradient of theirs is made, nor zeros of one)."""
  first, last = _split_last(optim.trained(blocks, labels))
  frozen = optim.frozen(blocks, labels)
  return (optim.join(first, jax.tree.map(lambda a: a[:-1], frozen)),
          optim.join(last, jax.tree.map(lambda a: a[-1], frozen)))


@jax.custom_vjp
def _split_last(blocks):
  """Stacked blocks -> (every layer but the last, the last), whose gradients join as one
  concatenation (autodiff would add two zero-padded ones): where the kernels' gradients fold
  (fold.py), XLA then takes each layer's slice of it back to the matmul that made it."""
  return jax.tree.map(lambda a: a[:-1], blocks), jax.tree.map(lambda a: a[-1], blocks)


def _split_last_fwd(blocks):
  return _split_last(blocks), None


def _split_last_bwd(_, cts):
  first, last = cts
  return (jax.tree.map(lambda f, l: jnp.concatenate([f, l[None]]), first, last),)


_split_last.defvjp(_split_last_fwd, _split_last_bwd)


# The parts of a decoder block that `DecoderBlock.finish` runs (of its attention, `o` alone).
TAIL = ("attn", "norm2", "mlp")


def _trained_blocks(p: ModulePlan):
  """Which stacked parameters train (a tree of bools), for the Stack's backward tasks."""
  return jax.tree.map(lambda label: label != optim.FROZEN, p.labels.get(BLOCKS, {}))
