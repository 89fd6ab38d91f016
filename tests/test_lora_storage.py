"""How a LoRA run stores its frozen base, read off the arrays: in the compute dtype, with no
optimizer state, no gradient accumulator and no weight gradient made in the step, and a device's
bytes of each equal to the memory check's."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from mimo_jax import memory, programs
from mimo_jax.data import loader
from mimo_jax.models import lora
from mimo_jax.step import Step
from mimo_jax.trees import paths
from tests.test_lora import lora_config


def _device_bytes(tree) -> int:
  """Bytes the first device holding `tree` holds of it (the arrays' own shards)."""
  shards = [s for a in jax.tree.leaves(tree) for s in a.addressable_shards]
  first = min(s.device.id for s in shards)
  return sum(s.data.nbytes for s in shards if s.device.id == first)


def _outputs(jaxpr):
  """(primitive name, output aval) of every equation of `jaxpr` and of the jaxprs inside it."""
  for eqn in jaxpr.eqns:
    for v in eqn.outvars:
      yield eqn.primitive.name, v.aval
    for p in eqn.params.values():
      for sub in (p if isinstance(p, (list, tuple)) else [p]):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          yield from _outputs(inner)


@pytest.fixture(scope="module")
def bf16_step(data_dir):
  """One bfloat16 step of a LoRA language model on dp2 (gradients kept per rank) beside a frozen
  tower: (config, step, state after it, the language step's arguments)."""
  cfg = lora_config(data_dir, vision=(0, 1, 1), language=(1, 2, 1))
  cfg.model.dtype = "bfloat16"
  step = Step.build(cfg)
  state = step.init_state(0)
  batch = loader.train_dataset(cfg, loader.build_paths(cfg)["train"], step.ctx.groups)[0]
  program, args = step.programs.language_step, []

  def capture(*a):
    args.append(a)
    return program(*a)
  step.programs = dataclasses.replace(step.programs, language_step=capture)
  state, _ = step.train_step(state, batch)
  return cfg, step, state, args[0]


def test_frozen_base_is_stored_in_the_compute_dtype(bf16_step):
  _, step, state, _ = bf16_step
  for name in ("language", "vision"):
    labels = paths(step.plan[name].labels)
    for k, a in paths(state[name].params).items():
      want = jnp.bfloat16 if labels[k] == "frozen" else jnp.float32
      assert a.dtype == want, (name, k, a.dtype)
  lang = paths(state["language"].params)
  assert {k for k in lang if paths(step.plan["language"].labels)[k] != "frozen"} == \
      {k for k in lang if lora.is_adapter(k)}
  # The projector trains beside the frozen tower, in float32.
  assert any(k.startswith("projector/") and a.dtype == jnp.float32
             for k, a in paths(state["vision"].params).items())


def test_frozen_base_has_no_optimizer_state_or_gradient_buffers(bf16_step):
  cfg, step, state, args = bf16_step
  params = state["language"].params
  adapters = {k for k in paths(params) if lora.is_adapter(k)}
  is_adam = lambda x: isinstance(x, optax.ScaleByAdamState)
  adam = [s for s in jax.tree.leaves(state["language"].opt_state, is_leaf=is_adam) if is_adam(s)]
  assert adam and all(set(paths(m)) == adapters for s in adam for m in (s.mu, s.nu))
  acc = step.programs.language_accumulator({"language": params})["grads"]["language"]
  assert set(paths(acc)) == adapters
  # Nothing in the step's program makes an array of a frozen kernel's shape from a matmul (its
  # weight gradient) or holds one in float32 (a master copy, or zeros of its gradient).
  frozen = [a for k, a in paths(params).items() if a.ndim >= 2 and not lora.is_adapter(k)]
  shapes = {a.shape for a in frozen} | {a.shape[1:] for a in frozen if a.ndim == 3}
  jaxpr = jax.make_jaxpr(lambda *a: programs.language_step(step.ctx, *a))(*args).jaxpr
  seen = [(prim, a.shape, a.dtype) for prim, a in _outputs(jaxpr)
          if getattr(a, "shape", None) in shapes]
  assert any(prim == "dot_general" for prim, _ in _outputs(jaxpr))  # the walk reaches them
  assert seen  # the kernels themselves, as the layers slice and read them (bfloat16)
  found = [x for x in seen if x[0] == "dot_general" or x[2] == jnp.float32]
  assert not found, found[:5]
  # The tower's accumulator holds its projector's gradients alone.
  tower = step.programs.zeros["vision"](state["vision"].params)
  assert jax.tree.leaves(tower) and all(k.startswith("projector/") for k in paths(tower))
  # The memory check counts what the arrays hold on a device.
  need = memory.module_bytes(cfg)
  for name in ("language", "vision"):
    assert _device_bytes(state[name].params) == need[name]["parameters"], name
    assert _device_bytes(state[name].opt_state) == need[name]["optimizer state"], name
  summed = step.programs.reduce["language"](acc)
  assert _device_bytes(acc) + _device_bytes(summed) == need["language"]["gradients"]
  assert _device_bytes(tower) == need["vision"]["gradients"]


def test_a_float32_run_stores_float32(data_dir):
  cfg = lora_config(data_dir)
  plan = Step.build(cfg).plan
  assert all(a.dtype == np.float32 for a in jax.tree.leaves(plan["language"].abstract_params))
