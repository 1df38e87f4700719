"""4-bit gradient compression with an 8-bit, moving-averaged, periodically reset error (LoCo)."""

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from loco_jax import comm, kernels
from loco_jax.core import buckets, feedback, leaves, quant
from loco_jax.comm import AxisName, bucketed
from loco_jax.transforms.loco_state import LocoState, check_state

GATHER_MODES = ("bf16", "quantized")

# What `loco` uses for the arguments left at None, by bit width (the "Low-bit LoCo" sweep in
# docs/EXPERIMENTS.md chose 2 and 3 bits; every other width keeps the paper's recipe).
BIT_WIDTH_DEFAULTS = {
    2: dict(scale_method="rms", clip_rms=1.5, block_size=128, beta=0.8, error_bits=8),
    3: dict(scale_method="rms", clip_rms=3.0, block_size=256, beta=0.8, error_bits=8),
}
PAPER_DEFAULTS = dict(scale_method="absmax", clip_rms=None, block_size=2048, beta=0.8,
                      error_bits=8)


def defaults_for(bits: int) -> dict:
  """The settings `loco(bits=bits)` uses for arguments left at None (`BIT_WIDTH_DEFAULTS`, else
  the paper's: absmax blocks of 2048, beta 0.8, an 8-bit error).

  Example:
    >>> defaults_for(2)["scale_method"], defaults_for(4)["block_size"]
    ('rms', 2048)
  """
  return dict(BIT_WIDTH_DEFAULTS.get(bits, PAPER_DEFAULTS))


def _resolve_defaults(bits, scale, scale_method, clip_rms, block_size, beta, error_bits):
  """(scale_method, clip_rms, block_size, beta, error_bits) with None replaced by the width's
  default; ValueError where the given ones contradict each other."""
  if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)):
    return scale_method, clip_rms, block_size, beta, error_bits  # _check_args says why
  table = defaults_for(int(bits))
  pick = lambda value, name: table[name] if value is None else value
  block_size, beta, error_bits = (pick(block_size, "block_size"), pick(beta, "beta"),
                                  pick(error_bits, "error_bits"))
  if scale is not None:
    if scale_method not in (None, "absmax") or clip_rms is not None:
      raise ValueError(f"a fixed scale={scale!r} replaces the block scales: scale_method="
                       f"{scale_method!r} and clip_rms={clip_rms!r} do not apply to it")
    return "absmax", None, block_size, beta, error_bits
  if scale_method is None:
    scale_method = table["scale_method"]
    if clip_rms is not None and scale_method != "rms":
      raise ValueError(f"clip_rms={clip_rms!r} needs scale_method='rms' (the default at "
                       f"bits={bits} is {scale_method!r})")
  if scale_method == "rms" and clip_rms is None:
    if table["clip_rms"] is None:
      raise ValueError(f"scale_method='rms' at bits={bits} has no default clip_rms: pass one "
                       f"(the top code sits at clip_rms x the block's rms; 2 bits use "
                       f"{BIT_WIDTH_DEFAULTS[2]['clip_rms']}, 3 bits "
                       f"{BIT_WIDTH_DEFAULTS[3]['clip_rms']})")
    clip_rms = table["clip_rms"]
  if not _concrete(clip_rms):
    raise ValueError("clip_rms must be a Python float: the kernel bakes it in (under "
                     "optax.inject_hyperparams pass it in static_args)")
  quant.check_scale_method(scale_method, clip_rms)
  return scale_method, clip_rms, block_size, beta, error_bits


def _concrete(x) -> bool:
  return not isinstance(x, jax.core.Tracer)


