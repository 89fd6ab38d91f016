"""The core property: every topology gives the single-device loss trajectory."""

import math
import re

import jax
import numpy as np
import pytest

from mimo_jax.data import digits, loader
from mimo_jax.batch import stack
from mimo_jax.data.layout import layout_microbatch
from mimo_jax.data.loader import make_layout
from mimo_jax.data.tokenizer import Tokenizer
from mimo_jax.step import Step
from tests.helpers import assert_close_trajectory, language_step_hlo, run_steps, tiny_config

STEPS = 4
SINGLE = {"vision": (0, 1, 1), "language": (0, 1, 1)}


@pytest.fixture(scope="module")
def reference(single_reference):
  assert len(single_reference) == STEPS
  return single_reference


def test_reference_learns(reference):
  # Guards the parity tests against comparing two runs that do nothing.
  assert reference[-1]["loss"] < reference[0]["loss"]
  assert all(np.isfinite(m["grad_norm"]) and m["grad_norm"] > 0 for m in reference)


@pytest.fixture(scope="module")
def trained(data_dir):
  """run_steps' results (STEPS steps) for a topology, of the loader's batches or
  _mixed_batches', each trained once a module: the parity tests compare their metrics, and
  test_language_gradients_summed_once_a_step compiles the language step of two of them again."""
  runs = {}

  def run(topo: dict, mixed: bool = False):
    key = (tuple(sorted(topo.items())), mixed)
    if key not in runs:
      cfg = tiny_config(data_dir, **topo)
      runs[key] = run_steps(cfg, STEPS, batches=_mixed_batches(cfg) if mixed else None)
    return runs[key]
  return run


def test_one_mesh_of_eight_matches_single_device(data_dir, reference):
  got = run_steps(tiny_config(data_dir, vision=(0, 8, 1), language=(0, 8, 1)), 3)[0]
  assert_close_trajectory(reference[:3], got, rtol=1e-5)


@pytest.mark.parametrize("topo", [
    pytest.param({"vision": (0, 4, 1), "language": (4, 1, 1)}, id="fan-in-4to1"),
    pytest.param({"vision": (0, 1, 1), "language": (1, 4, 1)}, id="fan-out-1to4"),
    pytest.param({"vision": (0, 2, 1), "language": (2, 2, 2)}, id="vision-dp2-to-dp2tp2"),
    pytest.param({"vision": (0, 4, 1), "language": (0, 2, 2)}, id="colocated-dp4-dp2tp2"),
    pytest.param({"vision": (0, 2, 2), "language": (4, 4, 1)}, id="vision-dp2tp2-to-dp4"),
])
def test_topology_matches_single_device(reference, trained, topo):
  got = trained(topo)[0]
  assert_close_trajectory(reference, got, rtol=1e-4)


def _mixed_batches(cfg):
  """Step 0: text-only and 1..3-image samples mixed; step 1: a text-only microbatch."""
  tr_x, tr_y, _, _ = digits.split_images()
  micro = cfg.data.micro_batch
  mixed = digits.make_samples(tr_x, tr_y, micro, [0.4, 0.2, 0.2, 0.2], seed=7)
  images = digits.make_samples(tr_x, tr_y, micro, [0.0, 0.0, 0.0, 1.0], seed=8)
  text = digits.make_samples(tr_x, tr_y, micro, [1.0, 0.0, 0.0, 0.0], seed=9)
  assert any(not len(s["images"]) for s in mixed) and any(len(s["images"]) for s in mixed)
  steps = [[mixed, text], [text, images], [images, mixed], [mixed, mixed]]
  tok = Tokenizer()

  def make(lang_dp):
    layout = make_layout(cfg, lang_dp)
    out = []
    for s, step in enumerate(steps):
      mbs = []
      for m, samples in enumerate(step):
        decoded = [{"images": np.asarray(x["images"], np.uint8).reshape(-1, 8, 8),
                    "text": x["text"]} for x in samples]
        ids = [1000 * s + 100 * m + i for i in range(micro)]
        mbs.append(layout_microbatch(decoded, ids, layout, tok))
      out.append(stack(mbs))
    return out
  return make


@pytest.fixture(scope="module")
def mixed_reference(data_dir):
  cfg = tiny_config(data_dir, **SINGLE)
  return run_steps(cfg, STEPS, batches=_mixed_batches(cfg))[0]


