"""One optimizer step across module meshes.

XLA compiles one SPMD program per mesh, so a step is a few jitted functions per module, chained by
the host without waiting on the device (DESIGN §3.1). Per microbatch m:

  encoder forward (m+1) | bridge (m) -> language forward+backward (m) -> bridge back -> encoder
  backward (m)

The encoder forward for m+1 is dispatched before the language model's work for m, so on disjoint
meshes the two overlap. The encoder forward returns its `jax.vjp` closure (a pytree of residuals),
which its backward consumes: no recomputation. After the last microbatch each module computes the
squared norm of its gradients, the scalars are exchanged, and each module applies one clip factor
and its own optax update (see optim.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding

from mimo_jax import bridge, optim
from mimo_jax.config import Config, parse_freeze
from mimo_jax.models.mimo import Module, language_logits, slot_mismatches
from mimo_jax.topology import REPLICATED, Topology

# Per encoder: its images, the owner of each slot, and where its tokens go in the text.
ENCODER_FIELDS = {"vision": ("images_nhwc", "slot_ids_n", "img_pos_bl")}
TEXT_FIELDS = ("tokens_bl", "targets_bl", "loss_mask_bl", "positions_bl", "segment_ids_bl",
               "token_sample_bl", "sample_ids_b", "colon_b", "num_images_b")


@dataclasses.dataclass
class ModuleState:
  params: Any
  opt_state: Any


@dataclasses.dataclass
class Inputs:
  """One microbatch on device: text on the language mesh, images on each encoder's mesh."""
  text: dict[str, jax.Array]
  images: dict[str, jax.Array]
  slot_ids: dict[str, jax.Array]
  img_pos: dict[str, jax.Array]


def put(x: np.ndarray, sharding: NamedSharding) -> jax.Array:
  """Host array -> global array; each process fills only the shards of its own devices."""
  x = np.asarray(x)
  return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index], dtype=x.dtype)


def _tree_add(a, b):
  return jax.tree.map(jnp.add, a, b)


