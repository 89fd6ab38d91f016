"""The step's programs: each a named function, jitted once per mesh by `Programs.build`.

XLA compiles one SPMD program per mesh, so a training step is a few programs per module, chained by
the host (step.py). Every function here takes a `Context` (context.py: the static part: config,
plan, modules) first and typed microbatches (batch.py: `EncoderIn`, `LanguageIn`, `Slots`) after
it; `Programs` holds their jitted forms. Lists are chunks of microbatches (one, or a whole step for
a pipelined module), dicts are keyed by module or encoder name. Which programs make the
gradients, and where each module's are summed, is one value, `context.GradMode`, that the memory
check reads too.

Where the two dp sizes differ by a whole factor, the program that makes what crosses the bridge
(an encoder's forward, the language model's backward) cuts it for the bridge and the one that
takes it joins the pieces (`bridge.split`, `bridge.join`): the bridge itself only copies.

**Gradients summed once a step.** Wherever the language model is dp only (`GradMode.per_rank`),
its step runs in a `jax.shard_map` over its mesh (`each_rank`): each rank differentiates its own
rows (a rank's rows index only its own tokens), the gradients come back per rank [dp, ...] split
over dp and accumulate there, and `reduce` sums them once before the clip: one all-reduce a step.
The shard_map is manual over every mesh axis (cuDNN attention's partitioner fails inside a partly
manual one), so a tensor-parallel language model sums in every microbatch's step instead; a
pipelined one takes the whole step in one call and sums once anyway.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from mimo_jax import bridge, fold, optim, trees
from mimo_jax.batch import EncoderIn, LanguageIn, Merge, Slots, Text
from mimo_jax.config import Config
from mimo_jax.context import Context, GradMode
from mimo_jax.models import head_loss
from mimo_jax.models.mimo import slot_mismatches
from mimo_jax.sharding import REPLICATED


def _to_language(ctx: Context, name: str, x):
  """What goes to the language mesh leaves an encoder's program cut for it (a fan-out)."""
  return bridge.split(x, ctx.plan.sharding(name), ctx.plan.sharding("language"))


# ---- encoders -------------------------------------------------------------------------------

def encoder_apply(ctx: Context, name: str, params, inputs: list[dict],
                  owners: list | None = None) -> list[jax.Array]:
  """A chunk of microbatches' inputs -> their tokens, split over the encoder's dp (`owners`:
  their slots' owners, in training: `Context.encode`)."""
  drop = owners and name in ctx.dropping
  out = ctx.encode(name, params, trees.stack(inputs), trees.stack(owners) if drop else None)
  return [jax.lax.with_sharding_constraint(out[i], ctx.plan.sharding(name))
          for i in range(len(inputs))]


def encoder_tokens(ctx: Context, name: str, params, inputs: list[dict]) -> list:
  """The forward alone (a frozen encoder, evaluation), cut for the language mesh."""
  return [_to_language(ctx, name, e) for e in encoder_apply(ctx, name, params, inputs)]


def encoder_forward(ctx: Context, name: str, params, xs: list[EncoderIn]):
  """The forward with its `jax.vjp` closure (a pytree of residuals, which `encoder_backward`
  consumes: no recomputation) with respect to the trained leaves, the tokens and their owners
  cut for the language mesh."""
  p = ctx.plan[name]
  frozen = p.frozen(params)
  tokens, vjp = jax.vjp(lambda t: encoder_apply(ctx, name, p.join(t, frozen),
                                                [x.inputs for x in xs], [x.owner_nt for x in xs]),
                        p.trained(params))
  return ([_to_language(ctx, name, e) for e in tokens],
          [_to_language(ctx, name, x.owner_nt) for x in xs], vjp)


def encoder_backward(labels, vjp, d_tokens: list, acc):
  """The tokens' gradients (a fan-in's pieces joined here) through the forward's vjp, added to
  the accumulated parameter gradients (`labels`: the trained leaves', optim.combine)."""
  return optim.combine(acc, vjp([bridge.join(d) for d in d_tokens])[0], labels)


# ---- the language model ---------------------------------------------------------------------

