"""Fixes from a LLaVA probe: tools.generate refuses an image past Pillow's decompression-bomb
limit where Pillow would only warn, as tools.convert and tools.eval do."""

import warnings

import pytest
from PIL import Image

from mimo_jax.config import Config, ConfigError
from mimo_jax.data import digits
from mimo_jax.data.images import ImageProcessor
from mimo_jax.encoders.vision import VisionConfig
from tools import prompts


def test_generate_refuses_an_image_pillow_only_warns_of(tmp_path, monkeypatch):
  """60x60 pixels past a limit of 2000 (under twice it: Pillow warns, it does not raise): one
  line naming the file, the limit and the fix, and no warning of Pillow's printed above it."""
  digits.write_tokenizer(tmp_path / "tok")
  Image.new("L", (60, 60), 128).save(tmp_path / "big.png")
  cfg = Config()
  cfg.add_encoder("vision", VisionConfig())  # the digits' tower: 8x8, one channel
  proc = ImageProcessor.open(tmp_path / "tok")
  prompts.load_images([str(tmp_path / "big.png")], proc, cfg)  # taken under Pillow's limit
  monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 2000)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with pytest.raises(ConfigError) as e:
      prompts.load_images([str(tmp_path / "big.png")], proc, cfg)
  assert str(e.value) == (
      f"{tmp_path / 'big.png'}: refused as a possible decompression bomb (Image size (3600 pixels) "
      "exceeds limit of 2000 pixels, could be decompression bomb DOS attack.); give a smaller "
      "image."), str(e.value)
  assert not caught, [str(w.message) for w in caught]
