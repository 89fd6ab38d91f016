"""One record of images, audio features and a JSON header, as the synthetic and conversation
shards store them: a little-endian u32 header length, the header (with the shape of each image
under `shapes` and, where the record has clips, of each clip's features under `audio_shapes`),
then the images' uint8 bytes, then the clips' float32 (little-endian) bytes.

Clips are stored as features, not as encoded audio: no decoding or STFT while training, at
3000 · mel_bins · 4 bytes a 30 s window (960 KB at 80 bins, as int16 samples would take; FLAC
about a third of it). A record without clips has no `audio_shapes` and reads as before."""

from __future__ import annotations

import json
import struct

import numpy as np

AUDIO_DTYPE = np.dtype("<f4")


def pack(header: dict, images, audios=()) -> bytes:
  images = [np.ascontiguousarray(img, np.uint8) for img in images]
  audios = [np.ascontiguousarray(a, AUDIO_DTYPE) for a in audios]
  head = {"shapes": [list(img.shape) for img in images]}
  if audios:
    head["audio_shapes"] = [list(a.shape) for a in audios]
  text = json.dumps({**head, **header}, separators=(",", ":")).encode()
  return (struct.pack("<I", len(text)) + text + b"".join(img.tobytes() for img in images)
          + b"".join(a.tobytes() for a in audios))


def unpack_all(record: bytes) -> tuple[dict, list[np.ndarray], list[np.ndarray]]:
  """(header, images, audio features); ValueError for a record that is not one."""
  try:
    (size,) = struct.unpack_from("<I", record)
    header = json.loads(record[4:4 + size])
    images, audios, offset = [], [], 4 + size
    for shape in header["shapes"]:
      count = int(np.prod(shape))
      images.append(np.frombuffer(record, np.uint8, count, offset).reshape(shape))
      offset += count
    for shape in header.get("audio_shapes", ()):
      count = int(np.prod(shape))
      audios.append(np.frombuffer(record, AUDIO_DTYPE, count, offset).reshape(shape)
                    .astype(np.float32, copy=False))
      offset += count * AUDIO_DTYPE.itemsize
  except (KeyError, TypeError, struct.error) as e:
    raise ValueError(str(e) or type(e).__name__) from None
  if offset != len(record):
    raise ValueError(f"{len(record) - offset} bytes beyond the images and audio")
  return header, images, audios


def unpack(record: bytes) -> tuple[dict, list[np.ndarray]]:
  """(header, images) of a record without clips; ValueError for a record that is not one."""
  header, images, audios = unpack_all(record)
  if audios:
    raise ValueError(f"{len(audios)} audio clips in a record read for its images only")
  return header, images
