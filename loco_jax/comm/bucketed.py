"""LoCo's all-to-all on buckets (`core.buckets`): every bucket's packed codes and scales in one
all-to-all, and this device's shard averaged by `kernels.dequantize_mean`."""

from typing import Sequence

import jax
import jax.numpy as jnp

from loco_jax import kernels
from loco_jax.comm import coded, framing, wire
from loco_jax.core.layout import AxisName


def _means(codes: Sequence[jax.Array], peer_scales: Sequence[jax.Array] | None,
           blocks: Sequence[int], fixed_scale, bits: int) -> list[jax.Array]:
  """Each bucket's received rows (uint8 [rows, ...], float32 scales [rows, blocks] or None: the
  fixed scale) -> this device's averaged shard, [blocks * len] float32."""
  averaged = []
  for c, x in enumerate(codes):
    scales = (jnp.full((x.shape[0], blocks[c]), fixed_scale, jnp.float32)
              if peer_scales is None else peer_scales[c])
    averaged.append(kernels.dequantize_mean(x.reshape(x.shape[0], -1), scales, bits=bits))
  return averaged


def _flags(flag: jax.Array, rows: int) -> jax.Array:
  """This device's flag, once for every peer: float32 [rows]."""
  return jnp.broadcast_to(flag.astype(jnp.float32), (rows,))


def all_to_all_mean(packed: Sequence[jax.Array], scales: Sequence[jax.Array] | None,
                    fixed_scale, bits: int, flag: jax.Array,
                    axis_name: AxisName) -> tuple[list[jax.Array], jax.Array]:
  """ONE all-to-all of every bucket's packed rows (uint8 [rows, blocks, len * bits / 8]) and
  block scales ([rows, blocks]; None with a fixed scale), plus the float32 flag of each device.

  Returns this device's shard of each bucket averaged by `kernels.dequantize_mean`
  ([blocks * len] float32) and the sum of the peers' flags (NaN: some gradient not finite).
  """
  rows, k = packed[0].shape[0], len(packed)
  buffer, parts = framing.frame([*packed, *(scales or ()), _flags(flag, rows)])
  *got, flags = framing.unframe(wire.all_to_all(buffer, axis_name), parts)
  return (_means(got[:k], None if scales is None else got[k:], [x.shape[1] for x in packed],
                 fixed_scale, bits), flags.sum())


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
  rows, k = packed[0].shape[0], len(packed)
  codes_B, code_parts = framing.frame(packed)
  side = [*(scales or ()), _flags(flag, rows)[:, None]]
  side_S = jnp.concatenate(side, axis=1)
  capacity = coded.slot_bytes(codes_B.shape[1], capacity_bits * 8 / bits, coder)
  got = coded.all_to_all(codes_B, side_S, capacity, coder, axis_name)
  overflowed, corrupt = jax.lax.psum(got.missing, axis_name)

  def decoded():
    peer_side = framing.cut(got.side, [s.shape[1] for s in side])
    return (_means(framing.unframe(got.rows, code_parts), None if scales is None else
                   peer_side[:k], [x.shape[1] for x in packed], fixed_scale, bits),
            peer_side[-1].sum())

  averaged, flags = jax.lax.cond(
      overflowed > 0,
      lambda: all_to_all_mean(packed, scales, fixed_scale, bits, flag, axis_name), decoded)
  return averaged, flags + jnp.where(corrupt > 0, jnp.inf, 0.0).astype(jnp.float32)
