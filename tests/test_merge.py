"""transforms/merge.py, through train/reshard.relay: every compressor's per-device state made on 8
devices and merged for 4 (two_hop's on (node=2, local=4) for (2, 2) and (1, 4)). Against numpy
references: each old device's error decoded (`error_by_leaf`) and averaged, what the merge
preserves ((1/m) sum_j e'_j = (1/n) sum_i e_i), and the next step from the merged state."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import decoded
from loco_jax import co3, loco, two_hop
from loco_jax.core import buckets, layout
from loco_jax.core.leaves import ByGroup
from loco_jax.train import parallel, reshard
from loco_jax.transforms import baselines, merge
from loco_jax.transforms.loco_state import GroupState, LocoState

PARAMS = {"w": jnp.zeros((48, 40)), "b": jnp.zeros(40), "odd": jnp.zeros((5, 3))}
NAMES = sorted(PARAMS)  # the leaves' tree order


def _grads(seed: int, lead: tuple) -> dict:
  keys = jax.random.split(jax.random.key(seed), len(NAMES))
  return {k: jax.random.normal(key, (*lead, *PARAMS[k].shape)) * (1 + 3 * (k == "b"))
          for key, k in zip(keys, NAMES)}


def _state_on(opt, mesh, axes, steps: int, shard_mapped_update):
  """(the update on `mesh`, its state after `steps` steps of other gradients on each device)."""
  step, state = shard_mapped_update(opt, mesh, PARAMS, axes)
  lead = tuple(mesh.shape[a] for a in axes)
  for seed in range(steps):
    _, state = step(_grads(seed, lead), state)
  return step, state


def _relaid(opt, old_state, old_mesh, new_mesh, axes, shard_mapped_update):
  """(the update on `new_mesh`, the old state re-laid for it, the record)."""
  step, like = shard_mapped_update(opt, new_mesh, PARAMS, axes)
  saved_mesh = [list(a) for a in old_mesh.shape.items()]
  paths = reshard.saved_paths(like, saved_mesh, axes)
  found = {jax.tree_util.keystr(p): x for p, x in
           jax.tree_util.tree_leaves_with_path(jax.device_get(old_state))}
  assert sorted(found) == sorted(jax.tree.leaves(paths))  # the old layout, as saved
  specs = {jax.tree_util.keystr(p): x.sharding.spec for p, x in
           jax.tree_util.tree_leaves_with_path(old_state)}
  state, record = reshard.relay(jax.tree.map(found.get, paths), like, saved_mesh, axes,
                                jax.tree.map(specs.get, paths))
  return step, state, record


def _rows(x, n: int) -> np.ndarray:
  return np.asarray(x).reshape(n, -1)


def _device(state: LocoState, d: int, n: int, field: str = "error") -> LocoState:
  """Device d's LoCo state (of group "") out of the global arrays: `field` as its error."""
  g = state.groups[""]
  scales = getattr(g, "error_scale" if field == "error" else "gather_scale")
  take = lambda arrays: None if arrays is None else tuple(_rows(a, n)[d] for a in arrays)
  return LocoState(state.count, ByGroup({"": GroupState(take(getattr(g, field)), take(scales),
                                                        None, None)}), None)


def _decoded(state: LocoState, params: dict, rows: int, block_size: int,
             fixed: float | None = None) -> dict:
  """One device's error per leaf, flat, as LoCo decodes it (tests/decoded.py)."""
  return decoded.loco_leaves(state, params, rows, block_size, fixed)


LOCOS = {f"loco{bits}-{gather}": functools.partial(loco, bits=bits, gather=gather)
         for bits in (2, 3, 4) for gather in ("bf16", "quantized")}
LOCOS["loco4-fixed-scale"] = functools.partial(loco, bits=4, scale=2.0 ** 10,
                                               error_scale=2.0 ** 12)


