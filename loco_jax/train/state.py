"""Train states, the setup a train step is built from, and an optimizer's state on a mesh for a
shard_map step of your own."""

from typing import Any, NamedTuple

import jax
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from loco_jax.core import local_blocks
from loco_jax.train import mesh as mesh_lib
from loco_jax.train import sharding
from loco_jax.train.shards import ParamGather


class TrainState(NamedTuple):
  """A train step's state (or its PartitionSpecs).

  params: as placed (ddp); zero2: this device's float32 master shard of each leaf (of its own
  model block on a mesh with model axes); fsdp: an fsdp.Layered whose stacked leaves hold one
  shard a layer.
  """
  params: Any
  compressor_state: Any
  opt_state: Any
  step: jax.Array


class Setup(NamedTuple):
  """A train step's arguments, resolved once (`parallel.setup`) and handed to the mode's module
  (ddp.py, zero2.py, fsdp.py), whose `init(setup, params)` and `make_step(setup, loss_fn)` read
  them from here."""
  mesh: Mesh                                  # the user's mesh
  axes: mesh_lib.TrainAxes                    # averaged over by hand (data) or by GSPMD (model)
  optimizer: optax.GradientTransformation     # on the averaged gradient
  compressor: optax.GradientTransformation    # averages over the data axes
  params: Any                                 # the full params' shapes (ShapeDtypeStructs)
  param_specs: Any                            # their full specs: over the model axes only
  gather: ParamGather                         # the compute dtype; zero2, fsdp: the gather
  outer: "Outer | None" = None                # mode="diloco": its outer step


class Outer(NamedTuple):
  """mode="diloco"'s outer step (train/diloco.py)."""
  optimizer: optax.GradientTransformation     # on the averaged pseudo-gradient
  inner_steps: int                            # H: steps between two syncs of a fragment
  fragments: int                              # F: parts of the params synced in turn
  overlap: int = 0                            # tau: inner steps a sync runs beside
  alpha: float = 0.0                          # the worker's share when a sync is merged
  comm_mesh: Mesh | None = None               # overlap > 0: where the syncs run


def opt_state_specs(optimizer: optax.GradientTransformation, params: Any, mesh: Mesh,
                    axis_name: mesh_lib.AxisNames = "data") -> Any:
  """PartitionSpecs of `optimizer.init(params)` in a shard_map manual over the data axes.

  The fields `state_specs` names (LoCo's errors) are split over the data axes, the rest
  replicated; with model axes, as `init_opt_state` lays the state out.
  """
  data = mesh_lib.data_axes(mesh, axis_name)
  init = local_blocks.told_specs(optimizer.init, sharding.param_specs(params, mesh, data))
  return sharding.device_state_shapes(init, params, mesh, data)[1]


def init_opt_state(optimizer: optax.GradientTransformation, params: Any, mesh: Mesh,
                   axis_name: mesh_lib.AxisNames = "data") -> tuple[Any, Any]:
  """Runs `optimizer.init` on every device of the mesh, for a shard_map of your own.

  `params` may be placed with NamedShardings over the mesh's model axes (those not in
  `axis_name`). Returns (state, specs): the state on the mesh and its specs over the data axes,
  for a `jax.shard_map` manual over them. Over model axes the state is kept per device's own
  blocks: build the transformation with `specs=` (the params' PartitionSpecs), or update it
  under `loco_jax.core.local_blocks.leaf_specs(specs)`.

  Example:
    >>> opt = optax.chain(loco_jax.loco(axis_name="data"), optax.adamw(1e-3))
    >>> state, specs = init_opt_state(opt, params, mesh_lib.data_mesh())
    >>> specs[0].groups[""].error[0] == P("data")   # LoCo's error differs per device
    True
  """
  data = mesh_lib.data_axes(mesh, axis_name)
  init = local_blocks.told_specs(optimizer.init, sharding.param_specs(params, mesh, data))
  specs = opt_state_specs(optimizer, params, mesh, axis_name)
  run = jax.jit(jax.shard_map(init, mesh=mesh, in_specs=P(), out_specs=specs,
                              axis_names=set(data)))
  return run(params), specs
