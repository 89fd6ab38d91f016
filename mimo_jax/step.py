"""One optimizer step across module meshes.

XLA compiles one SPMD program per mesh, so a step is a few jitted functions per module, chained by
the host without waiting on the device (DESIGN §3.1). Each module works through the step's
microbatches in chunks: one microbatch at a time, or all of them in one call when the module is
pipelined (`topology.<module>.pp > 1`: the pipeline schedule runs over the step's microbatches,
see pipeline.py). With one microbatch a chunk on both sides, per microbatch m:

  encoder forward (m) -> bridge (m) -> language forward+backward (m) -> bridge back -> encoder
  backward (m)

The encoder runs ahead: its forwards for m+1 (and m+2 on a disjoint mesh) are dispatched before
the language model's work for m, and each forward's output is sent to the language mesh at once,
so that the copy is not queued behind the encoder's next backward. On disjoint meshes the modules
then overlap. Where the two dp sizes differ by a whole factor, the program that makes what crosses
(the encoder's forward, the language model's backward) cuts it for the bridge and the one that
takes it joins the pieces (`bridge.split`, `bridge.join`): the bridge itself only copies. The
encoder forward returns its `jax.vjp` closure (a pytree of residuals), which its backward
consumes: no recomputation. After the last microbatch each module computes the
squared norm of its gradients, the scalars are exchanged, and each module applies one clip factor
and its own optax update (see optim.py).

When every encoder shares the language model's mesh and that mesh is dp only, the four phases of
a microbatch are instead one jit (`Stepper.fused`): nothing to bridge, and XLA plans the encoder's
residuals together with its backward. Wherever the language model is dp only, its gradients (and on
that shared mesh every module's) stay per dp rank through the step and are summed once, before
the clip.

The state side (shardings, initialisation, checkpoint layout) is state.py's `StateLayout`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mimo_jax import bridge, optim
from mimo_jax.config import Config
from mimo_jax.models.mimo import (BLOCKS, Module, encode_images, language_logits,
                                  slot_mismatches)
from mimo_jax.pipeline import Stack
from mimo_jax.state import ModuleState, StateLayout
from mimo_jax.topology import REPLICATED, Topology

# Per encoder: the owner of each image token of its slots, and where its tokens go in the text.
ENCODER_FIELDS = {"vision": ("image_owner_nt", "img_pos_bl")}
# An encoder's inputs (models/mimo.encode_images): one image a slot, or images packed into slots.
IMAGE_FIELDS = {"images": "images_nhwc"}
PACKED_IMAGE_FIELDS = {"patches": "patches_npk", "pos": "patch_pos_np", "seg": "patch_seg_np"}
PIXELS = ("images", "patches")  # uint8 inputs, scaled to [0, 1] on device
TEXT_FIELDS = ("tokens_bl", "targets_bl", "loss_mask_bl", "positions_bl", "segment_ids_bl",
               "token_sample_bl", "sample_ids_b", "colon_b", "num_images_b")


@dataclasses.dataclass
class Inputs:
  """One microbatch on device: text on the language mesh, images on each encoder's mesh."""
  text: dict[str, jax.Array]
  images: dict[str, dict[str, jax.Array]]
  slot_ids: dict[str, jax.Array]
  img_pos: dict[str, jax.Array]


def put(x: np.ndarray, sharding: NamedSharding) -> jax.Array:
  """Host array -> global array; each process fills only the shards of its own devices."""
  x = np.asarray(x)
  return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index], dtype=x.dtype)


def _tree_add(a, b):
  return jax.tree.map(jnp.add, a, b)


def _stacked(xs: list) -> jax.Array:
  return jnp.stack(xs) if len(xs) > 1 else xs[0][None]


def _chunks(microbatches: int, whole: bool) -> list[list[int]]:
  return [list(range(microbatches))] if whole else [[m] for m in range(microbatches)]


