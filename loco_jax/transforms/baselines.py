"""Comparators for LoCo: fp32 and bf16 all-reduce, int4 without feedback, EF, EF21, sign, top-k.

The error-feedback baselines keep a per-device error: with an axis, create their state inside
`jax.shard_map` and declare it with `loco_jax.state_specs`. A non-finite gradient on any device
makes every output NaN and keeps the state; finite ones give finite outputs and errors (sums,
means and casts saturate). Non-float and zero-size leaves pass through; dtypes are kept.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from loco_jax.comm import gathers
from loco_jax.core import args, leaves, local_blocks, quant, trees
from loco_jax.core.layout import AxisName
from loco_jax.transforms import baseline_codecs


class ErrorFeedbackState(NamedTuple):
  """State of `error_feedback`, `sign_ef` and `topk_ef`; the error differs per device."""
  error: optax.Updates      # float32 [size] per leaf (size 0 for leaves passed through): h - d


class EF21State(NamedTuple):
  """State of `ef21`: this device's estimate g_i and the averaged estimate g (replicated)."""
  local: optax.Updates      # float32 [size] per leaf: g_i, differs per device
  estimate: optax.Updates   # float32 [size] per leaf: g, the output, the same on every device


def _check_fraction(fraction: float) -> None:
  try:
    value = float(fraction)
  except (TypeError, ValueError):
    raise ValueError(f"fraction must be a Python float in (0, 1] (it fixes how many values are "
                     f"sent, a shape), got {fraction!r}{args.STATIC_HINT}") from None
  args.check_fraction(value, "fraction", 0.0, 1.0, closed_low=False)


def _flat_zeros(params: Any) -> Any:
  return jax.tree.map(
      lambda x: jnp.zeros((x.size if leaves.compressible(x) else 0,), jnp.float32), params)


def _feedback_finish(grads: leaves.Leaves, average_group, fields: list) -> tuple[Any, list]:
  """Runs `average_group(grads, flag, fields)` -> (values, new fields, flags) on each group of
  leaves (the group's flat gradients and fields); returns the update and the fields per leaf,
  the old ones wherever some gradient was not finite."""
  old = [grads.per_leaf(f) for f in fields]

  def step(group: leaves.Group) -> leaves.GroupResult:
    values, new, flags = average_group(
        [grads.flat(i) for i in group.indices], leaves.flag(grads.finite(group.indices)),
        [[f[i] for i in group.indices] for f in old])
    return leaves.GroupResult(values, flags, new)
  mapped = grads.map_groups(step)
  done = grads.finish(mapped, grads.by_leaf(mapped.states, old), old)
  return done.update, done.state


def _saturating_cast_keeping_inf(x: jax.Array, dtype) -> jax.Array:
  """x as `dtype`, finite values beyond its range saturating; +-inf and NaN stay as they are."""
  return jnp.where(jnp.isinf(x), x.astype(dtype), quant.saturating_cast(x, dtype))


def _all_reduce(wire_dtype, axis_name: AxisName | None,
                name: str) -> optax.GradientTransformationExtraArgs:
  # Elementwise and a pmean: model-sharded leaves need no local view (nothing is flattened).
  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    grads, treedef = jax.tree.flatten(updates)
    sent = [i for i, g in enumerate(grads) if leaves.compressible(g)]
    wire = [_saturating_cast_keeping_inf(grads[i], wire_dtype) for i in sent]
    if axis_name is not None and wire:
      # The sum inside a mean overflows for finite gradients near the maximum; the mean of
      # x / 2**k (2**k >= n) cannot, and times 2**k it is the same number (powers of two: exact).
      down = quant.mean_factors(gathers.axis_size(axis_name, name))[0]
      wire = [x * jnp.asarray(down, x.dtype) for x in wire]
      # 16-bit floats: a mean that crosses at 16 bits on every backend (gathers.mean_16bit).
      wire = (gathers.mean_16bit(wire, axis_name) if wire[0].dtype == jnp.bfloat16
              else jax.lax.pmean(wire, axis_name))
      wire = [x * jnp.asarray(1 / down, x.dtype) for x in wire]
    out = list(grads)
    for i, x in zip(sent, wire):
      out[i] = _saturating_cast_keeping_inf(x, grads[i].dtype)
    return treedef.unflatten(out), state

  return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update_fn)


