"""The vision encoder plug-in: a ViT + projector over image slots (models/vit.py).

Slots: without dynamic resolution a slot holds one image of exactly `model.vision.image_size`,
sent as `images_nhwc` (uint8). With `data.slot_patches` > 0 a slot is a row of that many patches
into which a rank's images of any size (sides multiples of patch * downsample, up to `image_size`)
are packed first fit, sent as `patches_nqk` (uint8, block order, see patches.py), `patch_pos_nq`
(position ids) and `patch_seg_nq` (1, 2, ... per image in the slot, 0 = padding); the ViT attends
only within an image. With model.vision.position_resize=bicubic the position ids are 16 taps a
patch with their weights, `patch_taps_nqt` and `patch_tapw_nqt` (the table resized to each image's
grid), in place of `patch_pos_nq`. An image of gh x gw patches yields gh·gw/s² tokens
(s = downsample).
Sidecar fields: each image's (h, w).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from mimo_jax import encoders
from mimo_jax.config import Config
from mimo_jax.data.tokenizer import IMG
from mimo_jax.models.vit import ViTConfig
from mimo_jax.patches import bicubic_taps, grid_positions, patchify

PIXELS = ("images_nhwc", "patches_nqk")  # uint8, scaled to [0, 1] on device
PIXEL_MAX = 255.0


@dataclasses.dataclass
class VisionConfig(ViTConfig):
  """`model.vision`: the tower (models/vit.py) and where its weights come from."""
  # An HF directory (a SigLIP or CLIP tower, or a LLaVA checkpoint: tower and projector) whose
  # weights a run starts from instead of the seed's, or a mimo_jax run, WORKDIR[:STEP] (this
  # module's parameters of that step); not read on resume. The fields above must match its
  # config.json (mimo_jax/hf/fields.py derives them; a contradiction is an error) or the run's.
  init_from: str = ""


def slot_tokens(cfg: Config) -> int:
  """Image tokens an image slot yields: one image's, or a packed slot's (data.slot_patches)."""
  v = cfg.model.vision
  return cfg.data.slot_patches // v.downsample**2 if cfg.data.slot_patches else v.tokens_per_image


def slot_images(cfg: Config) -> int:
  """Most images a packed image slot holds (data.slot_patches): as many of the smallest of
  data.image_sizes as fit; 0 without packed slots. The layout never packs more, so attention can
  be sized for it (models/layers.packed_attention)."""
  d, v = cfg.data, cfg.model.vision
  if not d.slot_patches:
    return 0
  smallest = min(h * w for h, w in d.sizes(v.image_size)) // v.patch_size**2
  return max(d.slot_patches // smallest, 1)


def image_sizes(sample: dict) -> list[tuple[int, int]]:
  """(h, w) of each image of a full sample."""
  return [tuple(int(v) for v in np.shape(img)[:2]) for img in sample.get("images", ())]


@dataclasses.dataclass(frozen=True)
class ImageSlots(encoders.SlotLayout):
  noun = "image"
  slots_field = "data.image_slots"
  image_shape: tuple[int, ...] = (8, 8, 1)  # the largest image (the only size without packing)
  slot_patches: int = 0  # dynamic resolution: patches a slot; 0 = one image a slot
  patch_size: int = 4
  downsample: int = 1
  position_resize: str = "crop"  # model.vision.position_resize

  @property
  def taps(self) -> bool:
    """Positions as 16 weighted taps a patch (bicubic resize) rather than one id."""
    return self.packed and self.position_resize == "bicubic"

  @property
  def packed(self) -> bool:
    return self.slot_patches > 0

  def items(self, sample: dict) -> list:
    return list(sample.get("images", ()))

  def item_tokens(self, size: tuple[int, ...], sid: int) -> int:
    (h, w), (H, W) = size, self.image_shape[:2]
    if not self.packed:
      if (h, w) != (H, W):
        raise ValueError(f"sample {sid} has a {h}x{w} image but model.vision.image_size is {H}; "
                         "set data.slot_patches > 0 for images of several sizes (dynamic "
                         "resolution).")
      return self.slot_tokens
    unit = self.patch_size * self.downsample
    if h % unit or w % unit or h > H or w > W or h == 0 or w == 0:
      raise ValueError(f"sample {sid} has a {h}x{w} image; sides must be multiples of "
                       f"patch_size * downsample = {unit} and at most {H}x{W} "
                       "(model.vision.image_size).")
    return (h // self.patch_size) * (w // self.patch_size) // self.downsample**2

  def empty(self) -> dict[str, np.ndarray]:
    n, p, c = self.slots, self.patch_size, self.image_shape[2]
    if not self.packed:
      return {"images_nhwc": np.zeros((n,) + self.image_shape, np.uint8)}
    q = self.slot_patches
    pos = ({"patch_taps_nqt": np.zeros((n, q, 16), np.int32),
            "patch_tapw_nqt": np.zeros((n, q, 16), np.float32)} if self.taps else
           {"patch_pos_nq": np.zeros((n, q), np.int32)})
    return {"patches_nqk": np.zeros((n, q, p * p * c), np.uint8), **pos,
            "patch_seg_nq": np.zeros((n, q), np.int32)}

  def write(self, inputs, slot, start, tokens, item, size, nth) -> None:
    (h, w), (_, W, C) = size, self.image_shape
    img = np.asarray(item).reshape(h, w, C)
    if not self.packed:
      inputs["images_nhwc"][slot] = img
      return
    p, s = self.patch_size, self.downsample
    span = slice(start * s * s, (start + tokens) * s * s)
    inputs["patches_nqk"][slot, span] = patchify(img[None], p, s)[0]
    if self.taps:
      ids, weights = bicubic_taps(h // p, w // p, W // p, s)
      inputs["patch_taps_nqt"][slot, span] = ids
      inputs["patch_tapw_nqt"][slot, span] = weights
    else:
      inputs["patch_pos_nq"][slot, span] = grid_positions(h // p, w // p, s, W // p)
    inputs["patch_seg_nq"][slot, span] = nth

  def work(self, sizes) -> dict[str, int]:
    patches = [(h // self.patch_size) * (w // self.patch_size) for h, w in sizes]
    return {"patches": sum(patches), "patches_sq": sum(q * q for q in patches)}


class Vision(encoders.Encoder):
  name, sample_key, placeholder, size_fields, seed_salt = "vision", "images", IMG, 2, 1
  config_class = VisionConfig

  def item_sizes(self, sample: dict) -> list[tuple[int, int]]:
    return image_sizes(sample)

  def module(self, cfg: Config):
    # pylint: disable-next=import-outside-toplevel,cyclic-import
    from mimo_jax.models import mimo, vit
    v, lm = cfg.model.vision, cfg.model.language
    # A tower's rows: its patches (and class token), or a packed slot's patches.
    rows = cfg.data.slot_patches or v.positions
    dtype, att = jnp.dtype(cfg.model.dtype), mimo.attention_implementation(cfg, rows)
    # Runs of equal segment ids a packed slot holds (packed attention is sized by them): its
    # images and the padding after them.
    segments = slot_images(cfg) + 1 if cfg.data.slot_patches else 0
    return mimo.Module(self.name,
                       lambda rngs: vit.VisionEncoder(rngs, v, lm, dtype, att, segments),
                       lambda rngs: vit.ViTBlock(rngs, v, dtype, att, segments),
                       seed_salt=self.seed_salt)

  def slot_layout(self, cfg: Config, groups: int, slots: int) -> ImageSlots:
    v = cfg.model.vision
    return ImageSlots(self.name, cfg.data.placeholder, groups, slots, slot_tokens(cfg),
                      slot_images(cfg),
                      image_shape=(v.image_size, v.image_size, v.channels),
                      slot_patches=cfg.data.slot_patches, patch_size=v.patch_size,
                      downsample=v.downsample, position_resize=v.position_resize)

  def slots(self, cfg: Config, eval_batch: int = 0) -> int:
    return eval_batch * cfg.data.max_images if eval_batch else cfg.data.slots()

  def prepare(self, cfg: Config, inputs: dict) -> dict:
    return {k: v.astype(jnp.float32) / PIXEL_MAX if k in PIXELS else v
            for k, v in inputs.items()}

  def encode(self, model, run_blocks, inputs_m: dict) -> jax.Array:
    """`images_nhwc` [M, n, h, w, c] (one image a slot) or, packed, `patches_nqk` [M, n, q, k]
    with `patch_pos_nq` (or `patch_taps_nqt` and `patch_tapw_nqt` [M, n, q, 16]) and
    `patch_seg_nq` [M, n, q] -> tokens [M, n, t, language dim]."""
    if "images_nhwc" in inputs_m:
      x = jax.vmap(model.patches)(inputs_m["images_nhwc"])
      return jax.vmap(model.finish)(run_blocks(x, ()))
    if "patch_taps_nqt" in inputs_m:
      x = jax.vmap(model.packed_patches)(inputs_m["patches_nqk"], inputs_m["patch_taps_nqt"],
                                         inputs_m["patch_tapw_nqt"])
    else:
      x = jax.vmap(model.packed_patches)(inputs_m["patches_nqk"], inputs_m["patch_pos_nq"])
    return jax.vmap(model.finish)(run_blocks(x, (inputs_m["patch_seg_nq"],)))

  def flops(self, cfg: Config, params, work: dict[str, int]) -> float:
    """6·N a patch for the ViT's matmuls and 6·N an image token for the projector's, plus
    bidirectional attention of each image's patches against its own."""
    v = cfg.model.vision
    patch, projector = self.matmul_params(params)
    dense = 6 * (patch * work["patches"] + projector * work["patches"] / v.downsample**2)
    return float(dense + 12 * v.layers * v.dim * work["patches_sq"])


  def matmul_params(self, params) -> tuple[int, int]:
    """Matmul parameters a patch goes through (embedding, blocks) and an image token goes through
    after the pixel shuffle (the projector)."""
    # pylint: disable-next=import-outside-toplevel
    from mimo_jax.flops import kernel_params
    projector = kernel_params(params, "projector")
    return kernel_params(params) - projector, projector


ENCODER = encoders.register(Vision())


def hidden_states(cfg: Config, params: dict, images_nhwc) -> jax.Array:
  """Images [n, h, w, c] in [0, 1] -> the last block's output [n, tokens, dim] (the class token
  first if any; no final norm), patches in block order (row-major without a pixel shuffle), in
  one piece on one device (checks against transformers' towers)."""
  module = ENCODER.module(cfg)
  model = module.bind(params)
  return module.apply_blocks(params, model.patches(jnp.asarray(images_nhwc, jnp.float32)))


def image_tokens(cfg: Config, params: dict, images_nhwc) -> jax.Array:
  """Images [n, h, w, c] in [0, 1] -> projected image tokens [n, t, language dim], in one
  piece on one device (mimo_jax/whole.py merges them into the text)."""
  model = ENCODER.module(cfg).bind(params)
  return model.finish(hidden_states(cfg, params, images_nhwc))
