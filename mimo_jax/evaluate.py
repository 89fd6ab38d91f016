"""Held-out evaluation: teacher-forced loss and per-digit accuracy from greedy decoding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mimo_jax import distributed
from mimo_jax.data.tokenizer import PAD
from mimo_jax.step import Stepper


def _greedy_answers(logits_fn, tokens_bl, colon_b, steps: int) -> jax.Array:
  """Greedily generates `steps` words after ':' (answers wiped first); returns them [b, steps]."""
  b, l = tokens_bl.shape
  rows = jnp.arange(b)
  tokens_bl = jnp.where(jnp.arange(l)[None] > colon_b[:, None], PAD, tokens_bl)

  def body(j, tokens_bl):
    at = colon_b + j
    pred = jnp.argmax(logits_fn(tokens_bl)[rows, jnp.minimum(at, l - 1)], axis=-1)
    return tokens_bl.at[rows, at + 1].set(pred.astype(tokens_bl.dtype), mode="drop")

  tokens_bl = jax.lax.fori_loop(0, steps, body, tokens_bl)
  idx = jnp.minimum(colon_b[:, None] + 1 + jnp.arange(steps)[None], l - 1)
  return jnp.take_along_axis(tokens_bl, idx, axis=1)


class Evaluator:
  """Runs the eval batches through the same module meshes and bridge as training."""

  def __init__(self, stepper: Stepper, max_images: int, accuracy: bool = True):
    """`accuracy`: also decode greedily and score the digits (the digits task only)."""
    self.s, self.accuracy = stepper, accuracy

    def lang_eval(params, embs, img_pos, text):
      one = lambda tree: jax.tree.map(lambda a: a[None], tree)  # a chunk of one microbatch
      logits_fn = lambda tokens: stepper.logits(params, tokens[None], one(embs), one(img_pos),
                                                text["positions_bl"][None])[0]
      ce = optax.softmax_cross_entropy_with_integer_labels(logits_fn(text["tokens_bl"]),
                                                           text["targets_bl"])
      loss_sum = jnp.sum(ce * text["loss_mask_bl"])
      out = {"loss_sum": loss_sum, "tokens": jnp.sum(text["loss_mask_bl"])}
      if not accuracy:
        return out
      answers = _greedy_answers(logits_fn, text["tokens_bl"], text["colon_b"], max_images)
      idx = jnp.minimum(text["colon_b"][:, None] + jnp.arange(max_images)[None],
                        text["targets_bl"].shape[1] - 1)
      truth = jnp.take_along_axis(text["targets_bl"], idx, axis=1)
      digit = jnp.arange(max_images)[None] < text["num_images_b"][:, None]
      return dict(out, correct=jnp.sum((answers == truth) & digit), digits=jnp.sum(digit))

    self._lang_eval = jax.jit(lang_eval)

  def __call__(self, state, batches: list[dict[str, np.ndarray]]) -> dict[str, float]:
    totals = {"loss_sum": 0.0, "tokens": 0.0, "correct": 0.0, "digits": 0.0}
    outs = []
    for batch in batches:
      x = self.s.place(batch)
      embs = self.s.encode(state, x)
      outs.append(self._lang_eval(state["language"].params, embs, x.img_pos, x.text))
    for out in distributed.fetch(outs):
      for k in out:
        totals[k] += float(out[k])
    loss = {"eval_loss": totals["loss_sum"] / max(totals["tokens"], 1.0)}
    if not self.accuracy:
      return loss
    return dict(loss, eval_accuracy=totals["correct"] / max(totals["digits"], 1.0),
                eval_digits=int(totals["digits"]))
