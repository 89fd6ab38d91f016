"""The step's programs: each a named function, jitted once per mesh by `Programs.build`.

XLA compiles one SPMD program per mesh, so a training step is a few programs per module, chained by
the host (step.py). Every function here takes a `Context` (the static part: config, plan, modules)
first and arrays after it; `Programs` holds their jitted forms. Lists are chunks of microbatches
(one, or a whole step for a pipelined module), dicts are keyed by module or encoder name.

Where the two dp sizes differ by a whole factor, the program that makes what crosses the bridge
(an encoder's forward, the language model's backward) cuts it for the bridge and the one that
takes it joins the pieces (`bridge.split`, `bridge.join`): the bridge itself only copies.

**Gradients summed once a step.** Wherever the language model is dp only (`Context.defer_reduce`),
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

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from mimo_jax import bridge, optim
from mimo_jax.batch import Text
from mimo_jax.config import Config
from mimo_jax.encoders import Encoder
from mimo_jax.models.mimo import Module, language_logits, slot_mismatches
from mimo_jax.pipeline import Stack
from mimo_jax.sharding import BLOCKS, REPLICATED, Plan


@dataclasses.dataclass(frozen=True)
class Context:
  """What the programs need besides their arrays."""
  cfg: Config
  plan: Plan
  modules: dict[str, Module]
  encoders: dict[str, Encoder]
  stacks: dict[str, Stack]

  @classmethod
  def build(cls, cfg: Config, plan: Plan, modules: dict[str, Module], encoders: dict) -> "Context":
    tops = cfg.topology.modules()
    stacks = {n: Stack(m.layer, plan[n].mesh, plan[n].schedule, tops[n].remat, tops[n].unroll,
                       plan[n].gather) for n, m in modules.items()}
    return cls(cfg, plan, modules, encoders, stacks)

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

  @functools.cached_property
  def defer_reduce(self) -> bool:
    """The language model keeps per-rank gradients through the step (module docstring); not
    under FSDP, where full per-rank copies would undo the sharding, nor on one rank, where there
    is nothing to sum."""
    lang = self.plan["language"]
    return (not self.whole_step("language") and lang.tp == 1 and lang.dp > 1
            and not lang.sharded_params)

  @functools.cached_property
  def fused(self) -> bool:
    """Every encoder shares the language model's dp-only mesh: one program a microbatch."""
    tops, lang = self.cfg.topology.modules(), self.plan["language"]
    same = lambda a, b: (a.offset, a.pp, a.dp, a.tp) == (b.offset, b.pp, b.dp, b.tp)
    return not self.whole_step("language") and lang.tp == 1 and all(
        not self.whole_step(n) and same(tops[n], tops["language"]) for n in self.encoders)

  @functools.cached_property
  def fused_per_rank(self) -> bool:
    """The fused program keeps every module's gradients per rank (none is FSDP-sharded)."""
    return self.fused and self.groups > 1 and not any(
        p.sharded_params for p in self.plan.modules.values())

  def bind(self, name: str, params):
    """The NNX module; its `blocks` are not to be called directly (use `run_blocks`)."""
    return self.modules[name].bind(self.plan[name].unlayout(params))

  def run_blocks(self, name: str, params):
    """The module's block stack on `params` as a `RunBlocks` callable."""
    return lambda x_m, side_m: self.stacks[name](params[BLOCKS], x_m, side_m)

  def encode(self, name: str, params, inputs_m: dict) -> jax.Array:
    """Encoder `name` on stacked microbatches of its device inputs -> tokens [M, n, t, d]."""
    enc = self.encoders[name]
    return enc.encode(self.bind(name, params), self.run_blocks(name, params),
                      enc.prepare(self.cfg, inputs_m))

  def logits(self, params, text: Text, tokens: dict, pos: dict, groups: int,
             packed: bool) -> jax.Array:
    """The language model on stacked microbatches of rows with every encoder's tokens merged
    (`packed`: rows hold several samples, attention is masked to each)."""
    return language_logits(self.bind("language", params), self.run_blocks("language", params),
                           text.tokens_rl, tokens, pos, groups, text.positions_rl,
                           text.segment_ids_rl if packed else None)


def _stacked(xs: list) -> jax.Array:
  return jnp.stack(xs) if len(xs) > 1 else xs[0][None]


def _stack(trees: list):
  return jax.tree.map(lambda *xs: _stacked(list(xs)), *trees)


def _tree_add(a, b):
  return jax.tree.map(jnp.add, a, b)


def _to_language(ctx: Context, name: str, x):
  """What goes to the language mesh leaves an encoder's program cut for it (a fan-out)."""
  return bridge.split(x, ctx.plan.sharding(name), ctx.plan.sharding("language"))


# ---- encoders -------------------------------------------------------------------------------

def encoder_apply(ctx: Context, name: str, params, inputs: list[dict]) -> list[jax.Array]:
  """A chunk of microbatches' inputs -> their tokens, split over the encoder's dp."""
  out = ctx.encode(name, params, _stack(inputs))
  return [jax.lax.with_sharding_constraint(out[i], ctx.plan.sharding(name))
          for i in range(len(inputs))]