def _check_loco_merge(opt_factory, shard_mapped_update, old_n=8, new_n=4):
  opt = opt_factory(axis_name="data")
  old_mesh, new_mesh = parallel.data_mesh(old_n), parallel.data_mesh(new_n)
  _, old = _state_on(opt, old_mesh, ("data",), 2, shard_mapped_update)
  step, new, record = _relaid(opt, old, old_mesh, new_mesh, ("data",), shard_mapped_update)
  assert record.checkpoint_mesh == f"(data={old_n})" and record.mesh == f"(data={new_n})"
  assert "LocoState" in str(record) and int(new.count) == int(old.count) == 2
  layout_ = dict(new.signature.layout)
  block, fixed = layout_["block_size"], layout_["error_scale"]
  old_errors = [_decoded(_device(old, d, old_n), PARAMS, old_n, block, fixed)
                for d in range(old_n)]
  new_errors = [_decoded(_device(new, d, new_n), PARAMS, new_n, block, fixed)
                for d in range(new_n)]
  for k in NAMES:
    owed = np.mean([e[k] for e in old_errors], axis=0)
    assert np.abs(owed).max() > 0, k
    for e in new_errors[1:]:
      np.testing.assert_array_equal(e[k], new_errors[0][k])   # every new device alike
    # (1/m) sum_j e'_j = (1/n) sum_i e_i, up to re-quantizing the mean in int8: within half a
    # step of its block (the largest |value| / 127), here at most 1/254 of the leaf's largest.
    kept = np.mean([e[k] for e in new_errors], axis=0)
    bound = (0.5 / fixed if fixed else np.abs(owed).max() / 254) + 1e-6 * np.abs(owed).max()
    assert np.abs(kept - owed).max() <= bound, (k, np.abs(kept - owed).max(), bound)
  return step, old, new


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(LOCOS))
def test_every_loco_error_is_the_mean_of_the_old_devices(name, shard_mapped_update):
  _check_loco_merge(LOCOS[name], shard_mapped_update)


def _gather_rows(state: LocoState, n: int, block: int) -> dict:
  """The averaged shards' errors of gather="quantized", device r's as row r: per leaf."""
  return _decoded(_device(state, 0, n, "gather_error")._replace(groups=ByGroup({"": GroupState(
      tuple(np.asarray(a) for a in state.groups[""].gather_error),
      tuple(np.asarray(a) for a in state.groups[""].gather_scale), None, None)})),
                  PARAMS, n, block)


@pytest.mark.slow
def test_a_quantized_gathers_shard_errors_are_cut_again(shard_mapped_update):
  """Device r's gather error is row r of the averaged buckets: stacked over the devices (the
  global array itself), they decode as one error of each whole leaf, kept by the merge."""
  _, old, new = _check_loco_merge(LOCOS["loco4-quantized"], shard_mapped_update)
  block = dict(new.signature.layout)["block_size"]
  before, after = _gather_rows(old, 8, block), _gather_rows(new, 4, block)
  for k in NAMES:
    assert np.abs(before[k]).max() > 0
    bound = np.abs(before[k]).max() / 254 + 1e-6
    assert np.abs(after[k] - before[k]).max() <= bound, k


def _np_loco_mean(grads: dict, errors: list[dict], rows: int, block: int) -> dict:
  """LoCo's output in float64 (4 bits, absmax block scales, bf16 gather aside): the mean over
  the devices of round(s (g + e)) / s, per block of the plan over `rows` rows."""
  plan = buckets.plan(tuple(PARAMS[k].size for k in NAMES), rows, block)
  out = {}
  for k, leaf in zip(NAMES, plan.leaves):
    lens = [plan.block_lens[q.bucket] for q in leaf.pieces for _ in range(q.blocks)]
    ends = np.cumsum(lens)
    sent = []
    for d in range(len(errors)):
      h = np.asarray(grads[k][d], np.float64).reshape(-1) + errors[d][k]
      rows_ = np.pad(h, (0, rows * leaf.row_len - h.size)).reshape(rows, -1)
      d_ = np.zeros_like(rows_)
      for start, end in zip(np.concatenate([[0], ends[:-1]]), ends):
        x = rows_[:, start:end]
        s = 7 / np.maximum(np.abs(x).max(1, keepdims=True), 1e-30)
        d_[:, start:end] = np.clip(np.round(s * x), -8, 7) / s
      sent.append(d_.reshape(-1)[: h.size])
    out[k] = np.mean(sent, axis=0).reshape(PARAMS[k].shape)
  return out


