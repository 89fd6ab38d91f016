"""LoRA adapters (models/lora.py): a fresh adapter is the base exactly, merging keeps the trained
model's outputs, only adapters (and trained groups) have optimizer state, and every layout gives
the single-device LoRA trajectory."""

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from mimo_jax import init_from, memory
from mimo_jax.config import ConfigError, ModuleTopology
from mimo_jax.data import loader
from mimo_jax.encoders.audio import AudioConfig
from mimo_jax.models import lora
from mimo_jax.modules import build_modules
from mimo_jax.step import Step
from mimo_jax.trees import paths
from mimo_jax.validation import validate
from tests.helpers import assert_close_trajectory, run_steps, tiny_config

STEPS = 4


def lora_config(data_dir, vision_lora: bool = False, **topo):
  cfg = tiny_config(data_dir, **(topo or {"vision": (0, 1, 1), "language": (0, 1, 1)}))
  cfg.model.language.lora.rank = 4
  cfg.model.language.lora.alpha = 8.0
  cfg.optim.lr = 3e-3  # adapters start at zero: a larger rate makes the steps differ visibly
  if vision_lora:
    cfg.model.vision.lora.rank = 2
  else:
    cfg.optim.freeze = "vision"
  return cfg


@pytest.fixture(scope="module")
def single(data_dir):
  """The single-device LoRA run: (metrics, step, final state, initial parameters)."""
  return run_steps(lora_config(data_dir), STEPS)


@pytest.fixture(scope="module")
def single_both(data_dir):
  return run_steps(lora_config(data_dir, vision_lora=True), STEPS)[0]


def test_fresh_adapters_leave_the_base_bitwise(data_dir):
  cfg = lora_config(data_dir)
  plain = tiny_config(data_dir, vision=(0, 1, 1), language=(0, 1, 1))
  with_a, without = build_modules(cfg)["language"], build_modules(plain)["language"]
  p_a, p_0 = with_a.init(0), without.init(0)
  flat_a, flat_0 = paths(p_a), paths(p_0)
  adapters = [k for k in flat_a if lora.is_adapter(k)]
  # Every attention and MLP projection of the blocks, two adapters each.
  assert len(adapters) == 2 * 7 and not (set(flat_a) - set(adapters)) ^ set(flat_0)
  for k, v in flat_0.items():
    np.testing.assert_array_equal(flat_a[k], v, err_msg=k)
  assert all(np.all(flat_a[k] == 0) for k in adapters if k.endswith("lora_b"))
  assert all(np.any(flat_a[k] != 0) for k in adapters if k.endswith("lora_a"))
  tokens = jnp.arange(12, dtype=jnp.int32).reshape(2, 6) % 10
  pos = jnp.broadcast_to(jnp.arange(6), (2, 6))
  run = lambda m, p: m.bind(p).logits(m.apply_blocks(p, m.bind(p).embed(tokens), pos))
  np.testing.assert_array_equal(run(with_a, p_a), run(without, p_0))


def test_fresh_adapters_leave_an_fp8_base_bitwise(data_dir):
  cfg, plain = lora_config(data_dir), tiny_config(data_dir, vision=(0, 1, 1), language=(0, 1, 1))
  for c in (cfg, plain):
    c.model.dtype, c.model.language.fp8 = "bfloat16", True
  with_a, without = build_modules(cfg)["language"], build_modules(plain)["language"]
  p_a, p_0 = with_a.init(0), without.init(0)
  tokens = jnp.arange(12, dtype=jnp.int32).reshape(2, 6) % 10
  pos = jnp.broadcast_to(jnp.arange(6), (2, 6))
  run = lambda m, p: m.bind(p).logits(m.apply_blocks(p, m.bind(p).embed(tokens), pos))
  np.testing.assert_array_equal(run(with_a, p_a), run(without, p_0))
  # A trained adapter changes the FP8 model's outputs (its term is added beside the FP8 matmul).
  moved = jax.tree_util.tree_map_with_path(
      lambda path, x: x + 0.05 if path[-1].key == "lora_b" else x, p_a)
  assert float(jnp.max(jnp.abs(run(with_a, moved) - run(without, p_0)))) > 1e-3


