"""tools.plan's cost model (its docstring's **Profiles** and **Prediction**): module costs from
profile rows, a candidate's predicted step time, and the least step time any split could take."""

from __future__ import annotations

import numpy as np

from mimo_jax import encoders
from mimo_jax.config import Config
from mimo_jax.encoders.vision import slot_tokens
from tools.common import fail, load_config

MODULES = ("vision", "language")


def layout_config(cfg_spec: str, sets: list[str], layout: str = "") -> Config:
  """The config of `cfg_spec` with `sets` (`a.b=v` overrides) and `layout` (`config.set_layout`'s
  form, e.g. vision=0/2/1,language=2/2/1) applied; a bad one is one line and exit status 2
  (tools.common.load_config)."""
  return load_config("plan", cfg_spec, sets, layout, check=False)


def shape(cfg, module: str) -> tuple[int, int]:
  t = getattr(cfg.topology, module)
  return t.dp, t.tp


def _interp(points: dict[int, float], x: int) -> tuple[float, str]:
  """Linear in x between the nearest given points (the nearest one beyond them)."""
  xs = sorted(points)
  if x in points:
    return points[x], "profiled"
  note = "interpolated" if xs[0] < x < xs[-1] else f"from dp{xs[0] if x < xs[0] else xs[-1]}"
  return float(np.interp(x, xs, [points[k] for k in xs])), note


class Costs:
  """From profile rows: GPU-seconds per computed token of each module at each profiled (dp, tp),
  and for each GPU count g with a colocated dp-only profile the factor f_g = its step time / the
  sum of its modules' busy times."""

  def __init__(self, rows: list[dict], cfg_spec: str, sets: list[str], work_of):
    table: dict[tuple[str, int, int], list[float]] = {}
    factors: dict[int, list[float]] = {}
    for r in rows:
      cfg = layout_config(cfg_spec, sets, r["layout"])
      if any(getattr(cfg.topology, m).pp > 1 for m in MODULES):
        continue  # costs are of unpipelined modules; a pipeline's come from them (stretch)
      w = work_of(cfg)
      for m in MODULES:
        dp, tp = shape(cfg, m)
        if r.get(f"busy_{m}_s") and w[m]:
          table.setdefault((m, dp, tp), []).append(r[f"busy_{m}_s"] * dp * tp / w[m])
      if _colocated_dp_only(cfg):
        busy = r.get("busy_vision_s", 0) + r.get("busy_language_s", 0)
        if busy:
          factors.setdefault(cfg.topology.vision.dp, []).append(r["step_s"] / busy)
    if not table:
      fail("plan", "no profile row has busy times (busy_<module>_s); make the profile with "
           "python -m tools.bench --json=FILE.")
    self.table = {k: float(np.mean(v)) for k, v in table.items()}
    self.factors = {g: float(np.mean(v)) for g, v in factors.items()}

  def __call__(self, module: str, dp: int, tp: int) -> tuple[float, str]:
    """The cost at (dp, tp), and where it came from."""
    same = {d: c for (m, d, t), c in self.table.items() if m == module and t == tp}
    if same:
      return _interp(same, dp)
    same = {d: c for (m, d, t), c in self.table.items() if m == module and t == 1}
    if not same:
      fail("plan", f"no profile of {module} at tp 1 or {tp}; add a profile of the layouts "
           "--profile_layouts prints (python -m tools.bench --json=FILE).")
    return _interp(same, dp * tp)[0], f"as dp{dp * tp}"  # tp GPUs counted as dp ones

  def factor(self, gpus: int) -> float:
    """f_g on `gpus` GPUs (interpolated), 1 without a colocated dp-only profile."""
    return _interp(self.factors, gpus)[0] if self.factors else 1.0


def _colocated_dp_only(cfg) -> bool:
  v, l = cfg.topology.vision, cfg.topology.language
  return (v.offset, v.dp, v.tp, v.pp) == (l.offset, l.dp, l.tp, l.pp) and v.tp == v.pp == 1


def bridge_bytes(cfg) -> float:
  """Bytes through the bridge for one microbatch: image tokens forward, their gradients back."""
  itemsize = 2 if cfg.model.dtype == "bfloat16" else 4
  slots = encoders.get("vision").slots(cfg)
  return 2.0 * slots * slot_tokens(cfg) * cfg.model.language.dim * itemsize


def module_time(busy_s: float, pipeline: dict) -> float:
  """A module's step time from its unpipelined time on the same GPUs, stretched by its schedule's
  FLOPs and bubble (`stretch`)."""
  return busy_s * pipeline["compute"] / (1 - pipeline["bubble"])


def predict(c: dict, t_v: float, t_l: float, microbatches: int, bridge_s: float) -> float:
  """Step time from each module's time on its own GPUs (see the module docstring)."""
  if c["kind"] == "colocated":
    return t_v + t_l
  return max(t_v, t_l + t_v / microbatches) + bridge_s


def split_bound(cands: list[dict], gpus: int) -> dict | None:
  """The least step time any split of `gpus` GPUs between the modules could take, from the
  predicted candidates: a non-colocated step is at least max(T_v, T_l), and with g_v + g_l = G,
  max(S_v / g_v, S_l / g_l) >= (S_v + S_l) / G for the GPU-seconds S_m = T_m * g_m each module
  takes on its GPUs; so no split beats each module's fewest GPU-seconds on any of the candidates'
  GPU counts, summed, over G. None without a non-colocated candidate."""
  split = [c for c in cands if c["kind"] == "non-colocated"]
  if not split:
    return None
  out = {}
  for m in MODULES:
    c = min(split, key=lambda c: c[f"t_{m}"] * c[f"{m}_gpus"])
    out[m] = (c[f"t_{m}"] * c[f"{m}_gpus"], c[f"{m}_gpus"])
  out["step_s"] = sum(out[m][0] for m in MODULES) / gpus
  return out
