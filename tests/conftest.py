"""Fixtures the tests share: the 8-device data mesh and a transformation's update jitted under
jax.shard_map (the root conftest.py sets up the 8 simulated CPU devices)."""

import jax
import pytest
from jax.sharding import PartitionSpec as P

from loco_jax.train import parallel

N = 8


@pytest.fixture(scope="module")
def mesh():
  """Every device on one Auto 'data' axis."""
  return parallel.data_mesh(N)


def shard_mapped_update(opt, mesh, params, axes=("data",), out_spec=P()):
  """(jitted step(grads, state) -> (updates, state), the state made on every device).

  Each gradient leaf has one leading axis per entry of `axes` (a device's own gradient at
  each position); the update runs inside jax.shard_map over the mesh, the state is created
  there with `parallel.init_opt_state`, and every output leaf gets `out_spec`."""
  state, specs = parallel.init_opt_state(opt, params, mesh, axes[0] if len(axes) == 1
                                         else tuple(axes))
  grad_specs = jax.tree.map(lambda _: P(*axes), params)
  own = lambda x: x[(0,) * len(axes)]
  update = lambda g, s: opt.update(jax.tree.map(own, g), s)
  step = jax.jit(jax.shard_map(update, mesh=mesh, in_specs=(grad_specs, specs),
                               out_specs=(jax.tree.map(lambda _: out_spec, params), specs)))
  return step, state


@pytest.fixture(name="shard_mapped_update", scope="session")
def shard_mapped_update_fixture():
  """`shard_mapped_update` as a fixture."""
  return shard_mapped_update