def test_training_moves_only_adapters_and_merge_keeps_outputs(data_dir, single):
  metrics, step, state, init = single
  assert metrics[-1]["loss"] < metrics[0]["loss"]
  trained = paths(jax.device_get(state["language"].params))
  before = paths(init["language"])
  for k, v in trained.items():
    if lora.is_adapter(k) and k.endswith("lora_b"):
      assert np.any(v != before[k]), k
    elif not lora.is_adapter(k):
      np.testing.assert_array_equal(v, before[k], err_msg=k)
  cfg = lora_config(data_dir)
  module = step.modules["language"]
  plain = build_modules(tiny_config(data_dir, vision=(0, 1, 1), language=(0, 1, 1)))["language"]
  params = jax.device_get(state["language"].params)
  merged = lora.merge(params, cfg.model.language.lora)
  tokens = jnp.arange(16, dtype=jnp.int32).reshape(2, 8) % 10
  pos = jnp.broadcast_to(jnp.arange(8), (2, 8))
  run = lambda m, p: m.bind(p).logits(m.apply_blocks(p, m.bind(p).embed(tokens), pos))
  got, want = run(plain, merged), run(module, params)
  base = run(plain, lora.merge(init["language"], cfg.model.language.lora))
  assert float(jnp.max(jnp.abs(want - base))) > 1e-4  # it trained
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def test_only_trained_parameters_have_optimizer_state(single):
  _, step, state, _ = single
  adapters = {k for k in paths(state["language"].params) if lora.is_adapter(k)}
  is_adam = lambda x: isinstance(x, optax.ScaleByAdamState)
  adam = [s for s in jax.tree.leaves(state["language"].opt_state, is_leaf=is_adam) if is_adam(s)]
  # Frozen leaves are optax.MaskedNode (no arrays): the moments held are the adapters' alone.
  for moments in [s.mu for s in adam] + [s.nu for s in adam]:
    assert set(paths(moments)) == adapters


def test_a_target_that_matches_nothing_is_an_error(data_dir):
  cfg = lora_config(data_dir)
  cfg.model.language.lora.targets = "attn/qkv$"
  with pytest.raises(ConfigError, match=r"model\.language\.lora\.targets.*attn/qkv"):
    build_modules(cfg)["language"].init(0)
  cfg.model.language.lora.targets = "attn/(q"
  with pytest.raises(ConfigError, match=r"model\.language\.lora\.targets.*not a regular"):
    build_modules(cfg)["language"].init(0)
  cfg.model.language.lora.rank = -1
  with pytest.raises(ConfigError, match=r"model\.language\.lora\.rank"):
    build_modules(cfg)


def test_settings_that_would_change_nothing_are_errors(data_dir):
  """Dropout without adapters, and adapters frozen where they start fresh (B = 0: frozen, they
  stay zero), are refused before anything is written; adapters read from a PEFT directory or a
  run may be frozen."""
  cfg = lora_config(data_dir)
  cfg.model.language.lora.rank, cfg.model.language.lora.dropout = 0, 0.1
  with pytest.raises(ConfigError, match=r"^config\.model\.language\.lora\.dropout: is 0\.1 but "
                     r"model\.language\.lora\.rank is 0 .*leave dropout at 0\.$"):
    validate(cfg)
  cfg = lora_config(data_dir)
  cfg.optim.freeze = "vision,language_lora"
  validate(cfg)  # which adapters a run reads is known where it starts
  with pytest.raises(ConfigError, match=r"^config\.optim\.freeze: names language_lora, whose "
                     r"adapters start fresh .*model\.language\.lora\.rank=0 for no adapters\.$"):
    init_from.params(cfg, {"vision": None, "language": None}, read=False)
  init_from.frozen_fresh(cfg, ["vision", "language"], sourced={"language"})  # read from a run
  cfg.model.language.lora.init_from = "/some/peft/adapter"
  init_from.frozen_fresh(cfg, ["vision", "language"], sourced=set())


def test_a_rank_above_the_narrowest_adapted_layer_is_an_error(data_dir):
  # The tiny language model: dim 64, 4 heads of 16, 2 key-value heads: k and v are 64 → 32.
  cfg = lora_config(data_dir)
  cfg.model.language.lora.rank = 32
  validate(cfg)
  cfg.model.language.lora.rank = 33
  with pytest.raises(ConfigError, match=r"^config\.model\.language\.lora\.rank: 33 is more than "
                     r"the adapted blocks/attn/k projection .*64 → 32.* at most 32\.$"):
    validate(cfg)
  cfg.model.language.lora.targets = r"mlp/(gate|up|down)$"  # the MLP alone: 64 → 128 → 64
  validate(cfg)


