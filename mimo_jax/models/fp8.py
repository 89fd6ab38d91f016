"""FP8 matmuls for the blocks' linear layers (`model.<module>.fp8`), with current or delayed
scaling (`model.<module>.fp8_scaling`).

With current scaling (the default) each operand of a matmul is scaled by a power of two taken
from its own absolute maximum at the call, so that it spans the FP8 range, and cast: the inputs
and the kernel to float8_e4m3fn (3 mantissa bits, up to 448) in the forward pass, the incoming
gradient to float8_e5m2 (2 mantissa bits, up to 57344: the wider range gradients need) in the
backward pass. Current scaling keeps no
state (no amax history as delayed scaling does): parameters, optimizer state and checkpoints are
those of a bfloat16 run. A power-of-two scale is exact in every float type, so scaling and
unscaling add no rounding of their own.

A product is a dot of the FP8 operands with a bfloat16 result, scaled afterwards (exactly, the
scales being powers of two; XLA fuses the scaling into what reads the result): on Hopper GPUs XLA
runs it as a cuBLASLt FP8 GEMM (twice bfloat16's peak) that writes bfloat16; elsewhere it computes
the same values at higher precision. (Written as XLA's dequantize pattern instead, `dot(convert(q_a)
· scale_a, convert(q_b) · scale_b)`, the dots ran as bfloat16 GEMMs with jax 0.11.2 on an H200.)

Matmuls that share an input (attention's q, k and v; SwiGLU's gate and up) run as one, of their
kernels joined (models/layers.py), so the input, the joined kernel and the joined gradient are each
quantized once. The matmuls keep their FP8 operands for the backward pass, half the bytes of
bfloat16 ones. A remat policy that keeps matmul outputs keeps the quantized inputs too (their
checkpoint name is `OPERAND`), so the backward pass does not quantize an input again; the kernels
are quantized again instead, which costs little and keeps no gathered copy of a sharded (FSDP)
kernel across the layers.

A matmul's result differs from the bfloat16 one by the FP8 rounding of its operands: about 4%
(relative, over a whole product of random data) with e4m3 operands, 6% for the gradients with e5m2
ones (tests/test_fp8.py).

**Delayed scaling** (Transformer Engine's recipe; `fp8_scaling=delayed`): an input's and an incoming
gradient's scale come from the largest abs-max that operand had over the last `fp8_history` steps
(`AmaxHistory`, two on each linear layer, stacked with its layers), so the cast needs no reduction
over the operand first and can fuse into the kernel that produces it. The call still records the
operand's abs-max (a reduction nothing waits on); layers that run as one joined matmul (q, k, v;
gate, up) are cast at the largest of their histories, and each of them records the joined operand's
abs-max. The recorded values leave the custom VJP as the "gradients" of the histories (index 0, the
rest 0): the step combines them by maximum wherever it adds gradients (microbatches, dp ranks:
optim.combine, optim.reduce_ranks) and the update rolls them in (`roll`) instead of applying the
optimizer. A value beyond the history's scale saturates at the FP8 maximum (clipped, never NaN); an
empty history (a fresh run's first step) gives scale 1, as Transformer Engine's initial scale (for
that step values beyond the type's range saturate and those below its smallest subnormal, small
gradients among them, flush to zero). Kernels keep current scaling: a kernel's reduction is small
and its cast reads a parameter, not an activation being produced. Under `jax.vmap` or a loop that
reuses a layer within one differentiation, autodiff would add the recorded values: validation
refuses delayed scaling on a pipelined module, whose stages run microbatches in such loops.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

FORWARD, BACKWARD = jnp.float8_e4m3fn, jnp.float8_e5m2
OPERAND = "fp8_operand"  # checkpoint name of a matmul's quantized input (not its kernel)


def abs_max(x: jax.Array) -> jax.Array:
  return jnp.max(jnp.abs(x)).astype(jnp.float32)


def scale_for(amax: jax.Array, dtype) -> jax.Array:
  """The float32 power of two that brings `amax` into [max/2, max) of `dtype` (1 for 0)."""
  top = float(jnp.finfo(dtype).max)
  _, exponent = jnp.frexp(amax / top)  # amax / top = m · 2^exponent, m in [1/2, 1)
  return jnp.where(amax > 0, jnp.ldexp(jnp.float32(1), exponent), 1.0)  # exact, unlike exp2


def cast(x: jax.Array, scale: jax.Array, dtype) -> jax.Array:
  """`x / scale` in `dtype`, clipped: a value rounded past the largest finite one would become
  NaN, so one beyond the range saturates."""
  top = float(jnp.finfo(dtype).max)
  return jnp.clip(x.astype(jnp.float32) / scale, -top, top).astype(dtype)


def quantize(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
  """`x` in `dtype`, divided by the float32 power of two `scale` that brings its absolute maximum
  into [max/2, max) of `dtype`; `q · scale` is `x` rounded to `dtype`'s mantissa."""
  scale = scale_for(abs_max(x), dtype)
  return cast(x, scale, dtype), scale


