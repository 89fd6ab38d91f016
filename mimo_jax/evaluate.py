"""Held-out evaluation: teacher-forced loss, and answers generated greedily after each sample's
prompt (the generation's own decoder, generate.decode) on the run's meshes: the eval batches are
laid out as training lays them out, the encoders run on their meshes, and the language model
decodes every row on its dp ranks. The digits task names its digits this way (per-digit
accuracy); `eval.generate` samples are scored by `eval.metric`, and `tools.eval` answers a whole
eval set with the same program."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mimo_jax import distributed, generate
from mimo_jax.batch import Batch, Samples, Text
from mimo_jax.models.mimo import embed_merged
from mimo_jax.programs import Context
from mimo_jax.sharding import REPLICATED
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


def language_answers(ctx: Context, steps: int, eos: int | None, params, tokens: dict, pos: dict,
                     text: Text, samples: Samples) -> jax.Array:
  """Greedy answers [b, steps] after each row's prompt (its tokens through `answer_b`); a row
  that produced `eos` is `eos` after it."""
  model = ctx.bind("language", params)
  x_bld = embed_merged(model, text.tokens_rl, tokens, pos, ctx.groups)
  return generate.decode(model, *_prompts(x_bld, samples.answer_b), steps, eos=eos)


class Evaluator:
  """Runs the eval batches through the same module meshes and bridge as training."""

  def __init__(self, step: Step, max_images: int, accuracy: bool = True):
    """`accuracy`: also decode greedily and score the digits (the digits task only)."""
    self.step, self.accuracy = step, accuracy
    self._eval = jax.jit(functools.partial(language_eval, step.ctx, max_images, accuracy))
    self._answers = {}  # (steps, eos) -> its program

  def answers(self, state, batches: list[Batch], steps: int, eos: int | None = None,
              stop=None, done=None) -> dict[int, np.ndarray] | None:
    """Sample id -> its greedy answer (int32 [steps]) for every sample of `batches`, or None if
    `stop()` turns true between batches; `done(ids, answers)` after each batch."""
    key = (steps, eos)
    if key not in self._answers:
      out = self.step.plan.sharding("language", REPLICATED)  # every process fetches them
      self._answers[key] = jax.jit(functools.partial(language_answers, self.step.ctx, steps, eos),
                                   out_shardings=out)
    found = {}
    for batch in batches:
      if stop is not None and stop():
        return None
      x = self.step.place(batch)
      tokens = self.step.encode(state, x)
      got = distributed.fetch(self._answers[key](
          state["language"].params, tokens, {n: s.pos_rl for n, s in x.slots.items()}, x.text,
          x.samples))
      ids = [int(i) for i in batch.samples.ids_b]
      for i, answer in zip(ids, np.asarray(got)):
        if i >= 0:
          found[i] = answer
      if done is not None:
        done([i for i in ids if i >= 0], [found[i] for i in ids if i >= 0])
    return found

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
