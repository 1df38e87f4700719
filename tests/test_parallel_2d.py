"""Train steps on (data, model) and (node, local) meshes of 8 CPU devices: params keep their
model sharding, LoCo compresses each device's own model shard, two_hop through the builders."""

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from loco_jax import comm, loco, two_hop
from loco_jax.core import buckets, layout, local_blocks
from loco_jax.train import parallel, sharding
from loco_jax.transforms import baselines

import teacher

DATA, MODEL = 4, 2
# The MLP's matrices split over 'model' the Megatron way (columns of w1, rows of w2), b1 with
# w1's columns; b2 replicated.
SPECS = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None), "b2": P()}


def _mesh():
  return jax.make_mesh((DATA, MODEL), ("data", "model"), axis_types=(AxisType.Auto,) * 2)


_raw_params = teacher.params


def _placed(mesh):
  return jax.device_put(_raw_params(), {k: NamedSharding(mesh, s) for k, s in SPECS.items()})


_loss = teacher.loss
_batches = lambda steps, size=32: teacher.batches(steps, size)


def _train(mesh, params, compressor, optimizer=None, steps=4, mode="ddp", axis_name="data",
           loss_fn=_loss):
  optimizer = optimizer or optax.adam(1e-2)
  state, specs = parallel.init_train_state(params, optimizer, mesh, compressor=compressor,
                                           mode=mode, axis_name=axis_name)
  step = parallel.make_train_step(loss_fn, optimizer, mesh, params,
                                  compressor=compressor, mode=mode, axis_name=axis_name)
  losses = []
  for batch in _batches(steps):
    state, loss = step(state, batch)
    losses.append(float(loss))
  return losses, state, specs, step


def _specs_of(tree):
  return jax.tree.map(lambda x: x.sharding.spec, tree)


def _error_specs(state) -> dict:
  """The specs of LoCo's error buckets, per group (the axes its leaves are split over)."""
  return {key: {e.sharding.spec for e in group.error}
          for key, group in state.compressor_state.groups.items()}


@pytest.mark.slow
def test_ddp_keeps_model_sharding_and_matches_the_data_mesh():
  mesh = _mesh()
  fp32_2d, state, specs, _ = _train(mesh, _placed(mesh), baselines.uncompressed("data"))
  fp32_1d, _, _, _ = _train(parallel.data_mesh(DATA), _raw_params(),
                            baselines.uncompressed("data"))
  # The same math on both meshes (only the order of float sums differs).
  np.testing.assert_allclose(fp32_2d, fp32_1d, rtol=1e-5)
  assert fp32_2d[-1] < 0.7 * fp32_2d[0]
  for name, spec in SPECS.items():  # params and adam's moments stay split like the params
    assert sharding.same_specs(state.params[name].sharding.spec, spec), name
    assert sharding.same_specs(state.opt_state[0].mu[name].sharding.spec, spec), name
    assert state.params[name].sharding.mesh.shape == mesh.shape


@functools.cache
def _loco_runs():
  """LoCo ddp on the (data, model) mesh and on the 1-D mesh of the data axis alone."""
  mesh = _mesh()
  return (_train(mesh, _placed(mesh), loco(axis_name="data")),
          _train(parallel.data_mesh(DATA), _raw_params(), loco(axis_name="data")))


@functools.cache
def _loco_collectives():
  batch = _batches(1)[0]
  return [comm.compiled_collectives(step.jitted, state, batch)
          for _, state, _, step in _loco_runs()]


@pytest.mark.slow
def test_ddp_with_loco_compresses_model_shards_and_trains_like_the_data_mesh():
  (losses, state, _, _), (loco_1d, _, _, _) = _loco_runs()
  for name, spec in SPECS.items():
    assert sharding.same_specs(state.params[name].sharding.spec, spec), name
  # LoCo's errors (one array per bucket) differ per device: over 'data', and over 'model' for the
  # leaves split over it; each device holds the error of its own model blocks (w1's columns,
  # b1, w2's rows) and of b2.
  assert _error_specs(state) == {"model": {P(("data", "model"))}, "": {P("data")}}
  split, whole = buckets.plan((32, 512, 128), DATA, 2048), buckets.plan((4,), DATA, 2048)
  size = lambda p: sum(p.rows * b * n for b, n in zip(p.blocks, p.block_lens))
  errors = {key: group.error for key, group in state.compressor_state.groups.items()}
  assert sum(e.size for e in errors["model"]) == DATA * MODEL * size(split)
  assert sum(e.size for e in errors[""]) == DATA * size(whole)
  assert size(split) < (16 * 64 + 64 + 64 * 4) // MODEL + 2 * 8 * DATA  # blocks, not leaves
  # 4-bit rounding with error feedback on other blocks (model shards): close, not equal.
  np.testing.assert_allclose(losses, loco_1d, rtol=0.03)
  assert losses[-1] < 0.7 * losses[0]