def _check_args(bits, scale, error_bits, error_scale, beta, reset_interval, block_size, gather):
  hint = (" (under optax.inject_hyperparams pass it in static_args, e.g. static_args=('bits', "
          "'error_bits', 'reset_interval', 'block_size', 'axis_name', 'gather', 'scatter', "
          "'scale_method', 'clip_rms'))")
  for name, value in (("bits", bits), ("error_bits", error_bits)):
    try:
      quant.check_bits(value, name)
    except ValueError as e:
      raise ValueError(str(e) + hint) from None
  for name, value in (("reset_interval", reset_interval), ("block_size", block_size)):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
      raise ValueError(f"{name} must be a Python int, got {value!r}{hint}")
  if reset_interval < 0:
    raise ValueError(f"reset_interval must be >= 0 (0 never resets), got {reset_interval}")
  if block_size <= 0:
    raise ValueError(f"block_size must be a positive int, got {block_size}")
  if _concrete(beta) and not 0.0 <= float(beta) <= 1.0:
    raise ValueError(f"beta must be in [0, 1] (0 is classic error feedback), got {beta}")
  for name, value in (("scale", scale), ("error_scale", error_scale)):
    # Both s and 1 / s must be normal float32 numbers: CPUs and GPUs flush subnormals, and then
    # q / s is NaN (0 / 0) or inf for s below 2**-126, and silently 0 for s above 2**126.
    if value is not None and _concrete(value) and not (
        np.isfinite(value) and quant.TINY <= float(value) <= 1 / quant.TINY):
      raise ValueError(f"{name} must be None (absmax block scales) or a float in "
                       f"[2**-126, 2**126] (s and 1 / s normal float32), got {value}")
  if gather not in GATHER_MODES:
    raise ValueError(f"gather must be one of {GATHER_MODES}, got {gather!r}")


def _probe_kernel(bits: int, scale, error_bits: int, error_scale, beta, block_size: int,
                  scale_method: str = "absmax", clip_rms: float | None = None) -> None:
  """Runs the Pallas kernels' check (`kernels.pallas_report`) for these settings now, outside
  any trace.

  On GPU/TPU `auto` checks the Pallas kernels against the float64 reference by compiling and
  running small ones. Inside a jax.shard_map trace that check cannot run, and the step would
  take jnp; building the transformation (outside jit) caches the answer instead, for the step
  and for the receive-side mean (`dequantize_mean` is checked with error_bits 8, beta 0.8).
  """
  if _concrete(beta):
    kernels.chosen_implementation(bits=bits, error_bits=error_bits, beta=float(beta),
                                  block_size=block_size, scale_method=scale_method,
                                  clip_rms=clip_rms)
    kernels.chosen_implementation(bits=bits)


# The LoCo step pieces live in core.feedback and the leaf plumbing in core.leaves; the tests
# reach the unfused step by this name.
_reference_step = feedback.reference_step


