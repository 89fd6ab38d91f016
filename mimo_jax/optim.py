"""One optimizer step across modules: optax per module, one global-norm clip over all of them.

Arrays on different meshes cannot meet in one optax chain (docs/architecture.md). Each module
computes the squared norm of its trainable gradients on its own mesh; the scalars are copied to
every module (`bridge.transfer`), and every module sums them in the same order, so all modules
apply the bit-identical clip factor. Frozen groups get `optax.set_to_zero` and do not count in
the norm.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mimo_jax.config import Config, parse_freeze, parse_lr_mult

FROZEN = "frozen"


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


def module_transform(cfg: Config, groups_tree) -> optax.GradientTransformation:
  """optax.multi_transform over this module's parameter groups (frozen -> set_to_zero)."""
  o = cfg.optim
  frozen, mult = parse_freeze(cfg), parse_lr_mult(cfg)
  sched = schedule(cfg)
  transforms = {FROZEN: optax.set_to_zero()}
  for g in set(jax.tree.leaves(groups_tree)) - set(frozen) - {FROZEN}:
    lr = (lambda m: (lambda step: sched(step) * m))(mult.get(g, 1.0))
    transforms[g] = optax.adamw(lr, b1=o.b1, b2=o.b2, weight_decay=o.weight_decay,
                                mask=_decay_mask)
  return optax.multi_transform(transforms, labels(groups_tree, frozen))


def trainable_sq_norm(grads, label_tree) -> jax.Array:
  leaves = [jnp.sum(jnp.square(g.astype(jnp.float32)))
            for g, lab in zip(jax.tree.leaves(grads), jax.tree.leaves(label_tree))
            if lab != FROZEN]
  return sum(leaves, jnp.zeros((), jnp.float32))


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
