"""The run's modules, built from its config: each encoder's (its plug-in's `module`) and the
language model's, in dispatch order (models/mimo.Module: how to build one, its parameter groups).
"""

import jax.numpy as jnp

from mimo_jax import encoders
from mimo_jax.config import LANGUAGE, Config, lora_of, require, row_segments
from mimo_jax.config_run import DIGITS_VOCAB
from mimo_jax.models import lora
from mimo_jax.models.llm import DecoderBlock, LanguageModel
from mimo_jax.models.mimo import Module, attention_implementation


def build_modules(cfg: Config) -> dict[str, Module]:
  """Encoders first (encoders.of), `language` last; the order is the dispatch order of the step."""
  dtype = jnp.dtype(cfg.model.dtype)
  vocab = cfg.model.language.vocab_size or DIGITS_VOCAB  # 0: the digits task's tokenizer
  lm, att = cfg.model.language, attention_implementation(cfg)
  # Runs of equal segment ids a packed language row can hold (packed attention is sized by
  # them): a row's samples and its padding.
  ls = row_segments(cfg)
  out = {n: e.module(cfg) for n, e in encoders.of(cfg).items()}
  for n, e in encoders.of(cfg).items():
    rate = lora_of(cfg, n).dropout if lora_of(cfg, n) else 0
    # Masks are drawn per item row (models/lora.py), which the encoder's slots must name.
    require(not rate or e.dropout_rows(cfg) is not None, f"model.{n}.lora.dropout",
            f"{rate}: the {n} encoder's slots here (e.g. several items packed a slot) do not "
            f"name an item's rows the same way on every layout; set it to 0.")
  out[LANGUAGE] = Module(LANGUAGE, lambda rngs: LanguageModel(rngs, lm, vocab, dtype, att, ls),
                         lambda rngs: DecoderBlock(rngs, lm, dtype, att, ls), seed_salt=2)
  # Any module whose config has a `lora` section with rank > 0 gets adapters.
  return {n: lora.adapted(m, cfg, n) for n, m in out.items()}
