"""LoCo's step on buckets, shared by `loco` and `two_hop`: compress every bucket with its error
(`kernels.compress_step`), then average over an axis (`comm.bucketed`) and gather the shards."""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from loco_jax import kernels
from loco_jax.comm import bucketed, gathers
from loco_jax.core import buckets, leaves
from loco_jax.core.layout import AxisName
from loco_jax.codecs import huffman_deflate
from loco_jax.transforms.loco_state import GroupState
from loco_jax.transforms.settings import LocoSettings


class Averaging(NamedTuple):
  """How the step averages: over which axis, and what returns the averaged shards."""
  axis_name: AxisName | None   # None: local compression, nothing sent
  gather: str                  # "bf16" or "quantized"
  scatter: bool                # return this device's shard of each leaf, no gather
  capacity_bits: float | None  # the all-to-all's codes Huffman-coded in slots of this many
                               # bits a code; None: sent packed as they are

  @property
  def quantized_gather(self) -> bool:
    return self.axis_name is not None and self.gather == "quantized" and not self.scatter

  def rows(self) -> int:
    """Devices on the axis: each bucket's rows (1 without an axis)."""
    return 1 if self.axis_name is None else gathers.axis_size(self.axis_name)


class CompressedBuckets(NamedTuple):
  """A group's buckets after `kernels.compress_step`."""
  packed: list          # uint8 [rows, blocks, len * bits / 8] per bucket: what is sent
  scales: list | None   # float32 [rows, blocks] per bucket (None with a fixed scale)
  state: GroupState     # the new error and error scale buckets (gather fields None)
  decompressed: list    # float32 [rows, blocks, len] per bucket in local mode, else Nones
  finite: jax.Array     # bool []: every gradient value was finite


class Averaged(NamedTuple):
  """A group's buckets after the exchange."""
  values: list          # float32 [rows, blocks, len] per bucket (scatter: [blocks * len])
  flags: jax.Array      # float32 []: 0, or NaN where some device saw a non-finite gradient
  gather_error: Any     # the averaged shard's new error buckets (gather="quantized"), else None
  gather_scale: Any


def is_due(count: jax.Array, reset_interval: int) -> jax.Array:
  """Whether the error is zeroed before this step: k > 0 and a multiple of reset_interval."""
  if reset_interval == 0:
    return jnp.bool_(False)
  return (count > 0) & (count % reset_interval == 0)


def bucket_plans(grads: leaves.Leaves, rows: int, block_size: int, sizes=None) -> dict:
  """{group key: the bucket layout of the group's leaves} (`buckets.plan`); `sizes`: each
  leaf's elements where they are not the leaf's own (a shard of it)."""
  sizes = [x.size for x in grads.leaves] if sizes is None else sizes
  return {group.key: buckets.plan(tuple(n if i in group.indices else 0
                                        for i, n in enumerate(sizes)), rows, block_size)
          for group in grads.groups}


def group_shapes(plan: buckets.Plan, block_scales: bool, quantized_gather: bool) -> GroupState:
  """The shapes and dtypes of a group's state: one array per bucket of `plan`."""
  def arrays(dtype, length):
    return tuple(jax.ShapeDtypeStruct((length(plan.rows, b, n),), dtype)
                 for b, n in zip(plan.blocks, plan.block_lens))
  return GroupState(
      arrays(jnp.int8, lambda rows, b, n: rows * b * n),
      arrays(jnp.float32, lambda rows, b, n: rows * b) if block_scales else None,
      arrays(jnp.int8, lambda rows, b, n: b * n) if quantized_gather else None,
      arrays(jnp.float32, lambda rows, b, n: b) if quantized_gather and block_scales else None)


def compress_buckets(grad_buckets: list, errors: tuple, error_scales: tuple | None,
                     s: LocoSettings, reset, decompressed: bool, skip=None) -> CompressedBuckets:
  """LoCo's step on every gradient bucket [rows, blocks, len] with its error bucket."""
  packed, scales, new_errors, new_scales, values = [], [], [], [], []
  finite = jnp.bool_(True)
  for c, g in enumerate(grad_buckets):
    rows, blocks, n = g.shape
    out = kernels.compress_step(
        g.reshape(-1), errors[c], None if error_scales is None else error_scales[c],
        bits=s.bits, error_bits=s.error_bits, beta=s.beta, reset=reset, block_size=n,
        decompressed=decompressed, fixed_scale=s.scale, fixed_error_scale=s.error_scale,
        scale_method=s.scale_method, clip_rms=s.clip_rms, skip=skip)
    packed.append(out.packed.reshape(rows, blocks, -1))
    scales.append(out.scales.reshape(rows, blocks))
    new_errors.append(out.error)
    new_scales.append(out.error_scale)
    values.append(None if out.decompressed is None else out.decompressed.reshape(rows, blocks, n))
    finite &= out.finite
  state = GroupState(tuple(new_errors), None if s.error_scale is not None else tuple(new_scales),
                     None, None)
  return CompressedBuckets(packed, None if s.scale is not None else scales, state, values,
                           finite)


def average(sent: CompressedBuckets, plan: buckets.Plan, old: GroupState, s: LocoSettings,
            mode: Averaging, reset) -> Averaged:
  """The mean over the axis of every device's decompressed buckets: one all-to-all of the
  packed codes and scales, this device's shard averaged in float32, then a bfloat16 or
  re-quantized all-gather (or nothing: scatter). The flags travel with the payload."""
  flags = leaves.flag(sent.finite)
  if mode.axis_name is None:
    return Averaged(sent.decompressed, flags, None, None)
  if mode.capacity_bits is None:
    means, flags = bucketed.all_to_all_mean(sent.packed, sent.scales, s.scale, s.bits, flags,
                                            mode.axis_name)
  else:
    means, flags = bucketed.coded_all_to_all_mean(
        sent.packed, sent.scales, s.scale, s.bits, flags, mode.capacity_bits,
        huffman_deflate, mode.axis_name)
  if mode.scatter:
    # No gather follows to bring the flags back replicated: one 4-byte all-reduce does (every
    # device holds the same sum of the peers' flags; n times 0, NaN or inf keeps its meaning).
    return Averaged(means, jax.lax.psum(flags, mode.axis_name), None, None)
  as_buckets = lambda values: [v.reshape(plan.rows, b, n)
                               for v, b, n in zip(values, plan.blocks, plan.block_lens)]
  if mode.gather == "bf16":
    values, flags = gathers.gather_bf16(means, flags, mode.axis_name)
    return Averaged(as_buckets(values), flags[0], None, None)
  # The averaged shard is re-quantized with its own error: this device's row of every bucket
  # (zero where a leaf is padded, as every peer's codes there are).
  shard = compress_buckets([m.reshape(1, b, n) for m, b, n in zip(means, plan.blocks,
                                                                  plan.block_lens)],
                           old.gather_error, old.gather_scale, s, reset, False)
  values, flags = gathers.gather_packed(
      [x[0] for x in shard.packed], None if shard.scales is None else [x[0] for x in shard.scales],
      s.scale, s.bits, flags, mode.axis_name)
  return Averaged(as_buckets(values), flags[0], shard.state.error, shard.state.error_scale)
