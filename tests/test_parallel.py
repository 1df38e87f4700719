"""DDP and ZeRO-2 train steps on an 8-device CPU mesh: losses, state memory, wire bits."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from loco_jax import comm, loco
from loco_jax.train import parallel

import teacher

N = 8


_params, _loss = teacher.params, teacher.loss
_batches = lambda steps, size=64: teacher.batches(steps, size)


def _mean():
  from loco_jax.transforms import baselines
  return baselines.uncompressed(axis_name="data")


def _train(mode, compressor, optimizer=None, steps=30, **kwargs):
  mesh = parallel.data_mesh(N)
  optimizer = optimizer or optax.adam(1e-2)
  state, specs = parallel.init_train_state(_params(), optimizer, mesh, compressor=compressor,
                                           mode=mode)
  # The step needs the params' shapes only (and their shardings, on a mesh with model axes).
  step = parallel.make_train_step(_loss, optimizer, mesh, jax.eval_shape(_params),
                                  compressor=compressor, mode=mode, **kwargs)
  losses = []
  for batch in _batches(steps):
    state, loss = step(state, batch)
    losses.append(float(loss))
  return losses, state, step


@pytest.mark.slow
def test_ddp_and_zero2_uncompressed_agree():
  ddp, _, _ = _train("ddp", _mean())
  zero2, _, _ = _train("zero2", parallel.reduce_scatter("data"))
  np.testing.assert_allclose(zero2, ddp, rtol=1e-4)
  assert ddp[-1] < 0.5 * ddp[0]


@pytest.mark.slow
def test_zero2_with_loco_trains_like_uncompressed():
  plain, _, _ = _train("zero2", parallel.reduce_scatter("data"))
  compressed, _, _ = _train("zero2", loco(axis_name="data", scatter=True))
  int8_gather, _, _ = _train("zero2", loco(axis_name="data", scatter=True), param_gather="int8")
  assert compressed[-1] < 0.5 * compressed[0]
  assert abs(compressed[-1] - plain[-1]) < 0.1 * plain[0]
  assert abs(int8_gather[-1] - plain[-1]) < 0.1 * plain[0]


@pytest.mark.slow
def test_zero2_optimizer_state_is_a_shard_of_ddps():
  per_device = lambda tree, split: sum(
      x.nbytes / (N if split else 1) for x in jax.tree.leaves(tree))
  _, ddp, _ = _train("ddp", _mean(), steps=1)
  _, zero2, _ = _train("zero2", parallel.reduce_scatter("data"), steps=1)
  ddp_bytes = per_device(ddp.opt_state, False)
  zero2_bytes = per_device(zero2.opt_state, True)
  assert zero2_bytes < 1.3 * ddp_bytes / N, (zero2_bytes, ddp_bytes)


@pytest.mark.slow
def test_zero2_wire_bits_from_the_hlo():
  n_params = sum(x.size for x in jax.tree.leaves(_params()))
  bits = {}
  for name, compressor, dtype in [("plain", parallel.reduce_scatter("data"), jnp.float32),
                                  ("loco", loco(axis_name="data", scatter=True), jnp.bfloat16)]:
    _, state, step = _train("zero2", compressor, steps=1, compute_dtype=dtype)
    found = comm.lowered_collectives(step.jitted, state, _batches(1)[0])
    # The only all-reduces are scalars (the mean loss, LoCo's finiteness flag): the gradient
    # itself is never all-reduced.
    assert all(c.nbytes <= 4 for c in found if c.op == "all-reduce"), found
    bits[name] = {c.op: 0.0 for c in found}
    for c in found:
      bits[name][c.op] += comm.wire_bits_per_param([c], n_params)
  assert "reduce-scatter" in bits["plain"] and "all-to-all" not in bits["plain"]
  assert "reduce-scatter" not in bits["loco"] and "all-to-all" in bits["loco"]
  assert bits["loco"]["all-to-all"] < bits["plain"]["reduce-scatter"] / 6


@pytest.mark.slow
def test_bad_axis_and_batch():
  with pytest.raises(ValueError, match="num_devices must be in 1..8"):
    parallel.data_mesh(0)
  mesh = parallel.data_mesh(N)
  with pytest.raises(ValueError, match="'model'"):
    parallel.init_train_state(_params(), optax.adam(1e-2), mesh, compressor=_mean(),
                              axis_name="model")
  _, state, step = _train("ddp", _mean(), steps=1)
  with pytest.raises(ValueError, match="not divisible"):
    step(state, jnp.zeros((12, 20)))


@pytest.mark.slow
def test_apply_if_finite_after_the_compressor_skips_a_bad_step_everywhere():
  mesh = parallel.data_mesh(N)
  optimizer = optax.apply_if_finite(optax.adam(1e-2), max_consecutive_errors=5)
  compressor = loco(axis_name="data")
  state, specs = parallel.init_train_state(_params(), optimizer, mesh, compressor=compressor)
  step = parallel.make_train_step(_loss, optimizer, mesh, _params(),
                                  compressor=compressor)
  batch = _batches(1)[0]
  state, _ = step(state, batch)
  before = jax.tree.map(np.asarray, (state.params, state.compressor_state))
  poisoned = batch.at[5, 0].set(jnp.nan)  # one device's shard of the batch
  state, loss = step(state, poisoned)
  assert np.isnan(float(loss))
  jax.tree.map(np.testing.assert_array_equal, before,
               jax.tree.map(np.asarray, (state.params, state.compressor_state)))
  assert int(state.opt_state.total_notfinite) == 1


def _ndim_mask(params):
  return jax.tree.map(lambda x: x.ndim > 1, params)


@pytest.mark.slow
def test_zero2_evaluates_a_callable_mask_on_the_full_shapes_like_ddp():
  # optax evaluates the mask on what it is given: zero2's flat master shards have ndim 1, so
  # without masks.evaluate_on_full_shapes decay would be off for every leaf.
  optimizer = lambda: optax.adamw(1e-2, weight_decay=10.0, mask=_ndim_mask)
  _, ddp, _ = _train("ddp", _mean(), optimizer(), steps=1)
  _, zero2, _ = _train("zero2", parallel.reduce_scatter("data"), optimizer(), steps=1)
  zero2_params = parallel.unshard_params(zero2.params, _params())
  for k, x in _params().items():
    np.testing.assert_allclose(np.asarray(zero2_params[k]), np.asarray(ddp.params[k]),
                               rtol=1e-5, atol=1e-6)
  # Decay did act: one step of lr 1e-2 with weight_decay 10 shrinks w1 by about 10%.
  ratio = np.linalg.norm(zero2_params["w1"]) / np.linalg.norm(_params()["w1"])
  assert ratio < 0.95, ratio


@pytest.mark.slow
def test_zero2_clips_by_the_global_norm_of_the_whole_gradient_like_ddp():
  # zero2's optimizer runs under GSPMD on the global master shards: the norm is the whole
  # gradient's, not one device's shard's (which would clip each shard by a different factor).
  optimizer = lambda: optax.chain(optax.clip_by_global_norm(1e-3), optax.sgd(1.0))
  _, ddp, _ = _train("ddp", _mean(), optimizer(), steps=1)
  _, zero2, _ = _train("zero2", parallel.reduce_scatter("data"), optimizer(), steps=1)
  zero2_params = parallel.unshard_params(zero2.params, _params())
  moved = 0.0
  for k, x in _params().items():
    np.testing.assert_allclose(np.asarray(zero2_params[k]), np.asarray(ddp.params[k]),
                               rtol=1e-5, atol=1e-7)
    moved += float(np.sum((np.asarray(ddp.params[k]) - np.asarray(x)) ** 2))
  np.testing.assert_allclose(np.sqrt(moved), 1e-3, rtol=1e-4)  # the clip did act


def test_masks_see_full_shapes_through_inject_hyperparams_and_multi_transform():
  from loco_jax.train import masks
  mesh = parallel.data_mesh(N)
  seen = []
  labels = lambda p: jax.tree.map(lambda x: seen.append(x.shape) or "decay", p)
  opt = optax.multi_transform(
      {"decay": optax.inject_hyperparams(optax.adamw, static_args=("mask",))(
          1e-2, weight_decay=1.0, mask=_ndim_mask)},
      labels)
  assert masks.evaluate_on_full_shapes(opt) == 2
  shards = jax.tree.map(lambda x: jnp.zeros(x.shape), parallel.shard_params(_params(), mesh))
  with masks.full_shapes(_params()):
    opt.init(shards)
  assert set(seen) == {x.shape for x in jax.tree.leaves(_params())}
  seen.clear()
  opt.init(shards)   # outside full_shapes: as optax would, on the shards
  assert set(seen) == {x.shape for x in jax.tree.leaves(shards)}


@pytest.mark.slow
def test_compute_dtype_applies_in_ddp():
  _, state, step = _train("ddp", _mean(), steps=1, compute_dtype=jnp.bfloat16)
  _, _, step32 = _train("ddp", _mean(), steps=1)
  batch = _batches(1)[0]
  text = step.jitted.lower(state, batch).as_text()
  assert "bf16" in text and "bf16" not in step32.jitted.lower(state, batch).as_text()
  ddp_bf16, _, _ = _train("ddp", _mean(), steps=3, compute_dtype=jnp.bfloat16)
  ddp_f32, _, _ = _train("ddp", _mean(), steps=3)
  np.testing.assert_allclose(ddp_bf16, ddp_f32, rtol=0.05)
  assert ddp_bf16 != ddp_f32


@pytest.mark.parametrize("kwargs,match", [
    (dict(mode="ddp", param_gather="int8"), "param_gather='int8' is a mode='zero2' option"),
    (dict(mode="zero2", block_size=512), "block_size .* param_gather='int8'"),
    (dict(mode="zero2", param_gather="int8", block_size=0), "block_size must be a positive"),
    (dict(mode="ddp", compute_dtype=jnp.int32), "compute_dtype must be a float dtype"),
])
def test_options_that_would_be_ignored_raise(kwargs, match):
  mesh = parallel.data_mesh(N)
  with pytest.raises(ValueError, match=match):
    parallel.make_train_step(_loss, optax.adam(1e-2), mesh, _params(),
                             compressor=parallel.reduce_scatter("data"), **kwargs)


@pytest.mark.slow
def test_scalar_batch_leaf_and_mismatched_trees_name_the_leaf():
  _, state, step = _train("ddp", _mean(), steps=1)
  batch = _batches(1)[0]
  with pytest.raises(ValueError, match=r"batch leaf \['scale'\] is a scalar"):
    step(state, {"x": batch, "scale": jnp.float32(2.0)})
  with pytest.raises(ValueError, match=r"batch size 12 of batch leaf \['x'\]"):
    step(state, {"x": jnp.zeros((12, 20))})
  # zero2 with a compressor that returns whole gradients, not this device's shard.
  mesh = parallel.data_mesh(N)
  optimizer = optax.adam(1e-2)
  state, specs = parallel.init_train_state(_params(), optimizer, mesh, compressor=_mean(),
                                           mode="zero2")
  step = parallel.make_train_step(_loss, optimizer, mesh, _params(), compressor=_mean(),
                                  mode="zero2")
  with pytest.raises(ValueError, match=r"leaf \['b1'\] has shape \(64,\), .* has \(8,\)"
                                       r".*reduce-scatter semantics"):
    step(state, batch)
