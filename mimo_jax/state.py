"""Each module's state on its mesh: parameter groups and optax transform, the shardings of its
parameters and optimizer state, initialisation, and the conversion between a pipeline schedule's
layout of stacked blocks (`Schedule.to_layout`) and the topology-independent one that checkpoints
hold."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from mimo_jax import optim
from mimo_jax.config import Config, parse_freeze
from mimo_jax.models.mimo import BLOCKS, Module
from mimo_jax.pipeline import Schedule
from mimo_jax.topology import REPLICATED, Topology


@dataclasses.dataclass
class ModuleState:
  params: Any
  opt_state: Any


def _on_blocks(tree, fn):
  """`fn` applied to the leaves of stacked blocks (parameters and the optimizer moments that
  mirror them), identity elsewhere."""
  key = f"[{BLOCKS!r}]"
  return jax.tree_util.tree_map_with_path(
      lambda path, x: fn(x) if key in jax.tree_util.keystr(path) else x, tree)


def _with_shardings(shapes, shardings):
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes,
                      shardings)


class StateLayout:
  """Per module: schedule, parameter groups and labels (frozen or trained), optax transform, and
  the shardings of parameters and optimizer state on the module's mesh."""

  def __init__(self, cfg: Config, topo: Topology, modules: dict[str, Module]):
    self.cfg, self.topo, self.modules = cfg, topo, modules
    frozen = parse_freeze(cfg.optim.freeze)
    tops = cfg.topology.modules()
    self.schedule = {n: Schedule(tops[n].pp, tops[n].virtual) for n in modules}
    canonical = {n: m.abstract_params() for n, m in modules.items()}
    abstract = {n: jax.eval_shape(lambda p, n=n: self._layout(n, p), canonical[n])
                for n in modules}
    self.param_sh = {
        n: jax.tree.map(lambda s, n=n: topo.sharding(n, s),
                        m.specs(abstract[n], self.schedule[n].stage_spec()))
        for n, m in modules.items()}
    self.canonical_sh = {
        n: jax.tree.map(lambda s, n=n: topo.sharding(n, s), m.specs(canonical[n]))
        for n, m in modules.items()}
    group_trees = {n: m.groups(abstract[n]) for n, m in modules.items()}
    self.labels = {n: optim.labels(g, frozen) for n, g in group_trees.items()}
    self.tx = {n: optim.module_transform(cfg, g) for n, g in group_trees.items()}
    self.trainable = {n: any(l != optim.FROZEN for l in jax.tree.leaves(self.labels[n]))
                      for n in modules}
    self.abstract_params = {
        n: jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        abstract[n], self.param_sh[n]) for n in modules}
    self._opt_shapes = {n: jax.eval_shape(self.tx[n].init, self.abstract_params[n])
                        for n in modules}
    # Fixed once so that init, update and checkpoint restore all agree.
    self.opt_sh = {n: self._mirror_shardings(n, self.abstract_params[n], self._opt_shapes[n])
                   for n in modules}

  def _layout(self, name: str, tree):
    return _on_blocks(tree, self.schedule[name].to_layout)

  def _unlayout(self, name: str, tree):
    return _on_blocks(tree, self.schedule[name].from_layout)

  def _mirror_shardings(self, name: str, params, opt_shapes):
    """Optimizer-state leaves that mirror a parameter (Adam's moments) take its sharding; the
    rest (step counts) are replicated. Matched by the parameter's path at the end of the leaf's."""
    by_path = {jax.tree_util.keystr(p): a for p, a in
               jax.tree_util.tree_flatten_with_path(params)[0]}
    replicated = self.topo.sharding(name, REPLICATED)

    def sharding(path, leaf):
      key = jax.tree_util.keystr(path)
      for suffix, param in by_path.items():
        if key.endswith(suffix) and param.shape == leaf.shape:
          return param.sharding
      return replicated
    return jax.tree_util.tree_map_with_path(sharding, opt_shapes)

  def init_state(self, seed: int) -> dict[str, ModuleState]:
    """Parameters born sharded on their module's mesh; values depend only on the seed."""
    state = {}
    for name, module in self.modules.items():
      init = lambda seed, name=name, module=module: self._layout(name, module.init(seed))
      params = jax.jit(init, static_argnums=0, out_shardings=self.param_sh[name])(seed)
      opt_state = jax.jit(self.tx[name].init, out_shardings=self.opt_sh[name])(params)
      state[name] = ModuleState(params, opt_state)
    return state

  def abstract_state(self, canonical: bool = False) -> dict[str, dict]:
    """Shapes, dtypes and this topology's shardings of every module's state; with `canonical`,
    in the layout checkpoints hold (restore targets)."""
    out = {}
    for name in self.modules:
      opt = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                         self._opt_shapes[name], self.opt_sh[name])
      out[name] = {"params": self.abstract_params[name], "opt_state": opt}
      if canonical and self.schedule[name].virtual > 1:
        params = _with_shardings(jax.eval_shape(lambda p, name=name: self._unlayout(name, p),
                                                self.abstract_params[name]),
                                 self.canonical_sh[name])
        shapes = jax.eval_shape(lambda o, name=name: self._unlayout(name, o),
                                self._opt_shapes[name])
        out[name] = {"params": params, "opt_state": _with_shardings(
            shapes, self._mirror_shardings(name, params, shapes))}
    return out

  def canonical(self, state: dict[str, ModuleState]) -> dict[str, ModuleState]:
    """State in the topology-independent layout (stacked layers [L, ...]) for checkpoints."""
    return self._convert(state, canonical=True)

  def from_canonical(self, state: dict[str, ModuleState]) -> dict[str, ModuleState]:
    return self._convert(state, canonical=False)

  def _convert(self, state, canonical: bool):
    out = {}
    for name, s in state.items():
      if self.schedule[name].virtual == 1:
        out[name] = s
        continue
      tree = {"params": s.params, "opt_state": s.opt_state}
      fn = self._unlayout if canonical else self._layout
      shardings = jax.tree.map(lambda a: a.sharding, self.abstract_state(canonical)[name])
      moved = jax.jit(lambda t, name=name, fn=fn: fn(name, t), out_shardings=shardings)(tree)
      out[name] = ModuleState(moved["params"], moved["opt_state"])
    return out