def uncompressed(axis_name: AxisName | None = None) -> optax.GradientTransformationExtraArgs:
  """The mean of the gradients over `axis_name` in float32 (`jax.lax.pmean`, a ring all-reduce).

  Without an axis it is the identity. Each output keeps its gradient's dtype. A non-finite
  gradient stays non-finite in its leaf; finite ones give finite outputs (the mean of g / 2**k,
  times 2**k, cannot overflow; casts saturate).

  Example:
    >>> opt = optax.chain(uncompressed(), optax.adamw(3e-4))
    >>> state = opt.init(params)             # with an axis_name: inside jax.shard_map
    >>> updates, state = opt.update(grads, state, params)
  """
  return _all_reduce(jnp.float32, axis_name, "uncompressed")


def bf16(axis_name: AxisName | None = None) -> optax.GradientTransformationExtraArgs:
  """Gradients cast to bfloat16, averaged over `axis_name` in bfloat16, cast back to their dtype.

  Without an axis it rounds every float gradient to bfloat16 (PyTorch DDP's bf16 hook). With
  one, 16 bits a value cross on every backend (`comm.mean_16bit`). Finite values saturate, as in
  `uncompressed`; non-finite gradients stay non-finite.

  Example:
    >>> opt = optax.chain(bf16(), optax.adamw(3e-4))  # or axis_name="data"
    >>> state = opt.init(params)
    >>> updates, state = opt.update(grads, state, params)
  """
  return _all_reduce(jnp.bfloat16, axis_name, "bf16")


def int_quantized(bits: int = 4, block_size: int = 2048,
                  axis_name: AxisName | None = None,
                  specs: Any = None, scale_method: str = "absmax",
                  clip_rms: float | None = None) -> optax.GradientTransformationExtraArgs:
  """Absmax block quantization to `bits` without error feedback (like ZeRO++ qgZ).

  Blocks of at most `block_size` elements as `loco`'s buckets cut them, one float32 scale each,
  s = (2**(bits-1) - 1) / max|g|; d = round(s * g) / s: `loco(beta=1.0)`'s step. With an axis
  the output is the mean of every device's d over LoCo's wire (bits + 16 bits a parameter).
  `scale_method="rms"` with `clip_rms` uses loco's clipped-rms block scale (`quant.rms_scale`).
  Non-finite gradients: as the module docstring says.

  Example:
    >>> opt = optax.chain(int_quantized(bits=4), optax.adamw(3e-4))
    >>> state = opt.init(params)
    >>> updates, state = opt.update(grads, state, params)
  """
  codec = baseline_codecs.block_codec(bits, block_size, scale_method, clip_rms)

  def average_group(grads, flag, fields):
    sent = codec(grads, flag, axis_name)
    return sent.means, fields, sent.flags

  def update_fn(updates, state):
    grads = leaves.split(updates, axis_name)
    return (_feedback_finish(grads, average_group, [])[0] if grads.sent else updates), state

  return _on_local_blocks(lambda params: optax.EmptyState(), update_fn, axis_name, specs,
                          "int_quantized")


def _on_local_blocks(init_fn, update_fn, axis_name, specs,
                     name: str) -> optax.GradientTransformationExtraArgs:
  return optax.GradientTransformationExtraArgs(
      local_blocks.local_init(init_fn, axis_name, specs, name),
      local_blocks.local_update(update_fn, axis_name, specs, name=name))


def _feedback(codec: baseline_codecs.Codec, axis_name: AxisName | None, name: str,
              beta: float = 0.0, specs: Any = None) -> optax.GradientTransformationExtraArgs:
  """Classic error feedback around `codec`: h = g + e, send C(h), e' = h - d (float32); with
  `beta`, LoCo's moving average e' = beta e + (1 - beta)(h - d)."""
  def init_fn(params):
    return ErrorFeedbackState(_flat_zeros(params))

  def average_group(grads, flag, fields):
    errors, = fields
    hs = [quant.saturate(g + e) for g, e in zip(grads, errors)]  # finite, never inf
    decoded, means, flags = codec(hs, flag, axis_name)
    classic = args.is_concrete(beta) and beta == 0  # traced: inject_hyperparams
    new_errors = [h - d if classic  # h and d share their sign: no overflow
                  else quant.saturate(beta * e + (1.0 - beta) * (h - d))
                  for h, d, e in zip(hs, decoded, errors)]
    return means, [new_errors], flags

  return _stateful(init_fn, average_group, axis_name, specs, name)


def _stateful(init_fn, average_group, axis_name: AxisName | None, specs: Any,
              name: str) -> optax.GradientTransformationExtraArgs:
  """A transformation whose state's fields are per-leaf fields of `average_group`."""
  def update_fn(updates, state):
    trees.check_state_matches(name, updates, state, init_fn(updates))
    grads = leaves.split(updates, axis_name)
    if not grads.sent:
      return updates, state
    update, fields = _feedback_finish(grads, average_group, list(state))
    return update, type(state)(*map(grads.tree, fields))

  return _on_local_blocks(init_fn, update_fn, axis_name, specs, name)