@pytest.mark.slow
def test_the_next_loco_step_continues_from_the_merged_error(shard_mapped_update):
  """The next update on 4 devices from the merged state is LoCo's step (numpy, float64) on
  each device's gradient plus the merged error, averaged: within the bf16 gather's rounding."""
  step, _, new = _check_loco_merge(LOCOS["loco4-bf16"], shard_mapped_update)
  block = dict(new.signature.layout)["block_size"]
  grads = _grads(7, (4,))
  errors = [_decoded(_device(new, d, 4), PARAMS, 4, block) for d in range(4)]
  out, after = step(grads, new)
  want = _np_loco_mean(grads, errors, 4, block)
  for k in NAMES:
    np.testing.assert_allclose(np.asarray(out[k]), want[k], rtol=2 ** -8,
                               atol=2 ** -8 * np.abs(want[k]).max())
  assert int(after.count) == 3


FLOAT_ERRORS = {
    "error_feedback": (functools.partial(baselines.error_feedback, block_size=64), "error"),
    "sign_ef": (functools.partial(baselines.sign_ef, block_size=64), "error"),
    "topk_ef": (functools.partial(baselines.topk_ef, fraction=0.05), "error"),
    "ef21": (functools.partial(baselines.ef21, block_size=64), "local"),
    "co3": (functools.partial(co3, "fp4", refit_interval=1), "error"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(FLOAT_ERRORS))
def test_every_float_error_is_averaged_and_the_next_step_matches(name, shard_mapped_update):
  """The per-device field of 8 devices averaged in numpy (float64) is every new device's; the
  next update from the re-laid state equals the one from that state built by hand."""
  factory, field = FLOAT_ERRORS[name]
  opt = factory(axis_name="data")
  old_mesh, new_mesh = parallel.data_mesh(8), parallel.data_mesh(4)
  _, old = _state_on(opt, old_mesh, ("data",), 3, shard_mapped_update)
  step, new, record = _relaid(opt, old, old_mesh, new_mesh, ("data",), shard_mapped_update)
  assert type(old).__name__ in str(record)
  by_hand = {}
  for k in NAMES:
    rows = _rows(getattr(old, field)[k], 8)
    assert np.abs(rows - rows[0]).max() > 0, k   # the devices' errors differ
    owed = rows.astype(np.float64).mean(0).astype(np.float32)
    np.testing.assert_array_equal(_rows(getattr(new, field)[k], 4), np.tile(owed, (4, 1)))
    by_hand[k] = jax.device_put(np.tile(owed, 4), getattr(new, field)[k].sharding)
  built = new._replace(**{field: by_hand})
  if name == "ef21":  # the estimate, replicated, carried over; it is the mean of the g_i
    for k in NAMES:
      np.testing.assert_array_equal(np.asarray(new.estimate[k]), np.asarray(old.estimate[k]))
  if name == "co3":
    assert int(new.count) == int(old.count) == 3
    np.testing.assert_allclose(np.asarray(new.scale["w"]).reshape(4, -1)[:, 0],
                               _rows(old.scale["w"], 8).mean(), rtol=1e-6)
  grads = _grads(11, (4,))
  mine, theirs = step(grads, new), step(grads, built)
  for a, b in zip(jax.tree.leaves(mine), jax.tree.leaves(theirs)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


TWO_HOPS = {"rs-bf16": dict(intra="reduce_scatter", gather="bf16"),
            "loco-quantized": dict(intra="loco", gather="quantized")}


def _node_error(state, nodes: int, local: int, block: int, field: str = "node_error") -> dict:
  """two_hop's node hop: the error of each leaf's node shard l, averaged over the nodes, joined
  over l into one error of the whole leaf (float64)."""
  shards = {k: layout.shard_len(PARAMS[k].size, local) for k in NAMES}
  shard_params = {k: jnp.zeros(shards[k]) for k in NAMES}
  scales = getattr(state, field + "_scale")[""]
  at = lambda i, l: i * local + l
  joined = {k: [] for k in NAMES}
  for l in range(local):
    per_node = []
    for i in range(nodes):
      one = LocoState(0, ByGroup({"": GroupState(
          tuple(_rows(a, nodes * local)[at(i, l)] for a in getattr(state, field)[""]),
          tuple(_rows(a, nodes * local)[at(i, l)] for a in scales), None, None)}), None)
      per_node.append(_decoded(one, shard_params, nodes, block))
    for k in NAMES:
      joined[k].append(np.mean([e[k] for e in per_node], axis=0))
  return {k: np.concatenate(v)[: PARAMS[k].size] for k, v in joined.items()}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(TWO_HOPS))
@pytest.mark.parametrize("nodes, local", [(2, 2), (1, 4)])
def test_two_hops_node_errors_are_joined_and_cut_again(name, nodes, local,
                                                        shard_mapped_update):
  opt = two_hop(block_size=64, **TWO_HOPS[name])
  axes = ("node", "local")
  old_mesh, new_mesh = parallel.node_mesh(2, 4), parallel.node_mesh(nodes, local)
  _, old = _state_on(opt, old_mesh, axes, 2, shard_mapped_update)
  step, new, record = _relaid(opt, old, old_mesh, new_mesh, axes, shard_mapped_update)
  assert "TwoHopState" in str(record) and int(new.count) == 2
  before, after = _node_error(old, 2, 4, 64), _node_error(new, nodes, local, 64)
  for k in NAMES:
    assert np.abs(before[k]).max() > 0
    assert np.abs(after[k] - before[k]).max() <= np.abs(before[k]).max() / 254 + 1e-6, k
  if TWO_HOPS[name]["intra"] == "loco":  # the intra hop's error: the mean over all 8 devices
    mean_of = lambda s, n, rows: np.mean([_decoded(LocoState(0, ByGroup({"": GroupState(
        tuple(_rows(a, n)[d] for a in s.error[""]),
        tuple(_rows(a, n)[d] for a in s.error_scale[""]), None, None)}), None),
        PARAMS, rows, 64)["w"] for d in range(n)], axis=0)
    owed, kept = mean_of(old, 8, 4), mean_of(new, nodes * local, local)
    assert np.abs(kept - owed).max() <= np.abs(owed).max() / 254 + 1e-6
  out, _ = step(_grads(5, (nodes, local)), new)
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(out))


