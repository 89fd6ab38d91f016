"""The bridge moves data device to device: no host round trip, exact values, any dp pair."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mimo_jax import bridge
from mimo_jax.data import loader
from mimo_jax.step import Step
from mimo_jax.validation import validate
from tests.helpers import tiny_config


@contextlib.contextmanager
def no_host_transfers():
  """Rejects the host fallback of device_put but allows device-to-device copies
  (docs/architecture.md)."""
  with jax.transfer_guard_host_to_device("disallow_explicit"), \
       jax.transfer_guard_device_to_host("disallow_explicit"):
    yield


@pytest.fixture(name="programs")
def _programs(monkeypatch) -> list:
  """Records the bridge's own programs: cuts on a source device (the cut ranges) and joins on a
  destination (the piece count)."""
  made = []
  cut, join = bridge._splitter, bridge._concat  # pylint: disable=protected-access
  monkeypatch.setattr(bridge, "_splitter", lambda c: made.append(c) or cut(c))
  monkeypatch.setattr(bridge, "_concat", lambda n: made.append(n) or join(n))
  return made


def _sharding(offset: int, dp: int, tp: int = 1) -> NamedSharding:
  devices = np.asarray(jax.devices()[offset:offset + dp * tp]).reshape(dp, tp)
  return NamedSharding(Mesh(devices, ("dp", "tp")), P("dp"))


def test_guard_catches_the_host_fallback():
  x = jax.device_put(jnp.arange(12.0), _sharding(0, 4))
  with pytest.raises(Exception, match="Disallowed"):
    with no_host_transfers():
      jax.device_put(x, _sharding(4, 3)).block_until_ready()


@pytest.mark.parametrize("src,dst", [((0, 4), (4, 2)), ((0, 3), (4, 1)), ((0, 1), (4, 4)),
                                     ((0, 2, 2), (4, 1, 4)), ((0, 4, 2), (0, 2, 4)),
                                     ((0, 2), (2, 3)), ((0, 2), (4, 2)), ((0, 1), (1, 1))])
def test_transfer_roundtrip_without_host(src, dst):
  x = np.random.default_rng(0).normal(size=(12, 3, 5)).astype(np.float32)
  a = jax.device_put(x, _sharding(*src))
  with no_host_transfers():
    b = bridge.transfer(a, _sharding(*dst))
    b.block_until_ready()
  doubled = jax.block_until_ready(b * 2)  # a gradient-like array on the destination
  with no_host_transfers():
    back = bridge.transfer(doubled, _sharding(*src))
    back.block_until_ready()
  assert b.sharding == _sharding(*dst) and back.sharding == _sharding(*src)
  np.testing.assert_array_equal(np.asarray(b), x)
  np.testing.assert_array_equal(np.asarray(back), 2 * x)


@pytest.mark.parametrize("topo,batch", [
    pytest.param({"vision": (0, 4, 1), "language": (4, 2, 1)}, 16, id="fan-in-4to2"),
    pytest.param({"vision": (0, 3, 1), "language": (4, 1, 1)}, 12, id="fan-in-3to1"),
    pytest.param({"vision": (0, 1, 1), "language": (4, 4, 1)}, 16, id="fan-out-1to4"),
])
def test_training_step_without_host_transfers(programs, data_dir, topo, batch):
  """A whole step (encoder fwd, bridge, LLM fwd+bwd, bridge back, encoder bwd, update). Every
  fan-out here (image tokens 1 -> 4; gradients 1 -> 2 and 1 -> 3) leaves its producer cut and
  every fan-in (image tokens 4 -> 2 and 3 -> 1; gradients 4 -> 1) is joined by its consumer, so
  the bridge runs no program of its own: it only copies."""
  cfg = tiny_config(data_dir, **topo)
  cfg.data.global_batch, cfg.eval.batch = 2 * batch, batch
  validate(cfg, len(jax.devices()))
  stepper = Step.build(cfg)
  state = stepper.init_state(0)
  ds = loader.train_dataset(cfg, loader.build_paths(cfg)["train"], stepper.ctx.groups)
  for s in range(2):  # the first step compiles outside the guard
    host = ds[s]
    inputs, inv_tokens = jax.block_until_ready(stepper.place_step(host))
    guard = no_host_transfers() if s == 1 else contextlib.nullcontext()
    with guard:
      state, metrics = stepper.dispatch(state, inputs, inv_tokens)
      jax.block_until_ready((state, metrics))
  m = jax.device_get(metrics)
  assert int(m["mismatches"]) == 0 and np.isfinite(m["loss"])
  assert int(host.samples.items_b.sum()) > 0
  assert not programs, programs


@pytest.mark.parametrize("tp", [1, 2])
def test_aligned_shardings_copy_shard_to_shard(monkeypatch, tp):
  """Equal row splits send every shard whole to the device that holds the same rows (no cutting or
  joining program, no host), also with the devices in another order and with tp replicas."""
  programs = []
  for name in ("_splitter", "_concat"):
    real = getattr(bridge, name)
    monkeypatch.setattr(bridge, name, lambda n, real=real: programs.append(n) or real(n))
  x = np.arange(12 * 4, dtype=np.float32).reshape(12, 4)
  src = _sharding(0, 2, tp)
  devices = np.asarray(jax.devices()[4:4 + 2 * tp][::-1]).reshape(2, tp)
  dst = NamedSharding(Mesh(devices, ("dp", "tp")), P("dp"))
  a = jax.device_put(x, src)
  with no_host_transfers():
    b = jax.block_until_ready(bridge.transfer(a, dst))
  assert b.sharding == dst and not programs, programs
  np.testing.assert_array_equal(np.asarray(b), x)
  for shard in b.addressable_shards:
    np.testing.assert_array_equal(np.asarray(shard.data), x[shard.index])


@pytest.mark.parametrize("src,dst,cut", [((0, 3), (4, 1), False), ((0, 4), (4, 2), False),
                                         ((0, 1), (4, 3), True), ((0, 2), (2, 3), True)])
def test_whole_shards_are_sent_uncut(monkeypatch, src, dst, cut):
  """Fan-in sends each source shard as it is (no slicing program); only pieces smaller than their
  shard are cut on the source device."""
  cuts = []
  real = bridge._splitter  # pylint: disable=protected-access
  monkeypatch.setattr(bridge, "_splitter", lambda c: cuts.append(c) or real(c))
  x = np.arange(12 * 2, dtype=np.float32).reshape(12, 2)
  a = jax.device_put(x, _sharding(*src))
  with no_host_transfers():
    b = jax.block_until_ready(bridge.transfer(a, _sharding(*dst)))
  np.testing.assert_array_equal(np.asarray(b), x)
  assert bool(cuts) == cut, cuts


def test_send_copies_at_once_and_joins_on_the_destination_when_taken(monkeypatch):
  """`send` dispatches the copies; the join of a fan-in's pieces (a program on the destination)
  waits until the array is taken, and taking it twice gives the same array."""
  joins = []
  real = bridge._concat  # pylint: disable=protected-access
  monkeypatch.setattr(bridge, "_concat", lambda n: joins.append(n) or real(n))
  x = np.arange(12 * 2, dtype=np.float32).reshape(12, 2)
  a = jax.device_put(x, _sharding(0, 3))
  with no_host_transfers():
    get = bridge.send(a, _sharding(4, 1))
    assert not joins
    b = jax.block_until_ready(get())
  assert joins == [3] and get() is b
  np.testing.assert_array_equal(np.asarray(b), x)


@pytest.mark.parametrize("src,dst,k", [((0, 1), (4, 3), 3), ((0, 2), (4, 4), 2),
                                       ((0, 1), (0, 3), 3), ((0, 1, 2), (2, 2, 3), 2),
                                       ((0, 2), (2, 3), 1), ((0, 3), (4, 1), 1),
                                       ((0, 2), (4, 2), 1)])
def test_producer_cuts_a_fan_out_and_the_bridge_sends_its_parts(programs, src, dst, k):
  """`split` in the producer's jit returns k parts for a fan-out by k (the array itself otherwise),
  with no communication in the program; the bridge sends the parts without a cutting program."""
  src, dst = _sharding(*src), _sharding(*dst)
  x = np.arange(12 * 2 * 3, dtype=np.float32).reshape(12, 2, 3)
  assert bridge.fan_out(src, x.shape, dst) == k
  producer = jax.jit(lambda a: bridge.split(a * 2, src, dst))
  a = jax.device_put(x, src)
  hlo = producer.lower(a).compile().as_text()
  for op in ("all-to-all", "collective-permute", "all-gather", "all-reduce"):
    assert op not in hlo, op
  made = producer(a)
  assert isinstance(made, bridge.Parts) == (k > 1)
  if k > 1:
    assert len(made.parts) == k and made.shape == x.shape and made.nbytes == x.nbytes
    assert all(p.sharding == src for p in made.parts)
  with no_host_transfers():
    b = jax.block_until_ready(bridge.transfer(made, dst))
  assert b.sharding == dst
  np.testing.assert_array_equal(np.asarray(b), 2 * x)
  if k > 1:
    assert not programs, programs


def test_parts_for_another_destination_are_refused():
  src = _sharding(0, 1)
  made = jax.jit(lambda a: bridge.split(a, src, _sharding(4, 3)))(
      jax.device_put(np.zeros((12, 2), np.float32), src))
  with pytest.raises(ValueError, match="not a part"):
    bridge.transfer(made, _sharding(4, 2))


@pytest.mark.parametrize("src,dst,k", [((0, 3), (4, 1), 3), ((0, 4), (4, 2), 2),
                                       ((0, 4), (2, 2), 2), ((2, 2, 2), (0, 1, 2), 2),
                                       ((0, 2), (2, 3), 1), ((0, 1), (4, 3), 1)])
def test_fan_in_delivered_as_parts_and_joined_by_the_consumer(programs, src, dst, k):
  """`send(..., parts=True)` delivers a fan-in by k as `Parts` of whole source shards without a
  joining program; `join` in the consumer's jit gives the array back, with no communication."""
  src, dst = _sharding(*src), _sharding(*dst)
  x = np.arange(12 * 2 * 3, dtype=np.float32).reshape(12, 2, 3)
  assert bridge.fan_out(dst, x.shape, src) == k
  a = jax.device_put(x, src)
  with no_host_transfers():
    got = jax.block_until_ready(bridge.transfer(a, dst, parts=True))
  assert isinstance(got, bridge.Parts) == (k > 1)
  if k > 1:
    assert not programs and len(got.parts) == k and all(p.sharding == dst for p in got.parts)
  consumer = jax.jit(lambda y: bridge.join(y) + 1)
  hlo = consumer.lower(got).compile().as_text()
  for op in ("all-to-all", "collective-permute", "all-gather", "all-reduce"):
    assert op not in hlo, op
  y = consumer(got)
  assert y.sharding == dst
  np.testing.assert_array_equal(np.asarray(y), x + 1)


