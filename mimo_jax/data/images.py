"""Images as a vision tower's Hugging Face processor prepares them, from its
`preprocessor_config.json`, with Pillow and numpy (no transformers).

    processor = ImageProcessor.open("siglip-so400m-patch14-384")
    pixels = processor(PIL.Image.open("cat.png"))  # uint8 [h, w, 3]

Steps, as transformers' PIL backend runs them (`CLIPImageProcessorPil`, `SiglipImageProcessorPil`,
the processors without torchvision):

0. A 16-bit grayscale image is scaled to 8 bits (by 255 / 65535), a float one read as [0, 1]
   (`eight_bit`; Pillow's conversion would clip them), each rounded.
1. RGB: an image with transparency is composited onto white, grayscale and palette images become
   RGB. With `do_convert_rgb: false` an image keeps its bands: a grayscale image stays one channel
   ([h, w, 1]; the digits task's tower reads one channel).
2. Optionally LLaVA's pad to square (`pad_to_square`, LLaVA-1.5's `image_aspect_ratio=pad`): the
   image centred on a square of its longer side filled with the mean colour.
3. Resize with Pillow's filter (`resample`; bicubic for CLIP and SigLIP): the shortest edge to
   `size.shortest_edge` keeping the aspect ratio (the long side truncated, as transformers
   computes it) for CLIP, to `size.height` x `size.width` for SigLIP.
4. Center crop to `crop_size` (CLIP), padding with zeros where the image is smaller.

The result stays uint8, which is what the data shards hold. Rescaling by 1/255 and the per-channel
mean and std are applied on the device, in one place: the vision tower divides by 255 and
normalises with `model.vision.pixel_mean` / `pixel_std` (which `tools.hf import` takes from the
same file); `normalized` does the same on the host for checks.

The image side of the data tasks lives here too: an image file read through the processor (`load`),
the refusal, with the fix, of one a processor that keeps bands cannot read (`bands_refused`), the
images a conversion wrote (`Tally`, for its manifest) checked against the vision tower's config
(`check_sizes`), and the images the synthetic task draws (`synthetic_shapes`).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import pathlib
import warnings
from typing import Any

import numpy as np
from PIL import Image

from mimo_jax.config import Config, ConfigError
from mimo_jax.words import count

FILE = "preprocessor_config.json"
PROCESSORS = ("CLIPImageProcessor", "SiglipImageProcessor", "LlavaImageProcessor")


class ImageError(ConfigError):
  """An image or a processor config that cannot be used; the message names the file."""


@dataclasses.dataclass(frozen=True)
class ImageProcessor:
  shortest_edge: int = 0  # resize the shorter side to this, keeping the aspect ratio (CLIP)
  size: tuple[int, int] | None = None  # or resize to (height, width) (SigLIP)
  crop: tuple[int, int] | None = None  # then center crop to (height, width)
  resample: int = Image.Resampling.BICUBIC
  mean: tuple[float, ...] = (0.0, 0.0, 0.0)  # normalisation (on the device)
  std: tuple[float, ...] = (1.0, 1.0, 1.0)
  pad_to_square: bool = False  # LLaVA's pad to a square of the mean colour first
  convert_rgb: bool = True  # False: keep the image's bands (grayscale stays one channel)

  @classmethod
  def open(cls, directory, pad_to_square: bool = False) -> "ImageProcessor":
    """The processor a model directory's preprocessor_config.json describes."""
    path = pathlib.Path(directory) / FILE
    try:
      c = json.loads(path.read_text())
    except FileNotFoundError:
      raise ImageError(f"{path}: not found; a vision tower's directory holds its image "
                       "processor's preprocessor_config.json.") from None
    except (OSError, ValueError) as e:
      raise ImageError(f"{path}: unreadable ({e}).") from None
    kind = c.get("image_processor_type", "")
    if kind.removesuffix("Fast").removesuffix("Pil") not in PROCESSORS:
      raise ImageError(f"{path}: image_processor_type {kind!r} is not supported; supported: "
                       f"{', '.join(PROCESSORS)}.")
    if c.get("do_rescale", True) and abs(c.get("rescale_factor", 1 / 255) - 1 / 255) > 1e-12:
      raise ImageError(f"{path}: rescale_factor {c['rescale_factor']} is not supported (1/255, "
                       "which the vision tower applies).")
    size, out = c.get("size", {}), {"convert_rgb": bool(c.get("do_convert_rgb", True))}
    if c.get("do_resize", True):
      if "shortest_edge" in size:
        out["shortest_edge"] = int(size["shortest_edge"])
      elif "height" in size and "width" in size:
        out["size"] = (int(size["height"]), int(size["width"]))
      else:
        raise ImageError(f"{path}: size {size} is not supported (shortest_edge, or height and "
                         "width).")
    if c.get("do_center_crop", False):
      crop = c.get("crop_size", {})
      if not ("height" in crop and "width" in crop):
        raise ImageError(f"{path}: crop_size {crop} needs height and width.")
      out["crop"] = (int(crop["height"]), int(crop["width"]))
    if c.get("do_normalize", True):
      out["mean"] = tuple(float(x) for x in c.get("image_mean", (0.5, 0.5, 0.5)))
      out["std"] = tuple(float(x) for x in c.get("image_std", (0.5, 0.5, 0.5)))
    # LlavaImageProcessor's do_pad is LLaVA's pad to square (tools.hf export writes it so).
    return cls(resample=int(c.get("resample", Image.Resampling.BICUBIC)),
               pad_to_square=pad_to_square or bool(c.get("do_pad", False)), **out)

  @property
  def output_size(self) -> tuple[int, int]:
    """(height, width) of what it makes: its crop or its resize; with a shortest edge, a square of
    that edge (a lower bound: the image keeps its aspect ratio)."""
    return self.crop or self.size or (self.shortest_edge,) * 2

  @property
  def channels(self) -> int:
    """Channels of what it makes: 3 with RGB conversion; else 1, the grayscale it reads."""
    return 3 if self.convert_rgb else 1

  def __call__(self, image: Image.Image) -> np.ndarray:
    """A PIL image -> uint8 pixels [h, w, 3] ([h, w, bands] without RGB conversion), resized and
    cropped as the processor does; 16-bit and float grayscale images become 8-bit first
    (`eight_bit`)."""
    image = eight_bit(image)
    if self.convert_rgb:
      image = rgb(image)
    elif image.mode not in ("L", "RGB"):
      raise ValueError(f"a {image.mode} image where the processor keeps bands (do_convert_rgb "
                       "false) and reads L (grayscale) or RGB images")
    if self.pad_to_square:
      fill = tuple(int(m * 255) for m in self.mean)
      image = square(image, fill if image.mode == "RGB" else fill[0])
    if self.shortest_edge:
      image = image.resize(_shortest_edge(image.size, self.shortest_edge)[::-1], self.resample)
    elif self.size:
      image = image.resize(self.size[::-1], self.resample)
    pixels = np.asarray(image, np.uint8)
    if pixels.ndim == 2:
      pixels = pixels[..., None]
    return center_crop(pixels, self.crop) if self.crop else pixels

  def normalized(self, pixels: np.ndarray) -> np.ndarray:
    """uint8 pixels [h, w, 3] -> what the tower computes on: float32 [3, h, w], rescaled by
    1/255 and normalised per channel (the processor's pixel_values)."""
    x = pixels.astype(np.float32) / np.float32(255)
    x = (x - np.asarray(self.mean, np.float32)) / np.asarray(self.std, np.float32)
    return np.moveaxis(x, -1, 0)


