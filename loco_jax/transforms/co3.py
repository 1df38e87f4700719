"""CO3: small-float conversion with a GenNorm-fitted scale, Huffman coding, decaying error feedback."""

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from loco_jax.codecs import fp, gennorm, huffman
from loco_jax.core.layout import AxisName
from loco_jax.core import leaves, local_blocks, quant
# The host side; `_code` and `_decode_all` are also read by the tests from here.
from loco_jax.transforms.co3_host import (DECODED_KEPT, _code, _decode_all, _host,  # noqa: F401
                                          _roundtrip)

FORMATS = {"fp4": fp.FP4, "fp8": fp.FP8}
FIT_SAMPLES = 65_536      # per leaf, strided: the fit needs the shape, not every value
CAPACITY_MARGIN_BITS = 0.3
# Stream header (magic, count, CRC, code lengths: under 200 bytes) and lane table (~10 bits a
# lane of 2048 letters), as huffman.encode writes them.
HEADER_BYTES = 200
LANE_TABLE_BYTES_PER_SYMBOL = 2 / huffman.LANE_LETTERS
MIN_BETA = 0.35           # below it p(beta) is not a fit any more
SATURATION_QUANTILE = 0.99


class Co3State(NamedTuple):
  """CO3's state; every field but `count` and `overflows` differs per device."""
  count: jax.Array        # int32 steps taken; drives the refits
  error: optax.Updates    # float32 [size] per leaf: e = a - q
  scale: optax.Updates    # float32 [1] per leaf: the small-float scale from the last fit
  coded_bits: jax.Array   # float32 [1]: this device's Huffman-coded bits per parameter, last step
  overflows: jax.Array    # int32: steps whose coded size did not fit the collective's capacity

  PER_DEVICE = ("error", "scale", "coded_bits")


def fitted_scale(fmt: fp.FloatFormat, beta: float, alpha: float) -> float:
  """The scale CO3 uses for a GenNorm(beta, alpha) layer: p(beta)/alpha for fp4, else 1/alpha.

  p is fitted for beta >= 0.35 (REFERENCES.md), so smaller shapes use p(0.35). For fp8 the MSE
  hardly depends on the scale while values stay in range, and 1/alpha keeps them far from both
  its subnormals and its maximum.
  """
  return gennorm.fp4_scale(max(beta, MIN_BETA), alpha) if fmt == fp.FP4 else 1.0 / alpha


def default_capacity_bits(fmt: fp.FloatFormat) -> float:
  """Bits per symbol that a coded buffer reserves: the largest entropy of the fitted model over
  beta in [0.2, 3] (gradients seen in practice), plus a margin for Huffman's own overhead.
  """
  betas = np.linspace(0.2, 3.0, 15)
  worst = max(gennorm.entropy_bits(fmt, b, 1.0, fitted_scale(fmt, b, 1.0)) for b in betas)
  return min(worst + CAPACITY_MARGIN_BITS, float(fmt.bits))


def _absmax_scale(fmt: fp.FloatFormat, absmax, fallback):
  """max_value / absmax inside fp.scale_range (numpy or jnp); `fallback` where absmax is 0."""
  xp = jnp if isinstance(absmax, jax.Array) else np
  low, high = fp.scale_range(fmt)
  with np.errstate(divide="ignore", over="ignore"):  # absmax 0: replaced by the fallback
    scale = xp.clip(fp.max_value(fmt) / absmax, low, high).astype(np.float32)
  return xp.where(absmax > 0, scale, fallback)


def _fit_scales(fmt: fp.FloatFormat, sizes: tuple[int, ...], previous: np.ndarray,
                absmax: np.ndarray, samples: np.ndarray) -> np.ndarray:
  """Host side: one GenNorm fit per leaf, inside fp.scale_range.

  A leaf that cannot be fitted (fewer than two non-zero sampled values) takes the absmax
  scale of the whole leaf, or keeps its scale if the leaf is all zeros.
  """
  scales, start = np.array(previous, np.float32), 0
  low, high = fp.scale_range(fmt)
  for i, n in enumerate(sizes):
    x = samples[start:start + n]
    start += n
    # Exact zeros (dead units, unused embedding rows) are coded exactly at any scale; left in,
    # a few percent of them pull the fitted beta to its floor and the scale with it.
    x = x[x != 0]
    try:
      fit = gennorm.fit(x)
    except ValueError:  # all zeros or a single value: nothing to fit
      scales[i] = _absmax_scale(fmt, np.float32(absmax[i]), scales[i])
      continue
    # Where the data are heavier-tailed than the fit (tiny beta), cap the scale so that at
    # most 1% of the values saturate.
    tail = np.quantile(np.abs(x), SATURATION_QUANTILE)
    cap = fp.max_value(fmt) / tail if tail > 0 else np.inf
    # Clipped so that no level overflows on the way back, nor the scale underflows (fp8's
    # 1 / alpha of data near float32's maximum would be a denormal, flushed to 0).
    scales[i] = np.clip(min(fitted_scale(fmt, fit.beta, fit.alpha), cap), low, high)
  return scales