def test_the_rank_bound_is_each_built_layers_width(data_dir):
  """Validation works the widths out from config fields: each linear layer the modules build (a
  ViT's, a Whisper tower's with a linear projector, the language model's and its head) takes a
  rank up to its min(in, out), and not one more."""
  cfg = lora_config(data_dir, vision_lora=True)
  cfg.add_encoder("audio", AudioConfig(projector="linear"), ModuleTopology(0, 1, 1))
  cfg.model.audio.lora.rank = 2
  cfg.data.seq_len = 32  # room for a clip
  widths = {}
  for name, module in build_modules(cfg).items():
    model = nnx.eval_shape(lambda m=module: m.ctor(nnx.Rngs(0)))
    widths[name] = {"/".join(map(str, path)): min(layer.kernel.shape[-2:])
                    for path, layer in nnx.iter_graph(model) if isinstance(layer, nnx.Linear)}
  assert widths["language"]["head"] == 17 and widths["audio"]["projector"] == 32
  for name, layers in widths.items():
    section = cfg.model.module(name).lora
    kept = section.rank, section.targets
    for path, width in layers.items():
      section.targets, section.rank = f"^{re.escape(path)}$", width
      validate(cfg)
      section.rank = width + 1
      with pytest.raises(ConfigError, match=rf"model\.{name}\.lora\.rank: {width + 1} .*"
                         rf"{re.escape(path)} projection"):
        validate(cfg)
    section.rank, section.targets = kept


@pytest.fixture(scope="module")
def tp2(data_dir):
  cfg = lora_config(data_dir, vision=(0, 2, 1), language=(2, 2, 2))
  return cfg, run_steps(cfg, STEPS)


def test_tp2_matches_single_device(single, tp2):
  assert_close_trajectory(single[0], tp2[1][0], rtol=1e-4)


def _device_bytes(tree) -> int:
  """Bytes the first device holding `tree` holds of it (the arrays' own shards)."""
  shards = [s for a in jax.tree.leaves(tree) for s in a.addressable_shards]
  first = min(s.device.id for s in shards)
  return sum(s.data.nbytes for s in shards if s.device.id == first)


def test_adapters_split_with_their_base_and_bytes_match_the_memory_check(tp2):
  cfg, (_, step, state, _) = tp2
  params = paths(state["language"].params)
  spec = lambda k: tuple(params[k].sharding.spec)
  # Column-split q: B split on its output; row-split o: A split on its input.
  assert spec("blocks/attn/q/kernel")[-1] == "tp" and spec("blocks/attn/q/lora_b")[-1] == "tp"
  assert spec("blocks/attn/o/kernel")[-2] == "tp" and spec("blocks/attn/o/lora_a")[-2] == "tp"
  need = memory.module_bytes(cfg)["language"]
  assert _device_bytes(state["language"].params) == need["parameters"]
  assert _device_bytes(state["language"].opt_state) == need["optimizer state"]
  adapters = sum(math.prod(params[k].sharding.shard_shape(params[k].shape)) * 4
                 for k in params if lora.is_adapter(k))
  # Two Adam moments of the adapters, the schedule's counters aside: nothing for the base.
  assert 2 * adapters <= need["optimizer state"] < 2 * adapters + 1024


def test_memory_check_counts_the_adapters_activations(data_dir):
  """Each block keeps its adapters' own activations (x·A: their ranks added up, a token) unless
  remat=full, on the language model and on a tower with adapters."""
  cfg = lora_config(data_dir, vision_lora=True)
  plain = lora_config(data_dir, vision_lora=True)
  plain.model.language.lora.rank = plain.model.vision.lora.rank = 0
  with_adapters, without = memory.module_bytes(cfg), memory.module_bytes(plain)
  d, width = cfg.data, 4  # float32
  lm, v = cfg.model.language, cfg.model.vision
  tokens = d.micro_batch * d.seq_len
  assert (with_adapters["language"]["activations"] - without["language"]["activations"] ==
          tokens * lm.layers * 7 * lm.lora.rank * width)  # q, k, v, o, gate, up, down
  vision_extra = (with_adapters["vision"]["activations"] -
                  without["vision"]["activations"])
  assert vision_extra > 0 and vision_extra % (v.layers * v.lora.rank * width) == 0
  cfg.topology.language.remat = "full"
  plain.topology.language.remat = "full"
  assert (memory.module_bytes(cfg)["language"]["activations"] ==
          memory.module_bytes(plain)["language"]["activations"])


