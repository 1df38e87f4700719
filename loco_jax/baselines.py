"""Comparators for LoCo: fp32 and bf16 all-reduce, int4 without feedback, EF, EF21, sign, top-k."""

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from loco_jax import comm, quant, trees
from loco_jax.comm import AxisName, Payload
from loco_jax.loco import _compressible, _dequantize_blocks, _keep_if, _quantize_blocks, loco

_HINT = " (under optax.inject_hyperparams pass it in static_args)"


class ErrorFeedbackState(NamedTuple):
  """State of `error_feedback`, `sign_ef` and `topk_ef`; the error differs per device."""
  error: optax.Updates      # float32 [size] per leaf (size 0 for leaves passed through): h - d

  PER_DEVICE = ("error",)


class EF21State(NamedTuple):
  """State of `ef21`: this device's estimate g_i and the averaged estimate g (replicated)."""
  local: optax.Updates      # float32 [size] per leaf: g_i, differs per device
  estimate: optax.Updates   # float32 [size] per leaf: g, the output, the same on every device

  PER_DEVICE = ("local",)


# --- Argument checks ----------------------------------------------------------------------------

def _check_bits(bits: int) -> None:
  try:
    quant.check_bits(bits)
  except ValueError as e:
    raise ValueError(str(e) + _HINT) from None


def _check_block_size(block_size: int) -> None:
  if (isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer))
      or block_size <= 0):
    raise ValueError(f"block_size must be a positive int, got {block_size!r}{_HINT}")


def _check_fraction(fraction: float) -> None:
  try:
    value = float(fraction)
  except (TypeError, ValueError):
    raise ValueError(f"fraction must be a Python float in (0, 1] (it fixes how many values are "
                     f"sent, a shape), got {fraction!r}{_HINT}") from None
  if not 0.0 < value <= 1.0:
    raise ValueError(f"fraction must be in (0, 1], got {fraction!r}")


# --- One update's leaves ------------------------------------------------------------------------

class _Step(NamedTuple):
  """An update's leaves: `chosen` are the float, non-empty ones; `flag` is 0, or NaN if one of
  them is not finite (added to every output, so that a bad step is NaN everywhere)."""
  leaves: list
  treedef: Any
  chosen: list[int]
  flag: jax.Array

  def flat(self, i: int) -> jax.Array:
    return self.leaves[i].reshape(-1).astype(jnp.float32)

  def of(self, tree: Any) -> list:
    return self.treedef.flatten_up_to(tree)

  def outputs(self, values: list[jax.Array], flags: jax.Array) -> Any:
    """Flat float32 values of the chosen leaves (+ flags) -> the update, in the leaves' dtypes."""
    out = list(self.leaves)
    for i, v in zip(self.chosen, values):
      out[i] = quant.saturating_cast((v + flags).reshape(self.leaves[i].shape),
                                     self.leaves[i].dtype)
    return self.treedef.unflatten(out)


def _step(updates: Any) -> _Step:
  leaves, treedef = jax.tree.flatten(updates)
  chosen = [i for i, g in enumerate(leaves) if _compressible(g)]
  finite = jnp.bool_(True)
  for i in chosen:
    finite &= jnp.all(jnp.isfinite(leaves[i]))
  return _Step(leaves, treedef, chosen, jnp.where(finite, 0.0, jnp.nan).astype(jnp.float32))


def _flat_zeros(params: Any) -> Any:
  return jax.tree.map(
      lambda x: jnp.zeros((x.size if _compressible(x) else 0,), jnp.float32), params)


# --- Codecs: a compressor and its wire ----------------------------------------------------------

class _Codec(NamedTuple):
  """encode(h [size], rows) -> (message, d [size]), d being what the message decodes to;
  average(messages, flag, axis_name) -> (mean over the axis of every device's d [size] per leaf,
  the peers' flags summed and replicated)."""
  encode: Callable[[jax.Array, int], tuple[Any, jax.Array]]
  average: Callable[[list, jax.Array, AxisName], tuple[list[jax.Array], jax.Array]]


