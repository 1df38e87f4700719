"""Restores onto a mesh of another shape over the model axes (train/reshard.py,
train/model_blocks.py): (data=4, model=2) onto (data=2, model=4), (data=8) and back. Each
device's error is decoded by tests/decoded.py, apart from the library's merge: what the merge
preserves is checked against it, the master shards bit for bit; what cannot be made is refused
naming both sides."""

import re
from typing import Any, NamedTuple

import jax
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import decoded
import train_worker
from loco_jax import co3, loco
from loco_jax.train import checkpoint, model_blocks, parallel
from loco_jax.train.diloco import fragment_leaves
from model_runs import HIDDEN, SHAPES, SPECS, loco_rows, mesh_of, restored, run_on, trained
from loco_jax.transforms import baselines, merge

def test_blocks_are_joined_and_cut_again():
  x = np.arange(8 * 12, dtype=np.float32).reshape(8, 12)
  for spec, sizes_ in ((P(None, "model"), {"model": 4}), (P("a", "b"), {"a": 2, "b": 3}),
                       (P(("a", "b")), {"a": 2, "b": 2}), (P(), {"model": 2})):
    split = model_blocks.split_of(x.shape, spec, sizes_, "x")
    pieces = model_blocks.cut(x, split)
    assert len(pieces) == split.blocks
    np.testing.assert_array_equal(model_blocks.join(pieces, split), x)
  split = model_blocks.split_of(x.shape, P(None, "model"), {"model": 4}, "x")
  for b, piece in enumerate(model_blocks.cut(x, split)):  # block b: columns 3b..3b+2
    np.testing.assert_array_equal(piece, x[:, 3 * b:3 * b + 3].reshape(-1))
  two = model_blocks.split_of(x.shape, P("a", "b"), {"a": 2, "b": 3}, "x")
  assert two.block_at({"a": 1, "b": 2}, {"a": 2, "b": 3}) == 5
  np.testing.assert_array_equal(model_blocks.cut(x, two)[5], x[4:, 8:].reshape(-1))
  with pytest.raises(ValueError, match=re.escape("x: shape [8, 12] split as")):
    model_blocks.split_of(x.shape, P("model"), {"model": 3}, "x")


def _master(x: np.ndarray, spec: P, data: int, model: int) -> np.ndarray:
  """zero2's master shard of param x, written out here: each block flattened, padded to a
  multiple of the data rows, row r of block b at position r * model + b."""
  dim = next((d for d, e in enumerate(spec) if e == "model"), None)
  blocks = [x] if dim is None or model == 1 else np.split(x, model, axis=dim)
  flat = [b.reshape(-1) for b in blocks]
  row = -(-flat[0].size // data // 8) * 8
  rows = [np.pad(f, (0, data * row - f.size)).reshape(data, row) for f in flat]
  return np.stack(rows, axis=1).reshape(-1)


def test_master_shards_are_cut_again_for_other_model_blocks():
  x = np.random.default_rng(0).standard_normal((15, 32)).astype(np.float32)  # rows padded
  spec = P(None, "model")
  blocks = [model_blocks.split_of(x.shape, spec, {"model": m}, "w") for m in (2, 4, 1)]
  for (old, d_old, m_old), (new, d_new, m_new) in (((blocks[0], 4, 2), (blocks[1], 2, 4)),
                                                   ((blocks[0], 4, 2), (blocks[2], 8, 1)),
                                                   ((blocks[2], 8, 1), (blocks[0], 4, 2))):
    out = model_blocks.recut_rows(_master(x, spec, d_old, m_old), (old, new), (d_old, d_new), "w")
    np.testing.assert_array_equal(out, _master(x, spec, d_new, m_new))
  with pytest.raises(ValueError, match="values past the 240 elements"):
    bad = _master(x, spec, 4, 2).reshape(4, 2, -1)
    bad[3, 1, -1] = 1.0
    model_blocks.recut_rows(bad.reshape(-1), (blocks[0], blocks[1]), (4, 2), "w")


# error_feedback's and LoCo's: tests/test_resume_step.py, with the first step from them.
def _mean_kept(before: list, after: list) -> None:
  """Every new row (whole params) is the old rows' float64 mean, and the old rows differ."""
  for k in before[0]:
    stack = np.stack([r[k] for r in before]).astype(np.float64)
    assert np.abs(stack - stack[0]).max() > 0, k
    for r in after:
      np.testing.assert_array_equal(r[k], stack.mean(0).astype(np.float32))


FLOATS = {"ef21": (lambda: baselines.ef21(block_size=64, axis_name="data"), ("local",)),
          "co3": (lambda: co3("fp4", axis_name="data", refit_interval=2), ("error",))}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(FLOATS))