class UnsupportedImage(ValueError):
  """An image whose pixel values have no defined 8-bit meaning (`eight_bit`)."""


# Half an 8-bit step: float values this far outside [0, 1] round to 0 or 255 all the same.
FLOAT_SLACK = 0.5 / 255


def eight_bit(image: Image.Image) -> Image.Image:
  """A grayscale image of more than 8 bits as 8-bit grayscale ("L"), other images as they are:
  16-bit ("I;16", and a PNG's "I", as older Pillow opens 16-bit PNGs) scaled by 255 / 65535,
  float ("F") taken as [0, 1] and scaled by 255, both rounded. Pillow's own conversion clips
  instead (a 16-bit image comes out almost white, a float one black). A float image with values
  outside [0, 1] (or NaN), or a 32-bit integer image, is UnsupportedImage: its range is not
  known."""
  mode = image.mode
  if mode.startswith("I;16") or (mode == "I" and image.format == "PNG"):
    x = np.asarray(image).astype(np.uint32)
    if x.max(initial=0) > 65535:
      raise UnsupportedImage(f"a 16-bit image with values up to {x.max()} (past 65535)")
    return Image.fromarray(((x * 255 + 32767) // 65535).astype(np.uint8), "L")
  if mode == "F":
    x = np.asarray(image, np.float64)
    if x.size and not (np.isfinite(x).all() and -FLOAT_SLACK <= x.min()
                       and x.max() <= 1 + FLOAT_SLACK):
      seen = x[~np.isnan(x)]
      found = f"from {seen.min():.4g} to {seen.max():.4g}" if seen.size else "NaN only"
      raise UnsupportedImage(f"a float image with values {found}"
                             f"{' and NaN' if seen.size < x.size and seen.size else ''}, where "
                             "float pixels are read as [0, 1]; save it as 8- or 16-bit, or "
                             "scale it to [0, 1]")
    return Image.fromarray(np.clip(np.round(x * 255), 0, 255).astype(np.uint8), "L")
  if mode == "I":
    raise UnsupportedImage("a 32-bit integer image, whose range is not known; save it as 8- or "
                           "16-bit")
  return image


def rgb(image: Image.Image) -> Image.Image:
  """RGB, with any transparency composited onto white (as transformers converts)."""
  if "A" in image.getbands() or image.info.get("transparency") is not None:
    image = image.convert("RGBA")
    white = Image.new("RGBA", image.size, (255, 255, 255, 255))
    return Image.alpha_composite(white, image).convert("RGB")
  return image.convert("RGB")


def square(image: Image.Image, fill) -> Image.Image:
  """LLaVA's expand2square: the image centred on a square of its longer side."""
  w, h = image.size
  if w == h:
    return image
  out = Image.new(image.mode, (max(w, h),) * 2, fill)
  out.paste(image, (0, (w - h) // 2) if w > h else ((h - w) // 2, 0))
  return out


def _shortest_edge(size_wh: tuple[int, int], edge: int) -> tuple[int, int]:
  """(height, width) with the shorter side `edge`, the longer truncated as transformers does."""
  w, h = size_wh
  short, long = (w, h) if w <= h else (h, w)
  new_long = int(edge * long / short)
  return (new_long, edge) if w <= h else (edge, new_long)


def center_crop(pixels: np.ndarray, crop: tuple[int, int]) -> np.ndarray:
  """The centre (height, width) of pixels [h, w, c], padded with zeros where it is smaller."""
  h, w = pixels.shape[:2]
  ch, cw = crop
  if h < ch or w < cw:  # pad as transformers does: the image at ceil of half the margin
    nh, nw = max(h, ch), max(w, cw)
    top, left = -(-(nh - h) // 2), -(-(nw - w) // 2)
    padded = np.zeros((nh, nw) + pixels.shape[2:], pixels.dtype)
    padded[top:top + h, left:left + w] = pixels
    pixels, h, w = padded, nh, nw
  top, left = (h - ch) // 2, (w - cw) // 2
  return pixels[top:top + ch, left:left + cw]


# What Pillow raises for an image too large to decode safely (past Image.MAX_IMAGE_PIXELS it only
# warns, and `load` makes the warning an error: such an image would take a worker's memory).
TOO_LARGE = (Image.DecompressionBombError, Image.DecompressionBombWarning)


def too_large(e: Exception) -> str:
  """How the tools say an image of TOO_LARGE (`e`, Pillow's), with the fix."""
  return f"refused as a possible decompression bomb ({e}); give a smaller image"


def load(path, processor: ImageProcessor) -> np.ndarray:
  """The processor's pixels of the image file at `path`; Pillow's errors as they are (TOO_LARGE
  for one too large to decode)."""
  with warnings.catch_warnings():
    warnings.simplefilter("error", Image.DecompressionBombWarning)
    with Image.open(path) as image:
      return processor(image)


# Modes a processor that keeps an image's bands refuses, as said in errors (others: "a CMYK image").
_MODES = {"RGBA": "an RGBA image (with transparency)", "P": "a palette (P) image",
          "PA": "a palette image with transparency (PA)",
          "LA": "an LA image (grayscale with transparency)"}
# Pillow's conversion of `path` as a converting processor makes it (`rgb`), then to MODE.
_CONVERT = ("im = Image.open(path).convert(\"RGBA\"); Image.alpha_composite(Image.new(\"RGBA\", "
            "im.size, \"white\"), im).convert(\"{mode}\").save(new_path)")
_GRAY = "; .convert(\"L\") for grayscale"  # where the model's channels are not known


def bands_refused(path, convert_rgb: bool, channels: int | None, also: str = "") -> str | None:
  """Where a processor that keeps an image's bands (`convert_rgb` false) refuses the image file at
  `path` for bands other than the grayscale (L) or RGB it reads (RGBA, a palette, CMYK): what it
  is and the fix, the image converted to the model's `channels` (None: not known, as in
  tools.convert: RGB or grayscale) as a converting processor converts it (transparency onto
  white); `also` follows what the processor reads. None where the processor takes it, or the
  file cannot be opened."""
  if convert_rgb:
    return None
  try:
    with Image.open(path) as image:
      mode = eight_bit(image).mode
  except Exception:  # pylint: disable=broad-except
    return None
  if mode in ("L", "RGB"):
    return None
  to = {1: "grayscale (L)", 3: "RGB", None: "RGB or grayscale (L), as the model reads"}
  if channels not in to:
    fix = f"convert it to the model's {channels} channels"
  else:
    fix = (f"convert it to {to[channels]}, any transparency onto white as a converting processor "
           f"does (e.g. with Pillow: {_CONVERT.format(mode='L' if channels == 1 else 'RGB')}"
           f"{_GRAY if channels is None else ''})")
  if channels in (3, None):
    fix += (", or give a processor that converts it (\"do_convert_rgb\": true in its "
            "preprocessor_config.json)")
  return (f"{_MODES.get(mode, f'a {mode} image')}, where the processor keeps an image's bands "
          f"(\"do_convert_rgb\": false) and reads only grayscale (L) and RGB images{also}; {fix}")


@dataclasses.dataclass
class Tally:
  """The images of a conversion's samples, for its manifest."""
  count: int = 0
  most: int = 0  # in one sample
  sizes: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  channels: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  first: dict[int, str] = dataclasses.field(default_factory=dict)  # channels -> an image's name

  def add(self, pixels: list[np.ndarray], names: list[str] | None = None) -> None:
    """Counts one sample's images (uint8 [h, w, c] each), `names` saying where each came from
    (kept for the first image of each channel count, which `mixed_channels` names)."""
    self.count += len(pixels)
    self.sizes.update(tuple(int(v) for v in p.shape[:2]) for p in pixels)
    self.channels.update(int(p.shape[2]) for p in pixels)
    for p, name in zip(pixels, names or ()):
      self.first.setdefault(int(p.shape[2]), name)
    self.most = max(self.most, len(pixels))

  def mixed_channels(self, processor: str) -> str | None:
    """Where the images differ in channel count (a processor that keeps bands, `processor` its
    directory, read grayscale and RGB images): the counts with the first image of each, and the
    fix (the fewer converted to the most common count with Pillow, or a processor that converts);
    None where they agree."""
    if len(self.channels) < 2:
      return None
    counts = self.channels.most_common()
    named = [f"{count(n, 'image')} of {count(c, 'channel')} ({self.first.get(c, '?')}"
             f"{', ...' if n > 1 else ''})" for c, n in counts]
    most = counts[0][0]
    fewer = ", ".join(f"{c}-channel" for c, _ in counts[1:])
    mode = {1: "L", 3: "RGB"}.get(most)
    to = (f"convert the {fewer} images to {'grayscale' if mode == 'L' else mode} (with Pillow: "
          f"Image.open(path).convert(\"{mode}\").save(new_path))" if mode else
          f"convert the {fewer} images to {count(most, 'channel')}")
    return (f"its images differ in channels, {' and '.join(named)}, where the processor in "
            f"{processor} keeps an image's bands (\"do_convert_rgb\": false) and a model reads "
            f"one count; {to}, or give a processor that converts every image to RGB "
            f"(\"do_convert_rgb\": true in its {FILE}), then convert again")

  def size(self, processor: ImageProcessor) -> list[int]:
    """The most common image size (every one, with a crop or a square resize); without images,
    the processor's own."""
    return [int(v) for v in (self.sizes.most_common(1)[0][0] if self.sizes else
                             processor.output_size)]

  def channel(self, processor: ImageProcessor) -> int:
    """The most common channel count; without images, the processor's."""
    return self.channels.most_common(1)[0][0] if self.channels else processor.channels


def check_sizes(cfg: Config, directory: str, size: list[int] | None, sizes: list[list[int]],
                most: int = 0) -> None:
  """ConfigError unless the vision tower takes the converted images of `directory` (its manifest's
  most common `size` and all its `sizes`, `most` images in a sample): one size equal to
  model.vision.image_size, or any sizes with dynamic resolution (model.vision.slot_patches), and
  model.vision.max_images >= most; `size` None (data converted without images or a processor)
  has no size to check. Without a vision encoder (an audio-only model), data holding images is
  one ConfigError and data without them passes."""
  if "vision" not in cfg.model.encoders:
    if most > 0:
      raise ConfigError(f"config.model.vision: {directory} holds images (up to "
                        f"{count(most, 'image')} a sample, its conversations.json), but the config "
                        f"has no vision encoder (encoders: {', '.join(cfg.model.encoders) or 'none'}"
                        "); use a config with a vision encoder (e.g. configs/avlm.py), or convert "
                        "data without images.")
    return
  v = cfg.model.vision
  if v.max_images < most:
    raise ConfigError(f"config.model.vision.max_images: {v.max_images}, but a sample of "
                      f"{directory} holds {count(most, 'image')} (its conversations.json); use "
                      f">= {most}: --config.model.vision.max_images={most}, as the launch line "
                      "that tools.convert printed sets it.")
  if size is None:  # converted without images or an image processor: no size to agree with
    return
  h, w = size
  if not v.slot_patches and (h, w) != (v.image_size, v.image_size):
    raise ConfigError(f"config.model.vision.image_size: {v.image_size} where {directory} holds "
                      f"{h}x{w} images; set model.vision.image_size={h}, or "
                      "model.vision.slot_patches.")
  others = [f"{a}x{b}" for a, b in sizes if (a, b) != (h, w)]
  if others and not v.slot_patches:
    raise ConfigError(f"config.model.vision.slot_patches: {directory} holds images of several "
                      f"sizes ({h}x{w}, {', '.join(others[:3])}), which need dynamic resolution; "
                      "set model.vision.slot_patches, or convert with a processor that crops.")


def synthetic_shapes(cfg: Config, tower: Any) -> tuple[list[tuple[int, int]], int, int]:
  """The sizes the synthetic task draws its images from (data.image_sizes; default the image
  tower's image_size, square), their channels, and the pixels an image token covers on each side
  (patch_size * downsample); `tower` is the image encoder's config (model.vision, a ViTConfig)."""
  return (cfg.data.sizes(tower.image_size), tower.channels,
          tower.patch_size * tower.downsample)
