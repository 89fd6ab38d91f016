"""One optimizer step across modules: freezing, learning-rate multipliers, one global clip."""

import jax
import numpy as np
import pytest

from tests.helpers import assert_close_trajectory, run_steps, tiny_config

TOPO = {"vision": (0, 2, 1), "language": (2, 2, 2)}


def _init_and_final(data_dir, steps=2, topo=None, **optim):
  cfg = tiny_config(data_dir, **(topo or TOPO))
  for k, v in optim.items():
    setattr(cfg.optim, k, v)
  metrics, _, state, init = run_steps(cfg, steps)
  final = {n: jax.device_get(s.params) for n, s in state.items()}
  return metrics, init, final


def _same(a, b) -> bool:
  return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _changed(a, b) -> bool:
  return all(not np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _vit(p):
  return {k: v for k, v in p.items() if k != "projector"}


@pytest.fixture(scope="module")
def frozen_run(data_dir):
  """`_init_and_final(data_dir, steps=3, freeze=...)` on TOPO, trained once for each `freeze`
  (the tests below share them: host copies, never changed)."""
  runs = {}

  def get(freeze: str):
    if freeze not in runs:
      runs[freeze] = _init_and_final(data_dir, steps=3, freeze=freeze)
    return runs[freeze]
  return get


@pytest.mark.parametrize("freeze,frozen,trained", [
    ("vision,vision_projector", ["vit", "projector"], ["language"]),
    ("language", ["language"], ["vit", "projector"]),
    ("vision,language", ["vit", "language"], ["projector"]),  # projector-only training
])
def test_frozen_groups_stay_bitwise(frozen_run, freeze, frozen, trained):
  _, init, final = frozen_run(freeze)
  parts = {"vit": lambda p: _vit(p["vision"]), "projector": lambda p: p["vision"]["projector"],
           "language": lambda p: p["language"]}
  for name in frozen:
    assert _same(parts[name](init), parts[name](final)), name
  for name in trained:
    assert _changed(parts[name](init), parts[name](final)), name


def test_zero_lr_multiplier_freezes_group(data_dir):
  _, init, final = _init_and_final(data_dir, lr_mult="vision=0.0,language=2.0")
  assert _same(_vit(init["vision"]), _vit(final["vision"]))
  assert _changed(init["vision"]["projector"], final["vision"]["projector"])


def test_one_clip_factor_for_all_modules(data_dir):
  metrics, _, _ = _init_and_final(data_dir, steps=3, clip_norm=0.05)
  for m in metrics:
    assert m["clip_scale/vision"] == m["clip_scale/language"]  # bit-identical
    np.testing.assert_allclose(m["clip_scale/vision"], 0.05 / (m["grad_norm"] + 1e-6), rtol=1e-6)
    assert m["clip_scale/vision"] < 1.0


def test_frozen_gradients_leave_the_global_norm(data_dir, frozen_run):
  full, _, _ = _init_and_final(data_dir, steps=1)
  vision_only, _, _ = frozen_run("language")
  language_only, _, _ = frozen_run("vision,vision_projector")
  # Same init and first batch: the full norm is the root of the two modules' squared norms.
  np.testing.assert_allclose(
      full[0]["grad_norm"],
      np.hypot(vision_only[0]["grad_norm"], language_only[0]["grad_norm"]), rtol=1e-5)


@pytest.mark.parametrize("freeze,frozen", [
    ("vision,vision_projector", ["vit"]),
    ("language", ["language"]),
    ("vision,language", ["vit", "language"]),
])
def test_one_program_step_freezes_like_separate_calls(data_dir, frozen_run, freeze, frozen):
  """Colocated on one dp mesh every module runs as one program a microbatch (Stepper.fused): the
  frozen parts stay bitwise and the losses follow the layout that runs separate calls."""
  fused = {"vision": (0, 2, 1), "language": (0, 2, 1)}
  got, init, final = _init_and_final(data_dir, steps=3, topo=fused, freeze=freeze)
  want, _, _ = frozen_run(freeze)
  parts = {"vit": lambda p: _vit(p["vision"]), "language": lambda p: p["language"]}
  for name in frozen:
    assert _same(parts[name](init), parts[name](final)), name
  assert _changed(init["vision"]["projector"], final["vision"]["projector"]) == (
      "vision_projector" not in freeze)
  assert_close_trajectory(want, got, rtol=1e-4)



def test_a_run_says_what_trains_and_what_is_frozen():
  """`Plan.parameters`, the start-up line: the optimizer's groups counted, and each module's
  frozen leaves (a LoRA base, a group optim.freeze names) under its name."""
  import jax  # pylint: disable=import-outside-toplevel
  from mimo_jax import modules, optim, topology  # pylint: disable=import-outside-toplevel
  from mimo_jax.sharding import Plan  # pylint: disable=import-outside-toplevel
  from mimo_jax.words import amount  # pylint: disable=import-outside-toplevel
  from tests.configs import tiny  # pylint: disable=import-outside-toplevel
  cfg = tiny.get_config()
  cfg.optim.freeze = "language"  # the base; its adapters (language_lora) still train
  cfg.model.language.lora.rank = 4
  plan = Plan.build(cfg, topology.build(cfg).meshes, modules.build_modules(cfg))
  size = lambda tree: sum(a.size for a in jax.tree.leaves(tree))
  lang = plan["language"]
  frozen = size(optim.frozen(lang.canonical_params, lang.labels))
  adapters = size(optim.trained(lang.canonical_params, lang.labels))
  said = plan.parameters()
  assert said.startswith("trained: vision ") and f"language_lora {amount(adapters)}" in said
  assert said.endswith(f"; frozen: language {amount(frozen)}") and frozen > adapters > 0
  assert (amount(96), amount(20_480), amount(301_200_000), amount(1_104_000_000)) == (
      "96", "20.5 K", "301.2 M", "1.10 B")
