"""A module's LoRA adapters in its config: the rank against the layers its targets adapt, and
a PEFT adapter directory to start them from (validation.py calls `validate_adapters`)."""

import os
import re

from mimo_jax import hf
from mimo_jax.config import LANGUAGE, Config, ConfigError, lora_of, require
from mimo_jax.config_run import DIGITS_VOCAB
from mimo_jax.models.lora import patterns
from mimo_jax.models.vit import ViTConfig
from mimo_jax.models.whisper import WhisperConfig


def validate_adapters(cfg: Config, name: str) -> None:
  lora = getattr(cfg.model.module(name), "lora", None)
  if lora is not None:  # launch's check (a tool reading a run sets the rate to 0: it never drops)
    require(lora.rank > 0 or not lora.dropout, f"model.{name}.lora.dropout",
            f"is {lora.dropout} but model.{name}.lora.rank is 0 (no adapters, nothing to drop "
            "out for); set a rank, or leave dropout at 0.")
  _lora_rank(cfg, name)
  _adapter_source(cfg, name)


def _adapter_source(cfg: Config, name: str) -> None:
  """model.<name>.lora.init_from: a PEFT adapter directory, for a module with adapters (whether
  the adapter fits the module is hf/peft.read's check, when it is read)."""
  lora = getattr(cfg.model.module(name), "lora", None)
  if lora is None or not lora.init_from:
    return
  field = f"model.{name}.lora.init_from"
  require(lora.rank > 0, field, f"names a PEFT adapter but model.{name}.lora.rank is 0; set the "
          "rank (and alpha) to the adapter's r (and lora_alpha).")
  # hf/peft imports JAX, which launch configures after validation: imported here.
  from mimo_jax.hf import peft  # pylint: disable=import-outside-toplevel
  together = tuple(sorted((n for n in cfg.topology.modules()
                           if getattr(getattr(cfg.model.module(n), "lora", None), "init_from", "")
                           == lora.init_from), key=lambda n: (n == LANGUAGE, n)))
  try:
    peft.peft_names(together)
  except hf.HFError as e:
    raise ConfigError(f"config.{field}: {e}") from None
  missing = [f for f in (peft.CONFIG, peft.WEIGHTS)
             if not os.path.isfile(os.path.join(lora.init_from, f))]
  require(not missing, field, f"{lora.init_from} is not a PEFT adapter directory: it has no "
          f"{' or '.join(missing)}; name the folder PEFT's save_pretrained (or tools.hf export "
          "--peft) wrote.")


def _linears(cfg: Config, name: str) -> dict[str, tuple[int, int]]:
  """(in, out) of module `name`'s linear layers by the paths `lora.targets` matches, as the
  models build them (llm.py, vit.py, whisper.py); {} for a module of another kind."""
  section, lm = cfg.model.module(name), cfg.model.language

  def block(dim: int, heads: int, kv_heads: int, hidden: int, mlp: tuple[str, ...]) -> dict:
    inner, kv = dim // heads * heads, dim // heads * kv_heads  # layers.Attention's head_dim
    out = {"blocks/attn/q": (dim, inner), "blocks/attn/k": (dim, kv),
           "blocks/attn/v": (dim, kv), "blocks/attn/o": (inner, dim)}
    out.update({f"blocks/mlp/{m}": (hidden, dim) if m == "down" else (dim, hidden) for m in mlp})
    return out

  def projector(d_in: int) -> dict:
    if getattr(section, "projector", "mlp") == "linear":
      return {"projector": (d_in, lm.dim)}
    return {"projector/up": (d_in, section.projector_hidden),
            "projector/down": (section.projector_hidden, lm.dim)}

  if name == LANGUAGE:
    head = {} if lm.tie_embeddings else {"head": (lm.dim, lm.vocab_size or DIGITS_VOCAB)}
    return {**block(lm.dim, lm.heads, lm.kv_heads, lm.mlp_dim, ("gate", "up", "down")), **head}
  if isinstance(section, ViTConfig):
    v = section
    return {"embed": (v.patch_size**2 * v.channels, v.dim),
            **block(v.dim, v.heads, v.heads, v.mlp_dim, ("up", "down")),
            **projector(v.dim * v.downsample**2)}  # pixel shuffle: downsample² patches a token
  if isinstance(section, WhisperConfig):
    a = section
    return {**block(a.dim, a.heads, a.heads, a.mlp_dim, ("up", "down")), **projector(a.dim)}
  return {}


def _lora_rank(cfg: Config, name: str) -> None:
  """model.<name>.lora.rank at most the smallest width, min(in, out), of the layers its targets
  adapt: an update A·B of a layer has no higher rank, so a larger one only adds parameters (a
  typo, or the wrong module)."""
  lora = lora_of(cfg, name)
  if lora is None:
    return
  pats = patterns(lora, f"model.{name}.lora")
  adapted = {path: io for path, io in _linears(cfg, name).items()
             if any(re.search(p, path) for p in pats)}
  if not adapted:  # models/lora.attach names a pattern that matches no layer
    return
  path, (d_in, d_out) = min(adapted.items(), key=lambda kv: min(kv[1]))
  width = min(d_in, d_out)
  require(lora.rank <= width, f"model.{name}.lora.rank",
          f"{lora.rank} is more than the adapted {path} projection can use (it is {d_in} → "
          f"{d_out}: an update A·B of it has rank at most {width}, and a larger rank only adds "
          f"parameters); set a rank of at most {width}.")