class Stepper(StateLayout):
  """Builds the jitted per-module functions once and runs training and eval steps with them."""

  def __init__(self, cfg: Config, topo: Topology, modules: dict[str, Module]):
    super().__init__(cfg, topo, modules)
    tops = cfg.topology.modules()
    self.stacks = {n: Stack(m.layer, topo.meshes[n], self.schedule[n], tops[n].remat,
                            tops[n].unroll) for n, m in modules.items()}
    self.encoders = [n for n in modules if n != "language"]
    self.groups = topo.dp("language")
    self.image_fields = PACKED_IMAGE_FIELDS if cfg.data.slot_patches else IMAGE_FIELDS
    # Instrumentation for tools/bench.py: how arrays cross between meshes, and a callback after
    # each phase of a step (phase name, its outputs). Training leaves both alone.
    self.transfer = bridge.transfer
    # Image tokens and their gradients: copied at once, assembled when taken, a fan-in's pieces
    # joined inside the jit that takes them (`bridge.join`).
    self.send = functools.partial(bridge.send, parts=True)
    self.on_phase = None
    self._build_jits()

  def whole_step(self, name: str) -> bool:
    """Whether `name` takes all microbatches of a step in one call (a pipelined module)."""
    return self.schedule[name].pipelined

  def run_blocks(self, name: str, params):
    """The module's block stack on `params` as a `RunBlocks` callable."""
    return lambda x_m, side_m: self.stacks[name](params[BLOCKS], x_m, side_m)

  def bind(self, name: str, params):
    """The NNX module; its `blocks` are not to be called directly (use `run_blocks`)."""
    return self.modules[name].bind(self._unlayout(name, params))

  def _encode(self, name: str, params, x_m: dict[str, jax.Array]) -> jax.Array:
    """Encoder `name` on stacked microbatches of its inputs (pixels still uint8)."""
    x_m = {k: v.astype(jnp.float32) / self.cfg.data.pixel_max if k in PIXELS else v
           for k, v in x_m.items()}
    return encode_images(self.bind(name, params), self.run_blocks(name, params), x_m)

  def logits(self, params, tokens_m, embs_m, img_pos_m, positions_m, segment_ids_m=None):
    """The language model on M stacked microbatches (inside a jit on the language mesh)."""
    return language_logits(self.bind("language", params), self.run_blocks("language", params),
                           tokens_m, embs_m, img_pos_m, self.groups, positions_m, segment_ids_m)

  # ---- jitted functions -------------------------------------------------------------------

  def _build_jits(self) -> None:
    t = self.topo
    self._enc_fwd, self._enc_apply, self._enc_bwd = {}, {}, {}
    lang_batch = t.sharding("language")
    for name in self.encoders:
      out_sh = t.sharding(name)
      # What goes to the language mesh leaves the program cut for it where that is a fan-out.
      to_lang = lambda x, out_sh=out_sh: bridge.split(x, out_sh, lang_batch)

      def apply(params, images, name=name, out_sh=out_sh):
        """A chunk of microbatches: list of encoder inputs -> list of image tokens."""
        out = self._encode(name, params, {k: _stacked([m[k] for m in images]) for k in images[0]})
        return [jax.lax.with_sharding_constraint(out[i], out_sh) for i in range(len(images))]

      def fwd(params, images, slot_ids, apply=apply, to_lang=to_lang):
        embs, vjp = jax.vjp(lambda p: apply(p, images), params)
        return [to_lang(e) for e in embs], [to_lang(s) for s in slot_ids], vjp

      self._enc_fwd[name] = jax.jit(fwd)
      self._enc_apply[name] = jax.jit(lambda p, images, apply=apply, to_lang=to_lang:
                                      [to_lang(e) for e in apply(p, images)])
      self._enc_bwd[name] = jax.jit(
          lambda vjp, d_embs, acc: _tree_add(acc, vjp([bridge.join(d) for d in d_embs])[0]),
          donate_argnums=(2,))
    groups = self.groups
    packed = self.cfg.data.pack_rows > 0
    # The language model's gradients are kept per dp rank ([dp, ...], split over dp) and summed
    # over ranks once a step, in `_apply`: one all-reduce a step instead of one a microbatch. This
    # needs a shard_map manual over every mesh axis (cuDNN attention's partitioner fails inside a
    # partly manual one), so tensor-parallel layouts sum every microbatch as before; a pipelined
    # model takes the whole step in one call and sums once anyway.
    self.defer_reduce = not self.whole_step("language") and t.meshes["language"].shape["tp"] == 1

    def lang_loss(p, embs, pos, x, inv_tokens, groups):
      """The language model's share of the step's loss on stacked microbatches."""
      logits = language_logits(self.bind("language", p), self.run_blocks("language", p),
                               x["tokens_bl"], embs, pos, groups, x["positions_bl"],
                               x["segment_ids_bl"] if packed else None)
      ce = optax.softmax_cross_entropy_with_integer_labels(logits, x["targets_bl"])
      return jnp.sum(ce * x["loss_mask_bl"]) * inv_tokens

    def forward_backward(params, embs, pos, x, inv_tokens, groups):
      """Stacked microbatches -> (loss, parameter gradients, image-token gradients)."""
      loss_fn = lambda p, embs: lang_loss(p, embs, pos, x, inv_tokens, groups)
      loss, (g_params, g_embs) = jax.value_and_grad(loss_fn, argnums=(0, 1))(params, embs)
      return loss, g_params, g_embs

    def mismatches(slots, pos, x):
      return sum(jnp.sum(jax.vmap(slot_mismatches, in_axes=(0, 0, 0, None))(
          slots[n], pos[n], x["token_sample_bl"], groups)) for n in slots)

    def each_rank(fn, params, rows, inv_tokens, row_outputs=0):
      """`fn(params, *rows, inv_tokens) -> (loss, parameter gradients, *row_outputs)` on each dp
      rank's own rows and image tokens (a rank's rows index only its own tokens; tp and pp are
      1): the loss comes back summed over ranks, the gradients unsummed, [dp, ...]."""
      def local(params, rows, inv_tokens):
        params = jax.lax.pcast(params, ("dp",), to="varying")
        loss, grads, *outs = fn(params, *rows, inv_tokens)
        return (jax.lax.psum(loss, "dp"), jax.tree.map(lambda g: g[None], grads), *outs)
      split = P(None, "dp")  # [microbatches, rows or slots, ...]
      return jax.shard_map(local, mesh=t.meshes["language"], in_specs=(P(), split, P()),
                           out_specs=(P(), P("dp")) + (split,) * row_outputs)(
                               params, rows, inv_tokens)

    def lang_step(params, acc, embs, slot_ids, img_pos, text, inv_tokens):
      """A chunk of microbatches; every argument but params, acc and inv_tokens is a list (of
      dicts by encoder name) with one entry per microbatch."""
      x = {k: _stacked([tx[k] for tx in text]) for k in text[0]}
      pos = {n: _stacked(v) for n, v in img_pos.items()}
      slots = {n: _stacked([bridge.join(s) for s in v]) for n, v in slot_ids.items()}
      embs = {n: _stacked([bridge.join(e) for e in v]) for n, v in embs.items()}
      if self.defer_reduce:
        loss, g_params, g_embs = each_rank(
            lambda p, embs, pos, x, inv: forward_backward(p, embs, pos, x, inv, 1), params,
            (embs, pos, x), inv_tokens, row_outputs=1)
      else:
        loss, g_params, g_embs = forward_backward(params, embs, pos, x, inv_tokens, groups)
      # What the bridge moves back (cut here for it where that is a fan-out).
      g_embs = {n: [bridge.split(g[i], lang_batch, t.sharding(n)) for i in range(len(g))]
                for n, g in g_embs.items()}
      acc = {"grads": _tree_add(acc["grads"], g_params), "loss": acc["loss"] + loss,
             "mismatches": acc["mismatches"] + mismatches(slots, pos, x)}
      return acc, g_embs

    self._lang_step = jax.jit(lang_step, donate_argnums=(1,))

    # Encoders on the language model's own mesh (same devices, dp only) run with it as one
    # program a microbatch: forward through every module and backward in one jit, where XLA
    # plans the encoder's residuals with its backward instead of returning them from one call to
    # the next (tools/encoder_bench.py measures both); every module's gradients are kept per dp
    # rank and summed once a step.
    mesh = t.meshes["language"]
    self.fused = self.defer_reduce and all(
        not self.whole_step(n) and np.array_equal(t.meshes[n].devices, mesh.devices)
        for n in self.encoders)

    def fused_step(params, acc, images, slot_ids, img_pos, text, inv_tokens):
      """One microbatch through every module (dicts by module or encoder name)."""
      x = {k: v[None] for k, v in text.items()}
      pos = {n: v[None] for n, v in img_pos.items()}
      images = {n: {k: v[None] for k, v in im.items()} for n, im in images.items()}

      def loss_fn(params, images, pos, x, inv_tokens):
        embs = {}
        for n in self.encoders:
          e = self._encode(n, params[n], images[n])
          embs[n] = e if self.trainable[n] else jax.lax.stop_gradient(e)
        return lang_loss(params["language"], embs, pos, x, inv_tokens, 1)
      loss, grads = each_rank(jax.value_and_grad(loss_fn), params, (images, pos, x), inv_tokens)
      slots = {n: v[None] for n, v in slot_ids.items()}
      return {"grads": _tree_add(acc["grads"], grads), "loss": acc["loss"] + loss,
              "mismatches": acc["mismatches"] + mismatches(slots, pos, x)}

    self._fused_step = jax.jit(fused_step, donate_argnums=(1,))
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
    # Per-rank gradient accumulators [dp, ...] and their sum over ranks: the step's one
    # all-reduce of a module's gradients.
    per_rank_sh, self._reduce = {}, {}
    for name in self.modules:
      per_rank_sh[name] = jax.tree.map(lambda s: NamedSharding(s.mesh, P("dp", *s.spec)),
                                       self.param_sh[name])
      self._reduce[name] = jax.jit(lambda g: jax.tree.map(lambda a: jnp.sum(a, 0), g),
                                   out_shardings=self.param_sh[name])
    dp = t.dp("language")
    per_rank_zeros = lambda a: jnp.zeros((dp,) + a.shape, a.dtype)
    scalar = t.sharding("language", REPLICATED)
    metrics_sh = {"loss": scalar, "mismatches": scalar}

    def acc0(grads):
      return {"grads": grads, "loss": jnp.zeros((), jnp.float32),
              "mismatches": jnp.zeros((), jnp.int32)}
    deferred = self.defer_reduce
    self._lang_acc0 = jax.jit(
        lambda p: acc0(jax.tree.map(per_rank_zeros if deferred else jnp.zeros_like, p)),
        out_shardings={"grads": per_rank_sh["language"] if deferred
                       else self.param_sh["language"], **metrics_sh})
    self._fused_acc0 = jax.jit(lambda p: acc0(jax.tree.map(per_rank_zeros, p)),
                               out_shardings={"grads": per_rank_sh, **metrics_sh})

  def place(self, batch: dict[str, np.ndarray], m: int | None = None) -> Inputs:
    """Host arrays (microbatch m of a step batch, or a whole eval batch) -> device inputs. Of each
    language rank's image slots only the first `slots_sent[m]` travel (data.slot_buckets), and of
    its rows the first `rows_sent[m]` (data.row_buckets): ranks fill their slots and packed rows
    from the first, and a placeholder indexes its rank's slots from the first, so the rest are
    empty and nothing else changes."""
    pick = (lambda k: batch[k][m]) if m is not None else (lambda k: batch[k])
    lang_sh = self.topo.sharding("language")
    count = lambda k: int(batch[k][m]) if m is not None and k in batch else None

    def first(x, n):  # the first n entries of each rank's share of x
      if n is None:
        return x
      return x.reshape((self.groups, -1) + x.shape[1:])[:, :n].reshape((-1,) + x.shape[1:])

    rows = count("rows_sent")
    row = lambda k: first(pick(k), rows) if k.endswith("_bl") else pick(k)
    text = {k: put(row(k), lang_sh) for k in TEXT_FIELDS}
    slots = lambda k: first(pick(k), count("slots_sent"))

    images, slot_ids, img_pos = {}, {}, {}
    for name in self.encoders:
      f_slots, f_pos = ENCODER_FIELDS[name]
      images[name] = {k: put(slots(f), self.topo.sharding(name))
                      for k, f in self.image_fields.items()}
      slot_ids[name] = put(slots(f_slots), self.topo.sharding(name))
      img_pos[name] = put(row(f_pos), lang_sh)
    return Inputs(text, images, slot_ids, img_pos)

  # ---- training step ------------------------------------------------------------------------

  def _to_language(self, tree):
    dst = self.topo.sharding("language")
    return jax.tree.map(lambda x: self.transfer(x, dst), tree, is_leaf=bridge.is_array)

  def _phase(self, name: str, tree) -> None:
    if self.on_phase is not None:
      self.on_phase(name, tree)

  def encode(self, state: dict[str, ModuleState], x: Inputs) -> dict[str, jax.Array]:
    """Forward of every encoder (no backward), delivered to the language mesh."""
    return self._to_language({n: self._enc_apply[n](state[n].params, [x.images[n]])[0]
                              for n in self.encoders})

  def place_step(self, batch: dict[str, np.ndarray]) -> tuple[list[Inputs], jax.Array]:
    """All microbatches of a step on device, and 1 / the step's target tokens (DESIGN §2.3)."""
    inputs = [self.place(batch, m) for m in range(batch["tokens_bl"].shape[0])]
    # From the layout's counts, which cover the samples other processes read (scalable reads).
    inv_tokens = np.float32(1.0 / max(float(batch["target_tokens"].sum()), 1.0))
    return inputs, put(inv_tokens, self.topo.sharding("language", REPLICATED))

  def train_step(self, state: dict[str, ModuleState], batch: dict[str, np.ndarray]):
    """Dispatches one optimizer step; returns the new state and device-side metrics."""
    return self.dispatch(state, *self.place_step(batch))

  def dispatch(self, state: dict[str, ModuleState], inputs: list[Inputs], inv_tokens: jax.Array):
    """The step on already-placed inputs: device work only, no host transfer."""
    if self.fused:
      return self._dispatch_fused(state, inputs, inv_tokens)
    num_micro = len(inputs)
    acc = {n: self._zeros[n](state[n].params) for n in self.encoders}
    lang_acc = self._lang_acc0(state["language"].params)
    enc_chunks = {n: _chunks(num_micro, self.whole_step(n)) for n in self.encoders}
    fwd = {n: [] for n in self.encoders}  # per encoder chunk: (embs, slot ids, vjp or None)
    d_embs = {n: {} for n in self.encoders}  # microbatch -> gradient on the encoder mesh

    # Encoder chunks dispatched ahead of the language model's: one on a shared mesh (memory), two
    # on a disjoint one, so that the encoder's next forward is queued before its backward waits.
    ahead = {n: 1 if self.topo.colocated(n, "language") else 2 for n in self.encoders}
    delivered = {n: {} for n in self.encoders}  # microbatch -> (image tokens, slots) on language

    def encode_next(n):
      c = len(fwd[n])
      if c == len(enc_chunks[n]):
        return
      p, ms = state[n].params, enc_chunks[n][c]
      images, slots = [inputs[m].images[n] for m in ms], [inputs[m].slot_ids[n] for m in ms]
      if self.trainable[n]:
        fwd[n].append(self._enc_fwd[n](p, images, slots))
      else:
        fwd[n].append((self._enc_apply[n](p, images), slots, None))
      self._phase(n, fwd[n][-1][0])
      # Sent at once: a copy queued on the encoder's devices after its next backward would make
      # the language model wait for that backward too. Assembled on the language mesh only when
      # the language model takes it (`encoded`): a join of pieces there, queued now, would wait
      # for those copies ahead of the language model's earlier microbatches.
      dst = self.topo.sharding("language")
      sent = jax.tree.map(lambda x: self.send(x, dst), fwd[n][-1][:2], is_leaf=bridge.is_array)
      for i, m in enumerate(ms):
        delivered[n][m] = (sent[0][i], sent[1][i])
      if self.on_phase is not None:
        self._phase("bridge", jax.tree.map(lambda get: get(), sent))

    def encoded(n, m):
      """Microbatch m's image tokens and slot owners on the language mesh, dispatching the
      encoder's chunks up to the one that holds m and `ahead` more."""
      c = next(i for i, ms in enumerate(enc_chunks[n]) if m in ms)
      while len(fwd[n]) <= c + ahead[n] and len(fwd[n]) < len(enc_chunks[n]):
        encode_next(n)
      embs, slots = delivered[n].pop(m)
      return embs(), slots()

    for ms in _chunks(num_micro, self.whole_step("language")):
      got = [{n: encoded(n, m) for n in self.encoders} for m in ms]
      embs = {n: [g[n][0] for g in got] for n in self.encoders}
      slots = {n: [g[n][1] for g in got] for n in self.encoders}
      lang_acc, grads_back = self._lang_step(
          state["language"].params, lang_acc, embs, slots,
          {n: [inputs[m].img_pos[n] for m in ms] for n in self.encoders},
          [inputs[m].text for m in ms], inv_tokens)
      self._phase("language", lang_acc)
      for n in self.encoders:
        if not self.trainable[n]:
          continue
        for m, g in zip(ms, grads_back[n]):
          d_embs[n][m] = self.send(g, self.topo.sharding(n))()
        self._phase("bridge", d_embs[n])
        for c, chunk in enumerate(enc_chunks[n]):  # backward of every chunk now complete
          if c < len(fwd[n]) and fwd[n][c] is not None and all(m in d_embs[n] for m in chunk):
            acc[n] = self._enc_bwd[n](fwd[n][c][2], [d_embs[n][m] for m in chunk], acc[n])
            fwd[n][c] = None
            self._phase(n, acc[n])
    acc["language"] = (self._reduce["language"](lang_acc["grads"]) if self.defer_reduce
                       else lang_acc["grads"])
    return self._apply(state, acc, lang_acc)

  def _dispatch_fused(self, state, inputs: list[Inputs], inv_tokens: jax.Array):
    """`dispatch` when every module shares one dp-only mesh: one jit a microbatch, nothing to
    bridge, each module's gradients summed over ranks once at the end."""
    params = {n: state[n].params for n in self.modules}
    acc = self._fused_acc0(params)
    for x in inputs:
      acc = self._fused_step(params, acc, x.images, x.slot_ids, x.img_pos, x.text, inv_tokens)
    self._phase("step", acc)
    return self._apply(state, {n: self._reduce[n](g) for n, g in acc["grads"].items()}, acc)

  def _apply(self, state, grads, lang_acc):
    sq = {n: self._sq_norm[n](grads[n]) for n in self.modules}
    new_state, metrics = {}, {}
    for n in self.modules:
      sq_here = [bridge.transfer(sq[k], self.topo.sharding(n, REPLICATED))
                 for k in self.modules]
      params, opt_state, norm, scale = self._update[n](state[n].params, state[n].opt_state,
                                                        grads[n], sq_here)
      new_state[n] = ModuleState(params, opt_state)
      self._phase(n, params)
      metrics[f"clip_scale/{n}"] = scale
    metrics.update(loss=lang_acc["loss"], grad_norm=norm, mismatches=lang_acc["mismatches"])
    return new_state, metrics
