"""LoCo's error reset on 8 devices: zeroed before step k exactly when k > 0 and k % interval == 0.

The stored error is read through the state. To see whether a step started from a zeroed error,
each state is probed (a branch, not the trajectory) with a gradient on the 4-bit grid: values
+-7 in every block, so the absmax scale is 1 and compressing it leaves no residual. From a
zeroed error the probe's new error is exactly 0 on every device; from the trajectory's error
(random gradients, never on the grid) it is not.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from loco_jax import loco
from loco_jax.train import parallel

N = 8
PARAMS = {"w": jnp.zeros((16, 256)), "b": jnp.zeros((N * 40,))}  # whole blocks and a remainder
STEPS = 13


@pytest.fixture(scope="module")
def mesh():
  return parallel.data_mesh(N)


def _per_device_errors(state) -> np.ndarray:
  """int8 [devices, everything]: each device's stored error, all buckets."""
  return np.concatenate([np.asarray(e).reshape(N, -1) for e in jax.tree.leaves(state.groups[""].error)],
                        axis=1)


def _step(opt, mesh, specs):
  grad_specs = jax.tree.map(lambda _: P("data"), PARAMS)
  update = lambda g, s: opt.update(jax.tree.map(lambda x: x[0], g), s)
  return jax.jit(jax.shard_map(update, mesh=mesh, in_specs=(grad_specs, specs),
                               out_specs=(jax.tree.map(lambda _: P(), PARAMS), specs)))


@pytest.mark.slow
@pytest.mark.parametrize("reset_interval", [4, 5, 0])
def test_reset_zeroes_the_error_exactly_at_the_scheduled_steps(mesh, reset_interval):
  opt = loco(bits=4, axis_name="data", reset_interval=reset_interval)
  state, specs = parallel.init_opt_state(opt, PARAMS, mesh)
  step = _step(opt, mesh, specs)
  rng = np.random.default_rng(reset_interval)
  on_grid = {k: jnp.asarray(7.0 * rng.choice([-1.0, 1.0], (N, *x.shape)), jnp.float32)
             for k, x in PARAMS.items()}
  zeroed = []
  for k in range(STEPS):
    assert int(state.count) == k
    probe_out, probe = step(on_grid, state)
    errors = _per_device_errors(probe)
    zero = ~errors.any(axis=1)
    assert zero.all() or not zero.any(), (k, zero)  # every device resets, or none
    if zero.all():
      zeroed.append(k)
      # The output ignores the stored error too: the plain mean of the grid values (multiples
      # of 7/4, exact in the bfloat16 gather).
      for name, g in on_grid.items():
        np.testing.assert_array_equal(np.asarray(probe_out[name]), np.asarray(g).mean(axis=0))
    noisy = {k: jnp.asarray(rng.standard_normal((N, *x.shape)), jnp.float32)
             for k, x in PARAMS.items()}
    _, state = step(noisy, state)
    assert _per_device_errors(state).any(axis=1).all(), k  # the trajectory's error is never 0
  # Step 0 starts from init's zero error; then exactly the scheduled steps.
  scheduled = [k for k in range(1, STEPS) if reset_interval and k % reset_interval == 0]
  assert zeroed == [0] + scheduled
