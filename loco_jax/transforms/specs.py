"""PartitionSpecs of a transformation's state for `jax.shard_map`: per-device fields split."""

from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from loco_jax.core.layout import AxisName


def state_specs(state: Any, axis_name: AxisName) -> Any:
  """PartitionSpecs for an optimizer state, for `jax.shard_map` over `axis_name`.

  Fields that a state class lists in `PER_DEVICE` (LoCo's errors, a baseline's error) differ per
  device, so they are split over the axis (their global arrays stack every device's copy);
  every other leaf (step counters, the state of adamw after the average) is replicated.

  Example:
    >>> state = loco_jax.loco().init(params)   # with an axis_name: created inside shard_map
    >>> specs = state_specs(state, "data")
    >>> specs.error[""][0] == P("data"), specs.count == P()   # per device; replicated
    (True, True)
  """
  def spec(node):
    if hasattr(node, "PER_DEVICE") and hasattr(node, "_fields"):
      return type(node)(*[
          jax.tree.map(lambda _: P(axis_name) if name in node.PER_DEVICE else P(), value)
          for name, value in zip(node._fields, node)])
    return jax.tree.map(lambda _: P(), node)
  return jax.tree.map(spec, state, is_leaf=lambda n: hasattr(n, "PER_DEVICE"))
