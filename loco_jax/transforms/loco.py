"""4-bit gradient compression with an 8-bit, moving-averaged, periodically reset error (LoCo).

The step reads top-down in `update`: each group of leaves (`core.leaves`) is laid out in a few
flat buckets (`core.buckets`), compressed by one fused kernel a bucket, averaged over the axis
by one all-to-all and gathered (`bucket_step`); then every group keeps or skips the step.

Finite gradients give finite outputs and state: where the arithmetic would overflow, values
saturate at the largest finite one. A non-finite gradient (on any device of the axis) makes
every output NaN and leaves the state unchanged, so the error is never poisoned; wrap the
chain in `optax.apply_if_finite` to skip such steps.
"""

from typing import Any

import jax
import jax.numpy as jnp
import optax

from loco_jax.core import args, buckets, leaves, local_blocks, trees, workarounds
from loco_jax.core.layout import AxisName
from loco_jax.transforms.bucket_step import (Averaging, average, bucket_plans, compress_buckets,
                                             group_shapes, is_due)
from loco_jax.transforms.loco_state import GroupState, LocoState, bucket_layout, check_state
from loco_jax.transforms.settings import GATHER_MODES, LocoSettings, resolve


def _check_averaging(axis_name, gather: str, scatter: bool, entropy_code: bool,
                    capacity_bits: float | None, bits: int) -> Averaging:
  if gather not in GATHER_MODES:
    raise ValueError(f"gather must be one of {GATHER_MODES}, got {gather!r}")
  if gather == "quantized" and axis_name is None:
    raise ValueError("gather='quantized' needs an axis_name: there is no gather without one")
  if scatter and axis_name is None:
    raise ValueError("scatter=True needs an axis_name: without one there is nothing to scatter "
                     "(the output is the whole local gradient)")
  if scatter and gather != "bf16":
    raise ValueError(f"gather={gather!r} has no effect with scatter=True (no gather follows the "
                     f"scatter): pass one of them, not both")
  if not entropy_code:
    if capacity_bits is not None:
      raise ValueError(f"capacity_bits={capacity_bits!r} sizes entropy_code's slots: pass "
                       f"entropy_code=True with it, or leave it None")
    return Averaging(axis_name, gather, bool(scatter), None)
  if axis_name is None:
    raise ValueError("entropy_code=True needs an axis_name: it codes what the all-to-all sends, "
                     "and without an axis nothing is sent")
  capacity_bits = bits - 0.5 if capacity_bits is None else capacity_bits
  args.check_fraction(capacity_bits, f"capacity_bits (bits a {bits}-bit code, at most {bits})",
                      0.0, float(bits), closed_low=False)
  return Averaging(axis_name, gather, bool(scatter), float(capacity_bits))


def group_step(group: leaves.Group, plan: buckets.Plan, grad_buckets: list, old: GroupState,
               count: jax.Array, s: LocoSettings, mode: Averaging, skip=None) -> leaves.GroupResult:
  """One group's step: compress its buckets, average them over the axis, and take each
  leaf's values out of the averaged buckets."""
  reset = is_due(count, s.reset_interval)
  sent = compress_buckets(grad_buckets, old.error, old.error_scale, s, reset,
                          decompressed=mode.axis_name is None, skip=skip)
  averaged = average(sent, plan, old, s, mode, reset)
  take = buckets.shards if mode.scatter else buckets.from_buckets
  per_leaf = take(averaged.values, plan, buckets.starts(plan, count))
  new = sent.state._replace(gather_error=averaged.gather_error,
                            gather_scale=averaged.gather_scale)
  return leaves.GroupResult([per_leaf[i] for i in group.indices], averaged.flags, new)