def language_loss(ctx: Context, params, x: LanguageIn, inv_tokens, groups: int) -> jax.Array:
  """The language model's share of the step's loss on stacked microbatches: with
  `train.loss_chunk`, the head and the cross-entropy run only where a target carries loss, a
  chunk of positions at a time (models/head_loss.py), else over every position at once. A
  pipelined model's microbatches (all of the step's, at once) go through the head and the loss
  one at a time (`Context.pipelined_loss`): the step holds one microbatch's logits (or chunk's),
  not all of them (which would undo what a schedule with backward tasks saves)."""
  if ctx.plan["language"].schedule.pipelined:
    loss = ctx.pipelined_loss(params, x.text, x.tokens, x.positions, groups, ctx.packed)
    return loss * inv_tokens
  model, h_m, tail = ctx.hidden(params, x.text, x.tokens, x.positions, groups, ctx.packed,
                                train=True)
  return head_loss.loss_sum(model, h_m, x.text.targets_rl, x.text.loss_mask_rl, groups,
                            ctx.cfg.train.loss_chunk, tail) * inv_tokens


def mismatches(ctx: Context, x: LanguageIn) -> jax.Array:
  """Placeholders that received a token of another sample than their own (must be 0)."""
  return sum(jnp.sum(jax.vmap(slot_mismatches, in_axes=(0, 0, 0, None))(
      m.owner_nt, m.pos_rl, x.text.token_sample_rl, ctx.groups)) for m in x.merges.values())


def each_rank(ctx: Context, fn, params, rows: tuple, inv_tokens, row_outputs: int = 0):
  """`fn(params, *rows, inv_tokens) -> (loss, parameter gradients, *row_outputs)` on each dp
  rank's own rows and tokens (tp and pp are 1): the loss comes back summed over ranks, the
  gradients unsummed, [dp, ...]."""
  def local(params, rows, inv_tokens):
    params = jax.lax.pcast(params, ("dp",), to="varying")
    loss, grads, *outs = fn(params, *rows, inv_tokens)
    return (jax.lax.psum(loss, "dp"), jax.tree.map(lambda g: g[None], grads), *outs)
  split = P(None, "dp")  # [microbatches, rows or slots, ...]
  return jax.shard_map(local, mesh=ctx.plan["language"].mesh, in_specs=(P(), split, P()),
                       out_specs=(P(), P("dp")) + (split,) * row_outputs)(params, rows, inv_tokens)


def _forward_backward(ctx: Context, params, x: LanguageIn, inv_tokens, groups: int):
  """Stacked microbatches -> (loss, the trained parameters' gradients, the tokens' gradients)."""
  loss_fn = lambda p, tokens: language_loss(ctx, p["language"], x.with_tokens(tokens),
                                            inv_tokens, groups)
  loss, (g_params, g_tokens) = ctx.value_and_grad(loss_fn, {"language": params}, x.tokens,
                                                   mode=ctx.split_mode)
  return loss, g_params["language"], g_tokens


def _joined(x: LanguageIn) -> LanguageIn:
  """x with the pieces of a fan-in (`bridge.Parts`) joined."""
  join = lambda m: dataclasses.replace(m, tokens_ntd=bridge.join(m.tokens_ntd),
                                       owner_nt=bridge.join(m.owner_nt))
  return dataclasses.replace(x, merges={n: join(m) for n, m in x.merges.items()})


def _accumulate(ctx: Context, acc: dict, grads: dict, loss, mismatched) -> dict:
  """`acc` with a microbatch's gradients (module name -> tree, optim.combine), loss and count."""
  summed = {n: optim.combine(acc["grads"][n], g, ctx.plan[n].trained(ctx.plan[n].labels))
            for n, g in grads.items()}
  return {"grads": summed, "loss": acc["loss"] + loss,
          "mismatches": acc["mismatches"] + mismatched}


def language_step(ctx: Context, params, acc: dict, xs: list[LanguageIn], inv_tokens):
  """A chunk of microbatches: loss, gradients and mismatches added to `acc`; returns it and the
  tokens' gradients for each encoder, cut for the bridge where that is a fan-out."""
  x = trees.stack([_joined(x) for x in xs])
  if ctx.split_mode.keeps_per_rank("language"):
    loss, g_params, g_tokens = each_rank(
        ctx, lambda p, x, inv: _forward_backward(ctx, p, x, inv, 1), params,
        (x.without_owners(),), inv_tokens, row_outputs=1)
  else:  # summed over ranks here (reduce-scattered under FSDP)
    loss, g_params, g_tokens = _forward_backward(ctx, params, x, inv_tokens, ctx.groups)
    g_params = jax.lax.with_sharding_constraint(
        g_params, ctx.split_mode.acc_sh("language", ctx.plan["language"]))
  lang = ctx.plan.sharding("language")
  g_tokens = {n: [bridge.split(g[i], lang, ctx.plan.sharding(n)) for i in range(len(g))]
              for n, g in g_tokens.items()}
  return _accumulate(ctx, acc, {"language": g_params}, loss, mismatches(ctx, x)), g_tokens


