"""DDP: params and optimizer state whole on every device (split only over model axes); the
compressor averages each device's gradient, and the optimizer updates every copy alike.

On a mesh with model axes the compressor runs on each device's own model shard (told the
params' specs, `core.local_blocks`), and the optimizer updates the averaged gradient under
GSPMD.
"""

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from loco_jax.core import local_blocks, trees
from loco_jax.train import sharding, steps
from loco_jax.train.state import Setup, TrainState


def state_specs(setup: Setup) -> TrainState:
  """Full specs of ddp's state: params as placed; the optimizer state split like them where it
  is shaped like them; the compressor's per-device state split over the data axes and the
  leaf's model axes."""
  mesh, data, pspecs = setup.mesh, setup.axes.data, setup.param_specs
  return TrainState(
      pspecs, sharding.local_state_specs(setup.compressor.init, setup.params, pspecs, mesh, data),
      sharding.gspmd_state_specs(setup.optimizer.init, setup.params, pspecs, mesh, data,
                                 per_device=True), P())


def init(setup: Setup, params: Any) -> tuple[TrainState, TrainState]:
  """ddp's state on the mesh and its full specs (`parallel.init_train_state(mode="ddp")`)."""
  specs = state_specs(setup)
  compressor_init = local_blocks.told_specs(setup.compressor.init, setup.param_specs)

  def init_fn(placed):
    return TrainState(placed, compressor_init(placed), setup.optimizer.init(placed),
                      jnp.zeros([], jnp.int32))
  placed = jax.device_put(params, sharding.named(setup.mesh, setup.param_specs))
  state = jax.jit(steps.over_data(init_fn, setup, (setup.param_specs,), specs),
                  out_shardings=sharding.named(setup.mesh, specs))(placed)
  return state, specs


def make_step(setup: Setup, loss_fn: Callable[[Any, Any], jax.Array]) -> Callable:
  """ddp's jitted `step(state, batch) -> (state, mean loss)` (`parallel.make_train_step`):
  `loss_fn` on the params cast to the compute dtype, the batch's leading axis split over the
  data axes."""
  specs, axes = state_specs(setup), setup.axes
  dtype = setup.gather.dtype
  cast = lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
  average = local_blocks.told_specs(setup.compressor.update, setup.param_specs)

  def local_step(state: TrainState, batch):
    trees.check_same_shapes(state.params, setup.params, "state.params", "params_like")
    params = jax.tree.map(cast, state.params)
    loss, grads = steps.loss_and_grads(loss_fn, params, batch, setup)
    grads, compressor_state = average(grads, state.compressor_state, params)
    trees.check_same_shapes(grads, state.params, "the compressor's output", "state.params")
    updates, opt_state = setup.optimizer.update(grads, state.opt_state, state.params)
    return (TrainState(optax.apply_updates(state.params, updates), compressor_state, opt_state,
                       state.step + 1), jax.lax.pmean(loss, axes.name))

  return steps.jit_step(steps.over_data(local_step, setup, (specs, P(axes.name)),
                                        (specs, P())), setup, (specs, P()))
