"""Model FLOPs of a training step, for MFU.

Per token, a forward and backward pass costs 6·N FLOPs for the N parameters of the matmuls it goes
through, plus attention: QKᵀ and AV cost 4·s·d FLOPs a token and layer forward for s keys, so
12·layers·s·d for forward and backward (PaLM, arXiv 2204.02311, appendix B). The language model's
attention is causal, so a token sees (s + 1) / 2 keys on average. N excludes the embedding table (a
gather, not a matmul) and includes the output head. Each encoder counts its own FLOPs
(`Encoder.flops`, from the work its slot layout counts: e.g. an image tower's patches, each
image's attending within itself).

Counted are useful tokens only: the text tokens of real samples (padding excluded) and the items
of real samples (empty slots excluded).
MFU = FLOPs / step time / (GPUs · peak).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from mimo_jax import encoders
from mimo_jax.batch import Batch
from mimo_jax.config import Config
from mimo_jax.trees import kernel_params

H100_H200_BF16_PEAK = 989e12  # dense bf16 FLOP/s of one H100 / H200 SXM


@dataclasses.dataclass(frozen=True)
class FlopModel:
  """Model FLOPs of a step: each encoder's from its plug-in (encoders/*.py), the language
  model's here."""
  params: dict  # abstract parameters by module
  language_params: int  # matmul parameters a text position goes through (blocks, head)
  cfg: Config

  @classmethod
  def build(cls, cfg: Config, abstract_params: dict) -> "FlopModel":
    return cls(abstract_params, kernel_params(abstract_params["language"]), cfg)

  def encoder(self, name: str, work: dict[str, int]) -> float:
    """Encoder `name` on items whose FLOP-model counts are `work` (e.g. patches)."""
    return encoders.get(name).flops(self.cfg, self.params[name], work)

  def language_per_row(self, tokens: int) -> float:
    """A sample of `tokens` positions (its own segment when packed), attending causally."""
    lm = self.cfg.model.language
    return float(6 * self.language_params * tokens + 12 * lm.layers * lm.dim * tokens *
                 (tokens + 1) / 2)

  def step(self, batch: Batch) -> dict[str, float]:
    """Model FLOPs of a batch (a step's, or one microbatch): per module and in total."""
    # Per sample (its own segment when packed), counted for every sample of the step, including
    # those whose records other processes read.
    out = {"language": sum(self.language_per_row(int(n))
                           for n in np.ravel(batch.samples.tokens_b) if n)}
    for name, work in batch.stats.work.items():
      out[name] = self.encoder(name, {k: int(np.sum(v)) for k, v in work.items()})
    out["total"] = sum(out.values())
    return out
