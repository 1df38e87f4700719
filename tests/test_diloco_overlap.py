"""mode="diloco" with `overlap`: a sync runs on the communication devices beside the next tau
inner steps and is merged after them (alpha blend); against a float64 reference written by hand
(adam, Nesterov SGD, the MLP's gradient, the merge), its programs, checkpoints taken while a sync
runs, and the arguments it refuses."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from loco_jax import comm, loco
from loco_jax.train import checkpoint, checkpoint_record, diloco, parallel

import teacher

WORKERS = 4     # on devices 0-3; their communication devices are 4-7
LR, OUTER_LR, MOMENTUM = 1e-2, 0.7, 0.9
INNER = optax.adam(LR)


def _counting_mean(axis_name: str) -> optax.GradientTransformation:
  """A compressor with a state of its own: the mean over the axis divided by 1 + its count."""
  def update(updates, count, params=None):
    del params
    scale = 1.0 / (1.0 + count.astype(jnp.float32))
    return [jax.lax.pmean(g, axis_name) * scale for g in updates], count + 1
  return optax.GradientTransformation(lambda params: jnp.zeros([], jnp.int32), update)


def _train(params, steps, compressor=None, **outer):
  mesh = parallel.data_mesh(WORKERS)
  state, _ = parallel.init_train_state(params, INNER, mesh, compressor=compressor,
                                       mode="diloco", **outer)
  step = parallel.make_train_step(teacher.loss, INNER, mesh, params, compressor=compressor,
                                  mode="diloco", **outer)
  losses = []
  for batch in teacher.batches(steps, 32):
    state, loss = step(state, batch)
    losses.append(float(loss))
  return state, losses, step


def _grads(p: dict, rows: np.ndarray) -> tuple[float, dict]:
  """teacher.loss and its gradient, by hand in float64."""
  x, y = rows[:, :16], rows[:, 16:]
  h = np.tanh(x @ p["w1"] + p["b1"])
  out = h @ p["w2"] + p["b2"]
  d_out = 2 * (out - y) / out.size
  d_z = d_out @ p["w2"].T * (1 - h ** 2)
  return float(np.mean((out - y) ** 2)), {"w1": x.T @ d_z, "b1": d_z.sum(0),
                                          "w2": h.T @ d_out, "b2": d_out.sum(0)}


def _reference(params, steps, inner_steps, fragments, overlap, alpha, counting):
  """The step semantics of train/diloco.py's docstring, in float64 with loops over workers."""
  names = sorted(params)   # the leaves' order in the tree
  parts = [[names[i] for i in part] for part in diloco.fragment_leaves(params, fragments)]
  theta = {k: np.asarray(v, np.float64) for k, v in params.items()}
  workers = [{k: v.copy() for k, v in theta.items()} for _ in range(WORKERS)]
  mu = [{k: np.zeros_like(v) for k, v in theta.items()} for _ in range(WORKERS)]
  nu = [{k: np.zeros_like(v) for k, v in theta.items()} for _ in range(WORKERS)]
  trace = {k: np.zeros_like(v) for k, v in theta.items()}
  syncs, pending, losses = [0] * fragments, [], []   # pending: (step merged after, fragment)

  def merge(f):
    for w in workers:
      for k in parts[f]:
        w[k] = alpha * w[k] + (1 - alpha) * theta[k]

  for t, batch in enumerate(teacher.batches(steps, 32)):
    rows = np.split(np.asarray(batch, np.float64), WORKERS)
    step_losses = []
    for i, w in enumerate(workers):
      loss, g = _grads(w, rows[i])
      step_losses.append(loss)
      for k in w:
        mu[i][k] = 0.9 * mu[i][k] + 0.1 * g[k]
        nu[i][k] = 0.999 * nu[i][k] + 0.001 * g[k] ** 2
        m_hat, v_hat = mu[i][k] / (1 - 0.9 ** (t + 1)), nu[i][k] / (1 - 0.999 ** (t + 1))
        w[k] = w[k] - LR * m_hat / (np.sqrt(v_hat) + 1e-8)
    losses.append(np.mean(step_losses))
    for due, f in [p for p in pending if p[0] == t]:
      merge(f)
      pending.remove((due, f))
    f = diloco.sync_fragment(t, inner_steps, fragments)
    if f is None:
      continue
    scale = 1 / (1 + syncs[f]) if counting else 1.0
    syncs[f] += 1
    for k in parts[f]:
      mean = np.mean([theta[k] - w[k] for w in workers], axis=0) * scale
      trace[k] = mean + MOMENTUM * trace[k]
      theta[k] = theta[k] - OUTER_LR * (mean + MOMENTUM * trace[k])   # Nesterov
    if overlap:
      pending.append((t + overlap, f))
    else:
      merge(f)
  return theta, workers, losses


@pytest.mark.parametrize("fragments, overlap, alpha, counting", [
    (1, 1, None, False), (1, 3, 0.25, True), (2, 1, None, True), (2, 0, 0.5, False)])