def _product(a, sa, b, sb, dims, out_dtype):
  """dot(a · sa, b · sb) of FP8 operands `a`, `b`, in `out_dtype`: the product of the FP8 operands
  rounded to `out_dtype`, then scaled, which is exact as the scales are powers of two."""
  y = jax.lax.dot_general(a, b, dims, preferred_element_type=out_dtype)
  return y * (sa * sb).astype(out_dtype)


def _stored(q: jax.Array) -> jax.Array:
  """An FP8 residual as its bytes. `jax.checkpoint` passes each floating residual it saves through
  `reduce_precision` to its type's exponent and mantissa widths, which for float8_e4m3fn (no
  infinities, up to 448) means IEEE e4m3 (up to 240): on CPUs a value above 240 became NaN. It
  leaves integer residuals alone."""
  return jax.lax.bitcast_convert_type(q, jnp.uint8)


def _loaded(u: jax.Array, dtype) -> jax.Array:
  return jax.lax.bitcast_convert_type(u, dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _matmuls(x, ws, dtypes):
  return _forward(x, ws, dtypes)[0]


def _forward(x, ws, dtypes):
  """x [..., k] · each w [k, n_i]; `dtypes`: the names of the results', x's and the ws' dtypes."""
  qx, sx = quantize(x, FORWARD)
  qws = [quantize(w, FORWARD) for w in ws]
  dims = (((x.ndim - 1,), (0,)), ((), ()))
  ys = tuple(_product(qx, sx, qw, sw, dims, dtypes[0]) for qw, sw in qws)
  kept_x = (checkpoint_name(_stored(qx), OPERAND), checkpoint_name(sx, OPERAND))
  return ys, (kept_x, [(_stored(qw), sw) for qw, sw in qws])


def _backward(dtypes, res, gs):
  (qx, sx), qws = res
  qx = _loaded(qx, FORWARD)
  n = qx.ndim - 1
  lead = tuple(range(n))
  dx, dws = None, []
  for (qw, sw), g in zip(qws, gs):
    qw = _loaded(qw, FORWARD)
    qg, sg = quantize(g, BACKWARD)
    # dx [..., k] += g [..., n] · w [k, n]ᵀ;  dw [k, n] = x [..., k]ᵀ · g [..., n]
    d = _product(qg, sg, qw, sw, (((n,), (1,)), ((), ())), dtypes[1])
    dx = d if dx is None else dx + d
    dws.append(_product(qx, sx, qg, sg, ((lead, lead), ((), ())), dtypes[2]))
  return dx, dws


_matmuls.defvjp(_forward, _backward)


def matmuls(x: jax.Array, ws: Sequence[jax.Array], out_dtype=None) -> tuple[jax.Array, ...]:
  """x [..., k] · w [k, n] for each w, x quantized once; results in `out_dtype` (x's dtype)."""
  if not ws or any(w.ndim != 2 or w.shape[0] != x.shape[-1] for w in ws):
    raise ValueError(f"fp8.matmuls: kernels [k, n] with k = {x.shape[-1]} (the input's last "
                     f"axis), got {[w.shape for w in ws]}")
  if len({w.dtype for w in ws}) != 1:
    raise ValueError(f"fp8.matmuls: kernels of one dtype, got {[w.dtype.name for w in ws]}")
  out = jnp.dtype(out_dtype or x.dtype)
  return _matmuls(x, list(ws), (out.name, x.dtype.name, ws[0].dtype.name))


def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
                out_sharding=None):
  """`nnx.Linear`'s matmul (inputs [..., k] · kernel [k, n]) in FP8; any other contraction, or an
  explicit `out_sharding`, is an error. `precision` does not apply to FP8 products."""
  del precision
  if out_sharding is not None:
    raise ValueError(f"fp8.dot_general: out_sharding {out_sharding} is not supported; the result "
                     "takes the sharding its operands imply.")
  (contract_l, contract_r), (batch_l, batch_r) = dimension_numbers
  if (tuple(contract_l) != (lhs.ndim - 1,) or tuple(contract_r) != (0,) or batch_l or batch_r
      or rhs.ndim != 2):
    raise ValueError(f"fp8.dot_general: only inputs [..., k] times a kernel [k, n], got "
                     f"{lhs.shape} and {rhs.shape} with {dimension_numbers}")
  return matmuls(lhs, [rhs], preferred_element_type)[0]


# ---- delayed scaling --------------------------------------------------------------------------

INPUT_HISTORY, GRAD_HISTORY = "fp8_input_amax", "fp8_grad_amax"  # a linear layer's variables


class AmaxHistory(nnx.Variable):
  """Abs-maxes of an FP8 operand over the last steps, newest first (float32 [history]). Not a
  parameter: a step's gradient of it is the abs-max the step recorded (at index 0, the rest 0),
  gradients of it combine by maximum, and the update rolls it in (`roll`)."""


def is_history(path: str) -> bool:
  """Whether a parameter path names an `AmaxHistory` (trees.path_str form)."""
  return path.endswith("/" + INPUT_HISTORY) or path.endswith("/" + GRAD_HISTORY)


