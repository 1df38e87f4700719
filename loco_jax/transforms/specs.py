"""PartitionSpecs of a transformation's state for `jax.shard_map`: per-device fields split."""

from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from loco_jax.core.layout import AxisName
from loco_jax.transforms.baselines import EF21State, ErrorFeedbackState
from loco_jax.transforms.co3 import Co3State
from loco_jax.transforms.loco_state import LocoState
from loco_jax.transforms.two_hop import TwoHopState

# The fields of each state that differ from device to device.
_PER_DEVICE: dict[type, tuple[str, ...]] = {
    LocoState: ("groups",),
    TwoHopState: TwoHopState._fields[1:7],
    Co3State: ("error", "scale", "coded_bits"),
    ErrorFeedbackState: ("error",),
    EF21State: ("local",),
}


def register_per_device(state_type: type, fields: tuple[str, ...]) -> None:
  """Declares the per-device fields of a state class of your own, for `state_specs`.

  Example:
    >>> from typing import Any, NamedTuple
    >>> class MyState(NamedTuple):
    ...   count: jax.Array
    ...   error: Any
    >>> register_per_device(MyState, ("error",))
  """
  unknown = [f for f in fields if f not in getattr(state_type, "_fields", ())]
  if unknown:
    raise ValueError(f"register_per_device: {state_type.__name__} is a NamedTuple without the "
                     f"fields {unknown}")
  _PER_DEVICE[state_type] = tuple(fields)


def per_device_fields(state: Any) -> tuple[str, ...]:
  """The fields of `state` that differ per device (none for a state no one declared)."""
  return _PER_DEVICE.get(type(state), ())


def state_specs(state: Any, axis_name: AxisName) -> Any:
  """PartitionSpecs for an optimizer state, for `jax.shard_map` over `axis_name`.

  Per-device fields (LoCo's errors; yours through `register_per_device`) are split over the
  axis, every other leaf (step counters, adamw's state after the average) is replicated.

  Example:
    >>> state = loco_jax.loco().init(params)   # with an axis_name: created inside shard_map
    >>> specs = state_specs(state, "data")
    >>> specs.groups[""].error[0] == P("data"), specs.count == P()   # per device; replicated
    (True, True)
  """
  def spec(node):
    per_device = per_device_fields(node)
    if per_device:
      return type(node)(*[
          jax.tree.map(lambda _: P(axis_name) if name in per_device else P(), value)
          for name, value in zip(node._fields, node)])
    return jax.tree.map(lambda _: P(), node)
  return jax.tree.map(spec, state, is_leaf=lambda n: type(n) in _PER_DEVICE)
