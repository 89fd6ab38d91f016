"""State sharded over data-parallel ranks (`topology.<module>.shard`): ZeRO-1 and FSDP keep the
single-device trajectory, shrink what each device holds, and checkpoints move between them."""

import jax
import numpy as np
import pytest

from mimo_jax.step import Step
from tests.helpers import assert_close_trajectory, run_steps, tiny_config

STEPS = 4
SINGLE = {"vision": (0, 1, 1), "language": (0, 1, 1)}


def sharded_config(data_dir, shard: dict, **topo):
  cfg = tiny_config(data_dir, **topo)
  for name, mode in shard.items():
    cfg.topology.module(name).shard = mode
  return cfg


@pytest.fixture(scope="module")
def reference(data_dir):
  return run_steps(tiny_config(data_dir, **SINGLE), STEPS)[0]


@pytest.mark.parametrize("topo,shard", [
    pytest.param({"vision": (0, 2, 1), "language": (2, 4, 1)}, {"language": "full"},
                 id="language-fsdp-dp4-vision-dp2-split"),
    pytest.param({"vision": (0, 4, 1), "language": (0, 4, 1)},
                 {"vision": "full", "language": "full"}, id="both-fsdp-colocated-dp4"),
    pytest.param({"vision": (0, 2, 1), "language": (2, 2, 2)}, {"language": "full"},
                 id="language-fsdp-dp2-tp2"),
    pytest.param({"vision": (0, 2, 1), "language": (2, 2, 1, 2)}, {"language": "full"},
                 id="language-fsdp-dp2-pp2"),
    pytest.param({"vision": (0, 4, 1), "language": (4, 4, 1)}, {"language": "optimizer"},
                 id="language-zero1-dp4"),
    pytest.param({"vision": (0, 4, 1), "language": (0, 4, 1)}, {"vision": "optimizer"},
                 id="vision-zero1-fused"),
    pytest.param({"vision": (0, 4, 1), "language": (0, 2, 2)},
                 {"vision": "full", "language": "optimizer"}, id="mixed-colocated"),
])
def test_sharded_state_matches_single_device(data_dir, reference, topo, shard):
  got, step, state, _ = run_steps(sharded_config(data_dir, shard, **topo), STEPS)
  assert_close_trajectory(reference, got, rtol=1e-4)
  for name, mode in shard.items():  # the state really is split as asked
    plan = step.plan[name]
    if mode == "full":
      assert any("dp" in a.sharding.spec for a in jax.tree.leaves(state[name].params))
    moments = [a for a in jax.tree.leaves(state[name].opt_state) if a.ndim > 1]
    assert moments and any("dp" in a.sharding.spec for a in moments), plan.name
