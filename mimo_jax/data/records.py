"""One record of images and a JSON header, as the synthetic and conversation shards store them:
a little-endian u32 header length, the header (with the shape of each image under `shapes`), then
the images' uint8 bytes."""

from __future__ import annotations

import json
import struct

import numpy as np


def pack(header: dict, images) -> bytes:
  images = [np.ascontiguousarray(img, np.uint8) for img in images]
  text = json.dumps({"shapes": [list(img.shape) for img in images], **header},
                    separators=(",", ":")).encode()
  return struct.pack("<I", len(text)) + text + b"".join(img.tobytes() for img in images)


def unpack(record: bytes) -> tuple[dict, list[np.ndarray]]:
  """(header, images); ValueError for a record that is not one."""
  try:
    (size,) = struct.unpack_from("<I", record)
    header = json.loads(record[4:4 + size])
    images, offset = [], 4 + size
    for shape in header["shapes"]:
      count = int(np.prod(shape))
      images.append(np.frombuffer(record, np.uint8, count, offset).reshape(shape))
      offset += count
  except (KeyError, TypeError, struct.error) as e:
    raise ValueError(str(e) or type(e).__name__) from None
  if offset != len(record):
    raise ValueError(f"{len(record) - offset} bytes beyond the images")
  return header, images
