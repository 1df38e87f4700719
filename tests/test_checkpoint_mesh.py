"""Checkpoints and meshes: a state restores onto the mesh and layout it was saved on, bit for
bit, and is refused on any other, naming both (never a silent reinterpretation)."""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import train_worker
from loco_jax.train import checkpoint, files, parallel

HIDDEN = 64
# Every leaf split over 'model', so that zero2's master shards have the same global shapes on
# (data=4, model=2), (data=2, model=4) and on the 1-D mesh of 8: only the mesh tells them apart.
COLUMNS = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None), "b2": P("model")}
ROWS = {"w1": P("model", None), "b1": P("model"), "w2": P(None, "model"), "b2": P("model")}
CONFIG = {"model": "mlp-regression", "mode": "zero2", "compressor": "reduce_scatter('data')"}


def _mesh(data: int, model: int):
  return jax.make_mesh((data, model), ("data", "model"), axis_types=(AxisType.Auto,) * 2)


def _zero2(mesh, specs: dict | None):
  """(fresh state, train step, placed params): zero2 with the fp32 reduce-scatter comparator."""
  params = train_worker.init_params(HIDDEN)
  if specs is not None:
    params = jax.device_put(params, {k: NamedSharding(mesh, s) for k, s in specs.items()})
  optimizer, compressor = optax.adam(1e-2), parallel.reduce_scatter("data")
  state, specs_of_state = parallel.init_train_state(params, optimizer, mesh, mode="zero2",
                                                    compressor=compressor)
  step = parallel.make_train_step(train_worker.loss_fn, optimizer, mesh, params,
                                  compressor=compressor, mode="zero2")
  return state, step, params


def _trained(mesh, specs):
  state, step, params = _zero2(mesh, specs)
  state, _ = step(state, train_worker.batch(0, mesh))
  return state, step, params


def _assert_equal(a, b) -> None:
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
    assert x.sharding == y.sharding, jax.tree_util.keystr(path)
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y),
                                  err_msg=jax.tree_util.keystr(path))


def _shapes(state):
  return [x.shape for x in jax.tree.leaves(state)]


@pytest.mark.slow
def test_another_mesh_is_refused_naming_both(tmp_path):
  saved, _, _ = _trained(_mesh(4, 2), COLUMNS)
  checkpoint.save(tmp_path, 1, saved, CONFIG)
  for mesh, specs, now in ((parallel.data_mesh(8), None, "(data=8)"),
                           (_mesh(2, 4), COLUMNS, "(data=2, model=4)")):
    fresh, _, _ = _zero2(mesh, specs)
    assert _shapes(fresh) == _shapes(saved)  # the same global shapes: only the mesh differs
    with pytest.raises(ValueError, match=re.escape(
        f"mesh: checkpoint (data=4, model=2), now {now}")):
      checkpoint.restore(tmp_path, fresh, CONFIG)
  meta = checkpoint.metadata(tmp_path)
  assert meta["mesh"] == [["data", 4], ["model", 2]]
  assert meta["tree"][".params['w1']"] == [[16 * HIDDEN], "float32", [["data", "model"]]]


@pytest.mark.slow
def test_the_same_mesh_restores_bit_for_bit_and_trains_on(tmp_path):
  saved, step, _ = _trained(_mesh(4, 2), COLUMNS)
  checkpoint.save(tmp_path, 1, saved, CONFIG)
  fresh, _, _ = _zero2(_mesh(4, 2), COLUMNS)
  restored, at = checkpoint.restore(tmp_path, fresh, CONFIG)
  assert at == 1
  _assert_equal(restored, saved)
  batch = train_worker.batch(1, _mesh(4, 2))
  after_saved, loss_saved = step(jax.tree.map(jnp.copy, saved), batch)
  after_restored, loss_restored = step(restored, batch)
  assert float(loss_saved) == float(loss_restored)
  _assert_equal(after_restored, after_saved)