def test_delayed_merge_matches_the_float64_reference(fragments, overlap, alpha, counting):
  params, steps, inner_steps = teacher.params(), 13, 4
  compressor = _counting_mean("data") if counting else None
  state, losses, _ = _train(params, steps, compressor, inner_steps=inner_steps,
                            fragments=fragments, overlap=overlap, alpha=alpha)
  theta, workers, ref_losses = _reference(
      params, steps, inner_steps, fragments, overlap,
      (0.5 if overlap else 0.0) if alpha is None else alpha, counting)
  close = lambda a, b: np.testing.assert_allclose(np.asarray(a, np.float64), b, rtol=2e-4,
                                                  atol=2e-5)
  for k in params:
    close(state.params[k], theta[k])
    for i, w in enumerate(workers):
      close(state.workers[k][i], w[k])
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-4)
  if counting:   # the compressor's count moved with each of its fragment's syncs
    assert [int(c) for c in state.compressor_state] == [
        sum(diloco.sync_fragment(t, inner_steps, fragments) == f for t in range(steps))
        for f in range(fragments)]


def test_the_sync_runs_on_the_communication_devices_and_the_inner_steps_send_nothing():
  state, _, step = _train(teacher.params(), 5, loco(axis_name="data"), inner_steps=4,
                          overlap=2)
  comm_devices = set(jax.devices()[WORKERS:2 * WORKERS])
  assert set(state.params["w1"].sharding.device_set) == comm_devices
  assert set(state.workers["w1"].sharding.device_set) == set(jax.devices()[:WORKERS])
  lowered = step.lowered(state, teacher.batches(1, 32)[0])
  assert [share for _, share in lowered] == [0.75, 0.25, 0.25]
  found = [comm.collectives(program.compile().as_text(), 2 * WORKERS) for program, _ in lowered]
  inner, merge, sync = found
  assert inner == [] and merge == []
  assert "all-to-all" in {c.op for c in sync}
  anchor_sharding = lowered[2][0].compile().input_shardings[0][0][0]
  assert anchor_sharding.device_set == comm_devices


def test_a_checkpoint_taken_while_a_sync_runs_resumes_bit_for_bit(tmp_path):
  params, outer = teacher.params(), {"inner_steps": 4, "fragments": 2, "overlap": 1}
  compressor = loco(axis_name="data")
  mesh = parallel.data_mesh(WORKERS)
  config = checkpoint_record.train_layout(mesh, params, mode="diloco")
  state, _, step = _train(params, 0, compressor, **outer)
  batches = teacher.batches(9, 32)
  saved_at = 4  # fragment 1 synced after step 3 (0-based) and merges after step 4
  for k, batch in enumerate(batches):
    state, _ = step(state, batch)
    if k + 1 == saved_at:
      checkpoint.save(tmp_path, saved_at, state, config)
  # Restored onto the train step's mesh (as a state without overlap is laid out): the step
  # moves the sync's part to the communication devices.
  plain, _ = parallel.init_train_state(params, INNER, mesh, compressor=compressor,
                                       mode="diloco", inner_steps=4, fragments=2)
  for like in (plain, state):
    resumed, at = checkpoint.restore(tmp_path, like, config)
    assert at == saved_at
    _, _, again = _train(params, 0, compressor, **outer)
    for batch in batches[saved_at:]:
      resumed, _ = again(resumed, batch)
    for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(state)):
      assert np.array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("kwargs, error, message", [
    ({"overlap": -1}, ValueError, r"overlap must be an int in 0\.\.3 .* got -1"),
    ({"overlap": 4}, ValueError, r"overlap must be an int in 0\.\.3 .*inner_steps=4.* got 4"),
    ({"overlap": True}, ValueError, "got True"),
    ({"overlap": 1.0}, ValueError, "got 1.0"),
    ({"overlap": 1, "alpha": 1.5}, ValueError, r"alpha must be a float in \[0, 1\].* got 1.5"),
    ({"alpha": False}, ValueError, "alpha must be a float"),
    ({"outer_optimizer": "sgd"}, TypeError, "outer_optimizer must be an optax"),
    ({"outer_optimizer": optax.sgd}, TypeError, "outer_optimizer must be an optax"),
])
def test_bad_overlap_options_raise(kwargs, error, message):
  with pytest.raises(error, match=message):
    parallel.init_train_state(teacher.params(), INNER, parallel.data_mesh(WORKERS),
                              mode="diloco", inner_steps=4, **kwargs)


def test_overlap_needs_a_device_outside_the_mesh():
  with pytest.raises(ValueError, match=r"process 0 has no cpu device outside the mesh for its "
                                       r"8 mesh device\(s\).*jax_num_cpu_devices"):
    parallel.make_train_step(teacher.loss, INNER, parallel.data_mesh(), teacher.params(),
                             mode="diloco", inner_steps=4, overlap=1)
  with pytest.raises(ValueError, match="overlap is a mode='diloco' option"):
    parallel.setup(teacher.params(), INNER, parallel.data_mesh(WORKERS), overlap=1)
