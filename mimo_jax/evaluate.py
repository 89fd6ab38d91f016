"""Held-out evaluation: teacher-forced loss and per-digit accuracy from greedy decoding (the
generation's own decoder, generate.decode)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

from mimo_jax import distributed, generate
from mimo_jax.batch import Batch, Samples, Text
from mimo_jax.models.mimo import embed_merged
from mimo_jax.programs import Context
from mimo_jax.step import Step


def _prompts(x_bld: jax.Array, answer_b: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Each row's embeddings up to its answer (through the ':' at `answer_b`) moved to the row's
  end, left-padded as `generate.decode` takes prompts: (embeddings [b, l, d], mask [b, l])."""
  l = x_bld.shape[1]
  pad_b = l - 1 - answer_b
  src_bl = (jnp.arange(l)[None] - pad_b[:, None]) % l
  x_bld = jnp.take_along_axis(x_bld, src_bl[..., None], axis=1)
  return x_bld, jnp.arange(l)[None] >= pad_b[:, None]


def language_eval(ctx: Context, max_images: int, accuracy: bool, params, tokens: dict,
                  pos: dict, text: Text, samples: Samples) -> dict:
  """Loss sums of an eval batch (one sample a row) and, with `accuracy`, the digits named right by
  greedy decoding."""
  one = lambda tree: jax.tree.map(lambda a: a[None], tree)  # a chunk of one microbatch
  logits = ctx.logits(params, one(text), one(tokens), one(pos), ctx.groups, packed=False)[0]
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, text.targets_rl)
  out = {"loss_sum": jnp.sum(ce * text.loss_mask_rl), "tokens": jnp.sum(text.loss_mask_rl)}
  if not accuracy:
    return out
  model = ctx.bind("language", params)
  x_bld = embed_merged(model, text.tokens_rl, tokens, pos, ctx.groups)
  answers = generate.decode(model, *_prompts(x_bld, samples.answer_b), max_images)
  idx = jnp.minimum(samples.answer_b[:, None] + jnp.arange(max_images)[None],
                    text.targets_rl.shape[1] - 1)
  truth = jnp.take_along_axis(text.targets_rl, idx, axis=1)
  digit = jnp.arange(max_images)[None] < samples.items_b[:, None]
  return dict(out, correct=jnp.sum((answers == truth) & digit), digits=jnp.sum(digit))


class Evaluator:
  """Runs the eval batches through the same module meshes and bridge as training."""

  def __init__(self, step: Step, max_images: int, accuracy: bool = True):
    """`accuracy`: also decode greedily and score the digits (the digits task only)."""
    self.step, self.accuracy = step, accuracy
    self._eval = jax.jit(functools.partial(language_eval, step.ctx, max_images, accuracy))

  def __call__(self, state, batches: list[Batch], stop=None) -> dict[str, float] | None:
    """Eval metrics over `batches`, or None if `stop()` turns true between batches."""
    totals = {"loss_sum": 0.0, "tokens": 0.0, "correct": 0.0, "digits": 0.0}
    outs = []
    for batch in batches:
      if stop is not None and stop():
        return None
      x = self.step.place(batch)
      tokens = self.step.encode(state, x)
      outs.append(self._eval(state["language"].params, tokens,
                             {n: s.pos_rl for n, s in x.slots.items()}, x.text, x.samples))
    for out in distributed.fetch(outs):
      for k in out:
        totals[k] += float(out[k])
    loss = {"eval_loss": totals["loss_sum"] / max(totals["tokens"], 1.0)}
    if not self.accuracy:
      return loss
    return dict(loss, eval_accuracy=totals["correct"] / max(totals["digits"], 1.0),
                eval_digits=int(totals["digits"]))
