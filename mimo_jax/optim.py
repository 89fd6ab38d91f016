"""One optimizer step across modules: optax per module, one global-norm clip over all of them.

Arrays on different meshes cannot meet in one optax chain (docs/architecture.md). Each module
computes the squared norm of its trainable gradients on its own mesh; the scalars are copied to
every module (`bridge.transfer`), and every module sums them in the same order, so all modules
apply the bit-identical clip factor.

Frozen leaves (frozen groups, a LoRA base) are outside all of it: the step differentiates the
trained leaves alone (`trained`; `join` puts the frozen ones back where the model needs the whole
tree), so a frozen leaf has no gradient, no accumulator and no optimizer state, and it is stored
in the compute dtype (`stored`): nothing makes a float32 master copy of it.

FP8 abs-max histories (delayed scaling, models/fp8.py) are trained leaves of their own label
(`AMAX`) that are not parameters: a step's "gradient" of one is the abs-max it recorded, which
every accumulation combines by maximum (`combine`, `reduce_ranks`: microbatches, dp ranks) and
the update rolls into the history (`roll_histories`). They are outside the optimizer (no moments,
no weight decay), the clip and the gradient norm.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mimo_jax.config import Config, parse_freeze, parse_lr_mult
from mimo_jax.models import fp8
from mimo_jax.models.mimo import AMAX, FROZEN  # the labels that are no group's (Module.group)


def trains(label: str) -> bool:
  """Whether a leaf of this label is a parameter the optimizer trains."""
  return label not in (FROZEN, AMAX)


def schedule(cfg: Config) -> optax.Schedule:
  o = cfg.optim
  warmup = min(o.warmup_steps, cfg.train.steps - 1)
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=o.lr, warmup_steps=warmup,
      decay_steps=max(cfg.train.steps, warmup + 1), end_value=o.lr * o.min_lr_ratio)


def _decay_mask(params):
  return jax.tree.map(lambda p: p.ndim >= 2, params)  # no decay on norms and biases


def labels(groups_tree, frozen: tuple[str, ...]):
  return jax.tree.map(lambda g: FROZEN if g in frozen else g, groups_tree)


def _select(tree, labels, keep_trained: bool):
  """The nested dicts of `tree` (a parameter tree, or one mirroring it) with the leaves whose label
  is (keep_trained: is not) FROZEN; emptied dicts are dropped."""
  if isinstance(labels, dict):
    out = {}
    for k, sub in labels.items():
      got = _select(tree[k], sub, keep_trained)
      if got is not None and not (isinstance(got, dict) and not got):
        out[k] = got
    return out
  return tree if (labels != FROZEN) == keep_trained else None


def trained(tree, labels):
  """The trained part of a parameter-shaped tree (what gradients and optimizer state cover)."""
  return _select(tree, labels, True)


def frozen(tree, labels):
  """The frozen part of a parameter-shaped tree."""
  return _select(tree, labels, False)


def join(a: dict, b: dict) -> dict:
  """The nested dicts `a` and `b` (a `trained` and a `frozen` part) as one tree."""
  out = dict(a)
  for k, v in b.items():
    out[k] = join(out[k], v) if k in out else v
  return out


def stored(shapes, labels, compute_dtype):
  """`shapes` (ShapeDtypeStructs) with every frozen floating leaf in the compute dtype: a frozen
  weight is read by the layers in that dtype and never updated, so a float32 copy of it would
  only double its bytes. A float32 run keeps float32 everywhere."""
  def one(a, label):
    if label != FROZEN or not jnp.issubdtype(a.dtype, jnp.floating):
      return a
    return jax.ShapeDtypeStruct(a.shape, compute_dtype, sharding=getattr(a, "sharding", None))
  return jax.tree.map(one, shapes, labels)


def cast(tree, shapes):
  """The arrays of `tree` in the dtypes of `shapes` (`stored`)."""
  return jax.tree.map(lambda x, a: x if x.dtype == a.dtype else x.astype(a.dtype), tree, shapes)


def module_transform(cfg: Config, groups_tree) -> optax.GradientTransformation:
  """optax.multi_transform over this module's parameter groups: of the trained part
  (`trained`), so a frozen leaf has no state (a frozen group in `groups_tree` gets set_to_zero)."""
  o = cfg.optim
  frozen, mult = parse_freeze(cfg), parse_lr_mult(cfg)
  sched = schedule(cfg)
  transforms = {FROZEN: optax.set_to_zero(), AMAX: optax.set_to_zero()}
  for g in set(jax.tree.leaves(groups_tree)) - set(frozen) - {FROZEN, AMAX}:
    lr = (lambda m: (lambda step: sched(step) * m))(mult.get(g, 1.0))
    transforms[g] = optax.adamw(lr, b1=o.b1, b2=o.b2, weight_decay=o.weight_decay,
                                mask=_decay_mask)
  return optax.multi_transform(transforms, labels(groups_tree, frozen))


def trainable_sq_norm(grads, label_tree) -> jax.Array:
  leaves = [jnp.sum(jnp.square(g.astype(jnp.float32)))
            for g, lab in zip(jax.tree.leaves(grads), jax.tree.leaves(label_tree))
            if trains(lab)]
  return sum(leaves, jnp.zeros((), jnp.float32))


def combine(a, b, label_tree):
  """Two gradient trees as one: summed, an abs-max history's (`AMAX`) by maximum. A leaf of the
  labels may be a subtree of `a` and `b` (a kernel held layer by layer: fold.py)."""
  def one(lab, x, y):
    return jax.tree.map(jnp.maximum if lab == AMAX else jnp.add, x, y)
  return jax.tree.map(one, label_tree, a, b)


def reduce_ranks(grads, label_tree):
  """Per-rank gradients [dp, ...] -> one: summed over ranks, an abs-max history's by maximum."""
  return jax.tree.map(lambda g, lab: jnp.max(g, 0) if lab == AMAX else jnp.sum(g, 0), grads,
                      label_tree)


def roll_histories(params, grads, label_tree):
  """`params` with each abs-max history rolled one step, the step's recorded abs-max (its
  gradient's index 0) entering as the newest (fp8.roll); other leaves as they are."""
  return jax.tree.map(lambda p, g, lab: fp8.roll(p, g) if lab == AMAX else p, params, grads,
                      label_tree)


def clip_factor(sq_norms: list[jax.Array], clip_norm: float) -> tuple[jax.Array, jax.Array]:
  """Global norm from every module's squared norm (fixed order) and the clip scale."""
  norm = jnp.sqrt(sum(sq_norms[1:], sq_norms[0]))
  return norm, jnp.minimum(1.0, clip_norm / (norm + 1e-6))


def at_step(opt_state, step: int):
  """`opt_state` with every learning-rate schedule's count at `step`: a group's fresh state that
  starts mid-run follows the run's schedule as the others do (Adam's own count, its bias
  correction, stays at 0)."""
  def at(x):
    if isinstance(x, optax.ScaleByScheduleState):
      return x._replace(count=jax.device_put(np.asarray(step, x.count.dtype), x.count.sharding))
    return x
  return jax.tree.map(at, opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByScheduleState))
