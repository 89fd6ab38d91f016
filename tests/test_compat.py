"""Private JAX behind one door: both paths of every compat function give the same arrays."""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mimo_jax import bridge, compat


@pytest.fixture(params=["public", "private"])
def path(request):
  if request.param == "private" and not compat.PRIVATE_OK:
    pytest.skip(f"jax {jax.__version__} is outside the tested releases {compat.TESTED}")
  before = compat.private_bridge()
  compat.use_private_bridge(request.param == "private")
  yield request.param
  compat.use_private_bridge(before)


def _sharding(ids, tp=1):
  devices = np.asarray([jax.devices()[i] for i in ids]).reshape(-1, tp)
  return NamedSharding(Mesh(devices, ("dp", "tp")), P("dp"))


def test_this_jax_is_a_tested_release():
  # pyproject.toml bounds jax to the releases compat.TESTED names.
  assert compat.PRIVATE_OK


def test_assemble_matches_the_public_function(path):
  dst = _sharding([5, 3, 6, 0], tp=2)
  x = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
  ref = jax.device_put(x, dst)
  pieces = [s.data for s in sorted(ref.addressable_shards,
                                   key=lambda s: list(dst.addressable_devices_indices_map(
                                       x.shape)).index(s.device))]
  got = compat.assemble(x.shape, x.dtype, compat.aval(x.shape, x.dtype, dst), dst, pieces)
  assert (compat.aval(x.shape, x.dtype, dst) is None) == (path == "public")
  assert got.sharding == dst
  for a, b in zip(got.addressable_shards, ref.addressable_shards):
    assert (a.device, a.index) == (b.device, b.index)
    np.testing.assert_array_equal(np.asarray(a.data), np.asarray(b.data))


@pytest.mark.parametrize("src,dst", [([0, 1, 2, 3], [4, 5]), ([0], [4, 5, 6, 7]), ([2, 3], [6, 7])])
def test_bridge_transfers_are_the_same_on_both_paths(path, src, dst):
  src, dst = _sharding(src), _sharding(dst)
  x = np.arange(16 * 4, dtype=np.float32).reshape(16, 4)
  got = jax.block_until_ready(bridge.transfer(jax.device_put(x, src), dst))
  assert got.sharding == dst
  np.testing.assert_array_equal(np.asarray(got), x)
  for s in got.addressable_shards:
    np.testing.assert_array_equal(np.asarray(s.data), x[s.index])


def test_the_private_bridge_is_refused_outside_the_tested_releases(monkeypatch):
  monkeypatch.setattr(compat, "PRIVATE_OK", False)
  with pytest.raises(RuntimeError, match="outside the releases"):
    compat.use_private_bridge(True)
