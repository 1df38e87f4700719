"""The baselines' compressors, each with its wire: block-scaled integers, sign with a block scale,
top-k; encode a leaf, and average every device's message over an axis."""

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from loco_jax.comm import exchange
from loco_jax.core import layout, quant
from loco_jax.core.layout import AxisName, Payload
from loco_jax.kernels.feedback import dequantize_blocks, quantize_blocks


class Codec(NamedTuple):
  """encode(h [size], rows) -> (message, d [size]), d being what the message decodes to;
  average(messages, flag, axis_name) -> (mean over the axis of every device's d [size] per leaf,
  the peers' flags summed and replicated)."""
  encode: Callable[[jax.Array, int], tuple[Any, jax.Array]]
  average: Callable[[list, jax.Array, AxisName], tuple[list[jax.Array], jax.Array]]


def block_codec(bits: int, block_size: int, scale_method: str = "absmax",
                clip_rms: float | None = None) -> Codec:
  """Block quantization to `bits` (absmax or clipped-rms scales, `quant.block_scale`); LoCo's
  all-to-all of packed codes, then a bf16 gather."""
  def encode(h, rows):
    wire = layout.leaf_layout(h.size, rows, block_size)
    payload = quantize_blocks(h, wire, bits, None, scale_method, clip_rms)
    return (payload, wire), dequantize_blocks(payload, wire, None)

  def average(messages, flag, axis_name):
    payloads, layouts = zip(*messages)
    shards, flags = exchange.all_to_all_mean(payloads, bits, None, flag, axis_name)
    return exchange.gather_bf16([quant.saturate(s, jnp.bfloat16) for s in shards], layouts, flags,
                            axis_name)

  return Codec(encode, average)


def sign_values(p: Payload) -> jax.Array:
  """1-bit codes on the grid {-1, 0}: -1 -> -scale, 0 -> +scale (per block)."""
  return p.scales[..., None] * jnp.where(p.codes < 0, -1.0, 1.0)


def sign_codec(block_size: int) -> Codec:
  """scale * sign(h) with scale = mean |h| per block (float32): one bit per element on the wire."""
  def encode(h, rows):
    wire = layout.leaf_layout(h.size, rows, block_size)
    h_RxBxL = layout.to_rows(h, wire)
    real_RxB = layout.to_rows(jnp.ones_like(h), wire).sum(-1)   # padding excluded from the mean
    # sum |h| 2**-k / (real 2**-k): the sum cannot overflow, and it is sum |h| / real exactly.
    down = quant.mean_factors(wire.block_len)[0]
    scales_RxB = quant.saturate(
        (jnp.abs(h_RxBxL) * down).sum(-1) / (jnp.maximum(real_RxB, 1.0) * down))
    payload = Payload(jnp.where(h_RxBxL < 0, -1, 0).astype(jnp.int8), scales_RxB)
    return (payload, wire), layout.from_rows(sign_values(payload), wire)

  def average(messages, flag, axis_name):
    # exchange.all_to_all_mean's path, with the sign decoding in place of codes / scale.
    payloads, layouts = zip(*messages)
    buffer, offsets = exchange.encode_rows(payloads, 1, flag)
    received_NxB = jax.lax.all_to_all(buffer, axis_name, 0, 0, tiled=True)
    n = received_NxB.shape[0]
    field = lambda j: received_NxB[:, offsets[j][0]:offsets[j][1]]
    shards = []
    for j, p in enumerate(payloads):
      codes = quant.unpack(field(2 * j).reshape(n, p.codes.shape[1], -1), 1)
      scales = exchange._from_bytes(field(2 * j + 1), jnp.float32, (n, p.scales.shape[1]))
      shards.append(quant.mean_over_peers(sign_values(Payload(codes, scales))))
    flags = exchange._from_bytes(field(len(offsets) - 1), jnp.float32, (n,))
    return exchange.gather_bf16([quant.saturate(s, jnp.bfloat16) for s in shards], layouts,
                            flags.sum(), axis_name)

  return Codec(encode, average)


def topk_count(size: int, fraction: float) -> int:
  """Entries `topk_ef` keeps of a leaf of `size` elements: max(1, round(fraction * size))."""
  return min(size, max(1, round(fraction * size)))


def scatter_mean(idx_NxK: jax.Array, vals_NxK: jax.Array, size: int) -> jax.Array:
  """Sum of N devices' sparse vectors (indices, values) divided by N -> [size] float32.

  One scatter-add per device, in device order, each with unique indices: every device adds in
  the same order (no atomics racing on a GPU), so the output is the same on all of them.
  """
  down, up = quant.mean_factors(idx_NxK.shape[0])  # a sum of x / 2**k never overflows
  summed = jnp.zeros((size,), jnp.float32)
  for idx_K, vals_K in zip(idx_NxK, vals_NxK):
    summed = summed.at[idx_K].add(vals_K * down, unique_indices=True)
  return quant.saturate(summed * up)


def topk_codec(fraction: float) -> Codec:
  """The k largest |h| of each leaf as (int32 index, float32 value); one all-gather of them all."""
  def encode(h, rows):
    del rows
    _, idx_K = jax.lax.top_k(jnp.abs(h), topk_count(h.size, fraction))
    vals_K = h[idx_K]
    return (idx_K, vals_K, h.size), scatter_mean(idx_K[None], vals_K[None], h.size)

  def average(messages, flag, axis_name):
    as_int = lambda x: jax.lax.bitcast_convert_type(x, jnp.int32)
    fields = [m[0] for m in messages] + [as_int(m[1]) for m in messages] + [as_int(flag)[None]]
    gathered_NxW = jax.lax.all_gather(jnp.concatenate(fields), axis_name, axis=0,
                                      to="invarying")
    starts = np.cumsum([0] + [f.size for f in fields])
    take = lambda j: gathered_NxW[:, starts[j]:starts[j + 1]]
    n_leaves = len(messages)
    means = [scatter_mean(take(j), jax.lax.bitcast_convert_type(take(n_leaves + j), jnp.float32),
                           size) for j, (_, _, size) in enumerate(messages)]
    flags = jax.lax.bitcast_convert_type(take(2 * n_leaves)[:, 0], jnp.float32)
    return means, flags.sum()

  return Codec(encode, average)


def encode_all(codec: Codec, hs: list[jax.Array], axis_name: AxisName | None,
            name: str) -> tuple[list, list[jax.Array]]:
  rows = 1 if axis_name is None else exchange.axis_size(axis_name, name)
  messages, decoded = zip(*[codec.encode(h, rows) for h in hs])
  return list(messages), list(decoded)


def average_all(codec: Codec, messages: list, decoded: list[jax.Array], flag: jax.Array,
             axis_name: AxisName | None) -> tuple[list[jax.Array], jax.Array]:
  """The mean over the axis of every device's decoded message; without an axis, `decoded`."""
  if axis_name is None:
    return decoded, flag
  return codec.average(messages, flag, axis_name)
