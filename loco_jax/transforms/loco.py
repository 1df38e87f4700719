"""4-bit gradient compression with an 8-bit, moving-averaged, periodically reset error (LoCo)."""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from loco_jax import comm, kernels
from loco_jax.core import buckets, quant, trees
from loco_jax.comm import AxisName, LeafLayout, Payload, bucketed

GATHER_MODES = ("bf16", "quantized")


class LocoState(NamedTuple):
  """LoCo's state. Every field but `count` differs per device: declare it with `state_specs`."""
  count: jax.Array            # int32 steps taken; drives the periodic reset
  error: optax.Updates        # int8 [size] per leaf: this device's averaged compression error
  error_scale: Any            # float32 [rows * blocks] per leaf, rows = devices on the axis
                              # (buckets.plan's blocks; None with a fixed `error_scale`)
  gather_error: Any           # int8 [row_len] per leaf: the shard's error (gather="quantized")
  gather_scale: Any           # float32 [blocks] per leaf (gather="quantized" with block scales)

  PER_DEVICE = ("error", "error_scale", "gather_error", "gather_scale")


def _concrete(x) -> bool:
  return not isinstance(x, jax.core.Tracer)


def _check_args(bits, scale, error_bits, error_scale, beta, reset_interval, block_size, gather):
  hint = (" (under optax.inject_hyperparams pass it in static_args, e.g. static_args=('bits', "
          "'error_bits', 'reset_interval', 'block_size', 'axis_name', 'gather', 'scatter'))")
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


def _compressible(x) -> bool:
  return jnp.issubdtype(x.dtype, jnp.floating) and x.size > 0


def _quantize_blocks(x: jax.Array, layout: LeafLayout, bits: int, scale) -> Payload:
  """[size] float32 -> int codes [rows, blocks, block_len] with absmax or fixed scales."""
  rows = comm.to_rows(x, layout)
  if scale is None:
    scales = quant.absmax_scale(rows, bits)
    return Payload(quant.compress(rows, scales[..., None], bits), scales)
  return Payload(quant.compress(rows, scale, bits), None)


def _dequantize_blocks(payload: Payload, layout: LeafLayout, scale) -> jax.Array:
  """Inverse of `_quantize_blocks`: -> [size] float32."""
  s = scale if payload.scales is None else payload.scales[..., None]
  return comm.from_rows(quant.decompress(payload.codes, s), layout)


class _Feedback(NamedTuple):
  sent: Payload             # the compressed h, laid out for the wire
  error: jax.Array          # int8 [size], the new stored error
  error_scale: Any          # float32 [blocks] or None
  finite: jax.Array         # bool []: every value of g was finite
  decompressed: Any         # d as float32 [size] (when asked for), else None


def _fusable(size: int, send: LeafLayout, scale, error_scale, beta, block_size: int) -> bool:
  """Whether `kernels.compress_step` can take the step: absmax scales for the payload and the
  error, a constant beta, and blocks of exactly `block_size` that line up with the wire rows."""
  return (scale is None and error_scale is None and _concrete(beta)
          and block_size % quant.PACK_UNIT == 0 and size % (send.rows * block_size) == 0)


def _probe_kernel(bits: int, scale, error_bits: int, error_scale, beta, block_size: int) -> None:
  """Runs the Pallas kernels' check (`kernels.pallas_report`) for these settings now, outside
  any trace.

  On GPU/TPU `auto` checks the Pallas kernels against the float64 reference by compiling and
  running small ones. Inside a jax.shard_map trace that check cannot run, and the step would
  take jnp; building the transformation (outside jit) caches the answer instead, for the step
  and for the receive-side mean (`dequantize_mean` is checked with error_bits 8, beta 0.8).
  """
  if _concrete(beta):
    kernels.chosen_implementation(bits=bits, error_bits=error_bits, beta=float(beta),
                                  block_size=block_size)
    kernels.chosen_implementation(bits=bits)