def test_layout_matches_single_device(data_dir, single):
  """Language dp4 beside a frozen vision tower on dp2 (split programs). Adapters in two pipeline
  stages, GPipe and 1F1B: tests/test_lora_dropout.py's layouts, whose adapters also drop."""
  got = run_steps(lora_config(data_dir, vision=(0, 2, 1), language=(2, 4, 1)), STEPS)[0]
  assert_close_trajectory(single[0], got, rtol=1e-4)


def test_fsdp_base_matches_single_device(data_dir, single):
  cfg = lora_config(data_dir, vision=(0, 2, 1), language=(2, 4, 1))
  cfg.topology.language.shard = "full"
  assert_close_trajectory(single[0], run_steps(cfg, STEPS)[0], rtol=1e-4)


def test_tower_and_language_colocated_match_single_device(data_dir, single_both):
  """Adapters on the tower and the language model, colocated on dp4 (the fused program), with the
  optimizer state sharded over dp (ZeRO-1) and the language model's matmul outputs kept (remat
  dots)."""
  cfg = lora_config(data_dir, vision_lora=True, vision=(0, 4, 1), language=(0, 4, 1))
  cfg.topology.vision.shard = cfg.topology.language.shard = "optimizer"
  cfg.topology.language.remat = "dots"
  assert_close_trajectory(single_both, run_steps(cfg, STEPS)[0], rtol=1e-4)


def test_benchmark_flop_count_has_the_config_model_sizes():
  # tools/hf_lora_bench.py counts the FLOPs of configs/vlm.py:llm8b_lora from its sizes: the
  # parameters it counts are the model's own (language, adapters, projector, tower).
  from configs import vlm  # pylint: disable=import-outside-toplevel
  from tools import hf_lora_bench  # pylint: disable=import-outside-toplevel
  cfg = vlm.get_config("llm8b_lora")
  built = build_modules(cfg)
  s, rank = hf_lora_bench.Sizes(), cfg.model.language.lora.rank
  lm = paths(built["language"].abstract_params())
  vit = paths(built["vision"].abstract_params())
  count = lambda tree, keep: sum(math.prod(a.shape) for k, a in tree.items() if keep(k))
  adapters = count(lm, lora.is_adapter)
  matmuls = count(lm, lambda k: k.endswith("kernel"))
  projector = count(vit, lambda k: k.startswith("projector/") and k.endswith("kernel"))
  tower = count(vit, lambda k: k.startswith("blocks/") and k.endswith("kernel"))
  got = hf_lora_bench.needed_flops(s, rank, samples=1)
  assert got["adapters"] == s.seq * 6 * adapters
  assert got["projector"] == s.image_tokens * 6 * projector
  attention_lm = 2 * 2 * s.layers * s.seq * s.dim * 3 // 2
  assert got["language"] == s.seq * (4 * matmuls + attention_lm)
  attention_vit = 4 * s.vit_layers * s.image_tokens * s.vit_dim
  assert got["tower"] == s.image_tokens * (2 * tower + attention_vit)


def test_the_step_computes_no_gradient_of_the_frozen_base(data_dir):
  # The LoRA step adds the adapters' matmuls but skips the base kernels' weight gradients: fewer
  # FLOPs than training every weight, where adapters alone would make it more.
  flops = {}
  for rank in (0, 4):
    cfg = lora_config(data_dir, vision=(0, 1, 1), language=(1, 1, 1))  # split: language_step
    cfg.model.language.lora.rank = rank
    step = Step.build(cfg)
    state = step.init_state(0)
    batch = loader.train_dataset(cfg, loader.build_paths(cfg)["train"], step.ctx.groups)[0]
    program, seen = step.programs.language_step, []

    def capture(*args, program=program, seen=seen):
      seen.append(program.lower(*args).compile().cost_analysis()["flops"])
      return program(*args)
    step.programs = dataclasses.replace(step.programs, language_step=capture)
    step.train_step(state, batch)
    flops[rank] = seen[0]
  assert flops[4] < flops[0]
