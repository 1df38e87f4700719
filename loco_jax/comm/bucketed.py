"""The wire for buckets (`core.buckets`): one all-to-all of every bucket, the receive side in
`kernels.dequantize_mean`, and the gathers of the averaged shards."""

from typing import Sequence

import jax
import jax.numpy as jnp

from loco_jax import kernels
from loco_jax.comm import coded, exchange, wire
from loco_jax.core import quant
from loco_jax.core.buckets import Plan
from loco_jax.core.layout import AxisName, Payload


def _as_bytes(x: jax.Array) -> jax.Array:
  """[rows, ...] -> [rows, nbytes] uint8, a bitcast."""
  if x.dtype.itemsize > 1:
    x = jax.lax.bitcast_convert_type(x, jnp.uint8)
  return x.reshape(x.shape[0], -1)


def _cut(x: jax.Array, widths: Sequence[int]) -> list[jax.Array]:
  """[rows, sum(widths)] -> [rows, w] per width."""
  cut, at = [], 0
  for w in widths:
    cut.append(x[:, at: at + w])
    at += w
  return cut


def _means(codes: Sequence[jax.Array], peer_scales: Sequence[jax.Array] | None,
           blocks: Sequence[int], fixed_scale, bits: int) -> list[jax.Array]:
  """Each bucket's received rows (uint8 [rows, blocks * len * bits / 8], float32 scales
  [rows, blocks] or None: the fixed scale) -> this device's averaged shard, [blocks * len]
  float32."""
  averaged = []
  for c, x in enumerate(codes):
    scales = (jnp.full((x.shape[0], blocks[c]), fixed_scale, jnp.float32)
              if peer_scales is None else peer_scales[c])
    averaged.append(kernels.dequantize_mean(x, scales, bits=bits))
  return averaged


def all_to_all_mean(packed: Sequence[jax.Array], scales: Sequence[jax.Array] | None,
                    fixed_scale, bits: int, flag: jax.Array,
                    axis_name: AxisName) -> tuple[list[jax.Array], jax.Array]:
  """ONE all-to-all of every bucket's packed rows (uint8 [rows, blocks, len * bits / 8]) and
  block scales ([rows, blocks]; None with a fixed scale), plus the float32 flag of each device.

  Device j receives row j from every peer (never re-quantized on the way) and averages them
  with `kernels.dequantize_mean`: returns this device's averaged shard of each bucket
  ([blocks * len] float32) and the sum of the peers' flags (0, or NaN when some peer saw a
  non-finite gradient).
  """
  rows = packed[0].shape[0]
  parts = [_as_bytes(x) for x in packed]
  parts += [] if scales is None else [_as_bytes(s) for s in scales]
  parts.append(_as_bytes(jnp.broadcast_to(flag.astype(jnp.float32), (rows, 1))))
  cut = _cut(wire.all_to_all(jnp.concatenate(parts, axis=1), axis_name),
             [x.shape[1] for x in parts])
  peer_scales = None if scales is None else [
      jax.lax.bitcast_convert_type(cut[len(packed) + c].reshape(rows, -1, 4), jnp.float32)
      for c in range(len(packed))]
  flags = jax.lax.bitcast_convert_type(cut[-1].reshape(rows, 4), jnp.float32)
  return (_means(cut[:len(packed)], peer_scales, [x.shape[1] for x in packed], fixed_scale,
                 bits), flags.sum())


def coded_all_to_all_mean(packed: Sequence[jax.Array], scales: Sequence[jax.Array] | None,
                          fixed_scale, bits: int, flag: jax.Array, capacity_bits: float,
                          coder: coded.ByteCoder,
                          axis_name: AxisName) -> tuple[list[jax.Array], jax.Array]:
  """`all_to_all_mean` with each row's packed codes entropy-coded on the host into a slot of
  `capacity_bits` a code (`comm.coded.all_to_all`); the scales and flags cross uncoded.

  Every device learns (one 8-byte all-reduce) whether some slot overflowed anywhere, and then
  all run the raw exchange instead, inside a lax.cond (lossless); a slot that does not decode
  to exactly its row makes the returned flag +inf on every device (the step is skipped).
  """
  rows, blocks = packed[0].shape[0], [x.shape[1] for x in packed]
  codes = [_as_bytes(x) for x in packed]
  side = ([] if scales is None else list(scales)) + [
      jnp.broadcast_to(flag.astype(jnp.float32), (rows, 1))]
  codes_B = jnp.concatenate(codes, axis=1)
  capacity = coded.slot_bytes(codes_B.shape[1], capacity_bits * 8 / bits, coder)
  got = coded.all_to_all(codes_B, jnp.concatenate(side, axis=1), capacity, coder, axis_name)
  overflowed, corrupt = jax.lax.psum(got.missing, axis_name)

  def decoded():
    peer_side = _cut(got.side, [s.shape[1] for s in side])
    peer_scales = None if scales is None else peer_side[:-1]
    return (_means(_cut(got.rows, [x.shape[1] for x in codes]), peer_scales, blocks,
                   fixed_scale, bits),
            peer_side[-1].sum())

  averaged, flags = jax.lax.cond(
      overflowed > 0,
      lambda: all_to_all_mean(packed, scales, fixed_scale, bits, flag, axis_name), decoded)
  return averaged, flags + jnp.where(corrupt > 0, jnp.inf, 0.0).astype(jnp.float32)


def gather_packed(packed: Sequence[jax.Array], scales: Sequence[jax.Array] | None, fixed_scale,
                  bits: int, p: Plan, flag: jax.Array,
                  axis_name: AxisName) -> tuple[list[jax.Array], jax.Array]:
  """All-gathers every bucket's re-quantized shard (uint8 [blocks, len * bits / 8], scales
  [blocks]) -> each bucket [rows, blocks, len] float32, and the flag (replicated)."""
  payloads = [Payload(x[None], None if scales is None else scales[c][None], packed=True)
              for c, x in enumerate(packed)]
  values, flags = exchange.gather_packed(payloads, p.bucket_layouts(), bits, fixed_scale, flag,
                                     axis_name)
  return ([v.reshape(p.rows, b, n) for v, b, n in zip(values, p.blocks, p.block_lens)], flags)


def gather_bf16(averaged: Sequence[jax.Array], p: Plan, flag: jax.Array,
                axis_name: AxisName) -> tuple[list[jax.Array], jax.Array]:
  """All-gathers every bucket's averaged shard in bfloat16 -> [rows, blocks, len] float32."""
  values, flags = exchange.gather_bf16([quant.saturate(a, jnp.bfloat16) for a in averaged],
                                   p.bucket_layouts(), flag, axis_name)
  return ([v.reshape(p.rows, b, n) for v, b, n in zip(values, p.blocks, p.block_lens)], flags)