def roll(history: jax.Array, recorded: jax.Array) -> jax.Array:
  """The history [..., H] after a step whose recorded abs-maxes are `recorded[..., 0]`."""
  return jnp.concatenate([recorded[..., :1], history[..., :-1]], axis=-1)


def history_scale(histories: Sequence[jax.Array], dtype) -> jax.Array:
  """The scale of an operand from its histories' maximum: known before the operand is, so its
  cast waits on no reduction. An empty history (a fresh run's first step) gives scale 1."""
  return scale_for(functools.reduce(jnp.maximum, [jnp.max(h) for h in histories]), dtype)


def _recorded(amax: jax.Array, history: jax.Array) -> jax.Array:
  """A history's gradient: this call's abs-max at index 0."""
  return jnp.zeros_like(history).at[0].set(amax.astype(history.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _delayed(x, ws, x_histories, g_histories, dtypes):
  return _delayed_forward(x, ws, x_histories, g_histories, dtypes)[0]


def _delayed_forward(x, ws, x_histories, g_histories, dtypes):
  """`_forward` with x cast at its history's scale; x's abs-max is recorded (nothing waits on
  it). The kernels keep current scaling: their reductions are small."""
  sx = history_scale(x_histories, FORWARD)
  qx, amax = cast(x, sx, FORWARD), abs_max(x)
  qws = [quantize(w, FORWARD) for w in ws]
  dims = (((x.ndim - 1,), (0,)), ((), ()))
  ys = tuple(_product(qx, sx, qw, sw, dims, dtypes[0]) for qw, sw in qws)
  kept_x = tuple(checkpoint_name(a, OPERAND) for a in (_stored(qx), sx, amax))
  return ys, (kept_x, [(_stored(qw), sw) for qw, sw in qws], x_histories, g_histories)


def _delayed_backward(dtypes, res, gs):
  (qx, sx, amax_x), qws, x_histories, g_histories = res
  qx = _loaded(qx, FORWARD)
  n = qx.ndim - 1
  lead = tuple(range(n))
  dx, dws, recorded_g = None, [], []
  for (qw, sw), g, histories in zip(qws, gs, g_histories):
    qw = _loaded(qw, FORWARD)
    sg = history_scale(histories, BACKWARD)
    qg = cast(g, sg, BACKWARD)
    amax_g = abs_max(g)
    recorded_g.append([_recorded(amax_g, h) for h in histories])
    d = _product(qg, sg, qw, sw, (((n,), (1,)), ((), ())), dtypes[1])
    dx = d if dx is None else dx + d
    dws.append(_product(qx, sx, qg, sg, ((lead, lead), ((), ())), dtypes[2]))
  return dx, dws, [_recorded(amax_x, h) for h in x_histories], recorded_g


_delayed.defvjp(_delayed_forward, _delayed_backward)


def delayed_matmuls(x: jax.Array, ws: Sequence[jax.Array], x_histories: Sequence[jax.Array],
                    g_histories: Sequence, out_dtype=None) -> tuple[jax.Array, ...]:
  """`matmuls` with delayed scaling: x cast at the scale of `x_histories`' maximum, each result's
  incoming gradient at the scale of its own entry of `g_histories` (one a kernel: a history, or
  the histories of the layers a joined kernel holds, whose maximum it takes and each of which
  records the gradient's abs-max). Their gradients are the abs-maxes recorded (`AmaxHistory`)."""
  if not ws or any(w.ndim != 2 or w.shape[0] != x.shape[-1] for w in ws):
    raise ValueError(f"fp8.delayed_matmuls: kernels [k, n] with k = {x.shape[-1]}, got "
                     f"{[w.shape for w in ws]}")
  if not x_histories or len(ws) != len(g_histories):
    raise ValueError(f"fp8.delayed_matmuls: input histories and one gradient entry a kernel, "
                     f"got {len(ws)} kernels, {len(x_histories)} input histories and "
                     f"{len(g_histories)} gradient entries")
  g_lists = [list(h) if isinstance(h, (list, tuple)) else [h] for h in g_histories]
  out = jnp.dtype(out_dtype or x.dtype)
  return _delayed(x, list(ws), list(x_histories), g_lists,
                  (out.name, x.dtype.name, ws[0].dtype.name))


def add_histories(layer, length: int) -> None:
  """Gives an `nnx.Linear` empty histories of `length` steps: its matmul takes delayed scaling."""
  setattr(layer, INPUT_HISTORY, AmaxHistory(jnp.zeros((length,), jnp.float32)))
  setattr(layer, GRAD_HISTORY, AmaxHistory(jnp.zeros((length,), jnp.float32)))


def delayed(layer) -> bool:
  """Whether a linear layer has histories (`add_histories`)."""
  return hasattr(layer, INPUT_HISTORY)


def history_length(section) -> int:
  """A module config's histories (`fp8_history` with `fp8` and delayed `fp8_scaling`), else 0."""
  delayed_ = getattr(section, "fp8", False) and getattr(section, "fp8_scaling", "") == "delayed"
  return section.fp8_history if delayed_ else 0
