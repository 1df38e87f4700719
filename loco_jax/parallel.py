"""Meshes, per-device optimizer state and data-parallel train steps under `jax.shard_map`."""

import jax
import jax.numpy as jnp
import optax
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

from loco_jax.loco import state_specs


def data_mesh(num_devices: int | None = None, axis_name: str = "data") -> Mesh:
  """A 1-D mesh of the first `num_devices` devices (all by default) with Auto axis types."""
  available = jax.device_count()
  num_devices = num_devices or available
  if not 1 <= num_devices <= available:
    raise ValueError(f"num_devices must be in 1..{available} (devices present), got "
                     f"{num_devices}")
  return jax.make_mesh((num_devices,), (axis_name,), axis_types=(AxisType.Auto,),
                       devices=jax.devices()[:num_devices])


def _check_axis(mesh: Mesh, axis_name: str) -> None:
  if axis_name not in mesh.axis_names:
    raise ValueError(f"axis_name {axis_name!r} is not an axis of the mesh; its axes are "
                     f"{tuple(mesh.axis_names)}")


def opt_state_specs(optimizer: optax.GradientTransformation, params, mesh: Mesh,
                    axis_name: str):
  """PartitionSpecs of `optimizer.init(params)` inside shard_map: LoCo errors per device."""
  _check_axis(mesh, axis_name)
  size = mesh.shape[axis_name]
  shapes = jax.eval_shape(
      jax.vmap(lambda _: optimizer.init(params), axis_name=axis_name, axis_size=size),
      jnp.zeros(size))
  return state_specs(shapes, axis_name)


def init_opt_state(optimizer: optax.GradientTransformation, params, mesh: Mesh,
                   axis_name: str = "data"):
  """Runs `optimizer.init` on every device of the mesh; returns the state and its specs.

  Example:
    >>> state, specs = init_opt_state(optax.chain(loco(axis_name="data"), optax.adamw(1e-3)),
    ...                               params, data_mesh())
  """
  specs = opt_state_specs(optimizer, params, mesh, axis_name)
  init = jax.jit(jax.shard_map(optimizer.init, mesh=mesh, in_specs=P(), out_specs=specs))
  return init(params), specs