def test_mean_keeps_equal_values_bit_for_bit():
  x = np.float32([0.1, 1 / 3, 7e-39])
  assert merge.mean([x, x.copy(), x.copy()]).tobytes() == x.tobytes()
  assert merge.mean([np.int32(4), np.int32(4)]) == 4
  np.testing.assert_array_equal(merge.mean([np.float32([1, 3]), np.float32([2, 4])]), [1.5, 3.5])


def test_a_state_type_without_a_merge_is_refused_or_registered():
  from typing import Any, NamedTuple

  class Mine(NamedTuple):
    error: Any
  assert merge.merge_of(Mine(np.zeros(2))) is None
  with pytest.raises(ValueError, match="merge must be callable and how a str"):
    merge.register_merge(Mine, "not a function", "the mean")
  merge.register_merge(Mine, lambda states, like, devices: [
      Mine(merge.mean([s.error for s in states]))] * math.prod(devices.new), "the mean")
  found, how = merge.merge_of(Mine(np.zeros(2)))[:2]
  devices = merge.Devices(("data",), (2,), (3,))
  out = found([Mine(np.float32([1, 2])), Mine(np.float32([3, 4]))], None, devices)
  assert how == "the mean" and len(out) == 3 and out[2].error.tolist() == [2.0, 3.0]
