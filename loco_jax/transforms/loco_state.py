"""LoCo's state: kept in the buckets the step compresses (`core.buckets`), and shown per leaf."""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from loco_jax.core import buckets, leaves, trees


class GroupState(NamedTuple):
  """One group's LoCo state: one array per bucket of the group's plan (None: not in this
  mode)."""
  error: tuple           # int8 [rows * blocks * len]: this device's averaged compression error
  error_scale: Any       # float32 [rows * blocks] (None with a fixed `error_scale`)
  gather_error: Any      # int8 [blocks * len]: the averaged shard's error (gather="quantized")
  gather_scale: Any      # float32 [blocks] (gather="quantized" with block scales)


class LocoState(NamedTuple):
  """LoCo's state, stored as it is stepped: per group of leaves (`leaves.group_key`: "" unless
  a model axis splits some), one array per bucket (`buckets.plan`); `error_by_leaf` shows it
  per leaf. `groups` differs per device: declare it with `state_specs`."""
  count: jax.Array   # int32 steps taken; drives the periodic reset
  groups: Any        # leaves.ByGroup: {group key: GroupState}
  signature: Any     # trees.TreeSignature of the params: their structure and shapes, no array


def bucket_layout(grads: leaves.Leaves, axes: leaves.AxisNames, block_size: int,
                  error_bits: int, error_scale: float | None) -> tuple:
  """What lays LoCo's buckets out besides the params' shapes (`trees.TreeSignature.layout`):
  `buckets.plan`'s block size, the averaged axes (its rows), each group's leaves, and how the
  error is stored, so that train/reshard.py can decode and re-encode it for another mesh."""
  return (("block_size", block_size), ("axes", leaves.axis_names(axes)),
          ("groups", tuple((g.key, tuple(g.indices)) for g in grads.groups)),
          ("error_bits", error_bits), ("error_scale", error_scale))


def check_state(state: Any, updates: Any, expected: Any) -> None:
  """ValueError where `updates` is not like the params `state` was made from, or `state` is
  not laid out as `expected` ({group key: `group_shapes`})."""
  if not isinstance(state, LocoState):
    raise ValueError(f"loco: the state must be a LocoState (from loco(...).init), got "
                     f"{type(state).__name__}")
  trees.check_layout("loco", state, updates, state.groups, expected)


def error_by_leaf(state: LocoState, params: Any, block_size: int = 2048,
                  rows: int = 1) -> tuple[Any, Any]:
  """One device's LoCo error per leaf: (int8 [size] per leaf, float32 block scales
  [rows * blocks] per leaf, None with a fixed error_scale), as trees like `params` (a leaf
  that is not compressed gets an empty array).

  `block_size`: the one `loco` used (`defaults_for(bits)` where left at None); `rows`: the
  devices on its axis (1 without one): the state's buckets hold each leaf's rows in their
  blocks (`buckets.plan`).

  Example:
    >>> params = {"b": jnp.zeros(100), "w": jnp.zeros((4, 512))}
    >>> error, scales = error_by_leaf(loco_jax.loco(block_size=512).init(params), params, 512)
    >>> error["w"].shape, scales["b"].shape
    ((2048,), (4,))
  """
  tree = leaves.split(params)
  p = buckets.plan(tuple(x.size if i in tree.sent else 0 for i, x in enumerate(tree.leaves)),
                   rows, block_size)
  expected = [((rows * b * n,), jnp.int8) for b, n in zip(p.blocks, p.block_lens)]
  if not set(state.groups) <= {""}:
    raise ValueError(f"error_by_leaf: the state has the groups {sorted(state.groups)}; it "
                     f"shows one device's state of leaves not split over a model axis (\"\")")
  group = state.groups.get("", GroupState((), None, None, None))  # no leaf: no group
  error_buckets, scale_buckets = group.error, group.error_scale
  if ([(tuple(e.shape), e.dtype) for e in error_buckets] != expected or
      scale_buckets is not None and [s.shape for s in scale_buckets] != [
          (rows * b,) for b in p.blocks]):
    raise ValueError(f"error_by_leaf: the state's error holds {trees.arrays_of(error_buckets)}, but "
                     f"params laid out in blocks of {block_size} over {rows} rows need "
                     f"{len(expected)} arrays of shapes {[s for s, _ in expected][:4]}: pass the params, "
                     f"block_size and rows (devices on the axis) the state was made for")
  block_starts = [[q.block0 for q in leaf.pieces] if leaf else None for leaf in p.leaves]
  as_tree = lambda per_leaf, dtype: tree.tree(
      [jnp.zeros((0,), dtype) if x is None else x for x in per_leaf])
  error = as_tree(buckets.from_buckets([e.reshape(rows, b, n) for e, b, n in zip(
      error_buckets, p.blocks, p.block_lens)], p, block_starts), jnp.int8)
  if scale_buckets is None:
    return error, None
  scales = buckets.scales_from_buckets([s.reshape(rows, b) for s, b in zip(
      scale_buckets, p.blocks)], p, block_starts)
  return error, as_tree(scales, jnp.float32)