def test_float_errors_are_their_mean_on_other_model_blocks(tmp_path, name):
  """Every new device holds its block of the old rows' mean, bit for bit as numpy's float64
  mean; ef21's estimate is carried over, co3's scales and coded bits averaged."""
  factory, fields = FLOATS[name]
  old, new = run_on(mesh_of(4, 2), "ddp", factory()), run_on(mesh_of(2, 4), "ddp", factory())
  state = trained(old, 3)
  out = restored(tmp_path, state, old, new).state.compressor_state
  for f in fields:
    _mean_kept(decoded.float_errors(getattr(state.compressor_state, f), SHAPES, SPECS, 4, 2),
               decoded.float_errors(getattr(out, f), SHAPES, SPECS, 2, 4))
  if name == "ef21":
    for k in SHAPES:
      whole = lambda s, m: decoded.float_errors(s.estimate, SHAPES, SPECS, 1, m)[0][k]
      np.testing.assert_array_equal(whole(out, 4), whole(state.compressor_state, 2))
  if name == "co3":
    for k in SHAPES:
      np.testing.assert_allclose(np.asarray(out.scale[k]),
                                 np.asarray(state.compressor_state.scale[k]).mean(), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(out.coded_bits),
                               np.asarray(state.compressor_state.coded_bits).mean(), rtol=1e-6)


@pytest.mark.slow
def test_diloco_fragments_keep_their_mean_on_other_model_blocks(tmp_path):
  """mode="diloco", 2 fragments: each fragment's error, over its own params, is the old rows'
  mean on every new device; every new worker the old workers' mean."""
  factory = lambda: baselines.error_feedback(block_size=64, axis_name="data")
  old, new = (run_on(mesh_of(*m), "diloco", factory(), inner_steps=2, fragments=2)
              for m in ((4, 2), (2, 4)))
  state = trained(old, 3)
  out = restored(tmp_path, state, old, new).state
  names = sorted(SHAPES)
  for f, part in enumerate(fragment_leaves(train_worker.init_params(HIDDEN), 2)):
    shapes = {names[i]: SHAPES[names[i]] for i in part}
    errors = lambda s, data, model: decoded.float_errors(
        dict(zip(shapes, jax.tree.leaves(s.compressor_state[f].error))), shapes, SPECS, data,
        model)
    _mean_kept(errors(state, 4, 2), errors(out, 2, 4))
  for k in SHAPES:
    rows = np.asarray(state.workers[k]).astype(np.float64)
    for row in np.asarray(out.workers[k]):
      np.testing.assert_array_equal(row, rows.mean(0).astype(np.float32))


