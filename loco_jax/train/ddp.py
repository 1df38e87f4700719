"""DDP: params and optimizer state whole on every device (split only over model axes); the
compressor averages each device's gradient, and the optimizer updates every copy alike.

On a mesh with model axes the compressor runs on each device's own model shard (a nested
shard_map), and the optimizer updates the averaged gradient under GSPMD.
"""

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from loco_jax.core import trees
from loco_jax.train import mesh as mesh_lib
from loco_jax.train import sharding, steps
from loco_jax.train.state import TrainState


def init_train_state(params: Any, optimizer: optax.GradientTransformation, mesh: Mesh,
                     compressor: optax.GradientTransformation, axes: mesh_lib.TrainAxes,
                     axis_name: mesh_lib.AxisNames) -> tuple[TrainState, TrainState]:
  """ddp's state and its full specs (`parallel.init_train_state(mode="ddp")`).

  Args:
    params: the params, plain or placed with NamedShardings over the model axes.
    optimizer: applied to the averaged gradient.
    compressor: averages the gradients over the data axes.
    mesh, axes, axis_name: the mesh, its data and model axes, and the data axes as given.

  Returns:
    (state, specs): params as placed; the optimizer state split like them where it is shaped
    like them; the compressor's per-device state split over the data axes and the leaf's
    model axes.
  """
  pspecs = sharding.train_param_specs(params, mesh, axes, axis_name)
  comp_specs = sharding.local_state_specs(compressor.init, params, pspecs, mesh, axes.data)
  opt_specs = sharding.gspmd_state_specs(optimizer.init, params, pspecs, mesh, axes.data,
                                         per_device=True)
  specs = TrainState(pspecs, comp_specs, opt_specs, P())
  compressor_init = steps.over_model(compressor.init, axes, (pspecs,), comp_specs)

  def init(placed):
    return TrainState(placed, compressor_init(placed), optimizer.init(placed),
                      jnp.zeros([], jnp.int32))
  placed = jax.device_put(params, sharding.named(mesh, pspecs))
  state = jax.jit(steps.over_data(init, mesh, axes, (pspecs,), specs),
                  out_shardings=sharding.named(mesh, specs))(placed)
  return state, specs


def make_train_step(loss_fn: Callable[[Any, Any], jax.Array],
                    optimizer: optax.GradientTransformation, mesh: Mesh, specs: TrainState,
                    params_like: Any, compressor: optax.GradientTransformation,
                    axes: mesh_lib.TrainAxes, axis_name: mesh_lib.AxisNames,
                    compute_dtype) -> Callable:
  """ddp's jitted `step(state, batch) -> (state, mean loss)` (`parallel.make_train_step`).

  Args:
    loss_fn: `loss_fn(params, batch)`, on params cast to `compute_dtype`.
    optimizer, compressor, mesh, axes, axis_name: as given to `init_train_state`.
    specs: `init_train_state`'s specs.
    params_like: the params given to `init_train_state`, placed alike.
    compute_dtype: the float dtype the params are cast to for `loss_fn`.

  Returns:
    The jitted step; the batch's leading axis split over the data axes.
  """
  pspecs = sharding.train_param_specs(params_like, mesh, axes, axis_name)
  if axes.model and not sharding.same_specs(specs.params, pspecs):
    raise ValueError(f"specs.params {specs.params} are not those of params_like's shardings "
                     f"({pspecs}): pass as params_like the params given to "
                     f"init_train_state, placed with the same NamedShardings")
  like = sharding.shapes_of(params_like)
  cast = lambda x: x.astype(compute_dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
  average = steps.over_model(compressor.update, axes,
                             (pspecs, specs.compressor_state, pspecs),
                             (pspecs, specs.compressor_state))

  def local_step(state: TrainState, batch):
    trees.check_same_shapes(state.params, like, "state.params", "params_like")
    params = jax.tree.map(cast, state.params)
    loss, grads = steps.loss_and_grads(loss_fn, params, batch, mesh, axes, pspecs)
    grads, compressor_state = average(grads, state.compressor_state, params)
    trees.check_same_shapes(grads, state.params, "the compressor's output", "state.params")
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    return (TrainState(optax.apply_updates(state.params, updates), compressor_state, opt_state,
                       state.step + 1), jax.lax.pmean(loss, axes.name))

  return steps.jit_step(steps.over_data(local_step, mesh, axes, (specs, P(axes.name)),
                                        (specs, P())), mesh, (specs, P()))
