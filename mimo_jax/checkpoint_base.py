"""Where a LoRA run's frozen weights are saved: the base a run names when it starts
(`name_base`, called as `checkpoint.name_base`)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from mimo_jax.checkpoint_steps import Base, base_folder
from mimo_jax.config import Config

if TYPE_CHECKING:
  from mimo_jax.checkpoint import Checkpointer


def name_base(ckpt: "Checkpointer", cfg: Config, found: int | None, meta: dict, canonical,
              frozen: dict[str, set]) -> None:
  """Sets `ckpt.base` for a run with frozen weights beside LoRA adapters (`frozen`: module ->
  `params/<path>` of its frozen leaves; all empty: every save holds everything). A fresh start
  saves the weights it starts from once, as a step 0 of parameters only (as an import writes;
  `canonical()` gives the state to save); a resume keeps the base its step names (or the
  folder `checkpoint.base` says it moved to), or an import's step 0 it resumed from."""
  if not any(frozen.values()):
    return
  held = lambda fps: {n: {k: fps[n][k] for k in sorted(paths) if k in fps.get(n, {})}
                      for n, paths in frozen.items()}
  if found is None:
    ckpt.base = Base(".", 0, held(ckpt.save(0, canonical(), cfg, params_only=True)["fingerprints"]))
  elif meta.get("base"):
    b = meta["base"]
    path = b["path"]
    if ckpt.moved_base:
      folder = os.path.abspath(base_folder(ckpt.path, path, ckpt.moved_base))
      path = "." if folder == os.path.abspath(ckpt.path) else folder
    ckpt.base = Base(path, b["step"], b["fingerprints"])
  elif meta.get("params_only") and found == 0:
    ckpt.base = Base(".", 0, held(meta["fingerprints"]))
