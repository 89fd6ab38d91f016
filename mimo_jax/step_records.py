"""What the training loop reads back of a step: its metrics record, the batch figures it logs,
and the errors that end a run (a non-finite step, a broken bridge)."""

import numpy as np

from mimo_jax import distributed, encoders
from mimo_jax.batch import Batch, total
from mimo_jax.config import Config


class BridgeMismatchError(RuntimeError):
  """Image tokens reached the text of a different sample."""


class NonFiniteStepError(FloatingPointError):
  """A step's loss or gradient norm is NaN or Inf: its state is never saved."""


def not_saved(step: int, values: str, saved: int, path: str, lr: float) -> NonFiniteStepError:
  """The error of a step that is not finite (`values`, as `finite` says them), which is not
  saved: the newest checkpoint `saved` (0: none) of `path` is where a lower lr resumes."""
  if saved:
    return NonFiniteStepError(
        f"step {step} is not finite ({values}); it was not saved. The newest checkpoint is step "
        f"{saved} ({path}); lower optim.lr (now {lr}) and run again to resume from it.")
  return NonFiniteStepError(f"step {step} is not finite ({values}); nothing was saved; lower "
                            f"optim.lr (now {lr}) and run again.")


def finite(metrics: dict) -> tuple[bool, str]:
  """Whether a step's loss and global gradient norm are finite (fetched), and what they are."""
  m = distributed.fetch({"loss": metrics["loss"], "grad_norm": metrics["grad_norm"]})
  loss, norm = float(m["loss"]), float(m["grad_norm"])
  return np.isfinite(loss) and np.isfinite(norm), f"loss {loss:.4g}, grad norm {norm:.4g}"


def record(step: int, metrics: dict, info: dict, step_time: float, lr: float) -> dict:
  m = distributed.fetch(metrics)
  if int(m["mismatches"]):
    raise BridgeMismatchError(
        f"step {step}: {int(m['mismatches'])} image placeholders received tokens of another "
        "sample; the bridge or the slot layout is broken.")
  return {"step": step, "loss": float(m["loss"]), "grad_norm": float(m["grad_norm"]), "lr": lr,
          "tokens_per_s": info["tokens"] / step_time, "step_time_s": step_time,
          "target_tokens": info["target_tokens"], **info["items"],
          "cost_spread": info["cost_spread"], "cost_spread_in_order": info["cost_spread_in_order"],
          "loader_wait_s": info["loader_wait_s"], "records_read": info["records_read"],
          **({"compile_padded": info["compile_padded"]} if "compile_padded" in info else {})}


def batch_info(batch: Batch, cfg: Config) -> dict:
  """What a record logs of its step's batch; each encoder's items under its sample key (e.g.
  `images`)."""
  return {"tokens": total(batch, lambda s: s.tokens),
          "target_tokens": total(batch, lambda s: s.target_tokens),
          "items": {e.sample_key: total(batch, lambda s, n=n: s.items.get(n, 0))
                    for n, e in encoders.of(cfg).items()},
          "records_read": total(batch, lambda s: s.records_read),
          "cost_spread": float(batch.stats.cost_spread.mean()),
          "cost_spread_in_order": float(batch.stats.cost_spread_in_order.mean())}