def encoder_tokens(ctx: Context, name: str, params, inputs: list[dict]) -> list:
  """The forward alone (a frozen encoder, evaluation), cut for the language mesh."""
  return [_to_language(ctx, name, e) for e in encoder_apply(ctx, name, params, inputs)]


def encoder_forward(ctx: Context, name: str, params, inputs: list[dict], owners: list):
  """The forward with its `jax.vjp` closure (a pytree of residuals, which `encoder_backward`
  consumes: no recomputation), the tokens and their owners cut for the language mesh."""
  tokens, vjp = jax.vjp(lambda p: encoder_apply(ctx, name, p, inputs), params)
  return ([_to_language(ctx, name, e) for e in tokens],
          [_to_language(ctx, name, o) for o in owners], vjp)


def encoder_backward(vjp, d_tokens: list, acc):
  """The tokens' gradients (a fan-in's pieces joined here) through the forward's vjp, added to
  the accumulated parameter gradients."""
  return _tree_add(acc, vjp([bridge.join(d) for d in d_tokens])[0])


# ---- the language model ---------------------------------------------------------------------

def language_loss(ctx: Context, params, tokens: dict, pos: dict, text: Text, inv_tokens,
                  groups: int) -> jax.Array:
  """The language model's share of the step's loss on stacked microbatches."""
  logits = ctx.logits(params, text, tokens, pos, groups, ctx.packed)
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, text.targets_rl)
  return jnp.sum(ce * text.loss_mask_rl) * inv_tokens


def mismatches(ctx: Context, owners: dict, pos: dict, text: Text) -> jax.Array:
  """Placeholders that received a token of another sample than their own (must be 0)."""
  return sum(jnp.sum(jax.vmap(slot_mismatches, in_axes=(0, 0, 0, None))(
      owners[n], pos[n], text.token_sample_rl, ctx.groups)) for n in owners)


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


def _forward_backward(ctx: Context, params, tokens, pos, text, inv_tokens, groups):
  """Stacked microbatches -> (loss, parameter gradients, the tokens' gradients)."""
  loss_fn = lambda p, tokens: language_loss(ctx, p, tokens, pos, text, inv_tokens, groups)
  loss, (g_params, g_tokens) = jax.value_and_grad(loss_fn, argnums=(0, 1))(params, tokens)
  return loss, g_params, g_tokens


def language_step(ctx: Context, params, acc: dict, tokens: dict, owners: dict, pos: dict,
                  text: list[Text], inv_tokens):
  """A chunk of microbatches: loss, gradients and mismatches added to `acc`; returns it and the
  tokens' gradients for each encoder, cut for the bridge where that is a fan-out. `tokens`,
  `owners` and `pos` map encoder name -> one array (or bridge.Parts) a microbatch."""
  x = _stack(text)
  pos = {n: _stacked(v) for n, v in pos.items()}
  owners = {n: _stacked([bridge.join(o) for o in v]) for n, v in owners.items()}
  tokens = {n: _stacked([bridge.join(e) for e in v]) for n, v in tokens.items()}
  if ctx.defer_reduce:
    loss, g_params, g_tokens = each_rank(
        ctx, lambda p, tokens, pos, x, inv: _forward_backward(ctx, p, tokens, pos, x, inv, 1),
        params, (tokens, pos, x), inv_tokens, row_outputs=1)
  else:  # summed over ranks here (reduce-scattered under FSDP)
    loss, g_params, g_tokens = _forward_backward(ctx, params, tokens, pos, x, inv_tokens,
                                                 ctx.groups)
    g_params = jax.lax.with_sharding_constraint(g_params, ctx.plan["language"].param_sh)
  lang = ctx.plan.sharding("language")
  g_tokens = {n: [bridge.split(g[i], lang, ctx.plan.sharding(n)) for i in range(len(g))]
              for n, g in g_tokens.items()}
  acc = {"grads": _tree_add(acc["grads"], g_params), "loss": acc["loss"] + loss,
         "mismatches": acc["mismatches"] + mismatches(ctx, owners, pos, x)}
  return acc, g_tokens