def test_train_layout_tells_apart_what_the_arrays_cannot(tmp_path):
  """Params split by rows or by columns over 'model': master shards of the same shapes and
  specs on the same mesh, their elements in another order. The layout in the config tells."""
  mesh = _mesh(4, 2)
  by_columns, _, columns = _zero2(mesh, COLUMNS)
  by_rows, _, rows = _zero2(mesh, ROWS)
  checkpoint.save(tmp_path / "columns", 1, by_columns, CONFIG)
  checkpoint.save(tmp_path / "rows", 1, by_rows, CONFIG)
  meta = [checkpoint.metadata(tmp_path / name) for name in ("columns", "rows")]
  assert meta[0]["tree"] == meta[1]["tree"] and meta[0]["mesh"] == meta[1]["mesh"]
  layout = checkpoint.train_layout(mesh, columns, mode="zero2")
  assert layout == {"mode": "zero2", "data axes": ["data"], "model axes": ["model"],
                    "params": {"['b1']": ["model"], "['b2']": ["model"],
                               "['w1']": [None, "model"], "['w2']": ["model"]},
                    "shapes": {"['b1']": [HIDDEN], "['b2']": [4], "['w1']": [16, HIDDEN],
                               "['w2']": [HIDDEN, 4]}}
  checkpoint.save(tmp_path / "laid_out", 1, by_columns, {**CONFIG, "layout": layout})
  rows_config = {**CONFIG, "layout": checkpoint.train_layout(mesh, rows, mode="zero2")}
  with pytest.raises(ValueError, match=re.escape(
      "layout.params.['w1']: checkpoint [None, 'model'], now ['model']")):
    checkpoint.restore(tmp_path / "laid_out", by_rows, rows_config)
  with pytest.raises(ValueError, match="mode must be one of"):
    checkpoint.train_layout(mesh, columns, mode="zero3")


def test_specs_must_match_on_the_same_mesh(tmp_path):
  mesh = parallel.data_mesh(8)
  state = {"w": jax.device_put(jnp.arange(16.0), NamedSharding(mesh, P("data")))}
  checkpoint.save(tmp_path, 1, state, {})
  replicated = {"w": jax.device_put(jnp.zeros(16), NamedSharding(mesh, P()))}
  with pytest.raises(ValueError, match=re.escape(
      "tree: ['w'] sharding checkpoint P('data'), now P()")):
    checkpoint.restore(tmp_path, replicated, {})


def test_a_state_on_two_meshes_is_refused(tmp_path):
  state = {"a": jax.device_put(jnp.ones(8), NamedSharding(parallel.data_mesh(8), P("data"))),
           "b": jax.device_put(jnp.ones(8), NamedSharding(parallel.data_mesh(4), P("data")))}
  with pytest.raises(ValueError, match=re.escape(
      "meshes of different shapes ((data=4), (data=8))")):
    checkpoint.save(tmp_path, 1, state, {})
  assert not tmp_path.joinpath("1").exists()


def _as_format_2(step_dir) -> None:
  """Rewrites a checkpoint as the previous version wrote it: no mesh, no specs, format 2."""
  meta_file = step_dir / "meta" / "metadata"
  meta = json.loads(meta_file.read_text())
  del meta["mesh"]
  meta["format"], meta["tree"] = 2, {k: v[:2] for k, v in meta["tree"].items()}
  meta_file.write_text(json.dumps(meta))
  marker = step_dir / checkpoint.COMMIT
  commit = json.loads(marker.read_text())
  commit["format"] = 2
  commit["files"] = files.digests(step_dir, exclude=(checkpoint.COMMIT,))
  marker.write_text(json.dumps(commit))


@pytest.mark.slow
def test_format_2_restores_from_one_device_only(tmp_path):
  one = {"w": jnp.arange(4.0), "count": jnp.asarray(3, jnp.int32)}
  checkpoint.save(tmp_path / "one", 2, one, {"model": "mlp"})
  _as_format_2(tmp_path / "one" / "2")
  restored, step = checkpoint.restore(tmp_path / "one", jax.tree.map(jnp.zeros_like, one),
                                      {"model": "mlp"})
  assert step == 2 and restored["w"].tolist() == [0.0, 1.0, 2.0, 3.0]
  assert int(restored["count"]) == 3

  mesh = parallel.data_mesh(8)
  eight = {"w": jax.device_put(jnp.arange(16.0), NamedSharding(mesh, P("data")))}
  checkpoint.save(tmp_path / "eight", 2, eight, {})
  _as_format_2(tmp_path / "eight" / "2")
  assert checkpoint.metadata(tmp_path / "eight")["format"] == 2  # still readable
  with pytest.raises(ValueError, match=re.escape(
      f"{tmp_path / 'eight' / '2'}: a checkpoint of format 2, from before checkpoints recorded "
      f"their mesh, of a state on 8 devices")):
    checkpoint.restore(tmp_path / "eight", eight, {})