@pytest.mark.slow
def test_zero2_goes_to_another_model_shape_and_back_exactly(tmp_path):
  """(data=4, model=2) -> (data=8) -> (data=4, model=2): the master shards and adam's moments
  are the saved ones bit for bit; LoCo's errors the mean after the first, kept by the second."""
  factory = lambda: loco(axis_name="data", scatter=True)
  first, eight = run_on(mesh_of(4, 2), "zero2", factory()), run_on(mesh_of(8), "zero2", factory())
  state = trained(first, 3)
  there = restored(tmp_path / "a", state, first, eight).state
  back = restored(tmp_path / "b", there, eight, run_on(mesh_of(4, 2), "zero2", factory())).state
  whole = lambda tree, run: parallel.unshard_params(tree, run.params)
  for mine, run in ((there, eight), (back, first)):
    for field in (lambda s: s.params, lambda s: s.opt_state[0].mu, lambda s: s.opt_state[0].nu):
      for a, b in zip(jax.tree.leaves(whole(field(mine), run)),
                      jax.tree.leaves(whole(field(state), first))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  rows = loco_rows(state.compressor_state, first.mesh)
  owed = {k: np.mean([r[k] for r in rows], axis=0) for k in SHAPES}
  for mine, mesh in ((there, eight.mesh), (back, first.mesh)):
    rows = loco_rows(mine.compressor_state, mesh)
    for k in SHAPES:
      bound = 2 * np.abs(owed[k]).max() / 254 * (1 + 1e-6)  # re-encoded once, then twice
      assert np.abs(rows[0][k] - owed[k]).max() <= bound, k


@pytest.mark.slow
def test_what_cannot_be_re_laid_is_refused_naming_both_sides(tmp_path):
  old = run_on(mesh_of(4, 2), "ddp", loco(axis_name="data"))
  checkpoint.save(tmp_path, 1, old.state, old.config)
  tensor = jax.make_mesh((4, 2), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2,
                         devices=jax.devices()[:8])
  params = jax.device_put(train_worker.init_params(HIDDEN), {
      k: NamedSharding(tensor, P(*[e and "tensor" for e in s])) for k, s in SPECS.items()})
  renamed, _ = parallel.init_train_state(params, optax.adam(1e-2), tensor,
                                         compressor=loco(axis_name="data"))
  config = {**old.config, "layout": checkpoint.train_layout(tensor, params, mode="ddp")}
  with pytest.raises(ValueError, match=re.escape(
      "mesh: checkpoint (data=4, model=2), now (data=4, tensor=2): a state re-laid for another "
      "mesh keeps its axes (names and order)")):
    checkpoint.restore(tmp_path, renamed, config, reshard=True)
  eight = run_on(mesh_of(8), "ddp", loco(axis_name="data"))
  no_layout = {k: v for k, v in eight.config.items() if k != "layout"}
  checkpoint.save(tmp_path / "bare", 1, old.state, no_layout)
  with pytest.raises(ValueError, match="which axes are data axes"):
    checkpoint.restore(tmp_path / "bare", eight.state, no_layout, reshard=True,
                       mesh_keys=("devices",))
  for mode, match in (("zero2", re.escape("layout.mode: checkpoint 'ddp', now 'zero2'")),
                      ("fsdp", "layout.mode")):
    other = run_on(mesh_of(8), mode, loco(axis_name="data", scatter=True), **(
        {"params": train_worker.layered_params(HIDDEN), "loss_fn": train_worker.layered_model()}
        if mode == "fsdp" else {}))
    with pytest.raises(ValueError, match=match):
      checkpoint.restore(tmp_path, other.state, other.config, reshard=True,
                         mesh_keys=("devices",))
  wider = run_on(mesh_of(8), "ddp", loco(axis_name="data"),
                 params=train_worker.init_params(2 * HIDDEN))
  with pytest.raises(ValueError, match=re.escape("layout.shapes.['b1']: checkpoint [32], now "
                                                 "[64]")):
    checkpoint.restore(tmp_path, wider.state, wider.config, reshard=True,
                       mesh_keys=("devices",))


class _DataSizesOnly(NamedTuple):
  error: Any


def test_a_state_without_a_reblock_is_re_laid_for_other_data_sizes_only():
  merge.register_merge(_DataSizesOnly, lambda states, like, devices: states, "kept")
  like = _DataSizesOnly(None)
  assert merge.merge_of(like).reblock is None
  blocks = model_blocks.ModelBlocks(("['w']",), (), (), {}, {}, (), None)
  with pytest.raises(ValueError, match="_DataSizesOnly is re-laid for other sizes of the data "
                                       "axes only, not for another shape over the model axes"):
    model_blocks.old_device(like, blocks, ".compressor_state")
