"""Held-out evaluation: teacher-forced loss and per-digit accuracy from greedy decoding."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax

from mimo_jax import distributed
from mimo_jax.batch import Batch, Samples, Text
from mimo_jax.data.tokenizer import PAD
from mimo_jax.programs import Context
from mimo_jax.step import Step


def _greedy_answers(logits_fn, tokens_rl, answer_b, steps: int) -> jax.Array:
  """Greedily generates `steps` words after ':' (answers wiped first); returns them [b, steps]."""
  b, l = tokens_rl.shape
  rows = jnp.arange(b)
  tokens_rl = jnp.where(jnp.arange(l)[None] > answer_b[:, None], PAD, tokens_rl)

  def body(j, tokens_rl):
    at = answer_b + j
    pred = jnp.argmax(logits_fn(tokens_rl)[rows, jnp.minimum(at, l - 1)], axis=-1)
    return tokens_rl.at[rows, at + 1].set(pred.astype(tokens_rl.dtype), mode="drop")

  tokens_rl = jax.lax.fori_loop(0, steps, body, tokens_rl)
  idx = jnp.minimum(answer_b[:, None] + 1 + jnp.arange(steps)[None], l - 1)
  return jnp.take_along_axis(tokens_rl, idx, axis=1)


def language_eval(ctx: Context, max_images: int, accuracy: bool, params, tokens: dict,
                  pos: dict, text: Text, samples: Samples) -> dict:
  """Loss sums of an eval batch (one sample a row) and, with `accuracy`, the digits named right by
  greedy decoding."""
  one = lambda tree: jax.tree.map(lambda a: a[None], tree)  # a chunk of one microbatch
  logits_fn = lambda tokens_rl: ctx.logits(
      params, one(dataclasses.replace(text, tokens_rl=tokens_rl)), one(tokens), one(pos),
      ctx.groups, packed=False)[0]
  ce = optax.softmax_cross_entropy_with_integer_labels(logits_fn(text.tokens_rl), text.targets_rl)
  out = {"loss_sum": jnp.sum(ce * text.loss_mask_rl), "tokens": jnp.sum(text.loss_mask_rl)}
  if not accuracy:
    return out
  answers = _greedy_answers(logits_fn, text.tokens_rl, samples.answer_b, max_images)
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
