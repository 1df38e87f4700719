"""ZeRO-2: float32 master shards of the params and the optimizer state on them (1/N a device).

A step gathers the params from the shards (`shards.gather_params`), takes this device's
gradient and hands it to a compressor with reduce-scatter semantics (`loco(..., scatter=True)`,
`shards.reduce_scatter`), which returns this device's shard of the averaged gradient. The
optimizer updates the global master shards under GSPMD, so a global norm is the same everywhere.
"""

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from loco_jax.core import local_blocks, trees
from loco_jax.train import masks, sharding, shards, steps
from loco_jax.train.state import Setup, TrainState


def state_specs(setup: Setup) -> TrainState:
  """Full specs of zero2's state: master shards split over the data axes (and a leaf's model
  axes), the optimizer state split like them, the compressor's per-device state of the full
  gradient."""
  masks.evaluate_on_full_shapes(setup.optimizer)
  mesh, data, pspecs = setup.mesh, setup.axes.data, setup.param_specs
  master_specs = sharding.master_specs(pspecs, data)
  master = jax.eval_shape(lambda p: shards.shard_params(p, mesh, data), setup.params)
  opt_init = masks.on_full_shapes(setup.optimizer.init, setup.params)
  return TrainState(
      master_specs,
      sharding.local_state_specs(setup.compressor.init, setup.params, pspecs, mesh, data),
      sharding.gspmd_state_specs(opt_init, master, master_specs, mesh, data), P())


def init(setup: Setup, params: Any) -> tuple[TrainState, TrainState]:
  """zero2's state on the mesh and its full specs (`parallel.init_train_state(mode="zero2")`);
  the optimizer's callable masks see the full-shaped params."""
  specs, pspecs = state_specs(setup), setup.param_specs
  master = shards.shard_params(params, setup.mesh, setup.axes.data)
  opt_init = masks.on_full_shapes(setup.optimizer.init, setup.params)
  compressor_init = steps.over_data(local_blocks.told_specs(setup.compressor.init, pspecs),
                                    setup, (pspecs,), specs.compressor_state)

  def init_fn(full, master):
    return TrainState(master, compressor_init(full), opt_init(master), jnp.zeros([], jnp.int32))
  full = jax.device_put(params, sharding.named(setup.mesh, pspecs))
  return jax.jit(init_fn, out_shardings=sharding.named(setup.mesh, specs))(full, master), specs


def make_step(setup: Setup, loss_fn: Callable[[Any, Any], jax.Array]) -> Callable:
  """zero2's jitted `step(state, batch) -> (state, mean loss)` (`parallel.make_train_step`):
  `loss_fn` on the params gathered as `setup.gather` says, the batch's leading axis split over
  the data axes."""
  specs, axes, pspecs = state_specs(setup), setup.axes, setup.param_specs
  blocks = sharding.local_shapes(setup.params, pspecs, setup.mesh)  # this device's model blocks
  shard_like = shards.shard_shapes(blocks, axes.size)

  def gather_blocks(master):
    trees.check_same_shapes(master, shard_like, "state.params (master shards)",
                            "params_like's shards")
    return shards.gather_params(master, blocks, axes.name, setup.gather)

  gather = local_blocks.on_blocks(gather_blocks, None, axes.model,
                                  (local_blocks.restrict(specs.params, axes.model),),
                                  local_blocks.restrict(pspecs, axes.model))
  scatter = local_blocks.told_specs(setup.compressor.update, pspecs)

  def local_grads(master, compressor_state, batch):
    params = gather(master)
    loss, grads = steps.loss_and_grads(loss_fn, params, batch, setup)
    averaged, compressor_state = scatter(grads, compressor_state, params)
    trees.check_same_shapes(averaged, master, "the compressor's output",
                            "state.params (master shards)", shards.scatter_hint("zero2"))
    return averaged, compressor_state, jax.lax.pmean(loss, axes.name)

  comp_specs = specs.compressor_state
  return steps.on_master_shards(
      steps.over_data(local_grads, setup, (specs.params, comp_specs, P(axes.name)),
                      (specs.params, comp_specs, P())), setup, specs)