def loco(bits: int = 4, scale: float | None = None, error_bits: int | None = None,
         error_scale: float | None = None, beta: float | None = None, reset_interval: int = 1024,
         block_size: int | None = None, axis_name: AxisName | None = None, gather: str = "bf16",
         scatter: bool = False, specs: Any = None, scale_method: str | None = None,
         clip_rms: float | None = None, entropy_code: bool = False,
         capacity_bits: float | None = None) -> optax.GradientTransformationExtraArgs:
  """Compresses gradients to `bits` with LoCo's error feedback; averages them over `axis_name`.

  Each step (k = count before it): the error is zeroed if reset_interval > 0 and k is a positive
  multiple of it; h = g + e; q = compress(h; s, bits) is sent (packed); d = q / s;
  e' = compress(beta * e + (1 - beta) * (h - d); s_e, error_bits). The output is d, or with
  `axis_name` the mean over the axis of every device's d. None takes the default for `bits`
  (`loco_jax.transforms.settings`).

  Args:
    bits: bits a gradient value is sent in (1..8).
    scale: None for a scale per block of `block_size` values, sent with the data; a float is
      the paper's fixed scale (2**17..2**19 for LLMs). `error_scale`: the same for the error.
    error_bits: bits of the stored error (default 8).
    beta: the error's moving average (default 0.8); 0 is classic error feedback.
    reset_interval: zero the error every this many steps (0: never).
    block_size: values per scale block.
    axis_name: None compresses locally; a mesh axis (or tuple) averages over it inside
      `jax.shard_map`, where the state is created too and declared with `state_specs`.
    gather: "bf16" (4 + 16 bits a parameter) or "quantized" (the averaged shards re-quantized
      to `bits` with an error of their own, about 4 + 4).
    scatter: return this device's flat shard of each leaf (`layout.shard_len(size, n)`
      values) instead of the whole mean: reduce-scatter semantics, for ZeRO-2 and FSDP.
    specs: the params' PartitionSpecs where Auto model axes shard them inside a shard_map
      manual over the data axes: each device then sends its own block (`core.local_blocks`).
    scale_method: "absmax", or "rms": the top code at `clip_rms` x the block's rms.
    entropy_code: Huffman-code the all-to-all's packed codes on the host (`comm.coded`, zlib's
      Huffman-only deflate) into fixed slots of `capacity_bits` a code (default bits - 0.5);
      the gather is not coded. Where some slot overflows, every device sends that step raw
      (lossless); a peer's slot that does not decode makes every device skip the step.

  Returns:
    An `optax.GradientTransformationExtraArgs` whose state is a `LocoState`.

  Example:
    >>> opt = optax.chain(loco_jax.loco(bits=4), optax.adamw(3e-4))
    >>> state = opt.init(params)
    >>> updates, state = opt.update(grads, state, params)
  """
  s = resolve(bits, scale, error_bits, error_scale, beta, reset_interval, block_size,
              scale_method, clip_rms)
  mode = _check_averaging(axis_name, gather, scatter, entropy_code, capacity_bits, s.bits)
  return optax.GradientTransformationExtraArgs(
      local_blocks.local_init(lambda params: init(s, mode, params), axis_name, specs, "loco"),
      local_blocks.local_update(lambda updates, state: update(s, mode, updates, state),
                                axis_name, specs, flat_output=mode.scatter, name="loco"))


def expected_groups(s: LocoSettings, mode: Averaging, plans: dict) -> dict:
  """{group key: the shapes of its state} (`bucket_step.group_shapes`) for its bucket plan."""
  return leaves.ByGroup({key: group_shapes(plan, s.error_scale is None, mode.quantized_gather)
                        for key, plan in plans.items()})


def init(s: LocoSettings, mode: Averaging, params: Any) -> LocoState:
  """The zero state for `params` (inside jax.shard_map when there is an axis)."""
  if trees.is_placeholder(params):
    return LocoState(jnp.zeros([], jnp.int32), *[jnp.zeros([], jnp.int8)] * 2)
  grads = leaves.split(params, mode.axis_name)
  groups = expected_groups(s, mode, bucket_plans(grads, mode.rows(), s.block_size))
  layout = bucket_layout(grads, mode.axis_name, s.block_size, s.error_bits, s.error_scale)
  return LocoState(jnp.zeros([], jnp.int32), optax.tree.zeros_like(groups),
                   trees.TreeSignature.of(params, layout))


def update(s: LocoSettings, mode: Averaging, updates: Any,
           state: LocoState) -> tuple[Any, LocoState]:
  """One step: each group's buckets compressed and averaged, then kept or skipped together."""
  grads = leaves.split(updates, mode.axis_name)
  plans = bucket_plans(grads, mode.rows(), s.block_size)
  check_state(state, updates, expected_groups(s, mode, plans))
  if not grads.sent:  # nothing to compress or send
    return updates, state._replace(count=optax.safe_increment(state.count))
  filled = {key: buckets.to_buckets([grads.flat(i) if p.leaves[i] else None
                                     for i in range(len(grads.leaves))], p)
            for key, p in plans.items()}
  finite = workarounds.finite_first([g for group in filled.values() for g in group],
                                    local=mode.axis_name is None,
                                    has_bare_leaf=any(p.has_bare_leaf() for p in plans.values()))
  prechecked = None if finite is None else grads.agree(leaves.flag(finite))
  skip = None if prechecked is None else jnp.isnan(prechecked)
  mapped = grads.map_groups(lambda group: group_step(
      group, plans[group.key], filled[group.key], state.groups[group.key], state.count, s,
      mode, skip))
  done = grads.finish(mapped, leaves.ByGroup(mapped.states), state.groups, state.count,
                      shards=mode.rows() if mode.scatter else None, prechecked=prechecked)
  return done.update, LocoState(done.count, done.state, state.signature)
