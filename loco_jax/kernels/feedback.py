"""The LoCo step on one flat float32 leaf: compensate, quantize, new error, and the reset
schedule. `loco` runs `compress_step` per bucket; `two_hop` runs this per leaf and per hop."""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from loco_jax.core import args, layout, quant
from loco_jax.core.layout import LeafLayout, Payload
from loco_jax.kernels.step import compress_step


def quantize_blocks(x: jax.Array, rows: LeafLayout, bits: int, scale,
                    scale_method: str = "absmax", clip_rms: float | None = None) -> Payload:
  """[size] float32 -> int codes [rows, blocks, block_len] with fixed or computed block scales
  (`quant.block_scale`: absmax, or rms clipped at `clip_rms`)."""
  x_RxBxL = layout.to_rows(x, rows)
  if scale is None:
    scales = quant.block_scale(x_RxBxL, bits, scale_method, clip_rms)
    return Payload(quant.compress(x_RxBxL, scales[..., None], bits), scales)
  return Payload(quant.compress(x_RxBxL, scale, bits), None)


def dequantize_blocks(payload: Payload, rows: LeafLayout, scale) -> jax.Array:
  """Inverse of `quantize_blocks`: -> [size] float32."""
  s = scale if payload.scales is None else payload.scales[..., None]
  return layout.from_rows(quant.decompress(payload.codes, s), rows)


class Feedback(NamedTuple):
  sent: Payload             # the compressed h, laid out for the wire
  error: jax.Array          # int8 [size], the new stored error
  error_scale: Any          # float32 [blocks] or None
  finite: jax.Array         # bool []: every value of g was finite
  decompressed: Any         # d as float32 [size] (when asked for), else None


def fusable(size: int, send: LeafLayout, scale, error_scale, beta, block_size: int) -> bool:
  """Whether `compress_step` can take the step: absmax scales for the payload and the error, a
  constant beta, and blocks of exactly `block_size` that line up with the wire rows."""
  return (scale is None and error_scale is None and args.is_concrete(beta)
          and block_size % quant.PACK_UNIT == 0 and size % (send.rows * block_size) == 0)


def feedback_step(g: jax.Array, error: jax.Array, error_scales, send: LeafLayout, reset,
                  bits: int, scale, error_bits: int, error_scale, beta, block_size: int,
                  decompressed: bool = False, fuse: bool = True) -> Feedback:
  """One LoCo step on one flat float32 leaf laid out in `send`'s rows.

  Aligned leaves go through the fused `compress_step` (one pass over memory: a Pallas kernel
  on GPU and TPU); the others, and every leaf with `fuse=False`, through the same math in jnp
  here, with ragged blocks padded.
  """
  if fuse and fusable(g.size, send, scale, error_scale, beta, block_size):
    out = compress_step(g, error, error_scales, bits=bits, error_bits=error_bits,
                        beta=float(beta), reset=reset, block_size=block_size,
                        decompressed=decompressed)
    sent = Payload(out.packed.reshape(send.rows, send.blocks, -1),
                   out.scales.reshape(send.rows, send.blocks), packed=True)
    return Feedback(sent, out.error, out.error_scale, out.finite, out.decompressed)
  own = layout.leaf_layout(g.size, 1, block_size)
  stored = Payload(layout.to_rows(error, own),
                   None if error_scales is None else error_scales[None])
  e = jnp.where(reset, 0.0, dequantize_blocks(stored, own, error_scale))
  h = quant.saturate(g + e)  # finite g near the float32 maximum: saturate, never inf
  sent = quantize_blocks(h, send, bits, scale)
  d = dequantize_blocks(sent, send, scale)
  residual = quantize_blocks(quant.saturate(beta * e + (1.0 - beta) * (h - d)), own, error_bits,
                             error_scale)
  new_scales = None if residual.scales is None else residual.scales[0]
  return Feedback(sent, layout.from_rows(residual.codes, own), new_scales,
                  jnp.all(jnp.isfinite(g)), d if decompressed else None)


def reference_step(g: jax.Array, error: jax.Array, error_scale: jax.Array, reset,
                   bits: int = 4, error_bits: int = 8, beta: float = 0.8,
                   block_size: int = 2048) -> Feedback:
  """Local-mode LoCo step on one leaf in plain jnp, never fused: an unfused formulation that
  tests compare `compress_step` with near the float32 maximum (the criterion for every
  implementation is `reference.check_step`, in float64)."""
  return feedback_step(g, error, error_scale, layout.leaf_layout(g.size, 1, block_size), reset,
                       bits, None, error_bits, None, beta, block_size, decompressed=True,
                       fuse=False)


def is_due(count: jax.Array, reset_interval: int) -> jax.Array:
  """Whether the error is zeroed before this step: k > 0 and a multiple of reset_interval."""
  if reset_interval == 0:
    return jnp.bool_(False)
  return (count > 0) & (count % reset_interval == 0)
