"""The multimodal model as separate modules (encoders by name + `language`) and the merge step.

The run's modules are built from its config by mimo_jax/modules.py. Each module owns its parameters, kept as a plain nested dict of arrays so that optax, orbax and the
shardings of the plan (sharding.py) all see the same simple pytree. `Module.bind` rebuilds the flax
NNX object from such a dict inside a jitted function. A module's repeated blocks live under
`blocks`, stacked on a leading layer axis; the step runs them through a `pipeline.Stack`
(`RunBlocks`), which is what lets the same model code run in one piece or in pipeline stages.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from mimo_jax.config import Config, LoraConfig
from mimo_jax.models.llm import LanguageModel
from mimo_jax.models.lora import is_adapter
from mimo_jax.models.fp8 import is_history
from mimo_jax.trees import path_str

Params = dict
# The parameter-group labels (`Module.group`) that are not a group's name: a leaf that never trains
# (a frozen group, a LoRA base), and an FP8 abs-max history (delayed scaling), which is not a
# parameter; optim.py gives neither an optimizer update.
FROZEN = "frozen"
AMAX = "fp8_amax"
# (x [M, ...], per-microbatch side inputs, each [M, ...]) -> x after every block.
RunBlocks = Callable[[jax.Array, tuple], jax.Array]


@dataclasses.dataclass
class Module:
  """One module: how to build it and its parameter groups."""
  name: str
  ctor: Callable[[nnx.Rngs], nnx.Module]
  layer_ctor: Callable[[nnx.Rngs], nnx.Module]  # one of the stacked `blocks`
  seed_salt: int
  # Parameter paths that never train (a fixed position table): the optimizer's frozen label.
  fixed: tuple[str, ...] = ()
  # LoRA adapters (models/lora.with_adapters): the adapters form the group `<name>_lora` and the
  # rest of the module, its projector aside, is frozen.
  lora: LoraConfig | None = None

  def init(self, seed: int) -> Params:
    """Parameters from the model seed alone: identical on every mesh."""
    key = jax.random.fold_in(jax.random.key(seed), self.seed_salt)
    return nnx.to_pure_dict(nnx.split(self.ctor(nnx.Rngs(params=key)))[1])

  def _bind(self, ctor: Callable, params: Params) -> nnx.Module:
    graphdef, state = nnx.split(nnx.eval_shape(lambda: ctor(nnx.Rngs(0))))
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state)

  def bind(self, params: Params) -> nnx.Module:
    return self._bind(self.ctor, params)

  def layer(self, params: Params, x: jax.Array, *side: jax.Array) -> jax.Array:
    """One block of the stack, from its slice of `params[BLOCKS]`."""
    return self.bind_layer(params)(x, *side)

  def bind_layer(self, params: Params) -> nnx.Module:
    """One block of the stack as its NNX module, from its slice of `params[BLOCKS]`."""
    return self._bind(self.layer_ctor, params)

  def apply_blocks(self, params: Params, x: jax.Array, *side: jax.Array) -> jax.Array:
    """`params["blocks"]` (stacked [L, ...]) applied one layer after another, in one piece on
    one device (what a check against another implementation runs; training uses a Stack)."""
    layers = jax.tree.leaves(params["blocks"])[0].shape[0]
    for i in range(layers):
      x = self.layer(jax.tree.map(lambda a, i=i: a[i], params["blocks"]), x, *side)
    return x

  def abstract_params(self, seed: int = 0) -> Params:
    return jax.eval_shape(lambda: self.init(seed))

  def group(self, path: str) -> str:
    """Parameter group of a path, for freezing and learning-rate multipliers."""
    if path in self.fixed:
      return FROZEN
    if is_history(path):  # FP8 delayed scaling's state, not a parameter (AMAX)
      return AMAX
    if self.lora is not None and is_adapter(path):
      return f"{self.name}_lora"
    if self.name != "language" and path.startswith("projector/"):
      return f"{self.name}_projector"
    return FROZEN if self.lora is not None else self.name

  def groups(self, params: Params) -> Params:
    return jax.tree_util.tree_map_with_path(lambda path, _: self.group(path_str(path)), params)


def attention_implementation(cfg: Config, packed: int = 0) -> str:
  """`model.attention`, with auto = cuDNN's fused attention on GPUs in bfloat16, else XLA's.
  Plain rows of an odd length run through cuDNN padded to an even one (`layers.attention`);
  `packed` > 0: the module's rows are packed segments of that length, which cuDNN's packed
  attention trains at even lengths only, so auto gives an odd one XLA's."""
  if cfg.model.attention != "auto":
    return cfg.model.attention
  gpu = jax.default_backend() == "gpu"
  return "cudnn" if gpu and cfg.model.dtype == "bfloat16" and packed % 2 == 0 else "xla"


