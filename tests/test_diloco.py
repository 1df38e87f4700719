"""mode="diloco": workers train alone for H steps, then the compressor averages the
pseudo-gradients and the outer optimizer updates the global params; against a reference written
with plain loops over the workers, on data and (data, model) meshes, with fragments, from a
checkpoint."""

import json
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from loco_jax import comm, loco
from loco_jax.train import checkpoint, checkpoint_record, diloco, parallel

import teacher

WORKERS = 4
INNER = optax.adam(1e-2)
OUTER = optax.sgd(0.7, momentum=0.9, nesterov=True)


_params, _loss = teacher.params, teacher.loss
_batches = lambda steps: teacher.batches(steps, 32)


def _train(mesh, params, steps, compressor=None, **outer):
  state, _ = parallel.init_train_state(params, INNER, mesh, compressor=compressor,
                                       mode="diloco", **outer)
  step = parallel.make_train_step(_loss, INNER, mesh, params, compressor=compressor,
                                  mode="diloco", **outer)
  losses = []
  for batch in _batches(steps):
    state, loss = step(state, jnp.asarray(batch))
    losses.append(float(loss))
  return state, losses, step


def _reference(params, steps, inner_steps, fragments=1):
  """DiLoCo with a loop over the workers, each on its rows of the batch, and a float32 mean."""
  parts = diloco.fragment_leaves(params, fragments)
  leaves, treedef = jax.tree.flatten(params)
  anchor = list(leaves)
  workers = [list(leaves) for _ in range(WORKERS)]
  inner_states = [INNER.init(treedef.unflatten(w)) for w in workers]
  outer_states = [OUTER.init([leaves[i] for i in part]) for part in parts]
  grad = jax.jit(jax.value_and_grad(_loss))
  losses = []
  for k, batch in enumerate(_batches(steps)):
    rows = np.split(batch, WORKERS)
    step_losses = []
    for i in range(WORKERS):
      loss, g = grad(treedef.unflatten(workers[i]), jnp.asarray(rows[i]))
      updates, inner_states[i] = INNER.update(g, inner_states[i], treedef.unflatten(workers[i]))
      workers[i] = jax.tree.leaves(optax.apply_updates(treedef.unflatten(workers[i]), updates))
      step_losses.append(float(loss))
    losses.append(np.mean(step_losses))
    f = diloco.sync_fragment(k, inner_steps, fragments)
    if f is None:
      continue
    part = parts[f]
    mean = [np.mean([np.asarray(anchor[j]) - np.asarray(w[j]) for w in workers], axis=0)
            for j in part]
    updates, outer_states[f] = OUTER.update(mean, outer_states[f], [anchor[j] for j in part])
    for j, u in zip(part, updates):
      anchor[j] = anchor[j] + u
      for w in workers:
        w[j] = anchor[j]
  return treedef.unflatten(anchor), [treedef.unflatten(w) for w in workers], losses


def _close(a, b, rtol=2e-5, atol=2e-6):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


@pytest.mark.parametrize("fragments", [1, 2])
def test_float32_average_matches_the_reference(fragments):
  params, steps, inner_steps = _params(), 9, 4
  state, losses, _ = _train(parallel.data_mesh(WORKERS), params, steps,
                            inner_steps=inner_steps, fragments=fragments)
  anchor, workers, ref_losses = _reference(params, steps, inner_steps, fragments)
  assert int(state.step) == steps
  _close(state.params, anchor)
  for i, w in enumerate(workers):
    _close(jax.tree.map(lambda x, i=i: x[i], state.workers), w)
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  # The global params moved: the syncs ran.
  assert not np.allclose(state.params["w1"], params["w1"])


def test_one_device_runs_alone():
  # One worker: the sync's mean is its own pseudo-gradient; the loss is its own.
  params, steps = _params(), 4
  state, losses, _ = _train(parallel.data_mesh(1), params, steps, inner_steps=2)
  assert int(state.step) == steps and all(np.isfinite(losses))
  assert not np.array_equal(state.params["w1"], params["w1"])


def test_fragments_sync_in_turn():
  params = _params()
  parts = diloco.fragment_leaves(params, 2)
  assert sorted(sum(parts, [])) == [0, 1, 2, 3] and all(parts)
  state, _, _ = _train(parallel.data_mesh(WORKERS), params, 2, inner_steps=4, fragments=2)
  leaves, moved = jax.tree.leaves(params), jax.tree.leaves(state.params)
  for j in range(4):  # after step 2 only fragment 0 has synced
    assert np.array_equal(moved[j], leaves[j]) == (j in parts[1])


def test_inner_step_sends_nothing_over_the_data_axis():
  mesh = parallel.data_mesh(WORKERS)
  compressor = loco(axis_name="data")
  state, _, step = _train(mesh, _params(), 1, compressor, inner_steps=4)
  batch = jnp.asarray(_batches(1)[0])
  hlo = lambda program: program.lower(state, batch).compile().as_text()
  assert comm.collectives(hlo(step.jitted), WORKERS) == []
  assert "all-to-all" in {c.op for c in comm.collectives(hlo(step.syncs[0]), WORKERS)}


