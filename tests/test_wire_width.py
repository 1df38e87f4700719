"""Collectives cross at their nominal width: 16-bit floats as uint16 (XLA:CPU widens bf16)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from loco_jax import comm, loco
from loco_jax.core import layout
from loco_jax.train import parallel, shards
from loco_jax.transforms import baselines

N = 8


def _on_devices(mesh, x_NxK):
  return jax.device_put(x_NxK, NamedSharding(mesh, P("data")))


def _sharded(fn, mesh):
  return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("data"), out_specs=P()))


def test_xla_cpu_widens_a_bf16_all_gather_and_comm_all_gather_does_not(mesh):
  raw = _sharded(lambda x: jax.lax.all_gather(x[0].astype(jnp.bfloat16), "data", tiled=True,
                                              to="invarying"), mesh)
  ours = _sharded(lambda x: comm.all_gather(x[0].astype(jnp.bfloat16), "data"), mesh)
  x = _on_devices(mesh, np.random.default_rng(0).standard_normal((N, 64)).astype(np.float32))
  # The lowered program says bf16 for both; only the compiled one shows what crosses.
  assert [c.dtype for c in comm.lowered_collectives(raw, x)] == ["bf16"]
  assert [c.dtype for c in comm.compiled_collectives(raw, x)] == ["f32"]
  assert [(c.op, c.dtype) for c in comm.compiled_collectives(ours, x)] == [("all-gather", "u16")]
  # A bitcast each side: the gathered values are exactly the rounded inputs, in device order.
  expected = np.asarray(x).astype(jnp.bfloat16).reshape(-1)
  np.testing.assert_array_equal(np.asarray(ours(x)), expected)


@pytest.mark.slow
@pytest.mark.numerics
@settings(max_examples=8, deadline=None)
@given(size=st.integers(1, 300), seed=st.integers(0, 2**16), scale=st.sampled_from([1e-3, 1.0, 1e4]))
def test_mean_16bit_is_the_mean_rounded_once(mesh, size, seed, scale):
  rng = np.random.default_rng(seed)
  x = (rng.standard_normal((N, size)) * scale).astype(np.float32)
  y = (rng.standard_normal((N, 3)) * scale).astype(np.float32)
  fn = jax.jit(jax.shard_map(
      lambda a, b: comm.mean_16bit([a[0].astype(jnp.bfloat16), b[0].astype(jnp.bfloat16)],
                                   "data", backend="cpu"),
      mesh=mesh, in_specs=(P("data"), P("data")), out_specs=P()))
  out = fn(_on_devices(mesh, x), _on_devices(mesh, y))
  for got, inputs in zip(out, (x, y)):
    assert got.dtype == jnp.bfloat16
    # Reference: float64 mean of the bf16-rounded inputs; one bf16 rounding (2**-9 relative)
    # plus the float32 sum's few ulps.
    ref = np.asarray(inputs.astype(jnp.bfloat16), np.float64).mean(0)
    np.testing.assert_allclose(np.asarray(got, np.float64), ref,
                               rtol=2 ** -8, atol=1e-6 * scale * np.abs(inputs).max())


def test_mean_16bit_chooses_the_collective_per_backend(mesh):
  x = _on_devices(mesh, np.ones((N, 40), np.float32))
  def step(backend):
    return _sharded(lambda a: comm.mean_16bit([a[0].astype(jnp.bfloat16)], "data", backend)[0],
                    mesh)
  widened = [(c.op, c.dtype) for c in comm.compiled_collectives(step("cpu"), x)]
  assert widened == [("all-to-all", "u16"), ("all-gather", "u16")]
  # Where bf16 crosses as it is (GPU, TPU) one all-reduce; lowered here, it says bf16.
  assert [(c.op, c.dtype) for c in comm.lowered_collectives(step("gpu"), x)] == [
      ("all-reduce", "bf16")]
  with pytest.raises(ValueError, match="bfloat16 or float16"):
    _sharded(lambda a: comm.mean_16bit([a[0]], "data", "cpu")[0], mesh)(x)


@pytest.mark.slow
@pytest.mark.parametrize("name, make, most_bits", [
    # (N-1)/N of: 4-bit codes + scales + flags, then 16 (bf16 gather) or 4 + scales.
    ("loco", lambda: loco(axis_name="data"), 7 / 8 * 20.5),
    ("loco-quantized", lambda: loco(axis_name="data", gather="quantized"), 7 / 8 * 8.5),
    ("bf16", lambda: baselines.bf16("data"), 2 * 7 / 8 * 16 + 0.1),
])
def test_compiled_steps_send_nominal_widths(mesh, name, make, most_bits):
  params = {"w": jnp.zeros((4096,)), "b": jnp.zeros((64,))}
  opt = make()
  state, specs = parallel.init_opt_state(opt, params, mesh)
  grad_specs = jax.tree.map(lambda _: P("data"), params)
  step = jax.jit(jax.shard_map(lambda g, s: opt.update(jax.tree.map(lambda x: x[0], g), s),
                               mesh=mesh, in_specs=(grad_specs, specs),
                               out_specs=(jax.tree.map(lambda _: P(), params), specs)))
  grads = {k: _on_devices(mesh, np.ones((N, *v.shape), np.float32)) for k, v in params.items()}
  found = comm.compiled_collectives(step, grads, state)
  assert {c.dtype for c in found} <= {"u8", "u16"}, found
  n_params = 4096 + 64
  assert 0.9 * most_bits < comm.wire_bits_per_param(found, n_params) <= most_bits


def test_zero2_param_gather_in_bf16_crosses_at_16_bits(mesh):
  like = {"w": jax.ShapeDtypeStruct((1024,), jnp.float32)}
  shard_len = layout.shard_len(1024, N)
  gather = jax.jit(jax.shard_map(
      lambda s: shards.gather_params({"w": s}, like, "data", shards.ParamGather(jnp.bfloat16)),
      mesh=mesh, in_specs=P("data"), out_specs=P()))
  master = _on_devices(mesh, np.arange(N * shard_len, dtype=np.float32) / 7)
  (c,) = comm.compiled_collectives(gather, master)
  assert (c.op, c.dtype, c.nbytes) == ("all-gather", "u16", 2 * N * shard_len)
  np.testing.assert_array_equal(np.asarray(gather(master)["w"]),
                                np.asarray(master)[:1024].astype(jnp.bfloat16))
