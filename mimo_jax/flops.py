"""Model FLOPs of a training step, for MFU.

Per token, a forward and backward pass costs 6·N FLOPs for the N parameters of the matmuls it goes
through, plus attention: QKᵀ and AV cost 4·s·d FLOPs a token and layer forward for s keys, so
12·layers·s·d for forward and backward (PaLM, arXiv 2204.02311, appendix B). The language model's
attention is causal, so a token sees (s + 1) / 2 keys on average; the ViT's is bidirectional.
N excludes the embedding table (a gather, not a matmul) and includes the output head.

Counted are useful tokens only: the text tokens of real samples (padding excluded) and the patches
of real images (empty image slots excluded); with images of several sizes packed into a slot, the
ViT's attention counts each image's patches against its own only.
MFU = FLOPs / step time / (GPUs · peak).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from mimo_jax.config import Config

H100_H200_BF16_PEAK = 989e12  # dense bf16 FLOP/s of one H100 / H200 SXM


def _kernel_params(params, prefix: str = "") -> int:
  """Parameters of matmul kernels under `prefix` (every `kernel` leaf)."""
  total = 0
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    key = jax.tree_util.keystr(path, simple=True, separator="/")
    if key.endswith("kernel") and key.startswith(prefix):
      total += int(np.prod(leaf.shape))
  return total


@dataclasses.dataclass(frozen=True)
class FlopModel:
  vision_patch_params: int  # matmul parameters a patch goes through (embedding, blocks)
  projector_params: int  # matmul parameters an image token goes through after the pixel shuffle
  language_params: int  # matmul parameters a text position goes through (blocks, head)
  cfg: Config

  @classmethod
  def build(cls, cfg: Config, abstract_params: dict) -> "FlopModel":
    v = abstract_params["vision"]
    projector = _kernel_params(v, "projector")
    return cls(_kernel_params(v) - projector, projector,
               _kernel_params(abstract_params["language"]), cfg)

  def vision(self, patches: int, patches_sq: int) -> float:
    """Images of `patches` patches in all, whose squared patch counts sum to `patches_sq` (each
    image attends within itself)."""
    v = self.cfg.model.vision
    dense = 6 * (self.vision_patch_params * patches +
                 self.projector_params * patches / v.downsample**2)
    return float(dense + 12 * v.layers * v.dim * patches_sq)

  def language_per_row(self, tokens: int) -> float:
    """A sample of `tokens` positions (its own segment when packed), attending causally."""
    lm = self.cfg.model.language
    return float(6 * self.language_params * tokens + 12 * lm.layers * lm.dim * tokens *
                 (tokens + 1) / 2)

  def step(self, batch: dict[str, np.ndarray]) -> dict[str, float]:
    """Model FLOPs of one step's batch (arrays with a leading microbatch axis)."""
    # Per sample (its own segment when packed), counted for every sample of the step, including
    # those whose records other processes read.
    language = sum(self.language_per_row(int(n)) for n in np.ravel(batch["tokens_b"]) if n)
    vision = self.vision(int(np.sum(batch["patches"])), int(np.sum(batch["patches_sq"])))
    return {"vision": vision, "language": language, "total": vision + language}