def _block_codec(bits: int, block_size: int) -> _Codec:
  """Absmax block quantization to `bits`; LoCo's all-to-all of packed codes, then a bf16 gather."""
  def encode(h, rows):
    layout = comm.leaf_layout(h.size, rows, block_size)
    payload = _quantize_blocks(h, layout, bits, None)
    return (payload, layout), _dequantize_blocks(payload, layout, None)

  def average(messages, flag, axis_name):
    payloads, layouts = zip(*messages)
    shards, flags = comm.all_to_all_mean(payloads, bits, None, flag, axis_name)
    return comm.gather_bf16([quant.saturate(s, jnp.bfloat16) for s in shards], layouts, flags,
                            axis_name)

  return _Codec(encode, average)


def _sign_values(p: Payload) -> jax.Array:
  """1-bit codes on the grid {-1, 0}: -1 -> -scale, 0 -> +scale (per block)."""
  return p.scales[..., None] * jnp.where(p.codes < 0, -1.0, 1.0)


def _sign_codec(block_size: int) -> _Codec:
  """scale * sign(h) with scale = mean |h| per block (float32): one bit per element on the wire."""
  def encode(h, rows):
    layout = comm.leaf_layout(h.size, rows, block_size)
    h_RxBxL = comm.to_rows(h, layout)
    real_RxB = comm.to_rows(jnp.ones_like(h), layout).sum(-1)   # padding excluded from the mean
    # sum |h| 2**-k / (real 2**-k): the sum cannot overflow, and it is sum |h| / real exactly.
    down = quant.mean_factors(layout.block_len)[0]
    scales_RxB = quant.saturate(
        (jnp.abs(h_RxBxL) * down).sum(-1) / (jnp.maximum(real_RxB, 1.0) * down))
    payload = Payload(jnp.where(h_RxBxL < 0, -1, 0).astype(jnp.int8), scales_RxB)
    return (payload, layout), comm.from_rows(_sign_values(payload), layout)

  def average(messages, flag, axis_name):
    # comm.all_to_all_mean's path, with the sign decoding in place of codes / scale.
    payloads, layouts = zip(*messages)
    buffer, offsets = comm.encode_rows(payloads, 1, flag)
    received_NxB = jax.lax.all_to_all(buffer, axis_name, 0, 0, tiled=True)
    n = received_NxB.shape[0]
    field = lambda j: received_NxB[:, offsets[j][0]:offsets[j][1]]
    shards = []
    for j, p in enumerate(payloads):
      codes = quant.unpack(field(2 * j).reshape(n, p.codes.shape[1], -1), 1)
      scales = comm._from_bytes(field(2 * j + 1), jnp.float32, (n, p.scales.shape[1]))
      shards.append(quant.mean_over_peers(_sign_values(Payload(codes, scales))))
    flags = comm._from_bytes(field(len(offsets) - 1), jnp.float32, (n,))
    return comm.gather_bf16([quant.saturate(s, jnp.bfloat16) for s in shards], layouts,
                            flags.sum(), axis_name)

  return _Codec(encode, average)


def _topk_count(size: int, fraction: float) -> int:
  """Entries `topk_ef` keeps of a leaf of `size` elements: max(1, round(fraction * size))."""
  return min(size, max(1, round(fraction * size)))


def _scatter_mean(idx_NxK: jax.Array, vals_NxK: jax.Array, size: int) -> jax.Array:
  """Sum of N devices' sparse vectors (indices, values) divided by N -> [size] float32.

  One scatter-add per device, in device order, each with unique indices: every device adds in
  the same order (no atomics racing on a GPU), so the output is the same on all of them.
  """
  down, up = quant.mean_factors(idx_NxK.shape[0])  # a sum of x / 2**k never overflows
  summed = jnp.zeros((size,), jnp.float32)
  for idx_K, vals_K in zip(idx_NxK, vals_NxK):
    summed = summed.at[idx_K].add(vals_K * down, unique_indices=True)
  return quant.saturate(summed * up)