def _permuted(ids: list[int], tp: int = 1) -> NamedSharding:
  devices = np.asarray([jax.devices()[i] for i in ids]).reshape(-1, tp)
  return NamedSharding(Mesh(devices, ("dp", "tp")), P("dp"))


@pytest.mark.parametrize("src,dst", [
    (([2, 0, 1], 1), ([7], 1)), (([3], 1), ([6, 4, 7, 5], 1)), (([1, 0, 3, 2], 2), ([7, 5], 1)),
    (([6, 4], 1), ([3, 1, 2, 0], 2)), (([5, 4, 7], 1), ([2, 0, 1], 1))])
@pytest.mark.parametrize("parts", [False, True])
def test_shards_and_assembly_follow_the_meshes_device_order(src, dst, parts):
  """The bridge reads shards and assembles arrays without the public functions' checks and
  reordering (`_shards`, `_assemble`): on meshes that list their devices out of order, with tp
  replicas, every shard is the one the sharding puts on that device, as the public functions
  build them."""
  src, dst = _permuted(*src), _permuted(*dst)
  x = np.arange(12 * 2, dtype=np.float32).reshape(12, 2)
  a = jax.device_put(x, src)
  read, order = bridge._shards, bridge._local_devices  # pylint: disable=protected-access
  shards = read(a)
  assert set(shards) == {s.device for s in a.addressable_shards}
  for s in a.addressable_shards:
    assert shards[s.device].devices() == {s.device}
    np.testing.assert_array_equal(np.asarray(shards[s.device]), x[s.index])
  made = jax.jit(lambda y: bridge.split(y, src, dst))(a) if parts else a
  with no_host_transfers():
    got = jax.block_until_ready(bridge.transfer(made, dst, parts=parts))
  arrays = got.parts if isinstance(got, bridge.Parts) else [got]
  for y in arrays:
    assert y.sharding == dst
    per_device = [read(y)[d] for d in order(dst, y.shape)]
    public = jax.make_array_from_single_device_arrays(y.shape, dst, per_device)
    for s, t in zip(y.addressable_shards, public.addressable_shards):
      assert (s.device, s.index) == (t.device, t.index)
      np.testing.assert_array_equal(np.asarray(s.data), np.asarray(t.data))
  consumer = jax.jit(lambda y: bridge.join(y) + 0)
  np.testing.assert_array_equal(np.asarray(consumer(got)), x)
