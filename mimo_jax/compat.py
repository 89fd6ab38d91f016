"""Every use of JAX's private modules, behind one door.

Four things the public API does not offer, or offers only with host work that matters:

* `assemble`: a global array from its per-device pieces without the checks of
  `jax.make_array_from_single_device_arrays` (the bridge's routes guarantee what they check).
* `copy`: many one-device arrays copied device to device in one call (the batched copy that
  `jax.device_put` ends in), without the Python layers before it.
* `packed_attention`: cuDNN's fused attention over packed segments (per-row offsets and lengths),
  which `jax.nn.dot_product_attention` does not take.
* `barrier`: a wait at the coordination service's barrier, which (unlike a device collective) does
  not occupy the devices while cross-process copies are still pending.

Each has a public fallback. The private paths are used only on JAX versions they were tested on
(`TESTED`), and for the bridge only when asked (`use_private_bridge`, or `MIMO_JAX_BRIDGE=private`):
inside the training step the public path costs less than 1% of a step (docs/benchmarks.md), so it
is the default. tests/test_compat.py runs both paths and compares them.
"""

from __future__ import annotations

import os

import jax
import numpy as np

# JAX releases whose private names below were tested; outside them only the public paths run.
TESTED = ((0, 10), (0, 11))


def _version() -> tuple[int, int]:
  major, minor = jax.__version_info__[:2]
  return int(major), int(minor)


PRIVATE_OK = _version() in TESTED
if PRIVATE_OK:
  # pylint: disable=g-bad-import-order,g-import-not-at-top
  from jax._src import core as _core
  from jax._src import distributed as _distributed
  from jax._src.array import ArrayImpl as _ArrayImpl
  from jax._src.lib import xla_client as _xc
  # pylint: enable=g-bad-import-order,g-import-not-at-top

_bridge = {"private": PRIVATE_OK and os.environ.get("MIMO_JAX_BRIDGE", "public") == "private"}


def use_private_bridge(on: bool) -> None:
  """Switches the bridge's assembly and copies to the private paths (or back to the public ones).
  Raises on a JAX release outside `TESTED`."""
  if on and not PRIVATE_OK:
    raise RuntimeError(f"jax {jax.__version__} is outside the releases the private bridge path "
                       f"was tested on ({TESTED}); use the public path.")
  _bridge["private"] = on


def private_bridge() -> bool:
  return _bridge["private"]


def aval(shape: tuple[int, ...], dtype, sharding: jax.sharding.Sharding):
  """What `assemble` needs to know of the array it builds (private path), or None."""
  if not _bridge["private"]:
    return None
  return _core.update_aval_with_sharding(_core.ShapedArray(shape, dtype), sharding)


def assemble(shape: tuple[int, ...], dtype, aval_, sharding: jax.sharding.Sharding,
             arrays: list) -> jax.Array:
  """A global array of `shape` on `sharding` from one array on each of this process's devices of
  the sharding, in the order of `sharding.addressable_devices_indices_map`."""
  if aval_ is not None:
    return _ArrayImpl(aval_, sharding, arrays, committed=True, _skip_checks=True)
  return jax.make_array_from_single_device_arrays(shape, sharding, arrays, dtype=dtype)


def copy_targets(devices: tuple) -> tuple[tuple, tuple]:
  """The one-device shardings of `devices` and what the private copy takes with them."""
  targets = tuple(jax.sharding.SingleDeviceSharding(d) for d in devices)
  if not PRIVATE_OK:
    return targets, ()
  # pylint: disable-next=protected-access
  return targets, tuple(t._internal_device_list for t in targets)


def copy(arrays: list, targets: tuple, device_lists: tuple) -> list:
  """Copies one-device `arrays` device to device, one onto each of `targets` (from
  `copy_targets`)."""
  if not arrays:
    return []
  if _bridge["private"]:
    return _xc.batched_copy_array_to_devices_with_sharding(
        arrays, device_lists, targets, [_xc.ArrayCopySemantics.REUSE_INPUT] * len(arrays))
  return jax.device_put(arrays, list(targets))


def packed_attention(q: jax.Array, k: jax.Array, v: jax.Array, offsets: jax.Array,
                     lengths: jax.Array, causal: bool) -> jax.Array:
  """cuDNN's fused attention on rows of packed segments ([b, l, heads, head_dim]; per-row segment
  `offsets` [b, M + 1] and `lengths` [b, M], -1 past the row's segments)."""
  if not PRIVATE_OK:
    raise NotImplementedError(
        f"cuDNN's packed attention is reached through private JAX names tested on {TESTED}, not "
        f"jax {jax.__version__}; use model.attention=xla.")
  # pylint: disable-next=g-import-not-at-top
  from jax._src.cudnn import fused_attention_stablehlo as cudnn
  mask = cudnn.MaskType.PADDING_CAUSAL if causal else cudnn.MaskType.PADDING
  return cudnn.dot_product_attention(
      q, k, v, q_seqlen=lengths, kv_seqlen=lengths, q_offsets=offsets, kv_offsets=offsets,
      scale=q.shape[-1] ** -0.5, mask_type=mask)


def share(name: str, value: str | None, timeout_s: int) -> str:
  """Process 0's `value` on every process (the others pass None), through the coordination
  service's key-value store where possible, else through a device collective
  (`multihost_utils.broadcast_one_to_all`, of a value that fits an int32)."""
  client = _distributed.global_state.client if PRIVATE_OK else None
  if client is not None:
    if value is not None:
      client.key_value_set(name, value)
    return client.blocking_key_value_get(name, timeout_s * 1000)
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  return str(int(multihost_utils.broadcast_one_to_all(np.int32(int(value or 0)))))


def barrier(name: str, timeout_s: int) -> None:
  """Waits until every process reaches the barrier `name`: at the coordination service where
  possible, else through a device collective (`multihost_utils.sync_global_devices`)."""
  if PRIVATE_OK and _distributed.global_state.client is not None:
    _distributed.global_state.client.wait_at_barrier(name, timeout_s * 1000)
    return
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  multihost_utils.sync_global_devices(name)