def fused_step(ctx: Context, params: dict, acc: dict, slots: dict[str, Slots], text: Text,
               inv_tokens):
  """One placed microbatch through every module as one program (`GradMode.fused`): encoders
  forward, merge, language forward and backward, encoders backward; every module's gradients per
  rank, or with an FSDP module (`GradMode.per_rank` empty) summed over ranks here."""
  one = lambda tree: jax.tree.map(lambda v: v[None], tree)  # a chunk of one microbatch
  x = one(LanguageIn(text, {n: Merge(None, s.owner_nt, s.pos_rl) for n, s in slots.items()}))
  # The encoders' inputs, and the owners of those that drop their adapters' input.
  inputs = one({n: s.inputs for n, s in slots.items()})
  inputs = (inputs, {n: s.owner_nt[None] for n, s in slots.items() if n in ctx.dropping})
  per_rank = bool(ctx.mode.per_rank)  # all modules or none: one `each_rank` differentiates all
  groups = 1 if per_rank else ctx.groups

  def loss_fn(params, inputs, x, inv_tokens):
    inputs, owners = inputs
    tokens = {}
    for n in ctx.encoders:
      e = ctx.encode(n, params[n], inputs[n], owners.get(n))
      tokens[n] = e if ctx.plan[n].trainable else jax.lax.stop_gradient(e)
    return language_loss(ctx, params["language"], x.with_tokens(tokens), inv_tokens, groups)
  grad_fn = lambda params, inputs, x, inv: ctx.value_and_grad(
      lambda p: loss_fn(p, inputs, x, inv), params, mode=ctx.mode)
  if per_rank:
    loss, grads = each_rank(ctx, grad_fn, params, (inputs, x.without_owners()), inv_tokens)
  else:
    loss, grads = grad_fn(params, inputs, x.without_owners(), inv_tokens)
    grads = jax.lax.with_sharding_constraint(
        grads, {n: ctx.mode.acc_sh(n, p) for n, p in ctx.plan.modules.items()})
  return _accumulate(ctx, acc, grads, loss, mismatches(ctx, x))


# ---- accumulators and the update ------------------------------------------------------------

def per_rank_zeros(dp: int, params):
  return jax.tree.map(lambda a: jnp.zeros((dp,) + a.shape, a.dtype), params)


def accumulator(ctx: Context, mode: GradMode, params: dict) -> dict:
  """What a step's microbatches add to: zero gradients of the trained leaves of `params` (module
  name -> parameters; per rank where `mode` keeps them so), loss and mismatch count."""
  trained = {n: ctx.plan[n].trained(p) for n, p in params.items()}

  def one(n, p):
    if mode.keeps_per_rank(n):
      return per_rank_zeros(ctx.groups, p)
    folds = mode.folds(n, ctx.plan[n])
    return zeros(p) if folds is None else fold.unstack(zeros(p), folds)
  return {"grads": {n: one(n, p) for n, p in trained.items()},
          "loss": jnp.zeros((), jnp.float32), "mismatches": jnp.zeros((), jnp.int32)}


def zeros(params):
  return jax.tree.map(jnp.zeros_like, params)


def reduce(labels, grads):
  """Per-rank gradients [dp, ...] -> their sum: the step's one all-reduce of a module (a
  reduce-scatter where its optimizer state is split over dp: ZeRO-1); an FP8 abs-max history's
  recorded abs-maxes by their maximum (optim.reduce_ranks)."""
  return optim.reduce_ranks(grads, labels)


def sq_norm(labels, grads) -> jax.Array:
  return optim.trainable_sq_norm(fold.restack(grads), labels)


def update(ctx: Context, name: str, params, opt_state, grads, sq_norms: list):
  """One clip factor from every module's squared norm (optim.py), then this module's optax
  update of its trained leaves (`params`: those alone; the frozen ones are not touched). FP8
  abs-max histories take no optax update (optim.AMAX): they roll in the step's abs-maxes."""
  norm, scale = optim.clip_factor(sq_norms, ctx.cfg.optim.clip_norm)
  p, grads = ctx.plan[name], fold.restack(grads)
  rolled = optim.roll_histories(params, grads, p.trained(p.labels))
  grads = jax.tree.map(lambda g: g * scale, grads)
  updates, opt_state = p.tx.update(grads, opt_state, params)
  new = optax.apply_updates(params, updates)
  new = jax.tree.map(lambda a, r, lab: r if lab == optim.AMAX else a, new, rolled,
                     p.trained(p.labels))
  return new, opt_state, norm, scale


