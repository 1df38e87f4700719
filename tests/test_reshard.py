"""train/reshard.py through `checkpoint.restore(..., reshard=True)`: a train state saved on 8
devices continues on 4 (and back), for every mode and compressor; a restore onto the same mesh
is what it was; a restore that cannot be made names both sides."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import decoded
import train_worker
from loco_jax import co3, loco, two_hop
from loco_jax.train import checkpoint, parallel, reshard
from loco_jax.core.leaves import ByGroup
from loco_jax.transforms import baselines
from loco_jax.transforms.loco_state import GroupState, LocoState

SAVE_AT, AFTER = 10, 10   # the checkpoint's step; the steps resumed after it
COMPRESSORS = {
    "loco4": lambda axis, scatter: loco(axis_name=axis, scatter=scatter),
    "loco4-quantized": lambda axis, scatter: loco(axis_name=axis, gather="quantized"),
    "loco2": lambda axis, scatter: loco(bits=2, axis_name=axis),
    "loco3": lambda axis, scatter: loco(bits=3, axis_name=axis),
    "two_hop": lambda axis, scatter: two_hop(intra="loco", gather="quantized", block_size=256),
    "co3": lambda axis, scatter: co3("fp4", axis_name=axis, refit_interval=4),
    "error_feedback": lambda axis, scatter: baselines.error_feedback(block_size=256,
                                                                    axis_name=axis),
    "ef21": lambda axis, scatter: baselines.ef21(block_size=256, axis_name=axis),
    "topk_ef": lambda axis, scatter: baselines.topk_ef(0.1, axis_name=axis),
    "sign_ef": lambda axis, scatter: baselines.sign_ef(block_size=256, axis_name=axis),
}


class Run:
  """A run of the MLP regression (train_worker's) on `mesh`: its state, step and config."""

  def __init__(self, mesh, mode: str = "ddp", name: str = "loco4",
               axis_name: str | tuple = "data", **extra):
    self.mesh, self.axis = mesh, axis_name
    params = train_worker.layered_params(32) if mode == "fsdp" else train_worker.init_params(32)
    loss = train_worker.layered_model() if mode == "fsdp" else train_worker.loss_fn
    if "model" in mesh.axis_names:
      params = {k: jax.device_put(v, NamedSharding(mesh, train_worker.MODEL_SPECS[k]))
                for k, v in params.items()}
    compressor = COMPRESSORS[name](axis_name, mode in ("zero2", "fsdp"))
    options = dict(compressor=compressor, mode=mode, axis_name=axis_name, **extra)
    self.state, _ = parallel.init_train_state(params, optax.adam(1e-2), mesh, **options)
    self.step = parallel.make_train_step(loss, optax.adam(1e-2), mesh, params, **options)
    self.config = {"model": "mlp-regression", "compressor": name, "devices": mesh.size,
                   "layout": checkpoint.train_layout(mesh, params, mode=mode,
                                                     axis_name=axis_name)}

  def batch(self, k: int) -> jax.Array:
    full = np.asarray(train_worker.batch(k, parallel.data_mesh(1)))
    return jax.device_put(full, NamedSharding(self.mesh, P(self.axis)))

  def train(self, steps: range) -> list[float]:
    losses = []
    for k in steps:
      self.state, loss = self.step(self.state, self.batch(k))
      losses.append(float(loss))
    return losses


def _resumed(tmp_path, old: Run, new: Run, steps: range) -> tuple[reshard.Restored, list]:
  checkpoint.save(tmp_path, steps.start, old.state, old.config)
  restored = checkpoint.restore(tmp_path, new.state, new.config, reshard=True,
                                mesh_keys=("devices",))
  assert restored.step == int(restored.state.step) == steps.start
  assert restored.resharded is not None
  new.state = restored.state  # the steps then donate it
  return restored._replace(state=jax.tree.map(jnp.copy, restored.state)), new.train(steps)


def _no_jump(uninterrupted: list[float], resumed: list[float], at: int) -> None:
  """The resumed curve stays within the uninterrupted run's step-to-step noise: the mean
  |loss_k+1 - loss_k| over the steps on either side of `at`."""
  noise = np.mean(np.abs(np.diff(uninterrupted)))
  gap = np.abs(np.asarray(resumed) - np.asarray(uninterrupted[at:at + len(resumed)]))
  assert gap.max() <= noise, (gap.max(), noise, gap)


# Every merge (tests/test_merge.py has each compressor's): loco3's is loco2's, error_feedback's
# and sign_ef's are topk_ef's.
CASES = [("ddp", name) for name in ("loco4", "loco4-quantized", "loco2", "co3", "ef21",
                                    "topk_ef")] + [
    ("zero2", "loco4"), ("fsdp", "loco4"), ("diloco", "loco4")]


@pytest.mark.slow
@pytest.mark.parametrize("mode, name", CASES)
def test_eight_devices_continue_on_four(tmp_path, mode, name):
  extra = {"inner_steps": 4} if mode == "diloco" else {}
  old = Run(parallel.data_mesh(8), mode, name, **extra)
  uninterrupted = old.train(range(SAVE_AT))
  saved = jax.tree.map(jnp.copy, old.state)
  uninterrupted += old.train(range(SAVE_AT, SAVE_AT + AFTER))
  old.state = saved
  new = Run(parallel.data_mesh(4), mode, name, **extra)
  restored, resumed = _resumed(tmp_path, old, new, range(SAVE_AT, SAVE_AT + AFTER))
  assert restored.resharded.checkpoint_mesh == "(data=8)"
  assert restored.resharded.mesh == "(data=4)"
  _no_jump(uninterrupted, resumed, SAVE_AT)


@pytest.mark.slow
def test_overlapped_diloco_continues_on_two_with_a_sync_in_flight(tmp_path):
  # H = 4, tau = 3: the sync after step 8 (1-based) is merged after step 11, so the checkpoint
  # of step 10 holds its result in the global params and the workers not yet merged.
  extra = {"inner_steps": 4, "overlap": 3}
  old = Run(parallel.data_mesh(4), "diloco", "loco4", **extra)
  uninterrupted = old.train(range(SAVE_AT))
  saved = jax.tree.map(jnp.copy, old.state)
  uninterrupted += old.train(range(SAVE_AT, SAVE_AT + AFTER))
  old.state = saved
  new = Run(parallel.data_mesh(2), "diloco", "loco4", **extra)
  restored, resumed = _resumed(tmp_path, old, new, range(SAVE_AT, SAVE_AT + AFTER))
  assert restored.resharded.mesh == "(data=2)"
  assert restored.state.params["w1"].sharding.device_set == set(jax.devices()[2:4])
  _no_jump(uninterrupted, resumed, SAVE_AT)


@pytest.mark.slow
def test_two_hop_continues_on_fewer_nodes_and_local_devices(tmp_path):
  axes = ("node", "local")
  old = Run(parallel.node_mesh(2, 4), "ddp", "two_hop", axis_name=axes)
  uninterrupted = old.train(range(SAVE_AT))
  saved = jax.tree.map(jnp.copy, old.state)
  uninterrupted += old.train(range(SAVE_AT, SAVE_AT + AFTER))
  old.state = saved
  new = Run(parallel.node_mesh(1, 4), "ddp", "two_hop", axis_name=axes)
  restored, resumed = _resumed(tmp_path, old, new, range(SAVE_AT, SAVE_AT + AFTER))
  assert "TwoHopState" in str(restored.resharded)
  _no_jump(uninterrupted, resumed, SAVE_AT)


@pytest.mark.slow
def test_two_hop_goes_to_another_model_shape_and_back(tmp_path):
  axes = ("node", "local")
  model = jax.make_mesh((2, 2, 2), (*axes, "model"), axis_types=(AxisType.Auto,) * 3,
                        devices=jax.devices()[:8])
  old = Run(model, "ddp", "two_hop", axis_name=axes)
  uninterrupted = old.train(range(SAVE_AT))
  saved = jax.tree.map(jnp.copy, old.state)
  uninterrupted += old.train(range(SAVE_AT, SAVE_AT + AFTER))
  old.state = saved
  flat = Run(parallel.node_mesh(2, 4), "ddp", "two_hop", axis_name=axes)
  there, resumed = _resumed(tmp_path / "there", old, flat, range(SAVE_AT, SAVE_AT + AFTER))
  assert there.resharded.mesh == "(node=2, local=4)" and "TwoHopState" in str(there.resharded)
  for field in ("error", "node_error", "gather_error"):  # the errors were carried, not dropped
    assert any(np.any(np.asarray(x)) for x in jax.tree.leaves(getattr(
        there.state.compressor_state, field))), field
  _no_jump(uninterrupted, resumed, SAVE_AT)
  # On one device either way: straight from the (node, local, model) mesh, or through the
  # (node, local) one. The node hop's error of each whole leaf is the same, up to re-encoding.
  one = [Run(parallel.node_mesh(1, 1), "ddp", "two_hop", axis_name=axes) for _ in range(2)]
  direct, _ = _resumed(tmp_path / "direct", old, one[0], range(SAVE_AT, SAVE_AT))
  flat.state = there.state
  through, _ = _resumed(tmp_path / "through", flat, one[1], range(SAVE_AT, SAVE_AT))
  for field in ("error", "node_error"):
    a, b = (_two_hop_leaves(r.state.compressor_state, field) for r in (direct, through))
    for k in a:
      np.testing.assert_allclose(a[k], b[k], atol=2 * np.abs(a[k]).max() / 127, err_msg=k)
  flat.state = there.state
  back = Run(model, "ddp", "two_hop", axis_name=axes)
  _, resumed = _resumed(tmp_path / "back", flat, back, range(SAVE_AT, SAVE_AT + AFTER))
  _no_jump(uninterrupted, resumed, SAVE_AT)


def _two_hop_leaves(state, field: str) -> dict:
  """A one-device two_hop state's `field` decoded per leaf (tests/decoded.py): on one device
  each hop's buckets are LoCo's over one row of whole leaves."""
  scale = state.error_scale if field == "error" else state.node_error_scale
  one = LocoState(state.count, ByGroup({"": GroupState(getattr(state, field)[""], scale[""],
                                                       None, None)}), None)
  return decoded.loco_leaves(one, train_worker.init_params(32), 1, 256)


def _mesh(data: int, model: int):
  return jax.make_mesh((data, model), ("data", "model"), axis_types=(AxisType.Auto,) * 2,
                       devices=jax.devices()[:data * model])


def _model_split(mesh) -> Run:
  """zero2 + LoCo with every param split over 'model' (train_worker's layout)."""
  run = object.__new__(Run)
  run.mesh, run.axis = mesh, "data"
  params = _placed(mesh, train_worker.init_params(32))
  compressor = loco(axis_name="data", scatter=True)
  run.state, _ = parallel.init_train_state(params, optax.adam(1e-2), mesh, mode="zero2",
                                           compressor=compressor)
  run.step = parallel.make_train_step(train_worker.loss_fn, optax.adam(1e-2), mesh, params,
                                      compressor=compressor, mode="zero2")
  run.config = {"model": "mlp-regression", "devices": mesh.size,
                "layout": checkpoint.train_layout(mesh, params, mode="zero2")}
  return run


@pytest.mark.slow
def test_model_blocks_are_re_laid_each_on_its_own(tmp_path):
  """(data=4, model=2) -> (data=2, model=2): the master shards and LoCo's errors of each model
  block over the data axis; the params unsharded are those saved, exactly."""
  old = _model_split(_mesh(4, 2))
  uninterrupted = old.train(range(SAVE_AT))
  saved = jax.tree.map(jnp.copy, old.state)
  uninterrupted += old.train(range(SAVE_AT, SAVE_AT + AFTER))
  old.state = saved
  new = _model_split(_mesh(2, 2))
  restored, resumed = _resumed(tmp_path, old, new, range(SAVE_AT, SAVE_AT + AFTER))
  assert "master shards" in str(restored.resharded) and "LocoState" in str(restored.resharded)
  params = train_worker.init_params(32)
  before = parallel.unshard_params(saved.params, _placed(old.mesh, params))
  after = parallel.unshard_params(restored.state.params, _placed(new.mesh, params))
  for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  _no_jump(uninterrupted, resumed, SAVE_AT)


def _placed(mesh, params):
  specs = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None), "b2": P("model")}
  return jax.device_put(params, {k: NamedSharding(mesh, s) for k, s in specs.items()})