def loco(
    bits: int = 4,
    scale: float | None = None,
    error_bits: int | None = None,
    error_scale: float | None = None,
    beta: float | None = None,
    reset_interval: int = 1024,
    block_size: int | None = None,
    axis_name: AxisName | None = None,
    gather: str = "bf16",
    scatter: bool = False,
    specs: Any = None,
    scale_method: str | None = None,
    clip_rms: float | None = None,
) -> optax.GradientTransformationExtraArgs:
  """Compresses gradients to `bits` with LoCo's error feedback; averages them over `axis_name`.

  Each step (k = count before it): the error is zeroed if reset_interval > 0 and k is a positive
  multiple of it; h = g + e; q = compress(h; s, bits) is what is sent (packed); d = q / s;
  e' = compress(beta * e + (1 - beta) * (h - d); s_e, error_bits). `scale=None` uses one absmax
  scale per block of about `block_size` elements (sent with the data); a float is the paper's
  fixed scale (2**17..2**19 for LLMs); `error_scale` likewise for the stored error (paper: 4s
  to 6s). beta = 0 is classic error feedback. `scale_method="rms"` puts the top code at
  `clip_rms` times the block's rms instead of at its max|h| (s = qmax / min(clip_rms x rms,
  max|h|), `quant.rms_scale`): values beyond it are clipped and the clipped part goes into the
  error like any other; at 2 and 3 bits this keeps most values off zero (an absmax scale
  rounds ~90% of a Gaussian block to 0 at 2 bits) and the grid's -2**(bits-1) code in use.

  Arguments left at None take the default for `bits` (`defaults_for`; chosen by the sweep in
  docs/EXPERIMENTS.md, "Low-bit LoCo"):

    bits     scale_method  clip_rms  block_size  beta  error_bits   payload bits/param
    2        rms           1.5       128         0.8   8            2 + 32/128 = 2.25
    3        rms           3.0       256         0.8   8            3 + 32/256 = 3.125
    others   absmax        -         2048        0.8   8            bits + 32/2048

  (the scales are float32, one per block, sent with the codes). `loco(bits=4)` is the paper's
  recipe as before.

  The leaves are laid out once, from their shapes, in a few buckets (`buckets.plan`: each
  leaf's per-device rows cut into whole blocks of `block_size`, a remainder into smaller blocks
  of a power-of-two multiple of 8, so no block straddles two leaves); the step runs one
  `kernels.compress_step` per bucket, whatever the leaf count. The state is kept in the same
  buckets (`LocoState`; `error_by_leaf` shows it per leaf).

  With `axis_name=None` the output is d (local compression: one device, or a simulation). With
  a mesh axis, inside `jax.shard_map`, the output is the mean over the axis of every device's d:
  one all-to-all carries every bucket's packed codes and scales, each device averages its shard
  of each bucket with `kernels.dequantize_mean`, and an all-gather returns the averaged shards
  in bfloat16 (`gather="bf16"`, 4 + 16 bits a parameter) or re-quantized to `bits` with a second
  error kept for the shard (`gather="quantized"`, about 4 + 4). `scatter=True` skips the gather
  and returns this device's shard of each leaf, flat [comm.shard_len(size, axis size)]: the
  per-leaf shard layout of sharded optimizers (`parallel`'s zero2), taken out of the buckets
  (row j of every bucket is device j's shard of every leaf). With an axis, create the state
  inside `shard_map` and declare it with `state_specs`: the errors differ per device.

  Leaves sharded over mesh axes other than `axis_name` (a model axis) are compressed and sent
  as each device's own block (`core.leaves`): manual axes need nothing, Explicit axes are read
  from the gradients' types, and Auto axes inside a shard_map manual over the data axes need
  `specs` (the params' PartitionSpecs, or the `leaves.leaf_specs` context manager); the
  state's buckets of such leaves are split over those axes too, and `init` and `update` give
  it the same sharding.

  Non-float and zero-size leaves pass through. A non-finite gradient (on any device of the
  axis) makes every output NaN and leaves the state unchanged, so the error is never poisoned;
  wrap the chain in `optax.apply_if_finite` to skip such steps. Finite gradients give finite
  outputs and state: where the arithmetic would overflow (g + e, q / s or the mean near the
  float32 maximum, the bfloat16 gather, the cast back to a float16 or bfloat16 leaf) the values
  saturate at the largest finite one, and the average is a sum of x / 2**k (`quant.mean_factors`).

  Example:
    >>> opt = optax.chain(loco_jax.loco(bits=4), optax.adamw(3e-4))
    >>> state = opt.init(params)
    >>> updates, state = opt.update(grads, state, params)
  """
  scale_method, clip_rms, block_size, beta, error_bits = _resolve_defaults(
      bits, scale, scale_method, clip_rms, block_size, beta, error_bits)
  _check_args(bits, scale, error_bits, error_scale, beta, reset_interval, block_size, gather)
  _probe_kernel(bits, scale, error_bits, error_scale, beta, block_size, scale_method, clip_rms)
  if gather == "quantized" and axis_name is None:
    raise ValueError("gather='quantized' needs an axis_name: there is no gather without one")
  if scatter and axis_name is None:
    raise ValueError("scatter=True needs an axis_name: without one there is nothing to scatter "
                     "(the output is the whole local gradient)")
  if scatter and gather != "bf16":
    raise ValueError(f"gather={gather!r} has no effect with scatter=True (no gather follows the "
                     f"scatter): pass one of them, not both")
  quantized_gather = gather == "quantized" and not scatter

  def rows_on_axis() -> int:
    return 1 if axis_name is None else comm.axis_size(axis_name)

  def plans(parts: leaves.Leaves) -> list[tuple[str, list[int], buckets.Plan]]:
    """The bucket layout of each group of leaves, with its key in the state (one group unless
    some leaves are sharded over a model axis and others not: those differ per shard, these
    do not)."""
    rows = rows_on_axis()
    return [(leaves.group_key(axes), group,
             buckets.plan(tuple(x.size if i in group else 0
                                for i, x in enumerate(parts.leaves)), rows, block_size))
            for axes, group in zip(parts.group_axes, parts.groups)]

  def init_body(params):
    groups = plans(leaves.split(params, axis_name))
    zeros = lambda dtype, size: {key: tuple(
        jnp.zeros((size(p.rows, blocks, n),), dtype) for blocks, n in zip(p.blocks, p.block_lens))
                                 for key, _, p in groups}
    block_scales = error_scale is None
    return LocoState(
        count=jnp.zeros([], jnp.int32),
        error=zeros(jnp.int8, lambda rows, blocks, n: rows * blocks * n),
        error_scale=zeros(jnp.float32, lambda rows, blocks, n: rows * blocks)
        if block_scales else None,
        gather_error=zeros(jnp.int8, lambda rows, blocks, n: blocks * n)
        if quantized_gather else None,
        gather_scale=zeros(jnp.float32, lambda rows, blocks, n: blocks)
        if quantized_gather and block_scales else None)

  def compress(g_b: list, errors: tuple, error_scales: tuple | None, reset, local: bool,
               skip=None) -> tuple:
    """LoCo's step on every gradient bucket [rows, blocks, len] with its error bucket: (packed
    [rows, blocks, len * bits / 8], scales [rows, blocks] (None with a fixed scale), the new
    error and error scale buckets (flat, as the state holds them), the decompressed buckets
    (local mode), all finite). `skip`: see `kernels.compress_step`."""
    packed, scales, new_e, new_es, decompressed, finite = [], [], [], [], [], jnp.bool_(True)
    for c, g in enumerate(g_b):
      rows, blocks, n = g.shape
      out = kernels.compress_step(
          g.reshape(-1), errors[c], None if error_scales is None else error_scales[c],
          bits=bits, error_bits=error_bits, beta=beta, reset=reset, block_size=n,
          decompressed=local, fixed_scale=scale, fixed_error_scale=error_scale,
          scale_method=scale_method, clip_rms=clip_rms, skip=skip)
      packed.append(out.packed.reshape(rows, blocks, -1))
      scales.append(out.scales.reshape(rows, blocks))
      new_e.append(out.error)
      new_es.append(out.error_scale)
      decompressed.append(None if out.decompressed is None else
                          out.decompressed.reshape(rows, blocks, n))
      finite &= out.finite
    return (packed, None if scale is not None else scales, tuple(new_e),
            None if error_scale is not None else tuple(new_es), decompressed, finite)

  def exchange(p: buckets.Plan, k: jax.Array, g_b: list, state: list, reset,
               skip=None) -> tuple:
    """One group's step: compress its gradient buckets, average them over the axis
    (all-to-all, receive-side mean, gather). -> (a function that takes the values per leaf out
    of the buckets, flags, a values bucket, the group's new state fields)."""
    errors, error_scales, gather_errors, gather_scales = state
    firsts = buckets.starts(p, k)
    packed, scales, new_e, new_es, local_d, finite = compress(
        g_b, errors, error_scales, reset, axis_name is None, skip)
    new_state = [new_e, new_es, None, None]
    take_values = buckets.from_buckets
    if axis_name is None:
      flags, values = leaves.flag(finite), local_d
    else:
      means, flags = bucketed.all_to_all_mean(packed, scales, scale, bits, leaves.flag(finite),
                                              axis_name)
      if scatter:
        # No gather follows to bring the flags back replicated: one 4-byte all-reduce does.
        flags, values, take_values = (jax.lax.psum(leaves.flag(finite), axis_name), means,
                                      buckets.shards)
      elif gather == "bf16":
        values, flags = bucketed.gather_bf16(means, p, flags, axis_name)
      else:
        # The averaged shard is re-quantized with its own error: this device's row of every
        # bucket (zero where a leaf is padded, as every peer's codes there are).
        shard_packed, shard_scales, new_state[2], new_state[3], _, _ = compress(
            [m.reshape(1, b, n) for m, b, n in zip(means, p.blocks, p.block_lens)],
            gather_errors, gather_scales, reset, False)
        values, flags = bucketed.gather_packed(
            [x[0] for x in shard_packed],
            None if shard_scales is None else [s[0] for s in shard_scales], scale, bits, p,
            flags, axis_name)
    return lambda: take_values(values, p, firsts), flags, values[0], new_state

  def update_body(updates, state):
    check_state(state, init_body(updates))
    parts, k = leaves.split(updates, axis_name), state.count
    if not parts.chosen:  # nothing to compress or send
      return updates, state._replace(count=optax.safe_increment(k))
    reset = feedback.is_due(k, reset_interval)
    filled = [(key, group, p, buckets.to_buckets(
        [parts.flat(i) if i in group else None for i in range(len(parts.leaves))], p))
              for key, group, p in plans(parts)]
    checked = None
    if axis_name is None and jax.default_backend() in leaves.SKIP_BY_COND and any(
        p.has_bare_leaf() for _, _, p, _ in filled):
      # `keep_or_skip`'s lax.cond would copy such a leaf (the bucket itself, an operand of the
      # cond): 64 MiB a step on one leaf of 2**24. So local mode checks the gradient buckets
      # first, and the step itself writes NaN updates and keeps the state where it is skipped.
      # (With many leaves the cond stays: it keeps XLA from fusing a small bucket's arithmetic
      # into every leaf's slice, 32% more kernel code on the GPT-2 tree.)
      finite = functools.reduce(jnp.logical_and, [buckets.finite(g) for *_, g_b in filled
                                                  for g in g_b])
      checked = parts.agree(leaves.flag(finite))
    skip = None if checked is None else jnp.isnan(checked)
    old = list(state[1:])
    takes, value_likes, flags, new = [], {}, jnp.float32(0), [{} for _ in old]
    for key, group, p, g_b in filled:
      take, group_flags, value_like, group_new = exchange(
          p, k, g_b, [None if f is None else f[key] for f in old], reset, skip)
      takes.append(take)
      value_likes.update(dict.fromkeys(group, value_like))
      flags = flags + group_flags
      for f, n in zip(new, group_new):
        f[key] = n
    new = [None if f is None else n for f, n in zip(old, new)]
    # Every shard, like every device of the axis, keeps or skips.
    flags = parts.agree(flags) if checked is None else checked

    def taken() -> list:
      values = [None] * len(parts.leaves)
      for take in takes:
        values = leaves.merge(take(), values)
      return values

    update, kept = parts.keep_or_skip(
        flags, taken, value_likes, new, old,
        rows_on_axis() if scatter and axis_name is not None else None,
        checked=checked is not None)
    return update, LocoState(jnp.where(jnp.isfinite(flags), optax.safe_increment(k), k), *kept)

  init_fn = leaves.local_init(init_body, axis_name, specs, "loco")
  update_fn = leaves.local_update(update_body, axis_name, specs,
                                  flat_output=scatter and axis_name is not None, who="loco")
  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def state_specs(state: Any, axis_name: AxisName) -> Any:
  """PartitionSpecs for an optimizer state, for `jax.shard_map` over `axis_name`.

  Fields that a state class lists in `PER_DEVICE` (LoCo's errors, a baseline's error) differ per
  device, so they are split over the axis (their global arrays stack every device's copy);
  every other leaf (step counters, the state of adamw after the average) is replicated.
  Example:
    >>> state = loco().init(params)   # with an axis_name: created inside jax.shard_map
    >>> specs = state_specs(state, "data")
    >>> specs.error[""][0] == P("data"), specs.count == P()   # per device; replicated
    (True, True)
  """
  def spec(node):
    if hasattr(node, "PER_DEVICE") and hasattr(node, "_fields"):
      return type(node)(*[
          jax.tree.map(lambda _: P(axis_name) if name in node.PER_DEVICE else P(), value)
          for name, value in zip(node._fields, node)])
    return jax.tree.map(lambda _: P(), node)
  return jax.tree.map(spec, state, is_leaf=lambda n: hasattr(n, "PER_DEVICE"))