def test_inner_step_updates_the_moments_in_place():
  # Unstacking a worker for the optimizer and stacking it again made XLA copy adam's moments on
  # entry on a one-device mesh, as a netbench host has (26 against 14 ms a step for netbench's
  # GPT). (The worker's params are copied, as the compute-only step copies its params.)
  mesh = parallel.data_mesh(1)
  state, _, step = _train(mesh, _params(), 1, inner_steps=4)
  text = step.jitted.lower(state, jnp.asarray(_batches(1)[0])).compile().as_text()
  copied = re.findall(r"copy\(%(state_opt_state\w*)", text)
  assert not [name for name in copied if "mu" in name or "nu" in name], copied


def test_loco_outer_average_tracks_float32_and_keeps_an_error():
  mesh, params = parallel.data_mesh(WORKERS), _params()
  exact, _, _ = _train(mesh, params, 8, inner_steps=4)
  state, _, _ = _train(mesh, params, 8, loco(axis_name="data"), inner_steps=4)
  errors = [g.error for g in state.compressor_state[0].groups.values()]
  assert any(np.asarray(e).any() for e in jax.tree.leaves(errors))
  moved = jax.tree.map(lambda a, p: np.abs(np.asarray(a) - np.asarray(p)).max(),
                       exact.params, params)
  gap = jax.tree.map(lambda a, b: np.abs(np.asarray(a) - np.asarray(b)).max(),
                     state.params, exact.params)
  for name in params:  # 4-bit pseudo-gradients: the sync lands near the exact one
    if moved[name] > 0:
      assert gap[name] < 0.2 * moved[name], (name, gap[name], moved[name])


def test_data_model_mesh_matches_the_data_mesh():
  mesh = jax.make_mesh((WORKERS, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
  specs = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None), "b2": P()}
  placed = jax.device_put(_params(), {k: NamedSharding(mesh, s) for k, s in specs.items()})
  state, losses, step = _train(mesh, placed, 6, inner_steps=3)
  assert state.params["w1"].sharding.spec == P(None, "model")
  assert state.workers["w1"].sharding.spec == P("data", None, "model")
  flat, flat_losses, _ = _train(parallel.data_mesh(WORKERS), _params(), 6, inner_steps=3)
  _close(state.params, flat.params, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(losses, flat_losses, rtol=1e-5)
  # The inner step's collectives stay within the model axis (groups of 2 devices).
  found = comm.collectives(step.jitted.lower(state, jnp.asarray(_batches(1)[0]))
                           .compile().as_text(), 8)
  assert all(c.group_size <= 2 for c in found), found


def test_checkpoint_resumes_bit_for_bit(tmp_path):
  mesh, params = parallel.data_mesh(WORKERS), _params()
  compressor, outer = loco(axis_name="data"), {"inner_steps": 2, "fragments": 2}
  config = checkpoint_record.train_layout(mesh, params, mode="diloco")
  state, _ = parallel.init_train_state(params, INNER, mesh, compressor=compressor,
                                       mode="diloco", **outer)
  like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                      state)
  step = parallel.make_train_step(_loss, INNER, mesh, params, compressor=compressor,
                                  mode="diloco", **outer)
  batches = [jnp.asarray(b) for b in _batches(6)]
  for k, batch in enumerate(batches):
    state, _ = step(state, batch)
    if k == 2:
      checkpoint.save(tmp_path, k + 1, state, config)
  resumed, at = checkpoint.restore(tmp_path, like, config)
  assert at == 3 and isinstance(resumed, diloco.DilocoState)
  step = parallel.make_train_step(_loss, INNER, mesh, params, compressor=compressor,
                                  mode="diloco", **outer)
  for batch in batches[3:]:
    resumed, _ = step(resumed, batch)
  for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(state)):
    assert np.array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("kwargs, message", [
    ({"mode": "ddp", "inner_steps": 4}, "inner_steps is a mode='diloco' option"),
    ({"mode": "zero2", "compressor": loco(axis_name="data", scatter=True), "fragments": 2},
     "fragments is a mode='diloco' option"),
    ({"mode": "diloco"}, "needs inner_steps a positive int, got None"),
    ({"mode": "diloco", "inner_steps": 0}, "needs inner_steps a positive int"),
    ({"mode": "diloco", "inner_steps": 4, "fragments": 3}, "must divide inner_steps=4"),
    ({"mode": "diloco", "inner_steps": 8, "fragments": 8}, r"fragments must be in 1\.\.4"),
])
def test_bad_options_raise(kwargs, message):
  with pytest.raises(ValueError, match=message):
    parallel.init_train_state(_params(), INNER, parallel.data_mesh(WORKERS), **kwargs)


def test_param_gather_and_scatter_compressors_are_refused():
  mesh, params = parallel.data_mesh(WORKERS), _params()
  with pytest.raises(ValueError, match="diloco keeps whole params"):
    parallel.make_train_step(_loss, INNER, mesh, params, mode="diloco", inner_steps=2,
                             param_gather="int8")
  with pytest.raises(ValueError, match="the compressor's output"):
    _train(mesh, params, 2, loco(axis_name="data", scatter=True), inner_steps=2)


@pytest.mark.slow
def test_step_bench_times_every_program(tmp_path):
  out = tmp_path / "bench.json"
  bench = Path(__file__).resolve().parents[1] / "experiments" / "diloco_step_bench.py"
  subprocess.run([sys.executable, str(bench), "--steps", "2", "--repeats", "1",
                  "--inner-steps", "2", "--model", "32,1,64,2", "--json", str(out)],
                 check=True, capture_output=True, timeout=300)
  medians = json.loads(out.read_text())["median_s"]
  assert sorted(medians) == ["compute", "inner", "round", "sync"]
  assert all(0 < s < 10 for s in medians.values())
