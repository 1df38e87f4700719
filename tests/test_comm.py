"""LoCo over an 8-device CPU mesh: the all-to-all mean, the gathers, and wire bytes from the HLO."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from loco_jax import comm, loco
from loco_jax.core import layout
from loco_jax.transforms.loco_state import error_by_leaf
from loco_jax.train import parallel

N = 8
PARAMS = {"w": jnp.zeros((256, 384)), "b": jnp.zeros(384), "odd": jnp.zeros((7, 13)),
          "s": jnp.zeros(())}
N_PARAMS = sum(x.size for x in jax.tree.leaves(PARAMS))


def _device_grads(seed):
  """Different gradients per device, stacked on a leading device axis: [N, *shape]."""
  keys = jax.random.split(jax.random.key(seed), len(PARAMS))
  return {k: jax.random.normal(key, (N, *x.shape)) * (1 + jnp.arange(N).reshape(-1, *[1] * x.ndim))
          for key, (k, x) in zip(keys, sorted(PARAMS.items()))}


@pytest.mark.slow
@pytest.mark.numerics
def test_output_is_the_mean_of_every_devices_decompressed_gradient(mesh, shard_mapped_update):
  kwargs = dict(scale=16.0, error_scale=64.0, reset_interval=3)  # fixed scales: layout-free
  opt = loco(axis_name="data", **kwargs)
  state, _ = parallel.init_opt_state(opt, PARAMS, mesh)
  step = shard_mapped_update(opt, mesh, PARAMS)[0]
  local = loco(**kwargs)
  local_states = [local.init(PARAMS) for _ in range(N)]
  local_update = jax.jit(local.update)
  for seed in range(4):
    grads = _device_grads(seed)
    out, state = step(grads, state)
    decompressed = []
    for d in range(N):
      d_out, local_states[d] = local_update(jax.tree.map(lambda g: g[d], grads), local_states[d])
      decompressed.append(d_out)
    want = jax.tree.map(lambda *xs: np.mean(np.stack(xs), axis=0), *decompressed)
    for k in PARAMS:  # the mean goes through one bf16 gather
      np.testing.assert_allclose(np.asarray(out[k]), want[k], rtol=2 ** -8, atol=1e-6)
    for d in range(N):
      # Device d's error per leaf (its buckets hold every leaf's N rows) against the local one's.
      # Two programs (the mesh step, the local one): FMA contraction of beta e + (1 - beta)(h - d)
      # differs between them and with the CPU's vector ISA, so a stored code may differ by one
      # where the residual sits on a rounding boundary, and rarely; never by more.
      group = state.groups[""]
      mine = state._replace(groups={"": group._replace(error=tuple(
          np.asarray(e).reshape(N, -1)[d] for e in group.error))})
      diff = (np.asarray(error_by_leaf(mine, PARAMS, rows=N)[0]["w"]).astype(int) -
              np.asarray(error_by_leaf(local_states[d], PARAMS)[0]["w"]).astype(int))
      assert np.abs(diff).max() <= 1 and np.mean(diff != 0) < 1e-3, np.abs(diff).max()


@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.parametrize("gather", ["bf16", "quantized"])
def test_block_scales_average_close_to_the_true_mean(mesh, gather, shard_mapped_update):
  opt = loco(axis_name="data", gather=gather)
  state, _ = parallel.init_opt_state(opt, PARAMS, mesh)
  step = shard_mapped_update(opt, mesh, PARAMS)[0]
  total_in, total_out = 0, 0
  for seed in range(6):
    grads = _device_grads(seed)
    out, state = step(grads, state)
    total_in += np.asarray(grads["w"]).mean(0)
    total_out += np.asarray(out["w"])
  scale = np.abs(total_in).mean()
  # Error feedback: the accumulated outputs track the accumulated mean gradient.
  assert np.abs(total_out - total_in).mean() < 0.25 * scale
  assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(out))


@pytest.mark.slow
def test_wire_bytes_from_the_hlo(mesh, shard_mapped_update):
  report = {}
  for gather in ("bf16", "quantized"):
    opt = loco(axis_name="data", gather=gather)
    state, _ = parallel.init_opt_state(opt, PARAMS, mesh)
    step = shard_mapped_update(opt, mesh, PARAMS)[0]
    found = comm.lowered_collectives(step, _device_grads(0), state)
    report[gather] = {c.op: comm.wire_bits_per_param([c], N_PARAMS) for c in found}
    assert [c.op for c in found] == ["all-to-all", "all-gather"]
    assert all(c.op not in ("all-reduce", "reduce-scatter") for c in found)
    assert found[0].dtype == "u8"
  # Sent bits per parameter per device ((n-1)/n of each buffer).
  assert report["bf16"]["all-to-all"] <= 4.1
  assert 13.0 < report["bf16"]["all-gather"] <= 16.0
  assert report["quantized"]["all-gather"] <= 4.1
  # The buffer itself: 4 bits plus scales, about 4.02 a parameter.
  opt = loco(axis_name="data")
  state, _ = parallel.init_opt_state(opt, PARAMS, mesh)
  step = shard_mapped_update(opt, mesh, PARAMS)[0]
  (a2a, _) = comm.lowered_collectives(step, _device_grads(0), state)
  assert 4.0 < 8 * a2a.nbytes / N_PARAMS <= 4.1


@pytest.mark.slow
@pytest.mark.numerics
def test_scatter_returns_this_devices_shard(mesh, shard_mapped_update):
  opt = loco(axis_name="data", scale=16.0, error_scale=64.0, scatter=True)
  step = shard_mapped_update(opt, mesh, PARAMS, out_spec=P("data"))[0]
  state, _ = parallel.init_opt_state(opt, PARAMS, mesh)
  grads = _device_grads(1)
  out, _ = step(grads, state)
  full = loco(axis_name="data", scale=16.0, error_scale=64.0)
  full_step, full_state = shard_mapped_update(full, mesh, PARAMS)
  full_out, _ = full_step(grads, full_state)
  for k, x in PARAMS.items():
    rows = layout.leaf_layout(x.size, N, None)
    assert out[k].shape == (N * rows.row_len,)
    np.testing.assert_allclose(np.asarray(out[k])[: x.size],
                               np.asarray(full_out[k]).reshape(-1), rtol=2 ** -8, atol=1e-6)
  found = comm.lowered_collectives(step, grads, state)
  assert "all-gather" not in [c.op for c in found]


@pytest.mark.slow
def test_non_finite_on_one_device_skips_the_step_on_every_device(mesh, shard_mapped_update):
  opt = loco(axis_name="data")
  state, _ = parallel.init_opt_state(opt, PARAMS, mesh)
  step = shard_mapped_update(opt, mesh, PARAMS)[0]
  _, state = step(_device_grads(0), state)
  grads = _device_grads(1)
  grads["w"] = grads["w"].at[3, 0, 0].set(jnp.inf)
  out, after = step(grads, state)
  assert all(np.all(np.isnan(np.asarray(x))) for x in jax.tree.leaves(out))
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)),
               after, state)


@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.parametrize("mode", [dict(), dict(gather="quantized"), dict(scatter=True)])
def test_the_cpu_workarounds_change_no_value_on_a_mesh(mesh, monkeypatch, mode,
                                                       shard_mapped_update):
  # With the XLA:CPU workarounds (`core.workarounds`) and without them (as GPU and TPU run),
  # the same updates and states, bit for bit (the same arithmetic), over a finite step, a
  # non-finite one and a finite one again.
  out_spec = P("data") if mode.get("scatter") else P()
  runs = []
  for switch in ("1", "0"):
    monkeypatch.setenv("LOCO_JAX_WORKAROUNDS", switch)
    opt = loco(axis_name="data", **mode)  # a new function: traced afresh
    step = shard_mapped_update(opt, mesh, PARAMS, out_spec=out_spec)[0]
    state, _ = parallel.init_opt_state(opt, PARAMS, mesh)
    seen = []
    for seed in range(3):
      grads = _device_grads(seed)
      if seed == 1:
        grads["b"] = grads["b"].at[5, 2].set(jnp.nan)
      out, state = step(grads, state)
      seen.append((out, state))
    runs.append(seen)
  assert all(np.all(np.isnan(np.asarray(x))) for x in jax.tree.leaves(runs[0][1][0]))
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)),
               runs[0], runs[1])


@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.parametrize("shapes", [{"w": (8, 1024)}, {"w": (8, 1024), "b": (96,)}])
def test_local_steps_checked_first_are_those_of_selects(monkeypatch, shapes):
  # Local mode on CPU where a leaf is a whole bucket checks the gradients first and skips in
  # the step (`workarounds.finite_first`); without the workarounds the step selects per leaf:
  # the same updates and states bit for bit over finite steps, a non-finite one on which a
  # reset was due (the error is kept, not reset) and a finite one after it.
  from loco_jax.core import buckets
  params = {k: jnp.zeros(v) for k, v in shapes.items()}
  assert buckets.plan(tuple(x.size for x in params.values()), 1, 1024).has_bare_leaf()
  runs = []
  for switch in ("1", "0"):
    monkeypatch.setenv("LOCO_JAX_WORKAROUNDS", switch)
    opt = loco(block_size=1024, reset_interval=2)  # a new function: traced afresh
    step, state, seen = jax.jit(opt.update), opt.init(params), []
    rng = np.random.default_rng(0)
    for k in range(4):
      grads = {n: jnp.asarray(rng.standard_normal(x.shape), jnp.float32)
               for n, x in params.items()}
      if k == 2:
        grads["w"] = grads["w"].at[3, 5].set(jnp.inf)
      out, state = step(grads, state)
      seen.append((out, state))
    runs.append(seen)
  skipped_out, skipped_state = runs[0][2]
  assert all(np.all(np.isnan(np.asarray(x))) for x in jax.tree.leaves(skipped_out))
  assert int(skipped_state.count) == 2
  assert np.any(np.asarray(skipped_state.groups[""].error[0]) != 0)  # kept, not reset
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)),
               runs[0], runs[1])


def test_a_tree_with_nothing_to_compress_passes_through(mesh):
  params = {"step": jnp.zeros((8,), jnp.int32)}
  opt = loco(axis_name="data")
  state, specs = parallel.init_opt_state(opt, params, mesh)
  step = jax.jit(jax.shard_map(opt.update, mesh=mesh, in_specs=(P(), specs),
                               out_specs=(P(), specs)))
  out, state = step(params, state)
  np.testing.assert_array_equal(np.asarray(out["step"]), 0)
  assert int(state.count) == 1


def test_compiled_collectives_counts_a_scans_collectives_once_per_iteration(mesh):
  # What one call sends: a psum in the body of a 3-step scan runs 3 times (fsdp's scan over
  # layers), not once as in the program text.
  def body(x, _):
    return x + jax.lax.psum(x, "data") * 0.5, None
  step = jax.jit(jax.shard_map(lambda x: jax.lax.scan(body, x, None, length=3)[0], mesh=mesh,
                               in_specs=P("data"), out_specs=P("data")))
  x = jnp.ones((8, 16), jnp.float32)
  found = [c for c in comm.compiled_collectives(step, x) if c.op == "all-reduce"]
  assert len(found) == 3 and all(c.nbytes == 64 for c in found)
