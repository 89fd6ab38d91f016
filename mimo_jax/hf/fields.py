"""config.json -> our config fields (model.language here, an encoder's through its mapping), and
the fields of a config that contradict a directory."""

from __future__ import annotations

from mimo_jax.config import LANGUAGE
from mimo_jax.hf import mapping
from mimo_jax.hf.source import LANGUAGE_TYPES, REQUIRED, HFError, Source, field


def config_section(src: Source, name: str) -> tuple[dict, str]:
  """Section `name` of a combined checkpoint's config.json (text_config, or an encoder's) and its
  name, or a lone model's whole config and ""."""
  if not src.combined:
    return src.config, ""
  return field(src.config, name, str(src.path / "config.json"), dict, {}), name


def text_config(src: Source) -> dict:
  return config_section(src, "text_config")[0]


def reader(src: Source, name: str):
  """get(key, kind, default, nullable): a field of `src`'s section `name`, checked (`field`)."""
  c, section = config_section(src, name)
  where = str(src.path / "config.json")
  return lambda key, kind, default=REQUIRED, nullable=False: field(c, key, where, kind, default,
                                                                    section, nullable)


def language_fields(src: Source) -> dict:
  """model.language fields from config.json (a language model, or a combined checkpoint's
  text_config)."""
  c, section = config_section(src, "text_config")
  where, get = str(src.path / "config.json"), reader(src, "text_config")
  kind = get("model_type", str, "llama")
  if kind not in LANGUAGE_TYPES:
    raise HFError(f"{where}: language model_type {kind!r} is not supported; supported: "
                  f"{', '.join(LANGUAGE_TYPES)}.")
  dim, heads = get("hidden_size", int), get("num_attention_heads", int)
  # transformers reads null as the default for these: head_dim, kv heads, biases, RoPE scaling.
  head_dim = get("head_dim", int, None, nullable=True)
  if head_dim not in (None, dim // heads):
    raise HFError(f"{where}: head_dim {head_dim} differs from hidden_size / "
                  f"num_attention_heads = {dim // heads}, which is the only layout supported.")
  for flag in ("mlp_bias",) + (("attention_bias",) if kind == "llama" else ()):
    if get(flag, bool, False, nullable=True):
      raise HFError(f"{where}: {flag}=true is not supported (Llama without biases; Qwen2's q, "
                    "k, v biases).")
  if get("hidden_act", str, "silu") != "silu":
    raise HFError(f"{where}: hidden_act {c['hidden_act']!r} is not supported (silu).")
  if kind == "qwen2" and get("use_sliding_window", bool, False, nullable=True):
    raise HFError(f"{where}: use_sliding_window=true is not supported.")
  rope, origin, last = {}, {}, "rope_scaling"  # RoPE fields, the section of each, the last one
  for name in ("rope_parameters", "rope_scaling"):  # the latter: transformers 4.x names
    r = get(name, dict, {}, nullable=True)
    rope.update(r)
    origin.update({k: name for k in r})
    last = name if r else last
  rope_get = lambda key, kind, default=REQUIRED: field(
      rope, key, where, kind, default, ".".join(filter(None, (section, origin.get(key, last)))))
  theta = get("rope_theta", float) if "rope_theta" in c else rope_get("rope_theta", float, 10000.0)
  rope_type = rope_get("rope_type", str, None) or rope_get("type", str, "default")
  fields = dict(dim=dim, layers=get("num_hidden_layers", int), heads=heads,
                kv_heads=get("num_key_value_heads", int, heads, nullable=True),
                mlp_dim=get("intermediate_size", int), rope_theta=theta,
                vocab_size=get("vocab_size", int), norm_eps=get("rms_norm_eps", float, 1e-6),
                qkv_bias=kind == "qwen2",
                tie_embeddings=get("tie_word_embeddings", bool, field(
                    src.config, "tie_word_embeddings", where, bool, False)))
  if rope_type == "llama3":
    fields.update(rope_scaling="llama3", rope_factor=rope_get("factor", float),
                  rope_low_freq_factor=rope_get("low_freq_factor", float),
                  rope_high_freq_factor=rope_get("high_freq_factor", float),
                  rope_original_positions=rope_get("original_max_position_embeddings", int))
  elif rope_type != "default":
    raise HFError(f"{where}: RoPE type {rope_type!r} is not supported (default, llama3).")
  return fields


def fields(src: Source, module: str) -> dict:
  """model.<module> fields from the directory."""
  if module == LANGUAGE:
    return language_fields(src)
  return mapping.get(module).fields(src)


def configure(cfg, src: Source) -> None:
  """Sets the fields of every module the directory holds in `cfg`."""
  for module in src.modules:
    for k, v in fields(src, module).items():
      setattr(cfg.model.module(module), k, v)


def check_fields(src: Source, module: str, fields: dict, section) -> list[str]:
  """The fields of config section `section` (model.<module>) that contradict `fields`."""
  agrees = (lambda src, k, ours, theirs: ours == theirs) if module == LANGUAGE else (
      mapping.get(module).agrees)
  return [f"model.{module}.{k}={getattr(section, k)!r} (the checkpoint has {v!r})"
          for k, v in fields.items() if not agrees(src, k, getattr(section, k), v)]
