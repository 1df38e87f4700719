"""Test helper: runs of the MLP regression (tests/train_worker.py) on (data=D, model=K) meshes,
the params split over "model" as SPECS say, checkpointed and restored onto another mesh; their
LoCo errors decoded per data row (tests/decoded.py)."""

from typing import Any, NamedTuple

import jax
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import decoded
import train_worker
from loco_jax.train import checkpoint, parallel

HIDDEN = 32
SPECS = train_worker.MODEL_SPECS
SHAPES = {k: np.shape(v) for k, v in train_worker.init_params(HIDDEN).items()}


def mesh_of(data: int, model: int = 0):
  """(data=D, model=K), or (data=D) for model=0."""
  if not model:
    return parallel.data_mesh(data)
  return jax.make_mesh((data, model), ("data", "model"), axis_types=(AxisType.Auto,) * 2,
                       devices=jax.devices()[:data * model])


class Run(NamedTuple):
  mesh: Any
  state: Any
  step: Any
  config: dict
  params: Any       # placed as the step takes them


def run_on(mesh, mode: str, compressor, loss_fn=train_worker.loss_fn, params=None,
           **options) -> Run:
  """A run of the MLP regression (or `params`, `loss_fn`) with `compressor`, the params split
  over "model" as SPECS say where the mesh has that axis."""
  params = train_worker.init_params(HIDDEN) if params is None else params
  if "model" in mesh.axis_names:
    params = jax.device_put(params, {k: NamedSharding(mesh, s) for k, s in SPECS.items()})
  options = dict(mode=mode, compressor=compressor, **options)
  state, _ = parallel.init_train_state(params, optax.adam(1e-2), mesh, **options)
  step = parallel.make_train_step(loss_fn, optax.adam(1e-2), mesh, params, **options)
  config = {"model": "mlp-regression", "devices": mesh.size,
            "layout": checkpoint.train_layout(mesh, params, mode=mode)}
  return Run(mesh, state, step, config, params)


def batch(mesh, k: int) -> jax.Array:
  full = np.asarray(train_worker.batch(k, parallel.data_mesh(1)))
  return jax.device_put(full, NamedSharding(mesh, P("data")))


def trained(run: Run, steps: int) -> Any:
  state = run.state
  for k in range(steps):
    state, _ = run.step(state, batch(run.mesh, k))
  return state


def restored(tmp_path, state, old: Run, new: Run) -> checkpoint.Restored:
  checkpoint.save(tmp_path, 3, state, old.config)
  out = checkpoint.restore(tmp_path, new.state, new.config, reshard=True, mesh_keys=("devices",))
  assert out.step == 3 and out.resharded is not None
  return out


def sizes(mesh) -> tuple[int, int]:
  return mesh.shape["data"], mesh.shape.get("model", 1)


def loco_rows(compressor_state, mesh, field: str = "error") -> list:
  """Each data row's LoCo `field` decoded into whole params (tests/decoded.py)."""
  block = dict(compressor_state.signature.layout)["block_size"]
  return decoded.loco_errors(compressor_state, SHAPES, SPECS, *sizes(mesh), block, field)
