"""ZeRO-2: float32 master shards of the params and the optimizer state on them (1/N a device).

A step gathers the params from the shards (`shards.gather_params`: the compute dtype, or int8
with block scales), takes this device's gradient, and hands it to a compressor with
reduce-scatter semantics (`loco(axis_name=..., scatter=True)`, `shards.reduce_scatter`), which
returns this device's shard of the averaged gradient. The optimizer then updates the global
master shards under GSPMD, so that what it computes over the whole gradient (a global norm,
`optax.apply_if_finite`'s finiteness) is the same on every device. On a mesh with model axes
each device shards its own model block.
"""

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from loco_jax.core import trees
from loco_jax.train import masks, sharding, shards, steps
from loco_jax.train import mesh as mesh_lib
from loco_jax.train.state import TrainState

def init_train_state(params: Any, optimizer: optax.GradientTransformation, mesh: Mesh,
                     compressor: optax.GradientTransformation, axes: mesh_lib.TrainAxes,
                     axis_name: mesh_lib.AxisNames) -> tuple[TrainState, TrainState]:
  """zero2's state and its full specs (`parallel.init_train_state(mode="zero2")`).

  Args:
    params: the params, plain or placed with NamedShardings over the model axes.
    optimizer: applied to the master shards; its callable masks see the full-shaped params.
    compressor: returns this device's shard of the averaged gradient.
    mesh, axes, axis_name: the mesh, its data and model axes, and the data axes as given.

  Returns:
    (state, specs): master shards split over the data axes (and a leaf's model axes), the
    optimizer state split like them, the compressor's per-device state of the full gradient.
  """
  masks.evaluate_on_full_shapes(optimizer)
  pspecs = sharding.train_param_specs(params, mesh, axes, axis_name)
  master = shards.shard_params(params, mesh, axis_name)
  opt_init = masks.on_full_shapes(optimizer.init, sharding.shapes_of(params))
  shard_specs = sharding.master_specs(pspecs, mesh, axes.data)
  specs = TrainState(
      shard_specs, sharding.local_state_specs(compressor.init, params, pspecs, mesh, axes.data),
      sharding.gspmd_state_specs(opt_init, master, shard_specs, mesh, axes.data), P())
  compressor_init = steps.over_data(
      steps.over_model(compressor.init, axes, (pspecs,), specs.compressor_state), mesh, axes,
      (pspecs,), specs.compressor_state)

  def init(full, master):
    return TrainState(master, compressor_init(full), opt_init(master), jnp.zeros([], jnp.int32))
  full = jax.device_put(params, sharding.named(mesh, pspecs))
  return jax.jit(init, out_shardings=sharding.named(mesh, specs))(full, master), specs


def make_train_step(loss_fn: Callable[[Any, Any], jax.Array],
                    optimizer: optax.GradientTransformation, mesh: Mesh, specs: TrainState,
                    params_like: Any, compressor: optax.GradientTransformation,
                    axes: mesh_lib.TrainAxes, axis_name: mesh_lib.AxisNames,
                    gather: shards.ParamGather) -> Callable:
  """zero2's jitted `step(state, batch) -> (state, mean loss)` (`parallel.make_train_step`).

  Args:
    loss_fn: `loss_fn(params, batch)`, on params gathered in `gather.dtype`.
    optimizer, compressor, mesh, axes, axis_name: as given to `init_train_state`.
    specs: `init_train_state`'s specs.
    params_like: the params given to `init_train_state`, placed alike.
    gather: how the params are gathered from the master shards.

  Returns:
    The jitted step; the batch's leading axis split over the data axes.
  """
  masks.evaluate_on_full_shapes(optimizer)
  like = sharding.shapes_of(params_like)
  pspecs = sharding.train_param_specs(params_like, mesh, axes, axis_name)
  if axes.model and not sharding.same_specs(
      specs.params, sharding.master_specs(pspecs, mesh, axes.data)):
    raise ValueError(f"specs.params {specs.params} are not those of params_like's shardings: "
                     f"pass as params_like the params given to init_train_state, placed with "
                     f"the same NamedShardings")
  blocks = sharding.local_shapes(like, pspecs, mesh)  # this device's model blocks
  shard_like = shards.shard_shapes(blocks, axes.size)

  def gather_blocks(master):
    trees.check_same_shapes(master, shard_like, "state.params (master shards)",
                            "params_like's shards")
    return shards.gather_params(master, blocks, axes.name, gather)

  def scatter(grads, compressor_state, params):
    averaged, compressor_state = compressor.update(grads, compressor_state, params)
    trees.check_same_shapes(averaged, shard_like, "the compressor's output",
                            "state.params (master shards)", shards.scatter_hint("zero2"))
    return averaged, compressor_state

  comp_specs = specs.compressor_state
  gather_params = steps.over_model(gather_blocks, axes, (specs.params,), pspecs)
  average = steps.over_model(scatter, axes, (pspecs, comp_specs, pspecs),
                             (specs.params, comp_specs))

  def local_grads(master, compressor_state, batch):
    params = gather_params(master)
    loss, grads = steps.loss_and_grads(loss_fn, params, batch, mesh, axes, pspecs)
    averaged, compressor_state = average(grads, compressor_state, params)
    return averaged, compressor_state, jax.lax.pmean(loss, axes.name)

  sharded_grads = steps.over_data(local_grads, mesh, axes,
                                  (specs.params, comp_specs, P(axes.name)),
                                  (specs.params, comp_specs, P()))
  update = masks.on_full_shapes(optimizer.update, like)

  def step(state: TrainState, batch):
    grads, compressor_state, loss = sharded_grads(state.params, state.compressor_state, batch)
    updates, opt_state = update(grads, state.opt_state, state.params)  # GSPMD, on the shards
    return (TrainState(optax.apply_updates(state.params, updates), compressor_state, opt_state,
                       state.step + 1), loss)

  return steps.jit_step(step, mesh, (specs, P()))