@pytest.mark.slow
def test_zero2_shards_go_8_to_4_to_8_exactly(tmp_path):
  """The master shards and adam's moments, re-cut twice, are the saved ones bit for bit; LoCo's
  errors are the mean after the first and stay it after the second (the devices agree)."""
  eight = Run(parallel.data_mesh(8), "zero2")
  eight.train(range(3))
  checkpoint.save(tmp_path / "a", 3, eight.state, eight.config)
  four = Run(parallel.data_mesh(4), "zero2")
  on_four = checkpoint.restore(tmp_path / "a", four.state, four.config, reshard=True,
                               mesh_keys=("devices",)).state
  checkpoint.save(tmp_path / "b", 3, on_four, four.config)
  back = checkpoint.restore(tmp_path / "b", Run(parallel.data_mesh(8), "zero2").state,
                            eight.config, reshard=True, mesh_keys=("devices",)).state
  like = train_worker.init_params(32)
  for state in (on_four, back):
    for a, b in zip(jax.tree.leaves(parallel.unshard_params(state.params, like)),
                    jax.tree.leaves(parallel.unshard_params(eight.state.params, like))):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  mu = lambda s: parallel.unshard_params(s.opt_state[0].mu, like)
  for a, b in zip(jax.tree.leaves(mu(back)), jax.tree.leaves(mu(eight.state))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  errors = lambda s, n: [np.asarray(e).reshape(n, -1)
                         for e in s.compressor_state.groups[""].error]
  for e in errors(back, 8):
    assert (e == e[0]).all()   # every device holds the one merged error


@pytest.mark.slow
def test_the_same_mesh_restores_bit_for_bit_with_reshard(tmp_path):
  run = Run(parallel.data_mesh(8))
  run.train(range(2))
  checkpoint.save(tmp_path, 2, run.state, run.config)
  fresh = Run(parallel.data_mesh(8)).state
  plain, _ = checkpoint.restore(tmp_path, fresh, run.config)
  restored = checkpoint.restore(tmp_path, fresh, run.config, reshard=True)
  assert restored.step == 2 and restored.resharded is None
  for a, b, c in zip(jax.tree.leaves(restored.state), jax.tree.leaves(plain),
                     jax.tree.leaves(run.state)):
    assert a.sharding == b.sharding == c.sharding
    np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
    np.testing.assert_array_equal(np.asarray(b), np.asarray(c))


def test_another_mesh_without_reshard_is_refused_and_hints_at_it(tmp_path):
  run = Run(parallel.data_mesh(8))
  checkpoint.save(tmp_path, 1, run.state, run.config)
  four = Run(parallel.data_mesh(4))
  with pytest.raises(ValueError, match=re.escape(
      "mesh: checkpoint (data=8), now (data=4)") + ".*reshard=True"):
    checkpoint.restore(tmp_path, four.state, four.config)
  with pytest.raises(ValueError, match="devices: checkpoint 8, now 4"):
    checkpoint.restore(tmp_path, four.state, four.config, reshard=True)
  with pytest.raises(ValueError, match="pass reshard=True with them"):
    checkpoint.restore(tmp_path, four.state, four.config, mesh_keys=("devices",))


@pytest.mark.slow
def test_another_model_mode_or_transformation_is_refused_naming_both(tmp_path):
  run = Run(parallel.data_mesh(8))
  config = {"model": "mlp"}  # nothing in the config tells them apart: the state does
  checkpoint.save(tmp_path, 1, run.state, config)
  restore = functools.partial(checkpoint.restore, tmp_path, config=config, reshard=True)
  other = train_worker.init_params(16)
  narrower = parallel.init_train_state(other, optax.adam(1e-2), parallel.data_mesh(4),
                                       compressor=loco(axis_name="data"))[0]
  cases = [
      (Run(parallel.data_mesh(4), "zero2").state, re.escape(
          "tree: .params['b1'] sharding checkpoint P(), now P('data')")),
      (Run(parallel.data_mesh(4), "ddp", "ef21").state, re.escape(
          "layout of .compressor_state.signature: checkpoint [['block_size', 2048]") + ".*now "
       "<absent>"),
      (Run(parallel.data_mesh(4), "ddp", "loco2").state, re.escape(
          "layout of .compressor_state.signature: checkpoint [['block_size', 2048]")),
      (narrower, re.escape("tree: .params['b1'] shape checkpoint [32], now [16]")),
  ]
  for like, match in cases:
    with pytest.raises(ValueError, match=match):
      restore(state_like=like)


def test_diloco_workers_restart_from_their_mean():
  mesh4 = parallel.data_mesh(4)
  like = jax.ShapeDtypeStruct((4, 3), jnp.float32, sharding=NamedSharding(mesh4, P("data")))
  meshes = reshard._Meshes(("data",), {"data": 8}, {"data": 4})
  workers = np.arange(24, dtype=np.float32).reshape(8, 3)
  out = reshard._per_worker(workers, like, meshes, ".workers")
  np.testing.assert_array_equal(out, np.tile(workers.mean(0), (4, 1)))
  same = np.tile(np.float32([0.1, 1 / 3, 3.0]), (8, 1))
  out = reshard._per_worker(same, like, meshes, ".workers")
  assert out.tobytes() == np.tile(same[0], (4, 1)).tobytes()   # at a sync: exactly the params


@pytest.mark.slow
def test_a_tree_record_that_lies_is_refused(tmp_path):
  """Shapes and dtypes come from the checkpoint's record when it is re-laid: a record altered
  (and its marker with it) is a ValueError naming the file, not a crash."""
  import json
  from loco_jax.train import files
  run = Run(parallel.data_mesh(8))
  step_dir = checkpoint.save(tmp_path, 1, run.state, run.config)
  four = Run(parallel.data_mesh(4))
  error = ".compressor_state.groups[''].error[0]"
  original = json.loads((step_dir / "meta" / "metadata").read_text())
  for key, shape, dtype, match in (
      (".params['b1']", [-1], "float32", re.escape("shape checkpoint [-1], now [32]")),
      (".params['b1']", [32], "no-such-dtype", "dtype checkpoint no-such-dtype, now float32"),
      (error, [-8], "int8", "the tree's shapes and dtypes are malformed")):
    meta_file = step_dir / "meta" / "metadata"
    meta = json.loads(json.dumps(original))
    meta["tree"][key][:2] = [shape, dtype]
    meta_file.write_text(json.dumps(meta))
    marker = step_dir / checkpoint.COMMIT
    commit = json.loads(marker.read_text())
    commit["files"] = files.digests(step_dir, exclude=(checkpoint.COMMIT,))
    marker.write_text(json.dumps(commit, indent=2) + "\n")
    with pytest.raises(ValueError, match=match):
      checkpoint.restore(tmp_path, four.state, four.config, reshard=True,
                         mesh_keys=("devices",))
