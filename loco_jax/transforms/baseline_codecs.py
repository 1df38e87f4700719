"""The baselines' compressors, each with its wire: LoCo's block quantization on buckets, sign
with a block scale, top-k. A codec takes a group's flat leaves and returns what each decodes
to on this device and their mean over the axis."""

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from loco_jax.comm import framing, gathers, wire
from loco_jax.core import args, buckets, layout, quant
from loco_jax.core.layout import AxisName
from loco_jax.transforms import bucket_step
from loco_jax.transforms.settings import resolve


class Sent(NamedTuple):
  """A codec's result for a group's leaves (flat float32 [size] each)."""
  decoded: list           # what each leaf's message decodes to, on this device
  means: list             # the mean over the axis of every device's decoded leaf
  flags: jax.Array        # the peers' flags summed, replicated


#: codec(hs, flag, axis_name) -> Sent; without an axis, means = decoded.
Codec = Callable[[list, jax.Array, AxisName | None], Sent]


def _rows(axis_name: AxisName | None) -> int:
  return 1 if axis_name is None else gathers.axis_size(axis_name, "baselines")


def block_codec(bits: int, block_size: int, scale_method: str = "absmax",
                clip_rms: float | None = None) -> Codec:
  """Block quantization to `bits` (absmax or clipped-rms scales) on LoCo's buckets: the fused
  step from a zero error, LoCo's all-to-all of packed codes, then a bf16 gather. ValueError
  for arguments out of range."""
  args.check_bits(bits)
  args.check_int(block_size, "block_size", 1)
  args.check_scale_method(scale_method, clip_rms)
  s = resolve(bits, None, 8, None, 1.0, 0, block_size, scale_method, clip_rms)

  def send(hs, flag, axis_name):
    plan = buckets.plan(tuple(h.size for h in hs), _rows(axis_name), block_size)
    zero = optax.tree.zeros_like(bucket_step.group_shapes(plan, True, False))
    sent = bucket_step.compress_buckets(buckets.to_buckets(hs, plan), zero.error,
                                        zero.error_scale, s, False, decompressed=True)
    sent = sent._replace(finite=jnp.isfinite(flag))  # h saturates: the gradients' flag rules
    mode = bucket_step.Averaging(axis_name, "bf16", False, None)
    averaged = bucket_step.average(sent, plan, zero, s, mode, False)
    starts = buckets.starts(plan, jnp.int32(0))
    return Sent(buckets.from_buckets(sent.decompressed, plan, starts),
                buckets.from_buckets(averaged.values, plan, starts), averaged.flags)

  return send


def sign_values(codes: jax.Array, scales: jax.Array) -> jax.Array:
  """1-bit codes on the grid {-1, 0}: -1 -> -scale, 0 -> +scale (per block)."""
  return scales[..., None] * jnp.where(codes < 0, -1.0, 1.0)


def sign_codec(block_size: int) -> Codec:
  """`scale * sign(h)` with `scale = mean |h|` per block (float32): one bit per element on the wire,
  one all-to-all of the packed signs and scales, a float32 mean of this device's shard, and a
  bf16 gather."""
  def encode(h, rows):
    wire_rows = layout.leaf_layout(h.size, rows, block_size)
    h_RxBxL = layout.to_rows(h, wire_rows)
    real_RxB = layout.to_rows(jnp.ones_like(h), wire_rows).sum(-1)  # padding left out
    # sum |h| 2**-k / (real 2**-k): the sum cannot overflow, and it is sum |h| / real exactly.
    down = quant.mean_factors(wire_rows.block_len)[0]
    scales_RxB = quant.saturate(
        (jnp.abs(h_RxBxL) * down).sum(-1) / (jnp.maximum(real_RxB, 1.0) * down))
    codes_RxBxL = jnp.where(h_RxBxL < 0, -1, 0).astype(jnp.int8)
    return codes_RxBxL, scales_RxB, wire_rows

  def send(hs, flag, axis_name):
    rows = _rows(axis_name)
    codes, scales, rows_of = zip(*[encode(h, rows) for h in hs])
    decoded = [layout.from_rows(sign_values(q, s), r) for q, s, r in zip(codes, scales, rows_of)]
    if axis_name is None:
      return Sent(decoded, decoded, flag)
    packed = [quant.pack(q, 1) for q in codes]
    buffer, parts = framing.frame([*packed, *scales, jnp.broadcast_to(flag, (rows,))])
    got = framing.unframe(wire.all_to_all(buffer, axis_name), parts)
    k = len(hs)
    shards = [quant.mean_over_peers(sign_values(quant.unpack(q, 1), s))
              for q, s in zip(got[:k], got[k:2 * k])]
    values, flags = gathers.gather_bf16(shards, got[-1].sum(), axis_name)
    return Sent(decoded, [layout.from_rows(v, r) for v, r in zip(values, rows_of)], flags[0])

  return send


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
  """The k largest `|h|` of each leaf as (int32 index, float32 value); one all-gather of them all
  (as int32 words), and a scatter-add of every device's pairs."""
  def send(hs, flag, axis_name):
    _rows(axis_name)  # an axis that is not bound: the error that says so
    picked = [jax.lax.top_k(jnp.abs(h), topk_count(h.size, fraction))[1] for h in hs]
    values = [h[idx_K] for h, idx_K in zip(hs, picked)]
    decoded = [scatter_mean(i[None], v[None], h.size) for h, i, v in zip(hs, picked, values)]
    if axis_name is None:
      return Sent(decoded, decoded, flag)
    buffer, parts = framing.frame([x[None] for x in [*picked, *values, flag[None]]], jnp.int32)
    got = framing.unframe(wire.all_gather(buffer, axis_name), parts)
    k = len(hs)
    means = [scatter_mean(i, v, h.size) for h, i, v in zip(hs, got[:k], got[k:2 * k])]
    return Sent(decoded, means, got[-1][:, 0].sum())

  return send