def _feedback_step(g: jax.Array, error: jax.Array, error_scales, send: LeafLayout, reset,
                   bits: int, scale, error_bits: int, error_scale, beta, block_size: int,
                   decompressed: bool = False, fuse: bool = True) -> _Feedback:
  """One LoCo step on one flat float32 leaf in `comm.leaf_layout` rows (per leaf: what
  `hierarchical.two_hop` runs; `loco` itself runs `kernels.compress_step` per bucket).

  Aligned leaves go through the fused kernel (one pass over memory: a Pallas kernel on GPU and
  TPU); the others, and every leaf with `fuse=False`, through the same math in jnp here, with
  ragged blocks padded.
  """
  if fuse and _fusable(g.size, send, scale, error_scale, beta, block_size):
    out = kernels.compress_step(g, error, error_scales, bits=bits, error_bits=error_bits,
                                beta=float(beta), reset=reset, block_size=block_size,
                                decompressed=decompressed)
    sent = Payload(out.packed.reshape(send.rows, send.blocks, -1),
                   out.scales.reshape(send.rows, send.blocks), packed=True)
    return _Feedback(sent, out.error, out.error_scale, out.finite, out.decompressed)
  own = comm.leaf_layout(g.size, 1, block_size)
  stored = Payload(comm.to_rows(error, own),
                   None if error_scales is None else error_scales[None])
  e = jnp.where(reset, 0.0, _dequantize_blocks(stored, own, error_scale))
  h = quant.saturate(g + e)  # finite g near the float32 maximum: saturate, never inf
  sent = _quantize_blocks(h, send, bits, scale)
  d = _dequantize_blocks(sent, send, scale)
  residual = _quantize_blocks(quant.saturate(beta * e + (1.0 - beta) * (h - d)), own, error_bits,
                              error_scale)
  new_scales = None if residual.scales is None else residual.scales[0]
  return _Feedback(sent, comm.from_rows(residual.codes, own), new_scales,
                   jnp.all(jnp.isfinite(g)), d if decompressed else None)


def _reference_step(g: jax.Array, error: jax.Array, error_scale: jax.Array, reset,
                    bits: int = 4, error_bits: int = 8, beta: float = 0.8,
                    block_size: int = 2048) -> _Feedback:
  """Local-mode LoCo step on one leaf in plain jnp, never fused: an unfused formulation that
  tests compare kernels.compress_step with near the float32 maximum (the criterion for every
  implementation is `reference.check_step`, in float64)."""
  return _feedback_step(g, error, error_scale, comm.leaf_layout(g.size, 1, block_size), reset,
                        bits, None, error_bits, None, beta, block_size, decompressed=True,
                        fuse=False)


def _is_due(count: jax.Array, reset_interval: int) -> jax.Array:
  """Whether the error is zeroed before this step: k > 0 and a multiple of reset_interval."""
  if reset_interval == 0:
    return jnp.bool_(False)
  return (count > 0) & (count % reset_interval == 0)


def _flag(finite: jax.Array) -> jax.Array:
  """0.0, or NaN when some gradient is not finite: it travels with the payload so that every
  device of the axis learns of it."""
  return jnp.where(finite, 0.0, jnp.nan).astype(jnp.float32)


def _nonfinite_flag(leaves: list, chosen: list[int]) -> tuple[jax.Array, jax.Array]:
  """(all finite, `_flag`) over the chosen leaves."""
  finite = jnp.bool_(True)
  for i in chosen:
    finite &= jnp.all(jnp.isfinite(leaves[i]))
  return finite, _flag(finite)


def _merge(new: list | None, old: list) -> list:
  """Per leaf: the new value, or the old one where there is none (leaves that are not sent)."""
  return old if new is None else [o if n is None else n for n, o in zip(new, old)]


def _keep_if(finite, new, old):
  return jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)


