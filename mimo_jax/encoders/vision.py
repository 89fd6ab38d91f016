"""The vision encoder plug-in: a ViT + projector over image slots (models/vit.py).

Slots: without dynamic resolution a slot holds one image of exactly `model.vision.image_size`,
sent as `images_nhwc` (uint8). With `model.vision.slot_patches` > 0 a slot is a row of that many
patches into which a rank's images of any size (sides multiples of patch * downsample, up to
`image_size`) are packed first fit, sent as `patches_nqk` (uint8, block order, see patches.py),
`patch_pos_nq` (position ids) and `patch_seg_nq` (1, 2, ... per image in the slot, 0 = padding);
the ViT attends only within an image. With model.vision.position_resize=bicubic the position ids
are 16 taps a patch with their weights, `patch_taps_nqt` and `patch_tapw_nqt` (the table resized
to each image's grid), in place of `patch_pos_nq`. An image of gh x gw patches yields gh·gw/s²
tokens (s = downsample).
The data settings that concern images live here too (`model.vision.max_images`, `image_slots`,
`slot_patches`), and so do the checks of the tower and of those settings (`Vision.validate`).
Sidecar fields: each image's (h, w).
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from mimo_jax import encoders, hf
from mimo_jax.config import ACTIVATIONS, Config, ConfigError, ModuleTopology, positive, require
from mimo_jax.config_run import BUILTIN_IMAGE_TOKEN
from mimo_jax.models import lora, mimo, vit
from mimo_jax.models.vit import POSITION_RESIZE, ViTConfig
from mimo_jax.patches import bicubic_taps, grid_positions, patchify
from mimo_jax.trees import kernel_params

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
  # Data settings (not the tower's parameters: a resume may change them).
  max_images: int = 3  # most images a sample may have
  # Image slots per microbatch, split evenly over the language dp ranks; 0 = global_batch /
  # microbatches * max_images (never overflows). Fewer slots waste less encoder compute, but a
  # microbatch whose images do not fit its rank's slots is an error.
  image_slots: int = 0
  # Dynamic resolution: each image slot is a row of this many ViT patches into which images of any
  # size (sides multiples of patch_size * downsample, at most image_size) are packed, attending
  # only within their image (cuDNN's packed attention on GPUs with model.attention=cudnn, else
  # XLA's masked attention); 0 = one image of image_size a slot.
  slot_patches: int = 0


def slot_tokens(cfg: Config) -> int:
  """Image tokens an image slot yields: one image's, or a packed slot's
  (model.vision.slot_patches)."""
  v = cfg.model.vision
  return v.slot_patches // v.downsample**2 if v.slot_patches else v.tokens_per_image


def slot_images(cfg: Config) -> int:
  """Most images a packed image slot holds (model.vision.slot_patches): as many of the smallest
  of data.image_sizes as fit; 0 without packed slots. The layout never packs more, so attention
  can be sized for it (models/layers.packed_attention)."""
  v = cfg.model.vision
  if not v.slot_patches:
    return 0
  smallest = min(h * w for h, w in cfg.data.sizes(v.image_size)) // v.patch_size**2
  return max(v.slot_patches // smallest, 1)


def image_sizes(sample: dict) -> list[tuple[int, int]]:
  """(h, w) of each image of a full sample."""
  return [tuple(int(v) for v in np.shape(img)[:2]) for img in sample.get("images", ())]


@dataclasses.dataclass(frozen=True)
class ImageSlots(encoders.SlotLayout):
  noun = "image"
  slots_field = "model.vision.image_slots"
  tokens_field = "model.vision.slot_patches"
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
                         "set model.vision.slot_patches > 0 for images of several sizes (dynamic "
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
    img = np.asarray(item)
    if img.size != h * w * C:  # a shape comparison: the image's channels disagree
      raise ConfigError(f"model.vision.channels: {C}, but the data holds a {h}x{w} image of "
                        f"{img.size // max(h * w, 1)} channels (a conversion whose images differ "
                        "in channels); convert the data again with images of one channel count "
                        "(Pillow's .convert(\"L\") or .convert(\"RGB\") of the others), or set "
                        "model.vision.channels to the data's count.")
    img = img.reshape(h, w, C)
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
  name, sample_key, size_fields, seed_salt = "vision", "images", 2, 1
  placeholder = BUILTIN_IMAGE_TOKEN  # data.image_token sets another (DataConfig.placeholder)
  noun, config_class, slots_field = "image", VisionConfig, ImageSlots.slots_field
  data_settings = moved_data_fields = ("max_images", "image_slots", "slot_patches")
  data_fields = ("max_images",)  # image_probs beside it is a data field

  def item_sizes(self, sample: dict) -> list[tuple[int, int]]:
    return image_sizes(sample)

  def module(self, cfg: Config):
    v, lm = cfg.model.vision, cfg.model.language
    dtype = jnp.dtype(cfg.model.dtype)
    att = mimo.attention_implementation(cfg, v.slot_patches)
    # Runs of equal segment ids a packed slot holds (packed attention is sized by them): its
    # images and the padding after them.
    segments = slot_images(cfg) + 1 if v.slot_patches else 0
    norm = mimo.layer_norm_kernel(cfg, self.name)
    return mimo.Module(self.name,
                       lambda rngs: vit.VisionEncoder(rngs, v, lm, dtype, att, segments, norm),
                       lambda rngs: vit.ViTBlock(rngs, v, dtype, att, segments, norm),
                       seed_salt=self.seed_salt)

  def load(self, path: str, cfg: Config):
    """The tower's tensors (and a LLaVA checkpoint's projector's) in the HF directory `path`,
    as mimo_jax/hf leaves; init_from.starts calls it for `model.vision.init_from`."""
    return hf.leaves(hf.Source.open(path), self.name, cfg)

  def slot_layout(self, cfg: Config, groups: int, slots: int) -> ImageSlots:
    v = cfg.model.vision
    return ImageSlots(self.name, cfg.data.placeholder, groups, slots, slot_tokens(cfg),
                      slot_images(cfg),
                      image_shape=(v.image_size, v.image_size, v.channels),
                      slot_patches=v.slot_patches, patch_size=v.patch_size,
                      downsample=v.downsample, position_resize=v.position_resize)

  def slots(self, cfg: Config, eval_batch: int = 0) -> int:
    v = cfg.model.vision
    if eval_batch:
      return eval_batch * v.max_images
    return v.image_slots or cfg.data.micro_batch * v.max_images

  def validate(self, cfg: Config) -> None:
    _tower(cfg)
    _variants(cfg)
    _image_data(cfg)

  def validate_topology(self, cfg: Config) -> None:
    v, t = cfg.model.vision, cfg.topology.vision
    require(v.heads % t.tp == 0, "topology.vision.tp",
            f"{t.tp} must divide model.vision.heads {v.heads}.")
    require(v.mlp_dim % t.tp == 0, "topology.vision.tp",
            f"{t.tp} must divide model.vision.mlp_dim {v.mlp_dim}.")

  def max_items(self, cfg: Config) -> int:
    return cfg.model.vision.max_images

  def tokens_per_item(self, cfg: Config) -> int:
    return cfg.model.vision.tokens_per_image

  def activation_bytes(self, cfg: Config, t: ModuleTopology) -> int:
    """Each slot's rows (its patches, or a packed slot's) at the block's input and, unless
    remat=full, the MLP's hidden units."""
    v = cfg.model.vision
    rows = self.slots(cfg) // t.dp * (v.slot_patches or v.positions)
    kept = v.dim + (0 if t.remat == "full" else v.mlp_dim // t.tp)
    return rows * kept * np.dtype(cfg.model.dtype).itemsize

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

  def dropout_rows(self, cfg: Config):
    """One image a slot: a row is (its slot's sample, the image's place among the sample's
    images · rows + the patch); the images of a sample fill its rank's slots in order, so that
    place is its slots before this one. Packed slots are not named so (None)."""
    if cfg.model.vision.slot_patches:
      return None
    return functools.partial(_image_rows, rows=cfg.model.vision.positions)

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
    projector = kernel_params(params, "projector")
    return kernel_params(params) - projector, projector


def _image_rows(inputs: dict, owner_nt: jax.Array, rows: int) -> tuple[jax.Array, jax.Array]:
  """`Vision.dropout_rows`: sample ids and positions [n, rows] of one-image slots."""
  del inputs
  positions = lora.item_places(owner_nt)[:, None] * rows + jnp.arange(rows, dtype=jnp.int32)
  return jnp.broadcast_to(owner_nt[:, :1], positions.shape), positions


def _tower(cfg: Config) -> None:
  """The tower's sizes, and the digits task's images."""
  v = cfg.model.vision
  positive(v, "model.vision", ("image_size", "channels", "patch_size", "dim", "layers", "heads",
                               "mlp_dim", "projector_hidden"))
  if cfg.data.task == "digits":
    require((v.image_size, v.channels) == (8, 1), "model.vision.image_size",
            "the digits task has 8x8 single-channel images; keep image_size=8, channels=1 "
            "(or data.task=synthetic).")
  require(v.image_size % v.patch_size == 0, "model.vision.patch_size",
          f"{v.patch_size} must divide image_size {v.image_size}.")
  require(v.downsample > 0 and (v.image_size // v.patch_size) % v.downsample == 0,
          "model.vision.downsample",
          f"{v.downsample} must divide the {v.image_size // v.patch_size} patches a side.")
  require(v.dim % v.heads == 0, "model.vision.heads", f"{v.heads} must divide dim {v.dim}.")


def _variants(cfg: Config) -> None:
  """The tower's architecture variants (Hugging Face towers)."""
  v = cfg.model.vision
  for field in ("activation", "projector_activation"):
    require(getattr(v, field) in ACTIVATIONS, f"model.vision.{field}",
            f"must be one of {', '.join(ACTIVATIONS)}, got {getattr(v, field)!r}.")
  require(v.norm_eps > 0, "model.vision.norm_eps", f"must be > 0, got {v.norm_eps}.")
  require(v.position_resize in POSITION_RESIZE, "model.vision.position_resize",
          f"must be one of {', '.join(POSITION_RESIZE)}, got {v.position_resize!r}.")
  try:
    norm = v.pixel_norm()
  except ValueError:
    raise ConfigError(f"config.model.vision.pixel_mean: {v.pixel_mean!r} or pixel_std "
                      f"{v.pixel_std!r} is not a comma-separated list of numbers.") from None
  if norm is not None:
    mean, std = norm
    require(len(mean) == len(std) == v.channels, "model.vision.pixel_mean",
            f"pixel_mean ({v.pixel_mean!r}) and pixel_std ({v.pixel_std!r}) need one value per "
            f"channel ({v.channels}).")
    for field, values in (("pixel_mean", mean), ("pixel_std", std)):
      require(all(math.isfinite(x) for x in values), f"model.vision.{field}",
              f"{getattr(v, field)!r}: values must be finite numbers.")
    require(all(x > 0 for x in std), "model.vision.pixel_std", "values must be > 0.")
  require(not (cfg.model.attention == "cudnn" and v.slot_patches % 2), "model.attention",
          f"cuDNN's packed attention trains even slot lengths only, and "
          f"model.vision.slot_patches is {v.slot_patches}; make it even, or use auto or xla.")
  require(not (v.class_token and v.slot_patches), "model.vision.class_token",
          "a class token needs one image a slot; set model.vision.slot_patches=0.")


def _image_data(cfg: Config) -> None:
  """The image data settings: how many images a sample has, of which sizes, in which slots."""
  d, v = cfg.data, cfg.model.vision
  require(v.max_images >= 1, "model.vision.max_images",
          "must be >= 1 (samples may still have 0 images).")
  require(v.image_slots >= 0, "model.vision.image_slots", "must be >= 0 (0 = worst case).")
  try:
    probs = d.probs()
  except ValueError:
    raise ConfigError(f"config.data.image_probs: {d.image_probs!r} is not a comma-separated "
                      "list of numbers.") from None
  if d.draws_image_counts:  # converted data's records say how many images they hold
    require(len(probs) == v.max_images + 1, "data.image_probs",
            f"needs max_images + 1 = {v.max_images + 1} probabilities, got {len(probs)}.")
    require(all(p >= 0 for p in probs) and abs(sum(probs) - 1) < 1e-6, "data.image_probs",
            "probabilities must be >= 0 and sum to 1.")
  try:
    sizes = d.sizes(v.image_size)
  except ValueError:
    raise ConfigError(f"config.data.image_sizes: {d.image_sizes!r} is not a comma-separated list "
                      "of sizes S or HxW.") from None
  unit = v.patch_size * v.downsample
  for h, w in sizes:
    require(0 < h <= v.image_size and 0 < w <= v.image_size and h % unit == 0 and w % unit == 0,
            "data.image_sizes", f"{h}x{w}: sides must be multiples of patch_size * downsample = "
            f"{unit} and at most model.vision.image_size = {v.image_size}.")
  require(v.slot_patches or sizes == [(v.image_size, v.image_size)], "data.image_sizes",
          f"{d.image_sizes!r} differs from model.vision.image_size = {v.image_size}; set "
          f"model.vision.slot_patches (e.g. {v.patches}) to pack images of several sizes.")
  require(not d.image_sizes or d.task == "synthetic", "data.image_sizes",
          "applies to data.task=synthetic only (digits are 8x8).")
  require(v.slot_patches >= 0, "model.vision.slot_patches",
          "must be >= 0 (0 = one image a slot).")
  require(v.slot_patches == 0 or (v.slot_patches >= v.patches and
                                  v.slot_patches % v.downsample**2 == 0),
          "model.vision.slot_patches",
          f"{v.slot_patches} must hold the largest image ({v.patches} patches) and be a multiple "
          f"of downsample² = {v.downsample**2}.")


ENCODER = encoders.register(Vision())


def hidden_states(cfg: Config, params: dict, images_nhwc) -> jax.Array:
  """Images [n, h, w, c] in [0, 1] -> the last block's output [n, tokens, dim] (the class token
  first if any; no final norm), patches in block order (row-major without a pixel shuffle), in
  one piece on one device (checks against transformers' towers)."""
  module = lora.adapted(ENCODER.module(cfg), cfg, ENCODER.name)
  model = module.bind(params)
  return module.apply_blocks(params, model.patches(jnp.asarray(images_nhwc, jnp.float32)))


def image_tokens(cfg: Config, params: dict, images_nhwc) -> jax.Array:
  """Images [n, h, w, c] in [0, 1] -> projected image tokens [n, t, language dim], in one
  piece on one device (mimo_jax/whole.py merges them into the text)."""
  model = lora.adapted(ENCODER.module(cfg), cfg, ENCODER.name).bind(params)
  return model.finish(hidden_states(cfg, params, images_nhwc))