@pytest.mark.slow
def test_one_loco_step_is_the_mean_gradient_within_4_bit_rounding():
  mesh, lr = _mesh(), 1.0
  batch = _batches(1)[0]
  _, state, _, _ = _train(mesh, _placed(mesh), loco(axis_name="data"), optax.sgd(lr), steps=1)
  # Independent reference: per data rank, the gradient on its quarter of the batch.
  params = _raw_params()
  grads = [jax.grad(_loss)(params, chunk) for chunk in jnp.split(batch, DATA)]
  for name in SPECS:
    got = (np.asarray(params[name], np.float64) - np.asarray(state.params[name])) / lr
    per_device = np.stack([np.asarray(g[name], np.float64) for g in grads])
    mean = per_device.mean(0)
    # Each device's 4-bit code is within half a step (absmax / 7) of its gradient; the bf16
    # gather adds 2**-8 relative.
    bound = np.abs(per_device).max() / 14 + np.abs(mean) * 2.0 ** -8 + 1e-6
    assert np.all(np.abs(got - mean) <= bound), name


def _collectives(compressor, mesh, params):
  _, state, _, step = _train(mesh, params, compressor, steps=0)
  return comm.compiled_collectives(step.jitted, state, _batches(1)[0])


@pytest.mark.slow
def test_compiled_collectives_over_model_are_the_models_own():
  mesh = _mesh()
  over = lambda found: collections.Counter(
      (c.op, c.dtype, c.nbytes) for c in found if c.group_size == MODEL)
  fp32 = _collectives(baselines.uncompressed("data"), mesh, _placed(mesh))
  compressed = _loco_collectives()[0]
  # LoCo on global leaves would all-gather the model-split gradients over 'model' and send
  # f32 all-to-alls there; on each device's own shard it adds nothing over 'model' but the
  # 4-byte flag that makes the shards keep or skip a step together.
  extra = over(compressed) - over(fp32)
  assert not over(fp32) - over(compressed), (over(fp32), over(compressed))
  assert sum(extra.values()) <= 1 and all(op == "all-reduce" and nbytes == 4
                                          for op, _, nbytes in extra), extra
  assert not any(c.op == "all-gather" for c in compressed if c.group_size == MODEL)
  assert any(c.op == "all-to-all" for c in compressed if c.group_size == DATA)


@pytest.mark.slow
def test_bytes_over_data_scale_with_the_model_shard():
  # Each model rank sends the codes of its half of each split leaf: half the 1-D mesh's bytes.
  data_bytes = lambda found: sum(c.nbytes for c in found
                                 if c.group_size == DATA and c.op != "all-reduce")
  two_d, one_d = map(data_bytes, _loco_collectives())
  assert 0.4 * one_d < two_d < 0.6 * one_d, (two_d, one_d)


@pytest.mark.slow
def test_zero2_on_a_data_model_mesh():
  mesh = _mesh()
  plain_2d, state, specs, _ = _train(mesh, _placed(mesh), parallel.reduce_scatter("data"),
                                     mode="zero2")
  plain_1d, state_1d, _, _ = _train(parallel.data_mesh(DATA), _raw_params(),
                                    parallel.reduce_scatter("data"), mode="zero2")
  np.testing.assert_allclose(plain_2d, plain_1d, rtol=1e-5)
  # Master shards and adam's moments: split over 'data' and, for a model-split leaf, 'model'.
  assert _specs_of(state.params)["w1"] == P(("data", "model"))
  assert _specs_of(state.opt_state[0].nu)["b2"] == P("data")
  assert state.params["w1"].size == DATA * MODEL * layout.shard_len(16 * 32, DATA)
  full = parallel.unshard_params(state.params, _placed(mesh))
  full_1d = parallel.unshard_params(state_1d.params, _raw_params())
  for name, spec in SPECS.items():
    assert sharding.same_specs(full[name].sharding.spec, spec), name
    np.testing.assert_allclose(np.asarray(full[name]), np.asarray(full_1d[name]), rtol=1e-5,
                               atol=1e-7)