def _topk_codec(fraction: float) -> _Codec:
  """The k largest |h| of each leaf as (int32 index, float32 value); one all-gather of them all."""
  def encode(h, rows):
    del rows
    _, idx_K = jax.lax.top_k(jnp.abs(h), _topk_count(h.size, fraction))
    vals_K = h[idx_K]
    return (idx_K, vals_K, h.size), _scatter_mean(idx_K[None], vals_K[None], h.size)

  def average(messages, flag, axis_name):
    as_int = lambda x: jax.lax.bitcast_convert_type(x, jnp.int32)
    parts = [m[0] for m in messages] + [as_int(m[1]) for m in messages] + [as_int(flag)[None]]
    gathered_NxW = jax.lax.all_gather(jnp.concatenate(parts), axis_name, axis=0,
                                      to="invarying")
    starts = np.cumsum([0] + [p.size for p in parts])
    take = lambda j: gathered_NxW[:, starts[j]:starts[j + 1]]
    n_leaves = len(messages)
    means = [_scatter_mean(take(j), jax.lax.bitcast_convert_type(take(n_leaves + j), jnp.float32),
                           size) for j, (_, _, size) in enumerate(messages)]
    flags = jax.lax.bitcast_convert_type(take(2 * n_leaves)[:, 0], jnp.float32)
    return means, flags.sum()

  return _Codec(encode, average)


def _encode(codec: _Codec, hs: list[jax.Array], axis_name: AxisName | None,
            who: str) -> tuple[list, list[jax.Array]]:
  rows = 1 if axis_name is None else comm.axis_size(axis_name, who)
  messages, decoded = zip(*[codec.encode(h, rows) for h in hs])
  return list(messages), list(decoded)


def _average(codec: _Codec, messages: list, decoded: list[jax.Array], flag: jax.Array,
             axis_name: AxisName | None) -> tuple[list[jax.Array], jax.Array]:
  """The mean over the axis of every device's decoded message; without an axis, `decoded`."""
  if axis_name is None:
    return decoded, flag
  return codec.average(messages, flag, axis_name)


# --- The transformations ------------------------------------------------------------------------

def _saturating_cast_keeping_inf(x: jax.Array, dtype) -> jax.Array:
  """x as `dtype`, finite values beyond its range saturating; +-inf and NaN stay as they are."""
  return jnp.where(jnp.isinf(x), x.astype(dtype), quant.saturating_cast(x, dtype))