def co3(
    fmt: str = "fp4",
    gamma: float = 0.7,
    refit_interval: int = 100,
    entropy_code: bool = True,
    axis_name: AxisName | None = None,
    capacity_bits: float | None = None,
    specs: Any = None,
) -> optax.GradientTransformationExtraArgs:
  """CO3's Convert, Compress, Correct as an optax transformation; averages over `axis_name`.

  Each step: a = g + gamma * e; every `refit_interval` steps (and at the first) a GenNorm fit of
  each leaf's a sets its scale (p(beta)/alpha for fp4); q = Q(a) in the small-float `fmt` is what
  is sent, as uint8 symbols; e = a - q. With `entropy_code`, the symbols of all leaves go through
  the Huffman codec in one host callback a step and the decoded symbols are used; the coded
  size is kept in `state.coded_bits` (bits per parameter).

  With `axis_name` (inside `jax.shard_map`), every device codes its symbols into a buffer of
  fixed capacity (collectives have static shapes: `capacity_bits` per symbol, by default the
  fitted model's worst entropy plus a margin, `default_capacity_bits(fmt)`, plus a header),
  the buffers and the per-leaf scales are all-gathered, and every device decodes and
  averages them (the federated server average). A device whose stream does not fit sends its
  raw symbols in a second, conditional all-gather that step, so no data is ever lost; such
  steps are counted in `state.overflows`. Without `entropy_code` the raw symbols are gathered.

  A leaf with fewer than two non-zero values (a scalar, a one-hot gradient) has no shape to
  fit: its scale is max_value(fmt) / max|a| every step, so its output tracks it.

  Finite in, finite out: a finite gradient never yields a non-finite output or state. a is
  computed saturating at float32's largest finite value, scales stay in
  fp.scale_range(fmt) (so q is finite and never flushed to 0; fp4 therefore tops out at
  3 * 2**126 = 2.6e38, beyond which values saturate), the average over devices
  divides before it sums, and the output saturates at the largest finite value of each
  leaf's dtype (fp16: 65504) before the cast back. NaN output is reserved for non-finite
  input: a non-finite gradient (on any device) makes every output NaN and leaves the state
  unchanged.

  A peer stream that does not decode to exactly this step's symbol count (corrupt, or coded
  for another shape) raises ValueError in the host callback; the step fails with a
  jax.errors.JaxRuntimeError carrying that message, never with a silently changed average.
  A gradient tree that does not match the state raises ValueError naming the leaf. Leaves
  sharded over mesh axes other than `axis_name` are coded as each device's own block, as in
  `loco` (`specs`).

  Example:
    >>> opt = optax.chain(loco_jax.co3("fp4", gamma=0.7), optax.sgd(0.1))
  """
  if fmt not in FORMATS:
    raise ValueError(f"fmt must be one of {tuple(FORMATS)}, got {fmt!r}")
  if not (isinstance(gamma, jax.core.Tracer) or 0.0 <= float(gamma) <= 1.0):
    raise ValueError(f"gamma must be in [0, 1] (1 is classic error feedback, 0 none), "
                     f"got {gamma}")
  if isinstance(refit_interval, bool) or not isinstance(refit_interval, int) or refit_interval < 1:
    raise ValueError(f"refit_interval must be an int >= 1, got {refit_interval!r}")
  small_float = FORMATS[fmt]
  if capacity_bits is None:
    capacity_bits = default_capacity_bits(small_float)
  elif not 0 < capacity_bits <= 8:
    raise ValueError(f"capacity_bits must be in (0, 8] bits per symbol or None, got "
                     f"{capacity_bits}")
  pairs = small_float.bits <= 4

  def init_fn(params):
    return Co3State(
        count=jnp.zeros([], jnp.int32),
        error=jax.tree.map(
            lambda x: jnp.zeros((x.size if leaves.compressible(x) else 0,), jnp.float32), params),
        scale=jax.tree.map(lambda x: jnp.ones((1,), jnp.float32), params),
        coded_bits=jnp.zeros((1,), jnp.float32),
        overflows=jnp.zeros([], jnp.int32))


  def convert(count, grads: list, errors: list, scales: list) -> tuple:
    """Convert: a = g + gamma * e, the scales (refitted every `refit_interval` steps), and the
    symbols. -> (a per leaf, scales [leaves], symbols [total] uint8)."""
    # Saturating: g + gamma * e may exceed float32 for finite g near its maximum.
    compensated = [quant.saturate(g + gamma * e) for g, e in zip(grads, errors)]
    old_scales = jnp.concatenate(scales)
    absmax = jnp.stack([jnp.max(jnp.abs(a)) for a in compensated])
    fitted = jax.lax.cond(
        count % refit_interval == 0,
        # A callback's result is typed replicated; it is this device's own.
        lambda: leaves.vary_like(_refit(small_float, compensated, old_scales, absmax),
                                 old_scales),
        lambda: old_scales)
    unfittable = jnp.stack([jnp.count_nonzero(a) < 2 for a in compensated])
    new_scales = jnp.where(unfittable, _absmax_scale(small_float, absmax, fitted), fitted)
    return compensated, new_scales, jnp.concatenate(
        [fp.encode(a, small_float, s) for a, s in zip(compensated, new_scales)])

  def exchange(symbols, new_scales, sizes: tuple, flag) -> tuple:
    """Compress and average one group's symbols. -> (values per leaf, flags, coded bytes,
    overflowed (0. or 1.))."""
    total, nbytes, overflowed = symbols.size, jnp.int32(0), 0.0
    if axis_name is None:
      if entropy_code:
        symbols, nbytes = _host(
            functools.partial(_roundtrip, pairs=pairs), (jax.ShapeDtypeStruct((total,), jnp.uint8),
                         jax.ShapeDtypeStruct((), jnp.int32)), symbols)
      return ([v[0] for v in _decode_leaves(symbols[None], new_scales[None], sizes, small_float)],
              flag, nbytes, overflowed)
    # Scales and the finiteness flag ride in one small gather, replicated afterwards.
    leaf_count = len(sizes)
    if entropy_code:
      capacity = HEADER_BYTES + math.ceil((capacity_bits / 8 + LANE_TABLE_BYTES_PER_SYMBOL)
                                          * total)
      buffer, nbytes = leaves.vary_like(_host(
          functools.partial(_code, capacity=capacity, pairs=pairs),
          (jax.ShapeDtypeStruct((capacity,), jnp.uint8), jax.ShapeDtypeStruct((), jnp.int32)),
          symbols), symbols)
      side = jnp.concatenate([new_scales, flag[None], jax.lax.bitcast_convert_type(
          nbytes, jnp.float32)[None]])
    else:
      side = jnp.concatenate([new_scales, flag[None]])
    side = jax.lax.all_gather(side, axis_name, to="invarying")
    peer_scales, flags = side[:, :leaf_count], side[:, leaf_count]
    if entropy_code:
      lengths = jax.lax.bitcast_convert_type(side[:, leaf_count + 1], jnp.int32)
      buffers = jax.lax.all_gather(buffer, axis_name, to="invarying")
      # The same on every device of the axis, and this model shard's own (as `buffers`).
      peer_symbols = leaves.vary_like(_host(
          functools.partial(_decode_all, total=total),
          jax.ShapeDtypeStruct((buffers.shape[0], total), jnp.uint8), buffers, lengths), buffers)
      overflowed = lengths > capacity
      peer_symbols = jax.lax.cond(
          jnp.any(overflowed),
          lambda: jnp.where(overflowed[:, None], _gather_raw(symbols, small_float, axis_name),
                            peer_symbols),
          lambda: peer_symbols)
      overflowed = jnp.any(overflowed).astype(jnp.float32)
    else:
      peer_symbols = _gather_raw(symbols, small_float, axis_name)
    values = _decode_leaves(peer_symbols, peer_scales, sizes, small_float)
    # Every device's flag: NaN where one saw a non-finite gradient. Never overflows.
    return [quant.mean_over_peers(v) for v in values], flags.sum(), nbytes, overflowed

  def update_body(updates, state):
    _flatten_matching(updates, state)  # ValueError naming a leaf the state does not fit
    parts = leaves.split(updates, axis_name)
    if not parts.sent:
      return updates, state
    errors, scales = parts.per_leaf(state.error), parts.per_leaf(state.scale)
    values, new_errors, new_scales = [None] * len(parts.leaves), list(errors), list(scales)
    flags, nbytes, symbols_sent, overflowed = jnp.float32(0), jnp.float32(0), 0, 0.0
    for group in [g.indices for g in parts.groups]:
      compensated, group_scales, symbols = convert(
          state.count, [parts.flat(i) for i in group], [errors[i] for i in group],
          [scales[i] for i in group])
      sizes = tuple(a.size for a in compensated)
      group_values, group_flags, group_bytes, group_overflowed = exchange(
          symbols, group_scales, sizes, leaves.flag(parts.finite(group)))
      sent = [v[0] for v in _decode_leaves(symbols[None], group_scales[None], sizes,
                                           small_float)]
      for j, i in enumerate(group):
        values[i] = group_values[j]
        new_errors[i] = compensated[j] - sent[j]
        new_scales[i] = group_scales[j:j + 1]
      flags = flags + group_flags
      nbytes = nbytes + group_bytes.astype(jnp.float32)
      symbols_sent += symbols.size
      overflowed = overflowed + group_overflowed
    flags = parts.agree(flags)  # every shard, like every device, keeps or skips the step
    finite = jnp.isfinite(flags)
    coded_bits = (8.0 * nbytes / symbols_sent if entropy_code
                  else jnp.float32(small_float.bits))
    if axis_name is not None and entropy_code:
      overflowed = parts.agree(jnp.asarray(overflowed, jnp.float32))
    new_errors, new_scales = leaves.keep_if(finite, (new_errors, new_scales), (errors, scales))
    return parts.outputs(values, flags), Co3State(
        count=jnp.where(finite, optax.safe_increment(state.count), state.count),
        error=parts.tree(new_errors),
        scale=parts.tree(new_scales),
        coded_bits=jnp.where(finite, coded_bits, state.coded_bits).reshape(1),
        overflows=state.overflows + (jnp.asarray(overflowed) > 0).astype(jnp.int32))

  return optax.GradientTransformationExtraArgs(
      local_blocks.local_init(init_fn, axis_name, specs, "co3"),
      local_blocks.local_update(update_body, axis_name, specs, name="co3"))