def fused_step(ctx: Context, params: dict, acc: dict, inputs: dict, owners: dict, pos: dict,
               text: Text, inv_tokens):
  """One microbatch through every module as one program (`Context.fused`): encoders forward,
  merge, language forward and backward, encoders backward; every module's gradients per rank, or
  with an FSDP module (`Context.fused_per_rank` false) summed over ranks here."""
  x = jax.tree.map(lambda v: v[None], text)
  pos = {n: v[None] for n, v in pos.items()}
  inputs = jax.tree.map(lambda v: v[None], inputs)

  groups = 1 if ctx.fused_per_rank else ctx.groups

  def loss_fn(params, inputs, pos, x, inv_tokens):
    tokens = {}
    for n in ctx.encoders:
      e = ctx.encode(n, params[n], inputs[n])
      tokens[n] = e if ctx.plan[n].trainable else jax.lax.stop_gradient(e)
    return language_loss(ctx, params["language"], tokens, pos, x, inv_tokens, groups)
  if ctx.fused_per_rank:
    loss, grads = each_rank(ctx, jax.value_and_grad(loss_fn), params, (inputs, pos, x),
                            inv_tokens)
  else:
    loss, grads = jax.value_and_grad(loss_fn)(params, inputs, pos, x, inv_tokens)
    grads = jax.lax.with_sharding_constraint(
        grads, {n: p.param_sh for n, p in ctx.plan.modules.items()})
  owners = {n: v[None] for n, v in owners.items()}
  return {"grads": _tree_add(acc["grads"], grads), "loss": acc["loss"] + loss,
          "mismatches": acc["mismatches"] + mismatches(ctx, owners, pos, x)}


# ---- accumulators and the update ------------------------------------------------------------

def _acc0(grads) -> dict:
  return {"grads": grads, "loss": jnp.zeros((), jnp.float32),
          "mismatches": jnp.zeros((), jnp.int32)}


def per_rank_zeros(dp: int, params):
  return jax.tree.map(lambda a: jnp.zeros((dp,) + a.shape, a.dtype), params)


def language_accumulator(ctx: Context, params) -> dict:
  """The language step's accumulator: gradients per rank where they are summed once a step."""
  zeros = (per_rank_zeros(ctx.groups, params) if ctx.defer_reduce
           else jax.tree.map(jnp.zeros_like, params))
  return _acc0(zeros)


def fused_accumulator(ctx: Context, params: dict) -> dict:
  if not ctx.fused_per_rank:
    return _acc0(zeros(params))
  return _acc0({n: per_rank_zeros(ctx.groups, p) for n, p in params.items()})


def zeros(params):
  return jax.tree.map(jnp.zeros_like, params)


def reduce(grads):
  """Per-rank gradients [dp, ...] -> their sum: the step's one all-reduce of a module (a
  reduce-scatter where its optimizer state is split over dp: ZeRO-1)."""
  return jax.tree.map(lambda a: jnp.sum(a, 0), grads)


def sq_norm(labels, grads) -> jax.Array:
  return optim.trainable_sq_norm(grads, labels)


def update(ctx: Context, name: str, params, opt_state, grads, sq_norms: list):
  """One clip factor from every module's squared norm (optim.py), then this module's optax
  update."""
  norm, scale = optim.clip_factor(sq_norms, ctx.cfg.optim.clip_norm)
  grads = jax.tree.map(lambda g: g * scale, grads)
  updates, opt_state = ctx.plan[name].tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, norm, scale


@dataclasses.dataclass(frozen=True)
class Programs:
  """The jitted programs of a step, per module where they run on its mesh."""
  encoder_forward: dict
  encoder_tokens: dict
  encoder_backward: dict
  language_step: object
  fused_step: object
  language_accumulator: object
  fused_accumulator: object
  zeros: dict
  reduce: dict
  sq_norm: dict
  update: dict

  @classmethod
  def build(cls, ctx: Context) -> "Programs":
    plan, lang = ctx.plan, ctx.plan["language"]
    part = functools.partial
    scalar = lambda n: plan.sharding(n, REPLICATED)
    metrics = {"loss": scalar("language"), "mismatches": scalar("language")}
    return cls(
        encoder_forward={n: jax.jit(part(encoder_forward, ctx, n)) for n in ctx.encoders},
        encoder_tokens={n: jax.jit(part(encoder_tokens, ctx, n)) for n in ctx.encoders},
        encoder_backward={n: jax.jit(encoder_backward, donate_argnums=(2,),
                                     out_shardings=plan[n].param_sh) for n in ctx.encoders},
        language_step=jax.jit(part(language_step, ctx), donate_argnums=(1,)),
        fused_step=jax.jit(part(fused_step, ctx), donate_argnums=(1,)),
        language_accumulator=jax.jit(
            part(language_accumulator, ctx),
            out_shardings={"grads": lang.per_rank_sh if ctx.defer_reduce else lang.param_sh,
                           **metrics}),
        fused_accumulator=jax.jit(
            part(fused_accumulator, ctx),
            out_shardings={"grads": {n: p.per_rank_sh if ctx.fused_per_rank else p.param_sh
                                     for n, p in plan.modules.items()}, **metrics}),
        zeros={n: jax.jit(zeros, out_shardings=p.param_sh) for n, p in plan.modules.items()},
        reduce={n: jax.jit(reduce, out_shardings=p.grad_sh) for n, p in plan.modules.items()},
        sq_norm={n: jax.jit(part(sq_norm, p.labels), out_shardings=scalar(n))
                 for n, p in plan.modules.items()},
        update={n: jax.jit(part(update, ctx, n), donate_argnums=(0, 1),
                           out_shardings=(p.param_sh, p.opt_sh, scalar(n), scalar(n)))
                for n, p in plan.modules.items()})
