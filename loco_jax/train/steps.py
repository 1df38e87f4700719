"""What every train step shares: the shard_map over the data axes, the nested one over the model
axes, the loss's gradient on this device's batch, and the jit around it."""

from typing import Any, Callable

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from loco_jax.train import mesh as mesh_lib
from loco_jax.train import sharding


def over_data(fn: Callable, mesh: Mesh, axes: mesh_lib.TrainAxes, in_specs: Any,
              out_specs: Any) -> Callable:
  """shard_map manual over the data axes; the model axes stay with GSPMD.

  It runs on the mesh's Auto twin (`mesh.auto_mesh`): over an Explicit model axis jax 0.10.2
  would all-gather every input at the shard_map's boundary.
  """
  return jax.shard_map(fn, mesh=mesh_lib.auto_mesh(mesh),
                       in_specs=sharding.restrict(in_specs, axes.data),
                       out_specs=sharding.restrict(out_specs, axes.data),
                       axis_names=set(axes.data))


def over_model(fn: Callable, axes: mesh_lib.TrainAxes, in_specs: Any,
               out_specs: Any) -> Callable:
  """Nested shard_map manual over the model axes too: `fn` sees each device's own blocks.

  The leaf core (core/leaves.py) sees there which leaves vary over the model axes: it
  compresses split and replicated leaves apart and makes their shards keep or skip a step
  together (a 4-byte flag over the model axes), so the outputs type-check against the specs.
  """
  if not axes.model:
    return fn
  return jax.shard_map(fn, in_specs=sharding.restrict(in_specs, axes.model),
                       out_specs=sharding.restrict(out_specs, axes.model),
                       axis_names=set(axes.model))


def loss_and_grads(loss_fn: Callable, params: Any, batch: Any, mesh: Mesh,
                   axes: mesh_lib.TrainAxes, specs: Any) -> tuple[jax.Array, Any]:
  """`loss_fn`'s value and gradient on this device's batch, inside `over_data`.

  Args:
    loss_fn: `loss_fn(params, batch) -> scalar`, run under GSPMD over the model axes.
    params: the full params (global over the model axes).
    batch: this device's batch.
    mesh: the train step's mesh; its Explicit model axes are Explicit again for `loss_fn`.
    axes: the step's axes.
    specs: the params' full specs.

  Returns:
    (loss, grads): this device's own, not averaged.
  """
  # Replicated params would make jax.grad psum the gradient in full precision (the transpose of
  # the implicit broadcast); marked varying, each device keeps its own gradient.
  params = jax.lax.pcast(params, axes.name, to="varying")
  value_and_grad = jax.value_and_grad(loss_fn)
  explicit = tuple(a for a in mesh_lib.explicit_axes(mesh) if a in axes.model)
  if explicit:
    value_and_grad = jax.sharding.explicit_axes(
        value_and_grad, axes=explicit,
        in_sharding=(sharding.restrict(specs, explicit), jax.tree.map(lambda _: P(), batch)))
  return value_and_grad(params, batch)


def jit_step(step: Callable, mesh: Mesh, out_specs: Any) -> Callable:
  """The jitted `step(state, batch)`: the state donated, the outputs placed as `out_specs`.

  On a mesh with Explicit axes the step runs with them Auto (`jax.sharding.auto_axes`), as its
  shard_maps do (`over_data`), and its outputs are Explicit again.
  """
  explicit = mesh_lib.explicit_axes(mesh)
  if not explicit:
    return jax.jit(step, donate_argnums=0, out_shardings=sharding.named(mesh, out_specs))

  def with_auto_axes(state, batch):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):  # auto_axes reads the context
      return jax.sharding.auto_axes(step, axes=explicit, out_sharding=out_specs)(state, batch)
  return jax.jit(with_auto_axes, donate_argnums=0,
                 out_shardings=sharding.named(mesh, out_specs))