@pytest.mark.parametrize("topo", [
    pytest.param({"vision": (0, 4, 1), "language": (4, 1, 1)}, id="fan-in"),
    pytest.param({"vision": (0, 1, 1), "language": (1, 2, 2)}, id="fan-out-tp"),
])
def test_text_only_samples_and_microbatch(mixed_reference, trained, topo):
  got = trained(topo, mixed=True)[0]
  assert_close_trajectory(mixed_reference, got, rtol=1e-4)


def test_bfloat16_compute_tracks_float32(data_dir, reference):
  cfg = tiny_config(data_dir, vision=(0, 4, 1), language=(4, 2, 2))
  cfg.model.dtype = "bfloat16"
  got, _, state, _ = run_steps(cfg, STEPS)
  assert all(p.dtype == np.float32 for s in state.values()
             for p in jax.tree.leaves(s.params))  # master weights stay float32
  losses = np.array([float(m["loss"]) for m in got])
  ref = np.array([float(m["loss"]) for m in reference])
  assert not np.array_equal(losses, ref)  # really computed in bfloat16
  np.testing.assert_allclose(losses, ref, rtol=2e-2)


def _all_reduced_elements(hlo: str) -> int:
  """Elements all-reduced by a compiled HLO module (results of all-reduce ops, tuples summed)."""
  total = 0
  for line in hlo.splitlines():
    m = re.search(r"= (.*?) all-reduce(?:-start)?\(", line)
    if m:
      total += sum(math.prod(int(d) for d in dims.split(",") if d)
                   for dims in re.findall(r"\[([0-9,]*)\]", m.group(1)))
  return total


def _microbatch_step_hlo(data_dir, trained, language, mixed) -> tuple[list[str], int, bool]:
  """Compiled HLO of each microbatch's language step in one training step (of the loader's second
  batch, after the steps of the parity test of that layout), the language model's parameter
  count, and whether the layout defers the gradient sum."""
  cfg = tiny_config(data_dir, vision=(0, 1, 1), language=language)
  _, stepper, state, _ = trained({"vision": (0, 1, 1), "language": language}, mixed)
  ds = loader.train_dataset(cfg, loader.build_paths(cfg)["train"], language[1])
  hlo = language_step_hlo(stepper, state, ds[1])
  assert len(hlo) == cfg.data.microbatches > 1
  params = sum(a.size for a in jax.tree.leaves(state["language"].params))
  return hlo, params, stepper.ctx.mode.keeps_per_rank("language")


def test_language_gradients_summed_once_a_step(data_dir, trained):
  """A dp-only language model sums its gradients over ranks once a step (`programs.reduce`), not in
  every microbatch's step: that step all-reduces only its loss and mismatch count."""
  hlo, _, deferred = _microbatch_step_hlo(data_dir, trained, (1, 4, 1), False)  # fan-out-1to4
  assert deferred
  assert [_all_reduced_elements(h) for h in hlo] == [2] * len(hlo)
  # With tensor parallelism each microbatch step still sums its gradients (see programs.py): the
  # count above would see them.
  hlo, params, deferred = _microbatch_step_hlo(data_dir, trained, (1, 2, 2), True)  # fan-out-tp
  assert not deferred
  assert all(_all_reduced_elements(h) > params // 2 for h in hlo)


@pytest.mark.parametrize("topo,fused", [
    ({"vision": (0, 1, 1), "language": (0, 1, 1)}, True),
    ({"vision": (0, 8, 1), "language": (0, 8, 1)}, True),
    ({"vision": (0, 4, 1), "language": (0, 4, 1)}, True),
    ({"vision": (0, 4, 1), "language": (0, 2, 2)}, False),  # other mesh shapes
    ({"vision": (0, 4, 1), "language": (4, 4, 1)}, False),  # disjoint
])
def test_colocated_dp_layouts_run_one_program_a_microbatch(data_dir, topo, fused):
  """Encoders on the language model's own dp-only mesh run with it as one jit a microbatch (the
  parity tests above cover both paths: the single-device reference runs this way)."""
  cfg = tiny_config(data_dir, **topo)
  assert Step.build(cfg).ctx.mode.fused == fused