# XLA's GPU options when `run.autotune` is false: its heuristics choose each matmul's kernel (no
# candidate is timed on the GPU, so a compile does not wait on the steps that run meanwhile), and
# no matmul is fused into a generated (Triton) kernel, whose choice would need timing.
HEURISTIC_KERNELS = {"xla_gpu_autotune_level": 0, "xla_gpu_enable_triton_gemm": False}


# XLA's GPU command buffers (CUDA graphs) with the kinds of command XLA records by default, and
# loops and conditionals (`run.device_loops`): a loop whose trip count the data decides (the
# loss's chunks, models/head_loss.py) runs inside the graph. Without them the host reads the
# loop's condition from the device at every iteration, and the device waits while the host
# launches what follows. XLA leaves loops out itself where the driver cannot (before CUDA 12.3).
DEVICE_LOOPS = {"xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,"
                                                 "DYNAMIC_SLICE_FUSION,WHILE,CONDITIONAL"}


def compiler_options(cfg: Config, pipelined: bool = False) -> dict | None:
  """The step programs' XLA options (`run.autotune`; `run.device_loops` where no module is
  `pipelined`: a pipeline's schedule has not been run so on a GPU); other backends ignore them.
  They override XLA_FLAGS' values of the same options."""
  options = {**({} if cfg.run.autotune else HEURISTIC_KERNELS),
             **(DEVICE_LOOPS if cfg.run.device_loops and not pipelined else {})}
  return options or None


def step_options(ctx: Context) -> dict | None:
  """`compiler_options` of a step's layout: the training step's programs and the eval loss's."""
  return compiler_options(ctx.cfg, any(p.schedule.pipelined for p in ctx.plan.modules.values()))


@dataclasses.dataclass(frozen=True)
class Programs:
  """The jitted programs of a step, per module where they run on its mesh (the fused program and
  its accumulator only where `Context.mode` is fused)."""
  encoder_forward: dict
  encoder_tokens: dict
  encoder_backward: dict
  language_step: Callable
  fused_step: Callable | None
  language_accumulator: Callable  # {"language": parameters} -> accumulator
  fused_accumulator: Callable | None  # every module's parameters -> accumulator
  zeros: dict
  reduce: dict
  sq_norm: dict
  update: dict

  @classmethod
  def build(cls, ctx: Context) -> "Programs":
    plan, mode = ctx.plan, ctx.mode
    part = functools.partial
    jit = part(jax.jit, compiler_options=step_options(ctx))
    scalar = lambda n: plan.sharding(n, REPLICATED)
    metrics = {"loss": scalar("language"), "mismatches": scalar("language")}
    acc = lambda mode, names: jit(part(accumulator, ctx, mode), out_shardings={
        "grads": {n: mode.acc_sh(n, plan[n]) for n in names}, **metrics})
    return cls(
        encoder_forward={n: jit(part(encoder_forward, ctx, n)) for n in ctx.encoders},
        encoder_tokens={n: jit(part(encoder_tokens, ctx, n)) for n in ctx.encoders},
        encoder_backward={n: jit(part(encoder_backward, plan[n].trained(plan[n].labels)),
                                     donate_argnums=(2,), out_shardings=plan[n].trained_sh)
                          for n in ctx.encoders},
        language_step=jit(part(language_step, ctx), donate_argnums=(1,)),
        fused_step=jit(part(fused_step, ctx), donate_argnums=(1,)) if mode.fused else None,
        language_accumulator=acc(ctx.split_mode, ["language"]),
        fused_accumulator=acc(mode, list(plan.modules)) if mode.fused else None,
        zeros={n: jit(lambda params, p=p: zeros(p.trained(params)), out_shardings=p.trained_sh)
               for n, p in plan.modules.items()},
        reduce={n: jit(part(reduce, p.trained(p.labels)), out_shardings=p.grad_sh)
                for n, p in plan.modules.items()},
        sq_norm={n: jit(part(sq_norm, p.trained(p.labels)), out_shardings=scalar(n))
                 for n, p in plan.modules.items()},
        update={n: jit(part(update, ctx, n), donate_argnums=(0, 1),
                           out_shardings=(p.trained_sh, p.opt_sh, scalar(n), scalar(n)))
                for n, p in plan.modules.items()})
