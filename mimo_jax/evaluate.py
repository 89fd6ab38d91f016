"""Held-out evaluation: teacher-forced loss, and answers generated greedily after each sample's
prompt (the generation's own decoder, generate.decode) on the run's meshes: the eval batches are
laid out as training lays them out, the encoders run on their meshes, and the language model
decodes every row on its dp ranks. The answers are scored on the host (eval_set.Generated): the
digits tasks' per-digit accuracy, `eval.generate`'s samples by `eval.metric`; `tools.eval`
answers a whole eval set with the same program."""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mimo_jax import distributed, generate, programs
from mimo_jax.batch import Batch, Samples, Text
from mimo_jax.models import head_loss
from mimo_jax.models.mimo import embed_merged
from mimo_jax.context import Context
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


def language_eval(ctx: Context, params, tokens: dict, pos: dict, text: Text) -> dict:
  """Loss sums of an eval batch (one sample a row); with `train.loss_chunk`, the head only where
  a target carries loss, as in training (models/head_loss.py)."""
  one = lambda tree: jax.tree.map(lambda a: a[None], tree)  # a chunk of one microbatch
  model, h, tail = ctx.hidden(params, one(text), one(tokens), one(pos), ctx.groups, packed=False)
  loss_sum = head_loss.loss_sum(model, h, one(text.targets_rl), one(text.loss_mask_rl),
                                ctx.groups, ctx.cfg.train.loss_chunk, tail)
  return {"loss_sum": loss_sum, "tokens": jnp.sum(text.loss_mask_rl)}


def language_answers(ctx: Context, steps: int, eos: int | None, params, tokens: dict, pos: dict,
                     text: Text, samples: Samples) -> jax.Array:
  """Greedy answers [b, steps] after each row's prompt (its tokens through `answer_b`); a row
  that produced `eos` is `eos` after it."""
  model = ctx.bind("language", params)
  x_bld = embed_merged(model, text.tokens_rl, tokens, pos, ctx.groups)
  return generate.decode(model, *_prompts(x_bld, samples.answer_b), steps, eos=eos)


class Evaluator:
  """Runs the eval batches through the same module meshes and bridge as training."""

  def __init__(self, step: Step, generated: Sequence = ()):
    """`generated`: eval_set.Generated (the digits tasks' accuracy, `eval.generate`), whose scores
    join the metrics."""
    self.step, self.generated = step, list(generated)
    # The eval loss's chunk loop as the step's (programs.step_options); generation's decoding
    # loop keeps XLA's default.
    self._eval = jax.jit(functools.partial(language_eval, step.ctx),
                         compiler_options=programs.step_options(step.ctx))
    self._answers = {}  # (steps, eos) -> its program

  def _answer(self, state, x: Batch, tokens: dict, steps: int, eos: int | None) -> jax.Array:
    key = (steps, eos)
    if key not in self._answers:
      out = self.step.plan.sharding("language", REPLICATED)  # every process fetches them
      self._answers[key] = jax.jit(functools.partial(language_answers, self.step.ctx, steps, eos),
                                   out_shardings=out)
    return self._answers[key](state["language"].params, tokens,
                              {n: s.pos_rl for n, s in x.slots.items()}, x.text, x.samples)

  def answers(self, state, batches: list[Batch], steps: int, eos: int | None = None,
              stop=None) -> dict[int, np.ndarray] | None:
    """Sample id -> its greedy answer (int32 [steps]) for every sample of `batches`, or None if
    `stop()` turns true between batches."""
    found = {}
    for batch in batches:
      if stop is not None and stop():
        return None
      x = self.step.place(batch)
      got = np.asarray(distributed.fetch(self._answer(state, x, self.step.encode(state, x), steps,
                                                      eos)))
      for i, answer in zip(batch.samples.ids_b.tolist(), got):
        if i >= 0:
          found[i] = answer
    return found

  def __call__(self, state, batches: list[Batch], stop=None) -> dict[str, float] | None:
    """Eval metrics over `batches` (and `generated`), or None if `stop()` turns true between
    batches."""
    totals = {"loss_sum": 0.0, "tokens": 0.0}
    outs = []
    for batch in batches:
      if stop is not None and stop():
        return None
      x = self.step.place(batch)
      outs.append(self._eval(state["language"].params, self.step.encode(state, x),
                             {n: s.pos_rl for n, s in x.slots.items()}, x.text))
    for out in distributed.fetch(outs):
      for k in out:
        totals[k] += float(out[k])
    result = {"eval_loss": totals["loss_sum"] / max(totals["tokens"], 1.0)}
    for generated in self.generated:
      scores = generated(self, state, stop)
      if scores is None:
        return None
      result.update(scores)
    return result