def loco(
    bits: int = 4,
    scale: float | None = None,
    error_bits: int = 8,
    error_scale: float | None = None,
    beta: float = 0.8,
    reset_interval: int = 1024,
    block_size: int = 2048,
    axis_name: AxisName | None = None,
    gather: str = "bf16",
    scatter: bool = False,
) -> optax.GradientTransformationExtraArgs:
  """Compresses gradients to `bits` with LoCo's error feedback; averages them over `axis_name`.

  Each step (k = count before it): the error is zeroed if reset_interval > 0 and k is a positive
  multiple of it; h = g + e; q = compress(h; s, bits) is what is sent (packed); d = q / s;
  e' = compress(beta * e + (1 - beta) * (h - d); s_e, error_bits). `scale=None` uses one absmax
  scale per block of about `block_size` elements (sent with the data); a float is the paper's
  fixed scale (2**17..2**19 for LLMs); `error_scale` likewise for the stored error (paper: 4s
  to 6s). beta = 0 is classic error feedback.

  The leaves are laid out once, from their shapes, in a few buckets (`buckets.plan`: each
  leaf's per-device rows cut into whole blocks of `block_size`, a remainder into smaller blocks
  of a power-of-two multiple of 8, so no block straddles two leaves); the step runs one
  `kernels.compress_step` per bucket, whatever the leaf count. The state stays per leaf (int8
  error like the params; block scales per leaf in bucket order).

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
  _check_args(bits, scale, error_bits, error_scale, beta, reset_interval, block_size, gather)
  _probe_kernel(bits, scale, error_bits, error_scale, beta, block_size)
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

  def plan_of(leaves: list, rows: int) -> buckets.Plan:
    return buckets.plan(tuple(x.size if _compressible(x) else 0 for x in leaves), rows,
                        block_size)

  def init_fn(params):
    leaves, treedef = jax.tree.flatten(params)
    p = plan_of(leaves, rows_on_axis())
    empty = lambda dtype: jnp.zeros((0,), dtype)
    tree = lambda make: treedef.unflatten([empty(jnp.int8) if leaf is None else make(leaf)
                                           for leaf in p.leaves])
    scales = lambda make: treedef.unflatten([empty(jnp.float32) if leaf is None else make(leaf)
                                             for leaf in p.leaves])
    fixed_error = error_scale is not None
    return LocoState(
        count=jnp.zeros([], jnp.int32),
        error=tree(lambda leaf: jnp.zeros((leaf.size,), jnp.int8)),
        error_scale=None if fixed_error else scales(
            lambda leaf: jnp.zeros((p.rows * leaf.blocks,), jnp.float32)),
        gather_error=tree(lambda leaf: jnp.zeros((leaf.row_len,), jnp.int8))
        if quantized_gather else None,
        gather_scale=scales(lambda leaf: jnp.zeros((leaf.blocks,), jnp.float32))
        if quantized_gather and not fixed_error else None)

  def compress(p: buckets.Plan, firsts: list, grads: list, errors: list, error_scales: list,
               reset, local: bool) -> tuple[list, list, list, list, list, jax.Array]:
    """LoCo's step on every bucket: (packed, scales, new errors and error scales per leaf,
    decompressed buckets (local mode), all finite)."""
    g_b, e_b = buckets.to_buckets(grads, p), buckets.to_buckets(errors, p)
    es_b = (buckets.scales_to_buckets(error_scales, p) if error_scale is None
            else [None] * len(g_b))
    packed, scales, new_e, new_es, decompressed, finite = [], [], [], [], [], jnp.bool_(True)
    for g, e, es, n in zip(g_b, e_b, es_b, p.block_lens):
      rows, blocks = g.shape[:2]
      out = kernels.compress_step(
          g.reshape(-1), e.reshape(-1), None if es is None else es.reshape(-1), bits=bits,
          error_bits=error_bits, beta=beta, reset=reset, block_size=n, decompressed=local,
          fixed_scale=scale, fixed_error_scale=error_scale)
      packed.append(out.packed.reshape(rows, blocks, -1))
      scales.append(out.scales.reshape(rows, blocks))
      new_e.append(out.error.reshape(rows, blocks, n))
      new_es.append(out.error_scale.reshape(rows, blocks))
      decompressed.append(None if out.decompressed is None else
                          out.decompressed.reshape(rows, blocks, n))
      finite &= out.finite
    return (packed, None if scale is not None else scales,
            buckets.from_buckets(new_e, p, firsts),
            None if error_scale is not None else buckets.scales_from_buckets(new_es, p, firsts),
            decompressed, finite)

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    trees.check_state_matches("loco", updates, state, jax.eval_shape(init_fn, updates))
    leaves, treedef = jax.tree.flatten(updates)
    k = state.count
    p = plan_of(leaves, rows_on_axis())
    if not any(p.leaves):  # nothing to compress or send
      return updates, state._replace(count=optax.safe_increment(k))
    flat_state = lambda tree: ([None] * len(leaves) if tree is None
                               else treedef.flatten_up_to(tree))
    errors, error_scales = flat_state(state.error), flat_state(state.error_scale)
    grads = [None if leaf is None else g.reshape(-1).astype(jnp.float32)
             for g, leaf in zip(leaves, p.leaves)]
    reset = _is_due(k, reset_interval)
    firsts = buckets.starts(p, k)
    packed, scales, new_errors, new_error_scales, local_d, finite = compress(
        p, firsts, grads, errors, error_scales, reset, axis_name is None)
    flag = _flag(finite)

    new_gather = (state.gather_error, state.gather_scale)
    if axis_name is None:
      averaged = [None if d is None else d + flag
                  for d in buckets.from_buckets(local_d, p, firsts)]
    else:
      means, flags = bucketed.all_to_all_mean(packed, scales, scale, bits, flag, axis_name)
      if scatter:
        # No gather follows to bring the flags back replicated: one 4-byte all-reduce does.
        flags = jax.lax.psum(flag, axis_name)
        averaged = [None if s is None else s + flags
                    for s in buckets.shards(means, p, firsts)]
      elif gather == "bf16":
        gathered, flags = bucketed.gather_bf16(means, p, flags, axis_name)
        averaged = [None if v is None else v + flags
                    for v in buckets.from_buckets(gathered, p, firsts)]
      else:
        # The averaged shard is re-quantized with its own error: the buckets of one row.
        shard_plan = p._replace(rows=1, leaves=tuple(
            None if leaf is None else leaf._replace(size=leaf.row_len) for leaf in p.leaves))
        gather_errors, gather_scales = flat_state(state.gather_error), flat_state(
            state.gather_scale)
        shard_packed, shard_scales, new_gather_errors, new_gather_scales, _, _ = compress(
            shard_plan, firsts, buckets.shards(means, p, firsts), gather_errors, gather_scales,
            reset, False)
        gathered, flags = bucketed.gather_packed(
            [x[0] for x in shard_packed],
            None if shard_scales is None else [s[0] for s in shard_scales], scale, bits, p,
            flags, axis_name)
        averaged = [None if v is None else v + flags
                    for v in buckets.from_buckets(gathered, p, firsts)]
        kept = _keep_if(jnp.isfinite(flags), (_merge(new_gather_errors, gather_errors),
                                              _merge(new_gather_scales, gather_scales)),
                        (gather_errors, gather_scales))
        new_gather = (treedef.unflatten(kept[0]),
                      None if state.gather_scale is None else treedef.unflatten(kept[1]))
      finite = jnp.isfinite(flags)  # every device of the axis keeps or skips the step together

    out = [g if v is None else quant.saturating_cast(
        v.reshape(v.shape if scatter and axis_name is not None else g.shape), g.dtype)
           for g, v in zip(leaves, averaged)]
    new_errors, new_error_scales = _keep_if(
        finite, (_merge(new_errors, errors), _merge(new_error_scales, error_scales)),
        (errors, error_scales))
    new_state = LocoState(
        count=jnp.where(finite, optax.safe_increment(k), k),
        error=treedef.unflatten(new_errors),
        error_scale=None if state.error_scale is None else treedef.unflatten(new_error_scales),
        gather_error=new_gather[0],
        gather_scale=new_gather[1])
    return treedef.unflatten(out), new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def state_specs(state: Any, axis_name: AxisName) -> Any:
  """PartitionSpecs for an optimizer state, for `jax.shard_map` over `axis_name`.

  Fields that a state class lists in `PER_DEVICE` (LoCo's errors, a baseline's error) differ per
  device, so they are split over the axis (their global arrays stack every device's copy);
  every other leaf (step counters, the state of adamw after the average) is replicated.
  Example:
    >>> state = loco().init(params)   # with an axis_name: created inside jax.shard_map
    >>> specs = state_specs(state, "data")
    >>> specs.error["w"] == P("data"), specs.count == P()   # per device; replicated
    (True, True)
  """
  def spec(node):
    if hasattr(node, "PER_DEVICE") and hasattr(node, "_fields"):
      return type(node)(*[
          jax.tree.map(lambda _: P(axis_name) if name in node.PER_DEVICE else P(), value)
          for name, value in zip(node._fields, node)])
    return jax.tree.map(lambda _: P(), node)
  return jax.tree.map(spec, state, is_leaf=lambda n: hasattr(n, "PER_DEVICE"))
