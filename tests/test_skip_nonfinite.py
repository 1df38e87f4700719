"""optax.apply_if_finite in every train mode: a NaN gradient in one layer on one device is
skipped on every device, and the state is kept (issue 30)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from loco_jax import loco
from loco_jax.train import fsdp, parallel

N, IN, OUT, HIDDEN, BATCH = 8, 16, 4, 32, 64


def _params() -> dict:
  rng = np.random.default_rng(0)
  return {"w1": (rng.standard_normal((IN, HIDDEN)) * 0.3).astype(np.float32),
          "b1": np.zeros(HIDDEN, np.float32),
          "w2": (rng.standard_normal((HIDDEN, OUT)) * 0.3).astype(np.float32),
          "b2": np.zeros(OUT, np.float32)}


def _head(p, h_BxH, batch):
  """The output layer's loss. A row whose last column is 1 gives w2[0, 0] a NaN gradient
  (sqrt of a negative number) and leaves every other leaf's gradient finite."""
  poisoned = batch[:, -1] > 0
  below = jnp.where(poisoned, p["w2"][0, 0] - 1e9, 1.0)
  trap = jnp.mean(jnp.where(poisoned, jnp.sqrt(below), 0.0))
  return jnp.mean((h_BxH @ p["w2"] + p["b2"] - batch[:, IN:IN + OUT]) ** 2) + trap


def _embed(p, batch):
  return jnp.tanh(batch[:, :IN] @ p["w1"] + p["b1"])


def _loss(p, batch):
  return _head(p, _embed(p, batch), batch)


def _batch(poisoned_row: int | None = None) -> jax.Array:
  rng = np.random.default_rng(1)
  x = rng.standard_normal((BATCH, IN)).astype(np.float32)
  y = np.tanh(x @ rng.standard_normal((IN, OUT))).astype(np.float32)
  flag = np.zeros((BATCH, 1), np.float32)
  if poisoned_row is not None:
    flag[poisoned_row] = 1.0
  return jnp.asarray(np.concatenate([x, y, flag], axis=1))


def _setup(mode: str, compressor):
  mesh = parallel.data_mesh(N)
  optimizer = optax.apply_if_finite(optax.adam(1e-2), max_consecutive_errors=3)
  params, loss_fn = _params(), _loss
  if mode == "fsdp":
    params = fsdp.Layered({k: params[k] for k in ("w1", "b1")}, {},
                          {k: params[k] for k in ("w2", "b2")})
    loss_fn = fsdp.LayeredModel(_embed, None, _head)
  state, specs = parallel.init_train_state(params, optimizer, mesh, compressor=compressor,
                                           mode=mode)
  step = parallel.make_train_step(loss_fn, optimizer, mesh, params,
                                  compressor=compressor, mode=mode)
  return state, step


def _host(tree):
  return jax.tree.map(np.asarray, tree)


@pytest.mark.slow
@pytest.mark.parametrize("mode, compressor", [
    ("ddp", loco(axis_name="data")),
    ("zero2", parallel.reduce_scatter("data")),
    ("zero2", loco(axis_name="data", scatter=True)),
    ("fsdp", loco(axis_name="data", scatter=True)),
], ids=["ddp-loco", "zero2-fp32", "zero2-loco", "fsdp-loco"])
def test_a_nan_in_one_layer_on_one_device_is_skipped_everywhere(mode, compressor):
  state, step = _setup(mode, compressor)
  state, loss = step(state, _batch())
  assert np.isfinite(float(loss))
  before = _host(state)
  # Row 3 lies on device 0 (8 rows a device): only its gradient of w2 is NaN. In zero2 and
  # fsdp only one device's shard of the averaged w2 would be NaN after a plain reduce-scatter.
  state, loss = step(state, _batch(poisoned_row=3))
  assert np.isnan(float(loss))
  after = _host(state)
  jax.tree.map(np.testing.assert_array_equal, before.params, after.params)
  jax.tree.map(np.testing.assert_array_equal, before.compressor_state, after.compressor_state)
  jax.tree.map(np.testing.assert_array_equal, before.opt_state.inner_state,
               after.opt_state.inner_state)
  counters = state.opt_state
  for counter in (counters.notfinite_count, counters.total_notfinite, counters.last_finite):
    copies = {int(shard.data) for shard in counter.addressable_shards}
    assert len(copies) == 1, copies  # every device holds the same count
  assert (int(counters.notfinite_count), int(counters.total_notfinite)) == (1, 1)
  assert not bool(counters.last_finite)
  # The next finite step is taken, and the counter of consecutive skips is reset.
  state, loss = step(state, _batch())
  assert np.isfinite(float(loss)) and int(state.opt_state.notfinite_count) == 0
  assert not np.array_equal(np.asarray(jax.tree.leaves(state.params)[0]),
                            jax.tree.leaves(before.params)[0])
