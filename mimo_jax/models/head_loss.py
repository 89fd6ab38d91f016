"""The language model's loss, with logits made only where a target carries loss.

A VLM row is mostly positions without a target (an image's tokens, a prompt's): the head and the
softmax over the vocabulary at those positions are work whose result the loss multiplies by 0.
`label_loss` gathers the positions whose weight is not 0 to the front of each dp rank's rows and
runs the final norm, the head and the cross-entropy over them `chunk` at a time, in a loop that
stops after the last chunk holding one (its trip count is data, so no shape depends on it). Each
chunk's gradients are made in the same pass (a custom VJP: the forward keeps the gradients of the
chunk inputs and of the parameters, the backward scales them), so no logits outlive their chunk:
a rank holds one chunk's [chunk, vocab] logits instead of its rows' [rows · seq_len, vocab].

Given a `Tail`, the loop runs more of the model there: the last block's work that is position by
position (its attention's output projection and its MLP, `DecoderBlock.finish`), whose results at
a position without a target feed nothing. Its rows are then the block's input and its attention's
mixed heads (`DecoderBlock.mix`), which needs every position, keys and values being read by all.

The result is the masked sum that `model.logits` and a cross-entropy over every position give,
summed in another order.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx


class Tail(NamedTuple):
  """The last block's position-wise rest: `apply(params, x, mixed) -> x` (the block's output from
  its input and its attention's mixed heads) and its parameters (the gradients of those that
  train are made in the loop)."""
  params: Any
  apply: Callable


def head(model) -> tuple:
  """(the head's parameters, `apply(params, x) -> float32 logits`) of a `LanguageModel`: its
  output layer (with any LoRA adapters), or the transposed embedding when they are tied."""
  if model.tied:
    return model.embedding[...], lambda e, x: (x @ e.astype(model.dtype).T).astype(jnp.float32)
  graphdef, state = nnx.split(model.head)
  return state, lambda s, x: nnx.merge(graphdef, s)(x).astype(jnp.float32)


def _bound(module) -> tuple:
  graphdef, state = nnx.split(module)
  return state, lambda s, x: nnx.merge(graphdef, s)(x)


def loss_sum(model, h_rld, targets_rl: jax.Array, weights_rl: jax.Array, groups: int,
             chunk: int, tail: Tail | None = None) -> jax.Array:
  """Σ weights · cross-entropy(model.logits(h), targets): `label_loss` with a chunk (> 0), else
  the logits of every position at once. With `tail`, h is (the last block's input, its mixed
  heads) and its output is the tail's."""
  if chunk:
    return label_loss(model, h_rld, targets_rl, weights_rl, groups, chunk, tail)
  if tail is not None:
    h_rld = tail.apply(tail.params, *h_rld)
  ce = optax.softmax_cross_entropy_with_integer_labels(model.logits(h_rld), targets_rl)
  return jnp.sum(ce * weights_rl)


def label_loss(model, h_rld, targets_rl: jax.Array, weights_rl: jax.Array, groups: int,
               chunk: int, tail: Tail | None = None) -> jax.Array:
  """Σ weights · cross-entropy(model.logits(h), targets) over every position of rows [..., r, l]
  (leading axes are microbatches), each of the `groups` dp ranks' rows (a contiguous r / groups
  each) compacted on its own, so that nothing crosses a rank. With `tail`, h is (the last block's
  input, its mixed heads), each [..., r, l, width], and `tail.apply` makes the block's output."""
  *lead, r, l = targets_rl.shape
  rows = tuple(h_rld) if tail is not None else (h_rld,)
  per = lambda a: a.reshape(-1, groups, r // groups * l, *a.shape[len(lead) + 2:])
  norm_params, norm = _bound(model.norm)
  head_params, head_apply = head(model)

  def apply(params, xs):
    norm_p, head_p, tail_p = params
    x = xs[0] if tail is None else tail.apply(tail_p, *xs)
    return head_apply(head_p, norm(norm_p, x))
  params = (norm_params, head_params, None if tail is None else tail.params)
  one = functools.partial(_rank_loss, params, apply=apply, chunk=chunk,
                          dtype=jnp.dtype(model.dtype))
  return jnp.sum(jax.vmap(jax.vmap(one))(tuple(per(a) for a in rows), per(targets_rl),
                                         per(weights_rl)))


def _rank_loss(params, xs: tuple, targets_n: jax.Array, weights_n: jax.Array, *,
               apply: Callable, chunk: int, dtype: jnp.dtype) -> jax.Array:
  """One rank's positions: those with a weight moved to the front, in order (the rest hold
  zeros), then `_chunked`."""
  n = targets_n.shape[0]
  chunk = min(chunk, n)
  keep = weights_n != 0
  idx = jnp.nonzero(keep, size=-(-n // chunk) * chunk, fill_value=n)[0]
  take = lambda a: jnp.take(a, idx, axis=0, mode="fill", fill_value=0)
  return _chunked(apply, chunk, dtype, params, tuple(take(x) for x in xs), take(targets_n),
                  take(weights_n), jnp.sum(keep, dtype=jnp.int32))


def _chunk_loss(apply, params, xs, targets, weights):
  ce = optax.softmax_cross_entropy_with_integer_labels(apply(params, xs), targets)
  return jnp.sum(ce * weights)


def _compute(a: jax.Array, dtype: jnp.dtype) -> jax.Array:
  """A parameter as the chunks' matmuls read it: a float kernel (two or more axes: a linear
  layer's, its adapters', a tied embedding) in the compute dtype `dtype`, which the layers cast
  it to anyway; norm scales, biases and the rest as they are."""
  if a.ndim >= 2 and jnp.issubdtype(a.dtype, jnp.floating):
    return a.astype(dtype)
  return a


def _loop(apply, chunk, dtype, params, xs: tuple, targets, weights, count, wrt_params, wrt_xs):
  """The loss over the first `count` positions, `chunk` at a time, and its gradients (float32
  for the parameters) with respect to the leaves of `params` and `xs` that `wrt_params` and
  `wrt_xs` (trees of bools like them) mark, as lists of those leaves'. The kernels are cast to
  `dtype` once, before the loop (`_compute`), not in every chunk: the gradients are those of
  the cast kernels, summed in float32, which is what the cast's own gradient passes on."""
  p_leaves, p_def = jax.tree.flatten(params)
  p_leaves = [_compute(a, dtype) for a in p_leaves]
  p_wrt = jax.tree.leaves(wrt_params)
  x_wrt = list(wrt_xs)
  pick = lambda leaves, wrt: [a for a, w in zip(leaves, wrt) if w]

  def fill(leaves, wrt, picked):
    picked = iter(picked)
    return [next(picked) if w else a for a, w in zip(leaves, wrt)]

  def piece(i):
    at = lambda a: jax.lax.dynamic_slice_in_dim(a, i * chunk, chunk)
    return [at(a) for a in xs], at(targets), at(weights)

  def body(i, carry):
    loss, d_params, d_xs = carry
    xc, tc, wc = piece(i)
    if not (any(p_wrt) or any(x_wrt)):
      return loss + _chunk_loss(apply, params, tuple(xc), tc, wc), d_params, d_xs
    chunk_loss = lambda p, x: _chunk_loss(apply, p_def.unflatten(fill(p_leaves, p_wrt, p)),
                                          tuple(fill(xc, x_wrt, x)), tc, wc)
    value, vjp = jax.vjp(chunk_loss, pick(p_leaves, p_wrt), pick(xc, x_wrt))
    g_params, g_xs = vjp(jnp.ones_like(value))
    d_params = [d + g for d, g in zip(d_params, g_params)]
    d_xs = [jax.lax.dynamic_update_slice_in_dim(d, g, i * chunk, 0) for d, g in zip(d_xs, g_xs)]
    return loss + value, d_params, d_xs

  # The first chunk runs before the loop (it is needed whenever any position carries loss): its
  # results give the loop's carry the types, sharded-ness included, that the body returns.
  zeros = (jnp.zeros((), jnp.float32),
           [jnp.zeros(p.shape, jnp.float32) for p in pick(p_leaves, p_wrt)],
           [jnp.zeros_like(x) for x in pick(list(xs), x_wrt)])
  return jax.lax.fori_loop(1, (count + chunk - 1) // chunk, body, body(0, zeros))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _chunked(apply, chunk, dtype, params, xs, targets, weights, count):
  no = lambda tree: jax.tree.map(lambda _: False, tree)
  return _loop(apply, chunk, dtype, params, xs, targets, weights, count, no(params), no(xs))[0]


def _primal(a) -> bool:
  return isinstance(a, jax.custom_derivatives.CustomVJPPrimal)


def _chunked_fwd(apply, chunk, dtype, params, xs, targets, weights, count):
  perturbed = lambda tree: jax.tree.map(lambda a: a.perturbed, tree, is_leaf=_primal)
  value = lambda tree: jax.tree.map(lambda a: a.value, tree, is_leaf=_primal)
  wrt_params, wrt_xs = perturbed(params), perturbed(xs)
  params, xs = value(params), value(xs)
  loss, d_params, d_xs = _loop(apply, chunk, dtype, params, xs, targets.value, weights.value,
                               count.value, wrt_params, wrt_xs)

  def tree(like, wrt, picked):
    """`picked` (the marked leaves' gradients) in `like`'s structure, None elsewhere."""
    leaves, treedef = jax.tree.flatten(like)
    picked = iter(picked)
    return treedef.unflatten([next(picked).astype(a.dtype) if w else None
                              for a, w in zip(leaves, jax.tree.leaves(wrt))])
  return loss, (tree(params, wrt_params, d_params), tree(xs, wrt_xs, d_xs))


def _chunked_bwd(apply, chunk, dtype, residuals, g):
  del apply, chunk, dtype
  d_params, d_xs = residuals
  scale = lambda a: None if a is None else (a * g).astype(a.dtype)
  keep_none = lambda tree: jax.tree.map(scale, tree, is_leaf=lambda a: a is None)
  return keep_none(d_params), keep_none(d_xs), None, None, None


_chunked.defvjp(_chunked_fwd, _chunked_bwd, symbolic_zeros=True)