def _flatten_matching(updates, state: Co3State):
  """(leaves, treedef, errors, scales); ValueError naming the first leaf the state does not fit."""
  paths_and_leaves, treedef = jax.tree_util.tree_flatten_with_path(updates)
  try:
    errors = treedef.flatten_up_to(state.error)
    scales = treedef.flatten_up_to(state.scale)
  except (ValueError, TypeError) as e:
    raise ValueError(f"co3: the gradient tree does not match the state's (init's params): "
                     f"{e}") from None
  for (path, g), error in zip(paths_and_leaves, errors):
    expected = (g.size if leaves.compressible(g) else 0,)
    if error.shape != expected:
      raise ValueError(
          f"co3: gradient leaf {jax.tree_util.keystr(path)} has shape {tuple(g.shape)} "
          f"({g.dtype}) but the state holds an error of shape {tuple(error.shape)} for it "
          f"(expected {expected}): pass gradients shaped like the params given to init.")
  return [g for _, g in paths_and_leaves], treedef, errors, scales


def _refit(fmt: fp.FloatFormat, compensated: list[jax.Array], old_scales: jax.Array,
           absmax: jax.Array) -> jax.Array:
  """New per-leaf scales from one host callback over strided samples of every leaf."""
  samples = [a[:: max(1, a.size // FIT_SAMPLES)][:FIT_SAMPLES] for a in compensated]
  sizes = tuple(s.size for s in samples)
  return _host(functools.partial(_fit_scales, fmt, sizes),
               jax.ShapeDtypeStruct(old_scales.shape, jnp.float32),
               old_scales, absmax, jnp.concatenate(samples))


def _decode_leaves(symbols_DxT: jax.Array, scales_DxL: jax.Array, sizes: tuple[int, ...],
                   fmt: fp.FloatFormat) -> list[jax.Array]:
  """Every device's symbols -> per leaf [devices, size] float32 values with that device's scale."""
  values, start = [], 0
  for j, n in enumerate(sizes):
    values.append(fp.decode(symbols_DxT[:, start:start + n], fmt, scales_DxL[:, j:j + 1]))
    start += n
  return values


def _gather_raw(symbols: jax.Array, fmt: fp.FloatFormat, axis_name: AxisName) -> jax.Array:
  """All-gathers uncoded symbols, two fp4 symbols a byte: [devices, total] uint8."""
  if fmt.bits > 4:
    return jax.lax.all_gather(symbols, axis_name, to="invarying")
  padded = jnp.pad(symbols, (0, symbols.size % 2)).reshape(2, -1)
  packed = padded[0] | (padded[1] << 4)
  gathered = jax.lax.all_gather(packed, axis_name, to="invarying")
  both = jnp.concatenate([gathered & 15, gathered >> 4], axis=1)
  return both[:, : symbols.size]
