"""What every train step shares: the shard_map over the data axes, the loss's gradient on this
device's batch, and the jit around it. The compressor finds each device's own model blocks
itself (`core.local_blocks`), told the params' specs."""

from typing import Any, Callable

import jax
import optax
from jax.sharding import PartitionSpec as P

from loco_jax.core import local_blocks
from loco_jax.train import masks, sharding
from loco_jax.train import mesh as mesh_lib
from loco_jax.train.state import Setup, TrainState


def over_data(fn: Callable, setup: Setup, in_specs: Any, out_specs: Any) -> Callable:
  """shard_map manual over the data axes; the model axes stay with GSPMD.

  It runs on the mesh's Auto twin (`mesh.auto_mesh`): over an Explicit model axis jax 0.10.2
  would all-gather every input at the shard_map's boundary.
  """
  data = setup.axes.data
  return jax.shard_map(fn, mesh=mesh_lib.auto_mesh(setup.mesh),
                       in_specs=local_blocks.restrict(in_specs, data),
                       out_specs=local_blocks.restrict(out_specs, data), axis_names=set(data))


def loss_and_grads(loss_fn: Callable, params: Any, batch: Any,
                   setup: Setup) -> tuple[jax.Array, Any]:
  """`loss_fn`'s value and gradient on this device's batch, inside `over_data`.

  `loss_fn` runs under GSPMD over the model axes (Explicit ones Explicit again) on the full
  params. Returns (loss, grads): this device's own, not averaged.
  """
  # Replicated params would make jax.grad psum the gradient in full precision (the transpose of
  # the implicit broadcast); marked varying, each device keeps its own gradient. (DiLoCo's
  # workers are varying already.)
  def varying(x):
    missing = tuple(a for a in setup.axes.data if a not in jax.typeof(x).manual_axis_type.varying)
    return jax.lax.pcast(x, missing, to="varying") if missing else x
  params = jax.tree.map(varying, params)
  value_and_grad = jax.value_and_grad(loss_fn)
  explicit = tuple(a for a in mesh_lib.explicit_axes(setup.mesh) if a in setup.axes.model)
  if explicit:
    value_and_grad = jax.sharding.explicit_axes(
        value_and_grad, axes=explicit,
        in_sharding=(local_blocks.restrict(setup.param_specs, explicit),
                     jax.tree.map(lambda _: P(), batch)))
  return value_and_grad(params, batch)


def jit_step(step: Callable, setup: Setup, out_specs: Any) -> Callable:
  """The jitted `step(state, batch)`: the state donated, the outputs placed as `out_specs`.

  On a mesh with Explicit axes the step runs with them Auto (`jax.sharding.auto_axes`), as its
  shard_maps do (`over_data`), and its outputs are Explicit again.
  """
  mesh = setup.mesh
  explicit = mesh_lib.explicit_axes(mesh)
  if not explicit:
    return jax.jit(step, donate_argnums=0, out_shardings=sharding.named(mesh, out_specs))

  def with_auto_axes(state, batch):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):  # auto_axes reads the context
      return jax.sharding.auto_axes(step, axes=explicit, out_sharding=out_specs)(state, batch)
  return jax.jit(with_auto_axes, donate_argnums=0,
                 out_shardings=sharding.named(mesh, out_specs))


def on_master_shards(sharded_grads: Callable, setup: Setup, specs: TrainState) -> Callable:
  """zero2's and fsdp's jitted step: `sharded_grads(master, compressor_state, batch)` gives this
  device's shard of the averaged gradient (in `over_data`), then the optimizer updates the
  global master shards under GSPMD, its callable masks on the full-shaped params."""
  update = masks.on_full_shapes(setup.optimizer.update, setup.params)

  def step(state: TrainState, batch):
    grads, compressor_state, loss = sharded_grads(state.params, state.compressor_state, batch)
    updates, opt_state = update(grads, state.opt_state, state.params)
    return (TrainState(optax.apply_updates(state.params, updates), compressor_state, opt_state,
                       state.step + 1), loss)
  return jit_step(step, setup, (specs, P()))
