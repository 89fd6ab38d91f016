"""Sample order and parameter init depend on the seeds only, never on the topology (§2.3)."""

import jax
import numpy as np
import pytest

from mimo_jax.batch import Batch
from mimo_jax.data import loader
from mimo_jax.data.tokenizer import IMG, Tokenizer
from mimo_jax.step import Step
from tests.helpers import tiny_config

ONE = {"vision": (0, 1, 1), "language": (0, 1, 1)}
EIGHT = {"vision": (0, 4, 1), "language": (4, 2, 2)}


def _samples(batch: Batch, m: int) -> list[tuple]:
  """Per row: sample id, text tokens (placeholders collapsed) and its images' pixels."""
  out = []
  mb = batch.microbatch(m)
  for b, sid in enumerate(mb.samples.ids_b):
    text = tuple(t for t in mb.text.tokens_rl[b] if t != IMG)
    images = mb.slots["vision"].inputs["images_nhwc"][mb.slots["vision"].owner_nt[:, 0] == sid]
    out.append((int(sid), text, images.tobytes()))
  return out


def test_same_seed_same_batches_on_1_and_8_devices(data_dir):
  c1, c8 = tiny_config(data_dir, **ONE), tiny_config(data_dir, **EIGHT)
  path = loader.build_paths(c1)["train"]
  ds1, ds8 = loader.train_dataset(c1, path, 1), loader.train_dataset(c8, path, 2)
  for step in range(3):
    b1, b8 = ds1[step], ds8[step]
    for m in range(c1.data.microbatches):
      assert _samples(b1, m) == _samples(b8, m)
  ids = [ds1[s].samples.ids_b.ravel().tolist() for s in range(3)]
  assert len(set(sum(ids, []))) == 3 * c1.data.global_batch  # no sample repeats within 3 steps


def test_data_seed_changes_order_and_restart_resumes_it(data_dir):
  cfg = tiny_config(data_dir, **ONE)
  path = loader.build_paths(cfg)["train"]
  a = loader.train_dataset(cfg, path, 1)[0].text.tokens_rl
  cfg.data.seed = 1
  b = loader.train_dataset(cfg, path, 1)[0].text.tokens_rl
  assert not np.array_equal(a, b)
  it = loader.train_iterator(cfg, path, 1, start_step=2)
  np.testing.assert_array_equal(next(it).text.tokens_rl,
                                loader.train_dataset(cfg, path, 1)[2].text.tokens_rl)


def test_same_seed_same_init_on_1_and_8_devices(data_dir):
  states = []
  for topo in (ONE, EIGHT):
    cfg = tiny_config(data_dir, **topo)
    stepper = Step.build(cfg)
    states.append({n: jax.device_get(s.params) for n, s in stepper.init_state(0).items()})
  for n in states[0]:
    for a, b in zip(jax.tree.leaves(states[0][n]), jax.tree.leaves(states[1][n])):
      np.testing.assert_array_equal(a, b)
  cfg.train.seed = 1
  other = Step.build(cfg).init_state(1)
  assert not np.array_equal(jax.device_get(other["language"].params["embedding"]),
                            states[0]["language"]["embedding"])


def test_tokenizer_rejects_unknown_words():
  with pytest.raises(ValueError, match="eleven"):
    Tokenizer().encode("<img> : eleven")


def test_loader_threads_give_the_same_batches(data_dir):
  cfg = tiny_config(data_dir, **EIGHT)
  path = loader.build_paths(cfg)["train"]
  plain = loader.train_iterator(cfg, path, 2)
  cfg.data.workers = 2
  threaded = loader.train_iterator(cfg, path, 2)
  for _ in range(3):
    a, b = next(plain), next(threaded)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
      np.testing.assert_array_equal(x, y)