def _all_reduce(wire_dtype, axis_name: AxisName | None,
                who: str) -> optax.GradientTransformationExtraArgs:
  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    leaves, treedef = jax.tree.flatten(updates)
    chosen = [i for i, g in enumerate(leaves) if _compressible(g)]
    wire = [_saturating_cast_keeping_inf(leaves[i], wire_dtype) for i in chosen]
    if axis_name is not None and wire:
      # The sum inside a mean overflows for finite gradients near the maximum; the mean of
      # x / 2**k (2**k >= n) cannot, and times 2**k it is the same number (powers of two: exact).
      down = quant.mean_factors(comm.axis_size(axis_name, who))[0]
      wire = [x * jnp.asarray(down, x.dtype) for x in wire]
      # 16-bit floats: a mean that crosses at 16 bits on every backend (comm.mean_16bit).
      wire = (comm.mean_16bit(wire, axis_name) if wire[0].dtype == jnp.bfloat16
              else jax.lax.pmean(wire, axis_name))
      wire = [x * jnp.asarray(1 / down, x.dtype) for x in wire]
    out = list(leaves)
    for i, x in zip(chosen, wire):
      out[i] = _saturating_cast_keeping_inf(x, leaves[i].dtype)
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
    >>> opt = optax.chain(loco_jax.baselines.uncompressed(), optax.adamw(3e-4))
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
    >>> opt = optax.chain(loco_jax.baselines.bf16(), optax.adamw(3e-4))  # or axis_name="data"
    >>> state = opt.init(params)
    >>> updates, state = opt.update(grads, state, params)
  """
  return _all_reduce(jnp.bfloat16, axis_name, "bf16")


def int_quantized(bits: int = 4, block_size: int = 2048,
                  axis_name: AxisName | None = None) -> optax.GradientTransformationExtraArgs:
  """Absmax block quantization to `bits` without error feedback (like ZeRO++ qgZ).

  The leaves are cut into blocks of at most `block_size` elements as `loco`'s buckets cut them,
  with one float32 scale each, s = (2**(bits-1) - 1) / max|g|; d = round(s * g) / s. It runs
  `loco(beta=1.0)` from a zero error every step. With an axis the output is the mean of every device's d over LoCo's wire: one
  all-to-all of packed codes and scales, a float32 average of this device's shard, and a
  bfloat16 all-gather (bits + 16 bits a parameter). A non-finite gradient (on any device) makes
  every output NaN; finite ones give finite outputs (q / s, the mean and the casts saturate at
  the largest finite value, as in `loco`). Non-float and zero-size leaves pass through; dtypes
  are kept.

  Example:
    >>> opt = optax.chain(loco_jax.baselines.int_quantized(bits=4), optax.adamw(3e-4))
    >>> state = opt.init(params)
    >>> updates, state = opt.update(grads, state, params)
  """
  _check_bits(bits)
  _check_block_size(block_size)
  # loco with beta = 1 and an error that starts at 0 every step: the same blocks (buckets), the
  # same kernels and wire, and no state to keep.
  inner = loco(bits, beta=1.0, block_size=block_size, axis_name=axis_name)

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    out, _ = inner.update(updates, inner.init(updates))
    return out, state

  return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update_fn)


def _feedback(codec: _Codec, axis_name: AxisName | None, who: str,
              beta: float = 0.0) -> optax.GradientTransformationExtraArgs:
  """Classic error feedback around `codec`: h = g + e, send C(h), e' = h - d (float32); with
  `beta`, LoCo's moving average e' = beta e + (1 - beta)(h - d) (an experiments' ablation)."""
  def init_fn(params):
    return ErrorFeedbackState(_flat_zeros(params))

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    trees.check_state_matches(who, updates, state, jax.eval_shape(init_fn, updates))
    step = _step(updates)
    if not step.chosen:
      return updates, state
    errors = step.of(state.error)
    hs = [quant.saturate(step.flat(i) + errors[i]) for i in step.chosen]  # finite, never inf
    messages, decoded = _encode(codec, hs, axis_name, who)
    means, flags = _average(codec, messages, decoded, step.flag, axis_name)
    new_errors = list(errors)
    for i, h, d in zip(step.chosen, hs, decoded):
      new_errors[i] = (h - d if beta == 0  # h and d share their sign: no overflow
                       else quant.saturate(beta * errors[i] + (1.0 - beta) * (h - d)))
    new_errors = _keep_if(jnp.isfinite(flags), new_errors, errors)
    return step.outputs(means, flags), ErrorFeedbackState(step.treedef.unflatten(new_errors))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def error_feedback(bits: int = 4, block_size: int = 2048,
                   axis_name: AxisName | None = None) -> optax.GradientTransformationExtraArgs:
  """Classic error feedback (Seide et al. 2014) around `int_quantized`, error in float32.

  h = g + e; d = Q(h) (absmax blocks of about `block_size`, `bits` bits); e' = h - d; the
  output is d, or with an axis the mean of every device's d over the same wire as
  `int_quantized`. This is `loco(beta=0)` with the error kept exactly.

  With an axis, create the state inside `jax.shard_map` and declare it with
  `loco_jax.state_specs` (or use `parallel.init_opt_state`): the error differs per device.
  A non-finite gradient (on any device of the axis) makes every output NaN and leaves the
  state unchanged; finite ones give finite outputs and errors (h = g + e, the means and the
  casts saturate at the largest finite value). Non-float and zero-size leaves pass through;
  dtypes are kept.

  Example:
    >>> opt = optax.chain(loco_jax.baselines.error_feedback(bits=4), optax.adamw(3e-4))
    >>> state = opt.init(params)
    >>> updates, state = opt.update(grads, state, params)
  """
  _check_bits(bits)
  _check_block_size(block_size)
  return _feedback(_block_codec(bits, block_size), axis_name, "error_feedback")


def sign_ef(block_size: int = 2048,
            axis_name: AxisName | None = None) -> optax.GradientTransformationExtraArgs:
  """1-bit sign compression with error feedback (the compressor of 1-bit Adam).

  h = g + e; per block of about `block_size` elements s = mean |h| (sent as float32) and
  d = s * sign(h) (sign(0) = +1), one bit per element; e' = h - d in float32. With an axis,
  one all-to-all carries the packed signs and scales, each device averages its shard in float32
  and a bfloat16 all-gather returns it (1 + 16 bits a parameter).

  With an axis, create the state inside `jax.shard_map` and declare it with
  `loco_jax.state_specs` (or use `parallel.init_opt_state`): the error differs per device.
  A non-finite gradient (on any device of the axis) makes every output NaN and leaves the
  state unchanged; finite ones give finite outputs and errors (h = g + e, the means and the
  casts saturate at the largest finite value). Non-float and zero-size leaves pass through;
  dtypes are kept.

  Example:
    >>> opt = optax.chain(loco_jax.baselines.sign_ef(), optax.adamw(3e-4))
    >>> state = opt.init(params)
    >>> updates, state = opt.update(grads, state, params)
  """
  _check_block_size(block_size)
  return _feedback(_sign_codec(block_size), axis_name, "sign_ef")


def topk_ef(fraction: float = 0.01,
            axis_name: AxisName | None = None) -> optax.GradientTransformationExtraArgs:
  """Top-k sparsification with error feedback: the k = max(1, round(fraction * size)) entries of
  largest |h| of each leaf are sent, the rest kept in the float32 error.

  h = g + e; d = h on the top-k entries, 0 elsewhere; e' = h - d. With an axis, one all-gather
  carries every device's (int32 index, float32 value) pairs of every leaf; each device sums
  them (scatter-add) and divides by the device count: each device sends (N - 1) * 64 * fraction
  bits a parameter (its pairs to each of N - 1 peers).

  With an axis, create the state inside `jax.shard_map` and declare it with
  `loco_jax.state_specs` (or use `parallel.init_opt_state`): the error differs per device.
  A non-finite gradient (on any device of the axis) makes every output NaN and leaves the
  state unchanged; finite ones give finite outputs and errors (h = g + e, the means and the
  casts saturate at the largest finite value). Non-float and zero-size leaves pass through;
  dtypes are kept.

  Example:
    >>> opt = optax.chain(loco_jax.baselines.topk_ef(fraction=0.01), optax.adamw(3e-4))
    >>> state = opt.init(params)
    >>> updates, state = opt.update(grads, state, params)
  """
  _check_fraction(fraction)
  return _feedback(_topk_codec(float(fraction)), axis_name, "topk_ef")


def ef21(bits: int = 4, block_size: int = 2048,
         axis_name: AxisName | None = None) -> optax.GradientTransformationExtraArgs:
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
    >>> opt = optax.chain(loco_jax.baselines.ef21(bits=4), optax.adamw(3e-4))
    >>> state = opt.init(params)
    >>> updates, state = opt.update(grads, state, params)
  """
  _check_bits(bits)
  _check_block_size(block_size)
  codec = _block_codec(bits, block_size)

  def init_fn(params):
    return EF21State(_flat_zeros(params), _flat_zeros(params))

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    trees.check_state_matches("ef21", updates, state, jax.eval_shape(init_fn, updates))
    step = _step(updates)
    if not step.chosen:
      return updates, state
    local, estimate = step.of(state.local), step.of(state.estimate)
    hs = [quant.saturate(step.flat(i) - local[i]) for i in step.chosen]
    messages, decoded = _encode(codec, hs, axis_name, "ef21")
    means, flags = _average(codec, messages, decoded, step.flag, axis_name)
    new_local, new_estimate = list(local), list(estimate)
    for i, c, c_mean in zip(step.chosen, decoded, means):
      new_local[i] = quant.saturate(local[i] + c)
      new_estimate[i] = quant.saturate(estimate[i] + c_mean)
    new_local, new_estimate = _keep_if(jnp.isfinite(flags), (new_local, new_estimate),
                                       (local, estimate))
    out = step.outputs([new_estimate[i] for i in step.chosen], flags)
    return out, EF21State(step.treedef.unflatten(new_local), step.treedef.unflatten(new_estimate))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
