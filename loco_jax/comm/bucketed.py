"""The wire for buckets (`core.buckets`): one all-to-all of every bucket, the receive side in
`kernels.dequantize_mean`, and the gathers of the averaged shards."""

from typing import Sequence

import jax
import jax.numpy as jnp

from loco_jax import kernels
from loco_jax.comm import exchange, wire
from loco_jax.core import quant
from loco_jax.core.buckets import Plan
from loco_jax.core.layout import AxisName, Payload


def _as_bytes(x: jax.Array) -> jax.Array:
  """[rows, ...] -> [rows, nbytes] uint8, a bitcast."""
  if x.dtype.itemsize > 1:
    x = jax.lax.bitcast_convert_type(x, jnp.uint8)
  return x.reshape(x.shape[0], -1)


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
  widths = [x.shape[1] for x in parts]
  received = wire.all_to_all(jnp.concatenate(parts, axis=1), axis_name)
  cut, at = [], 0
  for w in widths:
    cut.append(received[:, at: at + w])
    at += w
  averaged = []
  for c, x in enumerate(packed):
    blocks = x.shape[1]
    if scales is None:
      peer_scales = jnp.full((rows, blocks), fixed_scale, jnp.float32)
    else:
      peer_scales = jax.lax.bitcast_convert_type(
          cut[len(packed) + c].reshape(rows, blocks, 4), jnp.float32)
    averaged.append(kernels.dequantize_mean(cut[c], peer_scales, bits=bits))
  flags = jax.lax.bitcast_convert_type(cut[-1].reshape(rows, 4), jnp.float32)
  return averaged, flags.sum()


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