def layer_norm_kernel(cfg: Config, name: str) -> bool:
  """`model.layer_norm` for module `name`'s blocks: whether their LayerNorms run as the Pallas
  kernels of norm_kernels.py. auto: on GPUs, where the module runs on one device a replica and
  in one pipeline stage (topology dp = tp = pp = 1: a `pallas_call` under XLA's partitioner
  would gather its rows, and jax 0.11.2 refuses one inside a stage's shard_map)."""
  if cfg.model.layer_norm != "auto":
    return cfg.model.layer_norm == "pallas"
  t = cfg.topology.modules()[name]
  return jax.default_backend() == "gpu" and t.dp == 1 and t.tp == 1 and t.pp == 1


def _grouped(x: jax.Array, groups: int) -> jax.Array:
  return x.reshape((groups, x.shape[0] // groups) + x.shape[1:])


def merge_images(x_bld: jax.Array, emb_ntd: jax.Array, img_pos_bl: jax.Array,
                 groups: int) -> jax.Array:
  """Writes image tokens over their placeholders (see data/layout.py for the slot layout).

  `img_pos_bl` indexes the image tokens of the row's own language dp group, so the gather is
  batched over groups and never crosses a dp rank. A position without an image token (-1) reads
  past the tokens' end, which gives 0 and, in the backward pass, adds its gradient nowhere:
  clamped to token 0 instead, every text position would add its (zero) gradient to that one row
  of the scatter, one at a time.
  """
  b, l, d = x_bld.shape
  emb_gkd = _grouped(emb_ntd, groups).reshape(groups, -1, d)
  pos_gk = _grouped(img_pos_bl, groups).reshape(groups, -1)
  past = jnp.where(pos_gk >= 0, pos_gk, emb_gkd.shape[1])
  got = jnp.take_along_axis(emb_gkd, past[..., None], axis=1, mode="fill", fill_value=0)
  return jnp.where(img_pos_bl[..., None] >= 0, got.reshape(b, l, d).astype(x_bld.dtype), x_bld)


def slot_mismatches(image_owner_nt: jax.Array, img_pos_bl: jax.Array, token_sample_bl: jax.Array,
                    groups: int) -> jax.Array:
  """Placeholders whose image token belongs to another sample than their own token (must be 0)."""
  owners_gk = _grouped(image_owner_nt, groups).reshape(groups, -1)
  pos_gk = _grouped(img_pos_bl, groups).reshape(groups, -1)
  owner = jnp.take_along_axis(owners_gk, jnp.maximum(pos_gk, 0), axis=1)
  bad = (owner.reshape(img_pos_bl.shape) != token_sample_bl) & (img_pos_bl >= 0)
  return jnp.sum(bad.astype(jnp.int32))


def embed_merged(model: LanguageModel, tokens_bl: jax.Array, embs: dict[str, jax.Array],
                 img_pos: dict[str, jax.Array], groups: int) -> jax.Array:
  """One microbatch's token embeddings [b, l, d] with every encoder's image tokens merged."""
  x_bld = model.embed(tokens_bl)
  for name, emb_ntd in embs.items():
    x_bld = merge_images(x_bld, emb_ntd, img_pos[name], groups)
  return x_bld


def language_hidden(model: LanguageModel, run_blocks: RunBlocks, tokens_m: jax.Array,
                    embs_m: dict[str, jax.Array], img_pos_m: dict[str, jax.Array], groups: int,
                    positions_m: jax.Array, segment_ids_m: jax.Array | None = None) -> jax.Array:
  """M microbatches of text [M, b, l] with every encoder's image tokens merged -> the blocks'
  outputs [M, b, l, d] (`model.logits` makes the logits of them). With `segment_ids_m` (packed
  rows) a token attends only to earlier tokens of its own segment."""
  x_m = jax.vmap(lambda *a: embed_merged(model, *a, groups))(tokens_m, embs_m, img_pos_m)
  side = (positions_m,) if segment_ids_m is None else (positions_m, segment_ids_m)
  return run_blocks(x_m, side)


def language_logits(model: LanguageModel, run_blocks: RunBlocks, tokens_m: jax.Array,
                    embs_m: dict[str, jax.Array], img_pos_m: dict[str, jax.Array], groups: int,
                    positions_m: jax.Array, segment_ids_m: jax.Array | None = None) -> jax.Array:
  """As `language_hidden`, through the final norm and the head: float32 logits [M, b, l, vocab]."""
  return jax.vmap(model.logits)(language_hidden(model, run_blocks, tokens_m, embs_m, img_pos_m,
                                                groups, positions_m, segment_ids_m))
