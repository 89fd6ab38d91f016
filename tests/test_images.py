"""Image preprocessing equals transformers' CLIP and SigLIP processors (fixtures written by
tools/image_fixtures.py), and bad processor configs are one error naming the file."""

import json
import pathlib
import shutil

import numpy as np
import pytest
from PIL import Image

from mimo_jax.data import images
from mimo_jax.data.images import ImageError, ImageProcessor

FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures" / "images"
NAMES = ("portrait", "landscape", "tiny", "rgba", "grayscale", "palette")


@pytest.mark.parametrize("kind", ["clip", "siglip"])
@pytest.mark.parametrize("name", NAMES)
def test_pixels_equal_the_hf_processor(kind, name):
  proc = ImageProcessor.open(FIXTURES / kind)
  want = np.load(FIXTURES / "reference.npz")[f"{kind}/{name}"]
  pixels = proc(Image.open(FIXTURES / f"{name}.png"))
  assert pixels.dtype == np.uint8 and pixels.shape == want.shape[1:] + (3,)
  np.testing.assert_allclose(proc.normalized(pixels), want, rtol=0, atol=1e-6)


def test_the_tower_normalises_as_the_processor():
  """What the shards hold (uint8) becomes the processor's pixel values on the device: the
  tower's own rescale and normalisation with the config's pixel_mean and pixel_std."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from mimo_jax.encoders.vision import VisionConfig  # pylint: disable=import-outside-toplevel
  proc = ImageProcessor.open(FIXTURES / "clip")
  cfg = VisionConfig(pixel_mean=",".join(map(repr, proc.mean)),
                     pixel_std=",".join(map(repr, proc.std)))
  mean, std = (np.asarray(v, np.float32) for v in cfg.pixel_norm())
  pixels = proc(Image.open(FIXTURES / "portrait.png"))
  on_device = (jnp.asarray(pixels, jnp.float32) / 255.0 - mean) / std
  np.testing.assert_allclose(np.moveaxis(np.asarray(on_device), -1, 0),
                             np.load(FIXTURES / "reference.npz")["clip/portrait"], atol=1e-6)


def test_pad_to_square_centres_the_image_on_the_mean_colour():
  proc = ImageProcessor.open(FIXTURES / "siglip", pad_to_square=True)
  wide = Image.fromarray(np.full((10, 40, 3), 200, np.uint8))
  padded = images.square(images.rgb(wide), tuple(int(m * 255) for m in proc.mean))
  grid = np.asarray(padded)
  assert grid.shape == (40, 40, 3)
  assert (grid[15:25] == 200).all() and (grid[:15] == 127).all() and (grid[25:] == 127).all()
  assert proc(wide).shape == (20, 20, 3)


@pytest.mark.parametrize("change,words", [
    ({"image_processor_type": "ViTImageProcessor"}, "image_processor_type"),
    ({"rescale_factor": 0.5}, "rescale_factor"),
    ({"size": {"longest_edge": 30}}, "size"),
    ({"do_center_crop": True, "crop_size": {"height": 3}}, "crop_size"),
])
def test_unsupported_processor_configs_are_one_error(tmp_path, change, words):
  shutil.copytree(FIXTURES / "clip", tmp_path / "p")
  path = tmp_path / "p" / images.FILE
  path.write_text(json.dumps(dict(json.loads(path.read_text()), **change)))
  with pytest.raises(ImageError, match=words) as e:
    ImageProcessor.open(tmp_path / "p")
  assert str(path) in str(e.value)
  with pytest.raises(ImageError, match="not found"):
    ImageProcessor.open(tmp_path)


def test_without_rgb_conversion_a_grayscale_image_keeps_one_channel(tmp_path):
  """`do_convert_rgb: false` (the digits task's processor) keeps a grayscale image's one band
  through the resize, and refuses a mode it cannot keep rather than converting it."""
  shutil.copytree(FIXTURES / "siglip", tmp_path / "p")
  path = tmp_path / "p" / images.FILE
  path.write_text(json.dumps(dict(json.loads(path.read_text()), do_convert_rgb=False)))
  proc = ImageProcessor.open(tmp_path / "p")
  gray = Image.open(FIXTURES / "grayscale.png").convert("L")
  want = np.asarray(gray.resize((20, 20), Image.Resampling.BICUBIC))
  got = proc(gray)
  assert got.shape == (20, 20, 1)
  np.testing.assert_array_equal(got[..., 0], want)
  assert proc(gray.convert("RGB")).shape == (20, 20, 3)
  with pytest.raises(ValueError, match="RGBA image"):
    proc(Image.open(FIXTURES / "rgba.png").convert("RGBA"))
