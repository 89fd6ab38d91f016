"""The language model's loss, with logits made only where a target carries loss.

A VLM row is mostly positions without a target (an image's tokens, a prompt's): the head and the
softmax over the vocabulary at those positions are work whose result the loss multiplies by 0.
`label_loss` gathers the positions whose weight is not 0 to the front of each dp rank's rows and
runs the head and the cross-entropy over them `chunk` at a time, in a loop that stops after the
last chunk holding one (its trip count is data, so no shape depends on it). Each chunk's
gradients are made in the same pass (a custom VJP: the forward keeps the gradients of the chunk
inputs and of the head's parameters, the backward scales them), so no logits outlive their chunk:
a rank holds one chunk's [chunk, vocab] logits instead of its rows' [rows · seq_len, vocab].

The result is the masked sum that `model.logits` and a cross-entropy over every position give,
summed in another order.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx


def head(model) -> tuple:
  """(the head's parameters, `apply(params, x) -> float32 logits`) of a `LanguageModel`: its
  output layer (with any LoRA adapters), or the transposed embedding when they are tied."""
  if model.tied:
    return model.embedding[...], lambda e, x: (x @ e.astype(model.dtype).T).astype(jnp.float32)
  graphdef, state = nnx.split(model.head)
  return state, lambda s, x: nnx.merge(graphdef, s)(x).astype(jnp.float32)


def loss_sum(model, h_rld: jax.Array, targets_rl: jax.Array, weights_rl: jax.Array, groups: int,
             chunk: int) -> jax.Array:
  """Σ weights · cross-entropy(model.logits(h), targets): `label_loss` with a chunk (> 0), else
  the logits of every position at once."""
  if chunk:
    return label_loss(model, h_rld, targets_rl, weights_rl, groups, chunk)
  ce = optax.softmax_cross_entropy_with_integer_labels(model.logits(h_rld), targets_rl)
  return jnp.sum(ce * weights_rl)


def label_loss(model, h_rld: jax.Array, targets_rl: jax.Array, weights_rl: jax.Array,
               groups: int, chunk: int) -> jax.Array:
  """Σ weights · cross-entropy(model.logits(h), targets) over every position of rows [..., r, l]
  (leading axes are microbatches), each of the `groups` dp ranks' rows (a contiguous r / groups
  each) compacted on its own, so that nothing crosses a rank."""
  *lead, r, l, d = h_rld.shape
  x = model.norm(h_rld).reshape(-1, groups, r // groups * l, d)
  per = lambda a: a.reshape(-1, groups, r // groups * l)
  params, apply = head(model)
  one = functools.partial(_rank_loss, params, apply=apply, chunk=chunk)
  return jnp.sum(jax.vmap(jax.vmap(one))(x, per(targets_rl), per(weights_rl)))


def _rank_loss(params, x_nd: jax.Array, targets_n: jax.Array, weights_n: jax.Array, *,
               apply: Callable, chunk: int) -> jax.Array:
  """One rank's positions: those with a weight moved to the front, in order (the rest hold
  zeros), then `_chunked`."""
  n = x_nd.shape[0]
  chunk = min(chunk, n)
  keep = weights_n != 0
  idx = jnp.nonzero(keep, size=-(-n // chunk) * chunk, fill_value=n)[0]
  take = lambda a: jnp.take(a, idx, axis=0, mode="fill", fill_value=0)
  return _chunked(apply, chunk, params, take(x_nd), take(targets_n), take(weights_n),
                  jnp.sum(keep, dtype=jnp.int32))


def _chunk_loss(apply, params, x, targets, weights):
  ce = optax.softmax_cross_entropy_with_integer_labels(apply(params, x), targets)
  return jnp.sum(ce * weights)


def _loop(apply, chunk, params, x, targets, weights, count, wrt_params: bool, wrt_x: bool):
  """The loss over the first `count` positions, `chunk` at a time, and its gradients with respect
  to `params` and `x` where asked (else None)."""
  def piece(i):
    at = lambda a: jax.lax.dynamic_slice_in_dim(a, i * chunk, chunk)
    return at(x), at(targets), at(weights)

  def body(i, carry):
    loss, d_params, d_x = carry
    xc, tc, wc = piece(i)
    if not (wrt_params or wrt_x):
      return loss + _chunk_loss(apply, params, xc, tc, wc), d_params, d_x
    value, vjp = jax.vjp(lambda p, xc: _chunk_loss(apply, p, xc, tc, wc), params, xc)
    g_params, g_x = vjp(jnp.ones_like(value))
    if wrt_params:
      d_params = jax.tree.map(jnp.add, d_params, g_params)
    if wrt_x:
      d_x = jax.lax.dynamic_update_slice_in_dim(d_x, g_x, i * chunk, 0)
    return loss + value, d_params, d_x

  # The first chunk runs before the loop (it is needed whenever any position carries loss): its
  # results give the loop's carry the types, sharded-ness included, that the body returns.
  zeros = (jnp.zeros((), jnp.float32),
           jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params) if wrt_params
           else None,
           jnp.zeros_like(x) if wrt_x else None)
  return jax.lax.fori_loop(1, (count + chunk - 1) // chunk, body, body(0, zeros))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _chunked(apply, chunk, params, x, targets, weights, count):
  return _loop(apply, chunk, params, x, targets, weights, count, False, False)[0]


def _primal(a) -> bool:
  return isinstance(a, jax.custom_derivatives.CustomVJPPrimal)


def _chunked_fwd(apply, chunk, params, x, targets, weights, count):
  wrt_params = any(p.perturbed for p in jax.tree.leaves(params, is_leaf=_primal))
  wrt_x = x.perturbed
  params, x = jax.tree.map(lambda a: a.value, params, is_leaf=_primal), x.value
  loss, d_params, d_x = _loop(apply, chunk, params, x, targets.value, weights.value,
                              count.value, wrt_params, wrt_x)
  d_params = (jax.tree.map(lambda g, p: g.astype(p.dtype), d_params, params) if wrt_params
              else None)
  return loss, (d_params, d_x)


def _chunked_bwd(apply, chunk, residuals, g):
  del apply, chunk
  d_params, d_x = residuals
  scale = lambda a: None if a is None else (a * g).astype(a.dtype)
  return (jax.tree.map(scale, d_params) if d_params is not None else None, scale(d_x),
          None, None, None)


_chunked.defvjp(_chunked_fwd, _chunked_bwd, symbolic_zeros=True)
