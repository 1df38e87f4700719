"""Comparators for LoCo: fp32 and bf16 all-reduce, int4 without feedback, EF, EF21, sign, top-k.

For the error-feedback baselines (error_feedback, sign_ef, topk_ef, ef21): with an axis, create
the state inside `jax.shard_map` and declare it with
`loco_jax.state_specs` (or use `parallel.init_opt_state`): the error differs per device.
A non-finite gradient (on any device of the axis) makes every output NaN and leaves the
state unchanged; finite ones give finite outputs and errors (h = g + e, the means and the
casts saturate at the largest finite value). Non-float and zero-size leaves pass through;
dtypes are kept.
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


# --- Argument checks ----------------------------------------------------------------------------

def _check_fraction(fraction: float) -> None:
  try:
    value = float(fraction)
  except (TypeError, ValueError):
    raise ValueError(f"fraction must be a Python float in (0, 1] (it fixes how many values are "
                     f"sent, a shape), got {fraction!r}{args.STATIC_HINT}") from None
  args.check_fraction(value, "fraction", 0.0, 1.0, closed_low=False)


# --- One update's leaves ------------------------------------------------------------------------

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


# --- The transformations ------------------------------------------------------------------------

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

  Without an axis it is the identity. Non-float and zero-size leaves pass through; the output
  keeps each gradient's dtype (float16 and bfloat16 gradients are averaged in float32). There
  is no state: a non-finite gradient stays non-finite in its leaf of the output. Finite ones give
  finite outputs: the mean is that of g / 2**k, times 2**k (exact; no overflow near the float32
  maximum), and a cast back to a 16-bit leaf saturates at its largest finite value.

  Example:
    >>> opt = optax.chain(uncompressed(), optax.adamw(3e-4))
    >>> state = opt.init(params)             # with an axis_name: inside jax.shard_map
    >>> updates, state = opt.update(grads, state, params)
  """
  return _all_reduce(jnp.float32, axis_name, "uncompressed")


