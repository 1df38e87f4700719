"""4-bit gradient compression with an 8-bit, moving-averaged, periodically reset error (LoCo)."""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from loco_jax import comm, kernels, quant
from loco_jax.comm import AxisName, LeafLayout, Payload

GATHER_MODES = ("bf16", "quantized")


class LocoState(NamedTuple):
  """LoCo's state. Every field but `count` differs per device: declare it with `state_specs`."""
  count: jax.Array            # int32 steps taken; drives the periodic reset
  error: optax.Updates        # int8 [size] per leaf: this device's averaged compression error
  error_scale: Any            # float32 [blocks] per leaf (None with a fixed `error_scale`)
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
    if value is not None and _concrete(value) and not (np.isfinite(value) and float(value) > 0):
      raise ValueError(f"{name} must be None (absmax block scales) or a finite float > 0, "
                       f"got {value}")
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
  """Runs `kernels.compress_step`'s Pallas check for these settings now, outside any trace.

  The first fused step on GPU/TPU compares the Pallas kernel with jnp by compiling and running
  small kernels. Inside a jax.shard_map trace that comparison fails, and the step would fall
  back to jnp; building the transformation (outside jit) caches the answer instead.
  """
  if scale is None and error_scale is None and _concrete(beta):
    kernels.chosen_implementation(bits=bits, error_bits=error_bits, beta=float(beta),
                                  block_size=block_size)