@pytest.mark.slow
def test_zero2_with_loco_on_a_data_model_mesh_trains_like_uncompressed():
  mesh = _mesh()
  compressed, state, _, _ = _train(mesh, _placed(mesh), loco(axis_name="data", scatter=True),
                                   mode="zero2")
  plain, _, _, _ = _train(mesh, _placed(mesh), parallel.reduce_scatter("data"), mode="zero2")
  np.testing.assert_allclose(compressed, plain, rtol=0.03)
  assert _error_specs(state) == {"model": {P(("data", "model"))}, "": {P("data")}}


@pytest.mark.slow
def test_two_hop_through_make_train_step_splits_the_batch_over_both_axes():
  mesh = parallel.node_mesh(2, 4)
  seen = []
  def loss_fn(params, batch):
    seen.append(batch.shape[0])
    return _loss(params, batch)
  axes = ("node", "local")
  losses, state, specs, _ = _train(mesh, _raw_params(), two_hop("node", "local"),
                                   axis_name=axes, loss_fn=loss_fn)
  assert set(seen) == {32 // 8}  # each device its own eighth of the batch: no duplicated work
  # One error array per bucket of the node shards (group "": no model axis), split per device.
  assert all(spec == P(axes) for spec in specs.compressor_state.node_error[""])
  fp32, _, _, _ = _train(parallel.data_mesh(8), _raw_params(), baselines.uncompressed("data"))
  np.testing.assert_allclose(losses, fp32, rtol=0.03)


@pytest.mark.slow
def test_zero2_over_two_data_axes_matches_the_data_mesh():
  axes = ("node", "local")
  losses, _, specs, _ = _train(parallel.node_mesh(2, 4), _raw_params(),
                               parallel.reduce_scatter(axes), mode="zero2", axis_name=axes)
  assert specs.params["w1"] == P(axes)
  flat, _, _, _ = _train(parallel.data_mesh(8), _raw_params(), parallel.reduce_scatter("data"),
                         mode="zero2")
  np.testing.assert_allclose(losses, flat, rtol=1e-5)


@pytest.mark.slow
def test_a_nonfinite_gradient_in_one_model_shard_is_skipped_on_every_device():
  mesh = _mesh()
  def loss_fn(params, batch):
    # Finite loss, NaN gradient only in w1's column 0 (model rank 0's shard): 0 * sqrt'(-1).
    w = params["w1"][:, :1]
    return _loss(params, batch) + jnp.sum(jnp.where(w > 1e9, jnp.sqrt(w - 1e9), 0.0))
  _, state, _, _ = _train(mesh, _placed(mesh), loco(axis_name="data"), steps=1,
                          loss_fn=loss_fn)
  assert int(state.compressor_state.count) == 0
  # Kept (zero) on every device.
  for error in jax.tree.leaves([g.error for g in state.compressor_state.groups.values()]):
    assert not np.any(np.asarray(error)), error.sharding
  for name in SPECS:  # LoCo's output is NaN on every shard, split or replicated, so adam's is
    assert np.isnan(np.asarray(state.params[name])).all(), name


def _typed_loss(p, batch):
  """The MLP's loss written for sharding in types: the contraction over 'model' names its
  output's sharding (through auto_axes, as Hugging Face's Flax models need it); it asserts
  that the step hands it the params as Explicit over 'model', as on the user's mesh."""
  assert jax.typeof(p["w1"]).sharding.spec == P(None, "model"), jax.typeof(p["w1"])
  h = jnp.tanh(batch[:, :16] @ p["w1"] + p["b1"])
  out = jax.sharding.auto_axes(jnp.matmul, axes="model", out_sharding=P(None, None))(h, p["w2"])
  return jnp.mean((out + p["b2"] - batch[:, 16:]) ** 2)


@pytest.mark.slow
@pytest.mark.parametrize("mode, compressor", [
    ("ddp", baselines.uncompressed("data")), ("ddp", loco(axis_name="data")),
    ("zero2", parallel.reduce_scatter("data")), ("zero2", loco(axis_name="data", scatter=True)),
], ids=["ddp-fp32", "ddp-loco", "zero2-fp32", "zero2-loco"])
def test_an_explicit_mesh_moves_what_an_auto_mesh_moves(mode, compressor):
  runs = {}
  for kind in (AxisType.Auto, AxisType.Explicit):
    mesh = jax.make_mesh((DATA, MODEL), ("data", "model"), axis_types=(kind,) * 2)
    params = jax.device_put(_raw_params(), {k: NamedSharding(mesh, s) for k, s in SPECS.items()})
    loss_fn = _typed_loss if kind == AxisType.Explicit else _loss
    losses, state, _, step = _train(mesh, params, compressor, steps=2, mode=mode,
                                    loss_fn=loss_fn)
    found = comm.compiled_collectives(step.jitted, state, _batches(1)[0])
    runs[kind] = losses, state, collections.Counter(
        (c.op, c.dtype, c.nbytes, c.group_size) for c in found)
  (auto_losses, _, auto), (losses, state, explicit) = runs[AxisType.Auto], runs[AxisType.Explicit]
  # jax 0.10.2 would all-gather the params, the optimizer state and LoCo's state over 'model'
  # at the shard_map's boundary (f32, 18 to 30 all-gathers on this MLP): the same program now.
  assert explicit == auto, (explicit - auto, auto - explicit)
  assert not any(op == "all-gather" and group == MODEL for op, _, _, group in explicit)
  np.testing.assert_allclose(losses, auto_losses, rtol=1e-5)
  np.testing.assert_allclose(losses[0], _loss(_raw_params(), _batches(1)[0]), rtol=1e-5)
  assert losses[1] < losses[0]
  expected = SPECS if mode == "ddp" else {k: P(("data", "model")) if s else P("data")
                                           for k, s in SPECS.items()}
  for name, spec in expected.items():  # kept, and typed Explicit as on the user's mesh
    assert sharding.same_specs(jax.typeof(state.params[name]).sharding.spec, spec), name
  if hasattr(state.compressor_state, "error"):  # LoCo: its error per group of leaves
    assert _error_specs(state) == {"model": {P(("data", "model"))}, "": {P("data")}}


def test_what_the_builders_cannot_do_raises():
  mesh, opt = _mesh(), optax.adam(1e-2)
  node = parallel.node_mesh(2, 4)
  with pytest.raises(ValueError, match=r"'node' is not an axis of the mesh, whose axes are "
                                       r"\('data', 'model'\)"):
    parallel.init_train_state(_placed(mesh), opt, mesh, compressor=loco(axis_name="data"),
                              axis_name=("node", "data"))
  with pytest.raises(ValueError, match=r"'node' is not in axis_name='local' and splits no "
                                       r"param.*axis_name=\('node', 'local'\)"):
    parallel.init_train_state(_raw_params(), opt, node, compressor=two_hop(),
                              axis_name="local")
  with pytest.raises(ValueError, match="names an axis twice"):
    parallel.init_train_state(_raw_params(), opt, node, compressor=two_hop(),
                              axis_name=("node", "node"))
  with pytest.raises(ValueError, match="mode='fsdp' runs on a mesh of one data axis"):
    parallel.init_train_state(_placed(mesh), opt, mesh, compressor=loco(axis_name="data"),
                              mode="fsdp")
  with pytest.raises(ValueError, match="pass the averaging transformation as compressor="):
    parallel.init_train_state(_placed(mesh), optax.chain(loco(axis_name="data"), opt), mesh)
  with pytest.raises(ValueError, match="the optimizer holds per-device state"):
    parallel.init_train_state(_placed(mesh), optax.chain(loco(axis_name="data"), opt), mesh,
                              compressor=loco(axis_name="data"))
  on_data = jax.device_put(_raw_params(), NamedSharding(mesh, P("data")))
  with pytest.raises(ValueError, match=r"param \['b1'\] is split over the data axis 'data'"):
    parallel.init_train_state(on_data, opt, mesh, compressor=loco(axis_name="data"))
  state, _ = parallel.init_train_state(_placed(mesh), opt, mesh,
                                       compressor=loco(axis_name="data"))
  other = jax.device_put(_raw_params(), {k: NamedSharding(mesh, s) for k, s in
                                         {**SPECS, "w1": P("model", None)}.items()})
  step = parallel.make_train_step(_loss, opt, mesh, other, compressor=loco(axis_name="data"))
  with pytest.raises(ValueError, match=r"state.params\['w1'\] is split as .*params_like's "
                                       r"shardings make it"):
    step(state, _batches(1)[0])


@functools.cache
def _fp32_step_reference():
  _, state, _, _ = _train(parallel.data_mesh(DATA), _raw_params(),
                          baselines.uncompressed("data"), steps=1)
  return jax.tree.map(np.asarray, state.params)


@pytest.mark.slow
@settings(max_examples=4, deadline=None)
@given(st.fixed_dictionaries({name: st.sampled_from(
    [P()] + [P(*[None] * dim, "model") for dim in range(ndim)])
    for name, ndim in (("w1", 2), ("b1", 1), ("w2", 2))}))
def test_any_model_placement_trains_like_the_data_mesh_and_is_kept(placement):
  mesh = _mesh()
  placement = {**placement, "b2": P()}
  params = jax.device_put(_raw_params(), {k: NamedSharding(mesh, s) for k, s in placement.items()})
  if not any(placement.values()):  # 'model' would split nothing: every model rank repeats all
    with pytest.raises(ValueError, match="'model' is not in axis_name='data' and splits no"):
      parallel.init_train_state(params, optax.adam(1e-2), mesh,
                                compressor=baselines.uncompressed("data"))
    return
  _, state, specs, _ = _train(mesh, params, baselines.uncompressed("data"), steps=1)
  for name, spec in placement.items():
    assert sharding.same_specs(state.params[name].sharding.spec, spec), (name, spec)
    assert sharding.same_specs(specs.opt_state[0].nu[name], spec), (name, spec)
    np.testing.assert_allclose(np.asarray(state.params[name]), _fp32_step_reference()[name],
                               rtol=1e-5, atol=1e-7)


def _per_device_grads():
  """Each data rank's gradient on its quarter of a batch, and all of them stacked on dim 0 (as
  a shard_map with in_specs P("data") hands each data rank its own)."""
  chunks = jnp.split(_batches(1)[0], DATA)
  grads = [jax.grad(_loss)(_raw_params(), chunk) for chunk in chunks]
  return grads, jax.tree.map(lambda *g: jnp.concatenate(g), *grads)


@pytest.mark.slow
@pytest.mark.parametrize("told", ["specs=", "shardings"])
def test_init_opt_state_on_a_data_model_mesh_runs_the_readme_recipe(told):
  mesh = _mesh()
  params = _placed(mesh)
  if told == "specs=":  # the transformation is told the params' specs
    opt = optax.chain(loco(axis_name="data", specs=SPECS), optax.sgd(1.0))
    update = opt.update
  else:  # init_opt_state reads the params' NamedShardings; the update is told in a context
    opt = optax.chain(loco(axis_name="data"), optax.sgd(1.0))
    def update(g, s, p):
      with local_blocks.leaf_specs(SPECS):
        return opt.update(g, s, p)
  state, specs = parallel.init_opt_state(opt, params, mesh)
  assert specs == parallel.opt_state_specs(opt, params, mesh)
  assert {k: [g.error[0]] for k, g in specs[0].groups.items()} == {"": [P("data")],
                                                                 "model": [P("data")]}
  # Each device keeps the error of its own model blocks.
  for error in state[0].groups["model"].error:
    assert sharding.same_specs(error.sharding.spec, P(("data", "model")))
  step = jax.jit(jax.shard_map(update, mesh=mesh, in_specs=(P("data"), specs, P()),
                               out_specs=(P(), specs), axis_names={"data"}))
  per_device, grads = _per_device_grads()
  updates, new_state = step(grads, state, params)
  assert jax.tree.structure(new_state) == jax.tree.structure(state)
  assert int(new_state[0].count) == 1
  for name in SPECS:  # sgd(1): -(the mean gradient) within half a 4-bit step and the bf16 gather
    stacked = np.stack([np.asarray(g[name], np.float64) for g in per_device])
    mean = stacked.mean(0)
    bound = np.abs(stacked).max() / 14 + np.abs(mean) * 2.0 ** -8 + 1e-6
    assert np.all(np.abs(np.asarray(updates[name]) + mean) <= bound), name
  # Each device compressed its own model shard: over 'model' only the 4-byte keep-or-skip flag.
  found = comm.compiled_collectives(step, grads, state, params)
  assert [(c.op, c.nbytes) for c in found if c.group_size == MODEL] == [("all-reduce", 4)]