def error_feedback(bits: int = 4, block_size: int = 2048,
                   axis_name: AxisName | None = None,
                   specs: Any = None, scale_method: str = "absmax",
                   clip_rms: float | None = None,
                   beta: float = 0.0) -> optax.GradientTransformationExtraArgs:
  """Classic error feedback (Seide et al. 2014) around `int_quantized`, error in float32.

  h = g + e; d = Q(h) as in `int_quantized`; e' = h - d; the output is d, or the mean of every
  device's d: `loco(beta=0)` with the error kept exactly. `beta` > 0 keeps LoCo's moving
  average e' = beta e + (1 - beta)(h - d) in float32 instead (no int8, no periodic reset).

  Example:
    >>> opt = optax.chain(error_feedback(bits=4), optax.adamw(3e-4))
    >>> state = opt.init(params)
    >>> updates, state = opt.update(grads, state, params)
  """
  codec = baseline_codecs.block_codec(bits, block_size, scale_method, clip_rms)
  if args.is_concrete(beta) and not 0.0 <= float(beta) < 1.0:
    raise ValueError(f"beta must be in [0, 1) (0 is classic error feedback), got {beta}")
  return _feedback(codec, axis_name, "error_feedback", beta=beta, specs=specs)


def sign_ef(block_size: int = 2048,
            axis_name: AxisName | None = None,
            specs: Any = None) -> optax.GradientTransformationExtraArgs:
  """1-bit sign compression with error feedback (the compressor of 1-bit Adam).

  h = g + e; per block of about `block_size` elements `s = mean |h|` and `d = s * sign(h)`
  (sign(0) = +1); e' = h - d in float32. With an axis, LoCo's wire: 1 + 16 bits a parameter.

  Example:
    >>> opt = optax.chain(sign_ef(), optax.adamw(3e-4))
    >>> state = opt.init(params)
    >>> updates, state = opt.update(grads, state, params)
  """
  args.check_int(block_size, "block_size", 1)
  return _feedback(baseline_codecs.sign_codec(block_size), axis_name, "sign_ef", specs=specs)


def topk_ef(fraction: float = 0.01,
            axis_name: AxisName | None = None,
            specs: Any = None) -> optax.GradientTransformationExtraArgs:
  """Top-k sparsification with error feedback: the k = max(1, round(fraction * size)) entries of
  largest `|h|` of each leaf are sent, the rest kept in the float32 error.

  h = g + e; d = h on the top-k entries, 0 elsewhere; e' = h - d. With an axis, one all-gather
  of every device's (int32 index, float32 value) pairs, summed and divided by the device count:
  (N - 1) * 64 * fraction bits a parameter.

  Example:
    >>> opt = optax.chain(topk_ef(fraction=0.01), optax.adamw(3e-4))
    >>> state = opt.init(params)
    >>> updates, state = opt.update(grads, state, params)
  """
  _check_fraction(fraction)
  return _feedback(baseline_codecs.topk_codec(float(fraction)), axis_name, "topk_ef",
                   specs=specs)


def ef21(bits: int = 4, block_size: int = 2048,
         axis_name: AxisName | None = None,
         specs: Any = None) -> optax.GradientTransformationExtraArgs:
  """EF21 (Richtarik et al. 2021): devices send compressed changes of a running estimate.

  Each device keeps g_i (float32, starts at 0), sends c_i = Q(grad_i - g_i) over the wire of
  `int_quantized` and sets g_i += c_i; the output is g += mean_i c_i, the same on every device.

  Example:
    >>> opt = optax.chain(ef21(bits=4), optax.adamw(3e-4))
    >>> state = opt.init(params)
    >>> updates, state = opt.update(grads, state, params)
  """
  codec = baseline_codecs.block_codec(bits, block_size)

  def init_fn(params):
    return EF21State(_flat_zeros(params), _flat_zeros(params))

  def average_group(grads, flag, fields):
    local, estimate = fields
    hs = [quant.saturate(g - l) for g, l in zip(grads, local)]
    decoded, means, flags = codec(hs, flag, axis_name)
    new_estimate = [quant.saturate(e + c_mean) for e, c_mean in zip(estimate, means)]
    return (new_estimate,
            [[quant.saturate(l + c) for l, c in zip(local, decoded)], new_estimate], flags)

  return _stateful(init_fn, average_group, axis_name, specs, "ef21")