def _feedback_step(g: jax.Array, error: jax.Array, error_scales, send: LeafLayout, reset,
                   bits: int, scale, error_bits: int, error_scale, beta, block_size: int,
                   decompressed: bool = False, fuse: bool = True) -> _Feedback:
  """One LoCo step on a flat float32 vector: compensate, quantize, average the error, store it.

  Aligned leaves go through the fused kernel (one pass over memory: a Pallas kernel on GPU and
  TPU); the others, and every leaf with `fuse=False` (the reference the kernels are checked
  against), through the same math in jnp here, with ragged blocks padded.
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
  h = g + e
  sent = _quantize_blocks(h, send, bits, scale)
  d = _dequantize_blocks(sent, send, scale)
  residual = _quantize_blocks(beta * e + (1.0 - beta) * (h - d), own, error_bits, error_scale)
  new_scales = None if residual.scales is None else residual.scales[0]
  return _Feedback(sent, comm.from_rows(residual.codes, own), new_scales,
                   jnp.all(jnp.isfinite(g)), d if decompressed else None)


def _reference_step(g: jax.Array, error: jax.Array, error_scale: jax.Array, reset,
                    bits: int = 4, error_bits: int = 8, beta: float = 0.8,
                    block_size: int = 2048) -> _Feedback:
  """Local-mode LoCo step in plain jnp, never fused: what kernels.compress_step is checked
  against (`loco()` itself takes the kernel for such leaves)."""
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

  With `axis_name=None` the output is d (local compression: one device, or a simulation). With
  a mesh axis, inside `jax.shard_map`, the output is the mean over the axis of every device's d:
  one all-to-all carries every leaf's packed codes and scales, each device averages its shard in
  float32, and an all-gather returns the averaged shards in bfloat16 (`gather="bf16"`, 4 + 16
  bits a parameter) or re-quantized to `bits` with a second error kept for the shard
  (`gather="quantized"`, about 4 + 4). `scatter=True` skips the gather and returns this device's
  shard of each leaf, flat [comm.shard_len(size, axis size)], for sharded optimizers. With an
  axis, create the state inside `shard_map` and declare it with `state_specs`: the errors differ
  per device.

  Non-float and zero-size leaves pass through. A non-finite gradient (on any device of the
  axis) makes every output NaN and leaves the state unchanged, so the error is never poisoned;
  wrap the chain in `optax.apply_if_finite` to skip such steps.

  Example:
    >>> opt = optax.chain(loco_jax.loco(bits=4), optax.adamw(3e-4))
    >>> state = opt.init(params)
    >>> updates, state = opt.update(grads, state, params)
  """
  _check_args(bits, scale, error_bits, error_scale, beta, reset_interval, block_size, gather)
  _probe_kernel(bits, scale, error_bits, error_scale, beta, block_size)
  if gather == "quantized" and axis_name is None:
    raise ValueError("gather='quantized' needs an axis_name: there is no gather without one")
  quantized_gather = gather == "quantized" and not scatter
  wire_block = block_size if scale is None else None

  def rows_on_axis() -> int:
    return 1 if axis_name is None else comm.axis_size(axis_name)

  def error_buffers(size: int):
    blocks = comm.leaf_layout(size, 1, block_size).blocks if size else 0
    return jnp.zeros((size,), jnp.int8), jnp.zeros((blocks,), jnp.float32)

  def init_fn(params):
    leaves, treedef = jax.tree.flatten(params)
    sizes = [x.size if _compressible(x) else 0 for x in leaves]
    rows = rows_on_axis() if quantized_gather else 1
    own = [error_buffers(n) for n in sizes]
    shard = [error_buffers(comm.leaf_layout(n, rows, wire_block).row_len if n else 0)
             for n in sizes]
    unflatten = lambda buffers, j: treedef.unflatten([b[j] for b in buffers])
    return LocoState(
        count=jnp.zeros([], jnp.int32),
        error=unflatten(own, 0),
        error_scale=unflatten(own, 1) if error_scale is None else None,
        gather_error=unflatten(shard, 0) if quantized_gather else None,
        gather_scale=unflatten(shard, 1) if quantized_gather and error_scale is None else None)

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    leaves, treedef = jax.tree.flatten(updates)
    flat_state = lambda tree: ([None] * len(leaves) if tree is None
                               else treedef.flatten_up_to(tree))
    errors, error_scales = flat_state(state.error), flat_state(state.error_scale)
    rows = rows_on_axis()
    k = state.count
    reset = _is_due(k, reset_interval)
    step = lambda g, err, err_scales, send, local=False: _feedback_step(
        g, err, err_scales, send, reset, bits, scale, error_bits, error_scale, beta, block_size,
        decompressed=local)

    chosen = [i for i, g in enumerate(leaves) if _compressible(g)]
    if not chosen:  # nothing to compress or send
      return updates, state._replace(count=optax.safe_increment(k))

    sent, layouts, local_d = [], [], []
    finite = jnp.bool_(True)
    new_errors, new_error_scales = list(errors), list(error_scales)
    for i in chosen:
      g = leaves[i].reshape(-1).astype(jnp.float32)
      layout = comm.leaf_layout(g.size, rows, wire_block)
      fb = step(g, errors[i], error_scales[i], layout, axis_name is None)
      new_errors[i], new_error_scales[i] = fb.error, fb.error_scale
      finite &= fb.finite
      sent.append(fb.sent)
      layouts.append(layout)
      local_d.append(fb.decompressed)
    flag = _flag(finite)

    new_gather = (state.gather_error, state.gather_scale)
    if axis_name is None:
      averaged = [d + flag for d in local_d]
    else:
      shards, flags = comm.all_to_all_mean(sent, bits, scale, flag, axis_name)
      if scatter:
        # No gather follows to bring the flags back replicated: one 4-byte all-reduce does.
        flags = jax.lax.psum(flag, axis_name)
        averaged = [s.reshape(-1)[: lay.row_len] + flags for s, lay in zip(shards, layouts)]
      elif gather == "bf16":
        gathered, flags = comm.gather_bf16(shards, layouts, flags, axis_name)
        averaged = [v + flags for v in gathered]
      else:
        gather_errors, gather_scales = flat_state(state.gather_error), flat_state(
            state.gather_scale)
        shard_sent = []
        new_gather_errors, new_gather_scales = list(gather_errors), list(gather_scales)
        for i, s, lay in zip(chosen, shards, layouts):
          send = LeafLayout(lay.row_len, 1, lay.row_len, lay.blocks, lay.block_len)
          fb = step(s.reshape(-1)[: lay.row_len], gather_errors[i], gather_scales[i], send)
          new_gather_errors[i], new_gather_scales[i] = fb.error, fb.error_scale
          shard_sent.append(fb.sent)
        gathered, flags = comm.gather_packed(shard_sent, layouts, bits, scale, flags, axis_name)
        averaged = [v + flags for v in gathered]
        new_gather_errors, new_gather_scales = _keep_if(
            jnp.isfinite(flags), (new_gather_errors, new_gather_scales),
            (gather_errors, gather_scales))
        new_gather = (treedef.unflatten(new_gather_errors),
                      None if state.gather_scale is None else treedef.unflatten(
                          new_gather_scales))
      finite = jnp.isfinite(flags)  # every device of the axis keeps or skips the step together

    out = list(leaves)
    for i, value in zip(chosen, averaged):
      shape = value.shape if scatter and axis_name is not None else leaves[i].shape
      out[i] = value.reshape(shape).astype(leaves[i].dtype)
    new_errors, new_error_scales = _keep_if(
        finite, (new_errors, new_error_scales), (errors, error_scales))
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
    >>> specs = state_specs(jax.eval_shape(init_inside_shard_map, params), "data")
  """
  def spec(node):
    if hasattr(node, "PER_DEVICE") and hasattr(node, "_fields"):
      return type(node)(*[
          jax.tree.map(lambda _: P(axis_name) if name in node.PER_DEVICE else P(), value)
          for name, value in zip(node._fields, node)])
    return jax.tree.map(lambda _: P(), node)
  return jax.tree.map(spec, state, is_leaf=lambda n: hasattr(n, "PER_DEVICE"))