def bf16(axis_name: AxisName | None = None) -> optax.GradientTransformationExtraArgs:
  """Gradients cast to bfloat16, averaged over `axis_name` in bfloat16, cast back to their dtype.

  Without an axis it rounds every float gradient to bfloat16 (PyTorch DDP's bf16 hook). With
  one, a bf16 all-reduce where the backend moves bf16 as is (GPU, TPU); on CPU, whose
  collectives would widen it to 32 bits, the same 16 bits a value as uint16 all-to-all, float32
  sum and uint16 all-gather (`comm.mean_16bit`; the HLO accounting shows which ran). Finite
  gradients beyond bfloat16's range (or means beyond a float16 leaf's) saturate at the largest
  finite value instead of becoming inf, and the mean is that of g / 2**k, times 2**k (no
  overflow); non-finite gradients stay non-finite.

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

  The leaves are cut into blocks of at most `block_size` elements as `loco`'s buckets cut them,
  with one float32 scale each, s = (2**(bits-1) - 1) / max|g|; d = round(s * g) / s: LoCo's
  fused step from a zero error, as `loco(beta=1.0)`. With an axis the output is the mean of
  every device's d over LoCo's wire: one all-to-all of packed codes and scales, a float32
  average of this device's shard, and a bfloat16 all-gather (bits + 16 bits a parameter). A
  non-finite gradient (on any device) makes every output NaN; finite ones give finite outputs (q / s, the mean and the casts saturate at
  the largest finite value, as in `loco`). Non-float and zero-size leaves pass through; dtypes
  are kept. `scale_method="rms"` with `clip_rms` uses loco's clipped-rms block scale instead
  (`quant.rms_scale`); the default stays absmax at every width (the classic comparator).

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

  return optax.GradientTransformationExtraArgs(
      local_blocks.local_init(lambda params: optax.EmptyState(), axis_name, specs,
                              "int_quantized"),
      local_blocks.local_update(update_fn, axis_name, specs, name="int_quantized"))


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

  def update_fn(updates, state):
    trees.check_state_matches(name, updates, state, init_fn(updates))
    grads = leaves.split(updates, axis_name)
    if not grads.sent:
      return updates, state
    update, (errors,) = _feedback_finish(grads, average_group, [state.error])
    return update, ErrorFeedbackState(grads.tree(errors))

  return optax.GradientTransformationExtraArgs(
      local_blocks.local_init(init_fn, axis_name, specs, name),
      local_blocks.local_update(update_fn, axis_name, specs, name=name))


def error_feedback(bits: int = 4, block_size: int = 2048,
                   axis_name: AxisName | None = None,
                   specs: Any = None, scale_method: str = "absmax",
                   clip_rms: float | None = None,
                   beta: float = 0.0) -> optax.GradientTransformationExtraArgs:
  """Classic error feedback (Seide et al. 2014) around `int_quantized`, error in float32.

  h = g + e; d = Q(h) (absmax blocks of about `block_size`, `bits` bits); e' = h - d; the
  output is d, or with an axis the mean of every device's d over the same wire as
  `int_quantized`. This is `loco(beta=0)` with the error kept exactly. `scale_method="rms"`
  with `clip_rms` quantizes with loco's clipped-rms block scale (`quant.rms_scale`; e.g.
  `error_feedback(2, 256, scale_method="rms", clip_rms=1.5)` is classic EF on loco(bits=2)'s
  quantizer); the default stays absmax at every width (the classic comparator). `beta` > 0
  keeps LoCo's moving average instead, e' = beta e + (1 - beta)(h - d), in float32 (the
  ablation of LoCo's int8 error; no periodic reset).

  With an axis and for non-finite or non-float input: as the module docstring says.

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

  h = g + e; per block of about `block_size` elements s = mean |h| (sent as float32) and
  d = s * sign(h) (sign(0) = +1), one bit per element; e' = h - d in float32. With an axis,
  one all-to-all carries the packed signs and scales, each device averages its shard in float32
  and a bfloat16 all-gather returns it (1 + 16 bits a parameter).

  With an axis and for non-finite or non-float input: as the module docstring says.

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
  largest |h| of each leaf are sent, the rest kept in the float32 error.

  h = g + e; d = h on the top-k entries, 0 elsewhere; e' = h - d. With an axis, one all-gather
  carries every device's (int32 index, float32 value) pairs of every leaf; each device sums
  them (scatter-add) and divides by the device count: each device sends (N - 1) * 64 * fraction
  bits a parameter (its pairs to each of N - 1 peers).

  With an axis and for non-finite or non-float input: as the module docstring says.

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

  Each device keeps g_i (float32, starts at 0), sends c_i = Q(grad_i - g_i) (absmax blocks as in
  `int_quantized`) and sets g_i += c_i; the output is g += mean_i c_i, kept in the state and the
  same on every device. With an axis, the c_i travel the wire of `int_quantized`, so g follows
  mean_i g_i up to the bfloat16 rounding of the gathered means. Create the state inside
  `jax.shard_map` and declare it with `loco_jax.state_specs`: g_i differs per device. A
  non-finite gradient (on any device) makes every output NaN and leaves the state unchanged;
  finite ones give finite outputs and state (differences, sums, means and casts saturate at
  the largest finite value). Non-float and zero-size leaves pass through; dtypes are kept.

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

  def update_fn(updates, state):
    trees.check_state_matches("ef21", updates, state, init_fn(updates))
    grads = leaves.split(updates, axis_name)
    if not grads.sent:
      return updates, state
    update, (local, estimate) = _feedback_finish(grads, average_group,
                                                 [state.local, state.estimate])
    return update, EF21State(grads.tree(local), grads.tree(estimate))

  return optax.GradientTransformationExtraArgs(
      local_blocks.local_init(init_fn, axis_name, specs, "ef21"),
      local_blocks.local_update(update_fn, axis_name, specs, name="ef21"))