class Stepper:
  """Builds the jitted per-module functions once and runs training and eval steps with them."""

  def __init__(self, cfg: Config, topo: Topology, modules: dict[str, Module]):
    self.cfg, self.topo, self.modules = cfg, topo, modules
    self.encoders = [n for n in modules if n != "language"]
    self.groups = topo.dp("language")
    self.tokens_per_image = cfg.model.vision.tokens_per_image
    frozen = parse_freeze(cfg.optim.freeze)
    abstract = {n: m.abstract_params() for n, m in modules.items()}
    self.param_sh = {
        n: jax.tree.map(lambda s, n=n: topo.sharding(n, s), m.specs(abstract[n]))
        for n, m in modules.items()}
    group_trees = {n: m.groups(abstract[n]) for n, m in modules.items()}
    self.labels = {n: optim.labels(g, frozen) for n, g in group_trees.items()}
    self.tx = {n: optim.module_transform(cfg, g) for n, g in group_trees.items()}
    self.trainable = {n: any(l != optim.FROZEN for l in jax.tree.leaves(self.labels[n]))
                      for n in modules}
    self.abstract_params = {
        n: jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        abstract[n], self.param_sh[n]) for n in modules}
    self._opt_shapes = {n: jax.eval_shape(self.tx[n].init, self.abstract_params[n])
                        for n in modules}
    # Fixed once so that init, update and checkpoint restore all agree.
    self.opt_sh = {n: self._opt_shardings(n) for n in modules}
    self._build_jits()

  def _opt_shardings(self, name: str):
    """Optimizer-state leaves that mirror a parameter (Adam's moments) take its sharding; the
    rest (step counts) are replicated. Matched by the parameter's path at the end of the leaf's."""
    params = self.abstract_params[name]
    by_path = {jax.tree_util.keystr(p): a for p, a in
               jax.tree_util.tree_flatten_with_path(params)[0]}
    replicated = self.topo.sharding(name, REPLICATED)

    def sharding(path, leaf):
      key = jax.tree_util.keystr(path)
      for suffix, param in by_path.items():
        if key.endswith(suffix) and param.shape == leaf.shape:
          return param.sharding
      return replicated
    return jax.tree_util.tree_map_with_path(sharding, self._opt_shapes[name])

  # ---- jitted functions -------------------------------------------------------------------

  def _build_jits(self) -> None:
    t = self.topo
    self._enc_fwd, self._enc_apply, self._enc_bwd = {}, {}, {}
    for name in self.encoders:
      module, out_sh = self.modules[name], t.sharding(name)

      def apply(params, images, module=module, out_sh=out_sh):
        return jax.lax.with_sharding_constraint(module.bind(params)(images), out_sh)

      def fwd(params, images, slot_ids, apply=apply):
        emb, vjp = jax.vjp(lambda p: apply(p, images), params)
        return emb, slot_ids, vjp

      self._enc_fwd[name] = jax.jit(fwd)
      self._enc_apply[name] = jax.jit(apply)
      self._enc_bwd[name] = jax.jit(lambda vjp, d_emb, acc: _tree_add(acc, vjp(d_emb)[0]),
                                    donate_argnums=(2,))
    lang = self.modules["language"]
    groups, tpi = self.groups, self.tokens_per_image
    lang_batch = t.sharding("language")
    packed = self.cfg.data.pack_rows > 0

    def lang_step(params, acc, embs, slot_ids, img_pos, text, inv_tokens):
      def loss_fn(p, embs):
        logits = language_logits(lang.bind(p), text["tokens_bl"], embs, img_pos, groups,
                                 text["positions_bl"], text["segment_ids_bl"] if packed else None)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, text["targets_bl"])
        return jnp.sum(ce * text["loss_mask_bl"]) * inv_tokens
      loss, (g_params, g_embs) = jax.value_and_grad(loss_fn, argnums=(0, 1))(params, embs)
      g_embs = jax.lax.with_sharding_constraint(g_embs, lang_batch)  # what the bridge moves
      bad = sum(slot_mismatches(slot_ids[n], img_pos[n], text["token_sample_bl"], tpi, groups)
                for n in embs)
      acc = {"grads": _tree_add(acc["grads"], g_params), "loss": acc["loss"] + loss,
             "mismatches": acc["mismatches"] + bad}
      return acc, g_embs

    self._lang_step = jax.jit(lang_step, donate_argnums=(1,))
    self._zeros, self._sq_norm, self._update = {}, {}, {}
    for name in self.modules:
      sh, labels, tx = self.param_sh[name], self.labels[name], self.tx[name]
      self._zeros[name] = jax.jit(lambda p: jax.tree.map(jnp.zeros_like, p), out_shardings=sh)
      self._sq_norm[name] = jax.jit(lambda g, labels=labels: optim.trainable_sq_norm(g, labels),
                                    out_shardings=t.sharding(name, REPLICATED))

      def update(params, opt_state, grads, sq_norms, tx=tx):
        norm, scale = optim.clip_factor(sq_norms, self.cfg.optim.clip_norm)
        grads = jax.tree.map(lambda g: g * scale, grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, norm, scale

      scalar = t.sharding(name, REPLICATED)
      self._update[name] = jax.jit(update, donate_argnums=(0, 1),
                                   out_shardings=(sh, self.opt_sh[name], scalar, scalar))
    scalar = t.sharding("language", REPLICATED)
    self._lang_acc0 = jax.jit(
        lambda p: {"grads": jax.tree.map(jnp.zeros_like, p), "loss": jnp.zeros((), jnp.float32),
                   "mismatches": jnp.zeros((), jnp.int32)},
        out_shardings={"grads": self.param_sh["language"], "loss": scalar, "mismatches": scalar})

  # ---- state --------------------------------------------------------------------------------

  def init_state(self, seed: int) -> dict[str, ModuleState]:
    """Parameters born sharded on their module's mesh; values depend only on the seed."""
    state = {}
    for name, module in self.modules.items():
      params = jax.jit(module.init, static_argnums=0, out_shardings=self.param_sh[name])(seed)
      opt_state = jax.jit(self.tx[name].init, out_shardings=self.opt_sh[name])(params)
      state[name] = ModuleState(params, opt_state)
    return state

  def abstract_state(self) -> dict[str, dict]:
    """Shapes, dtypes and this topology's shardings of every module's state (restore targets)."""
    out = {}
    for name in self.modules:
      opt = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                         self._opt_shapes[name], self.opt_sh[name])
      out[name] = {"params": self.abstract_params[name], "opt_state": opt}
    return out

  def place(self, batch: dict[str, np.ndarray], m: int | None = None) -> Inputs:
    """Host arrays (microbatch m of a step batch, or a whole eval batch) -> device inputs."""
    pick = (lambda k: batch[k][m]) if m is not None else (lambda k: batch[k])
    lang_sh = self.topo.sharding("language")
    text = {k: put(pick(k), lang_sh) for k in TEXT_FIELDS}
    images, slot_ids, img_pos = {}, {}, {}
    for name in self.encoders:
      f_img, f_slots, f_pos = ENCODER_FIELDS[name]
      images[name] = put(pick(f_img), self.topo.sharding(name))
      slot_ids[name] = put(pick(f_slots), self.topo.sharding(name))
      img_pos[name] = put(pick(f_pos), lang_sh)
    return Inputs(text, images, slot_ids, img_pos)

  # ---- training step ------------------------------------------------------------------------

  def _to_language(self, tree):
    return bridge.transfer_tree(tree, self.topo.sharding("language"))

  def encode(self, state: dict[str, ModuleState], x: Inputs) -> dict[str, jax.Array]:
    """Forward of every encoder (no backward), delivered to the language mesh."""
    return self._to_language({n: self._enc_apply[n](state[n].params, x.images[n])
                              for n in self.encoders})

  def place_step(self, batch: dict[str, np.ndarray]) -> tuple[list[Inputs], jax.Array]:
    """All microbatches of a step on device, and 1 / the step's target tokens (DESIGN §2.3)."""
    inputs = [self.place(batch, m) for m in range(batch["tokens_bl"].shape[0])]
    inv_tokens = np.float32(1.0 / max(float(batch["loss_mask_bl"].sum()), 1.0))
    return inputs, put(inv_tokens, self.topo.sharding("language", REPLICATED))

  def train_step(self, state: dict[str, ModuleState], batch: dict[str, np.ndarray]):
    """Dispatches one optimizer step; returns the new state and device-side metrics."""
    return self.dispatch(state, *self.place_step(batch))

  def dispatch(self, state: dict[str, ModuleState], inputs: list[Inputs], inv_tokens: jax.Array):
    """The step on already-placed inputs: device work only, no host transfer."""
    num_micro = len(inputs)
    acc = {n: self._zeros[n](state[n].params) for n in self.encoders}
    lang_acc = self._lang_acc0(state["language"].params)

    def encode(m):
      out = {}
      for n in self.encoders:
        p, x = state[n].params, inputs[m]
        if self.trainable[n]:
          out[n] = self._enc_fwd[n](p, x.images[n], x.slot_ids[n])
        else:
          out[n] = (self._enc_apply[n](p, x.images[n]), x.slot_ids[n], None)
      return out

    pending = encode(0)
    for m in range(num_micro):
      current, pending = pending, (encode(m + 1) if m + 1 < num_micro else None)
      embs = self._to_language({n: current[n][0] for n in self.encoders})
      slots = self._to_language({n: current[n][1] for n in self.encoders})
      lang_acc, d_embs = self._lang_step(state["language"].params, lang_acc, embs, slots,
                                         inputs[m].img_pos, inputs[m].text, inv_tokens)
      for n in self.encoders:
        if self.trainable[n]:
          d_emb = bridge.transfer(d_embs[n], self.topo.sharding(n))
          acc[n] = self._enc_bwd[n](current[n][2], d_emb, acc[n])
    acc["language"] = lang_acc["grads"]
    return self._apply(state, acc, lang_acc)

  def _apply(self, state, grads, lang_acc):
    sq = {n: self._sq_norm[n](grads[n]) for n in self.modules}
    new_state, metrics = {}, {}
    for n in self.modules:
      sq_here = [bridge.transfer(sq[k], self.topo.sharding(n, REPLICATED))
                 for k in self.modules]
      params, opt_state, norm, scale = self._update[n](state[n].params, state[n].opt_state,
                                                        grads[n], sq_here)
      new_state[n] = ModuleState(params, opt_state)
      metrics[f"clip_scale/{n}"] = scale
    metrics.update(loss=lang_acc["loss"], grad_norm=norm, mismatches=lang_acc["mismatches"])
    return new_state, metrics
