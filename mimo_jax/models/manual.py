"""cuDNN's attention inside pipeline stages: `whole_manual`.

A pipeline's stages run in a `jax.shard_map` that is manual over the mesh's pp axis only, so that
dp and tp inside a layer stay automatic (pipeline.py). cuDNN's attention is a
`custom_partitioning` op, which XLA's partitioner cannot place in such a partly manual region: in
jax 0.11.2 its partitioner's check fails ("custom_partitioner: AssertionError"), or the compile
crashes. `whole_manual` runs it in a shard_map of its own over the other axes instead.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

# The checkpoint name of `whole_manual`'s output: remat `dots_attention` keeps it (pipeline.py),
# as it keeps cuDNN's attention outputs outside stages.
OUTPUT = "whole_manual_output"


def _axis(mesh, auto: set, name: str, sizes: list[int]) -> str | None:
  """Mesh axis `name` where it is automatic and splits every one of `sizes` evenly, else None
  (those arguments then stay whole on each rank of it)."""
  if name not in auto:
    return None
  return name if all(n % mesh.shape[name] == 0 for n in sizes) else None


def whole_manual(fn, *args) -> jax.Array:
  """`fn(*args)`, run manual over every mesh axis. Inside a shard_map manual over some axes only
  it runs in a shard_map of its own over the others, each argument's rows [b, ...] split over dp
  and the heads of [b, l, heads, head_dim] over tp (sharding.AXES), as the layers split them,
  where they divide evenly (an eval batch's slots need not); the result is [b, l, heads,
  head_dim]. Its backward pass is a shard_map of its own too, which runs the forward again from
  the arguments: residuals that cross such a nested shard_map get the wrong global shapes from
  jax's autodiff, or crash XLA's compile once a layer loop stacks them. The integer arguments
  (segment offsets) get no gradient; `fn` closes over no traced values (a `custom_vjp`'s rule).
  The output is named OUTPUT for remat policies. Elsewhere `fn(*args)`."""
  mesh = jax.sharding.get_abstract_mesh()
  manual = set() if mesh.empty else set(mesh.manual_axes)
  auto = set() if mesh.empty else set(mesh.axis_names) - manual
  if not manual or not auto:
    return fn(*args)
  dp = _axis(mesh, auto, "dp", [a.shape[0] for a in args])
  tp = _axis(mesh, auto, "tp", [a.shape[2] for a in args if a.ndim == 4])
  spec = lambda a: P(dp, None, tp, None) if a.ndim == 4 else P(dp, *[None] * (a.ndim - 1))
  specs, out = tuple(map(spec, args)), P(dp, None, tp, None)
  local = lambda f, ins, outs: jax.shard_map(f, in_specs=ins, out_specs=outs, axis_names=auto)
  floats = [jnp.issubdtype(a.dtype, jnp.floating) for a in args]

  def grads(*a_dy):  # on each rank: the float arguments' gradients, the forward run again
    *a, dy = a_dy
    ints = [x for x, f in zip(a, floats) if not f]

    def of_floats(*xs):
      xs, it = iter(xs), iter(ints)
      return fn(*(next(xs) if f else next(it) for f in floats))
    return jax.vjp(of_floats, *(x for x, f in zip(a, floats) if f))[1](dy)

  @jax.custom_vjp
  def run(*a):
    return local(fn, specs, out)(*a)

  def backward(a, dy):
    got = iter(local(grads, specs + (out,), tuple(s for s, f in zip(specs, floats) if f))(*a, dy))
    return tuple(next(got) if f else np.zeros(x.shape, jax.dtypes.float0)
                 for x, f in zip(a, floats))

  run.defvjp(lambda *a: (run(*a), a), backward)
  return checkpoint_name(run(*args), OUTPUT)
