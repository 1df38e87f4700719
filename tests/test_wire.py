"""Chunked collectives: the same data as one collective, the same bytes in the accounting."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from loco_jax import comm, loco
from loco_jax.comm import wire
from loco_jax.train import parallel

N = 8


def _on_devices(mesh, x):
  return jax.device_put(x, NamedSharding(mesh, P("data")))


def _ops(found):
  return [(c.op, c.dtype) for c in found if not c.conditional]


@pytest.mark.slow
@settings(max_examples=8, deadline=None)
@given(columns=st.integers(1, 300), chunk=st.integers(1, 1200),
       dtype=st.sampled_from([np.uint8, np.uint16, np.float32]))
def test_chunked_all_to_all_moves_what_one_all_to_all_moves(mesh, columns, chunk, dtype):
  x = np.random.default_rng(columns).integers(0, 250, (N * N, columns)).astype(dtype)
  def step(chunk_bytes):
    return jax.jit(jax.shard_map(lambda v: wire.all_to_all(v, "data", chunk_bytes), mesh=mesh,
                                 in_specs=P("data"), out_specs=P("data")))
  with wire.chunking(None):
    whole = step(None)
  pieces = step(chunk)
  xs = _on_devices(mesh, x)
  expected = x.reshape(N, N, columns).transpose(1, 0, 2).reshape(N * N, columns)
  np.testing.assert_array_equal(np.asarray(pieces(xs)), expected)
  np.testing.assert_array_equal(np.asarray(whole(xs)), expected)
  found = comm.compiled_collectives(pieces, xs)
  per_peer = columns * np.dtype(dtype).itemsize
  assert len(found) == min(columns, -(-per_peer // chunk))
  assert {c.op for c in found} == {"all-to-all"}
  assert sum(c.nbytes for c in found) == sum(c.nbytes for c in comm.compiled_collectives(whole,
                                                                                          xs))


@pytest.mark.slow
@settings(max_examples=8, deadline=None)
@given(length=st.integers(1, 64), chunk=st.integers(1, 900))
def test_chunked_all_gather_returns_the_devices_rows_in_order(mesh, length, chunk):
  x = np.random.default_rng(length).standard_normal((N * length, 3)).astype(np.float32)
  step = jax.jit(jax.shard_map(lambda v: wire.all_gather(v, "data", chunk), mesh=mesh,
                               in_specs=P("data"), out_specs=P()))
  xs = _on_devices(mesh, x)
  np.testing.assert_array_equal(np.asarray(step(xs)), x)
  found = comm.compiled_collectives(step, xs)
  assert len(found) == min(3 * length, -(-12 * length // chunk))
  assert sum(c.nbytes for c in found) == x.nbytes


@pytest.mark.slow
def test_loco_and_the_bf16_mean_give_the_same_result_chunked(mesh):
  grads = np.random.default_rng(0).standard_normal((N, 5000)).astype(np.float32) * 1e-3
  params = {"w": jnp.zeros(5000)}

  def run(chunk, make):
    with wire.chunking(chunk):
      opt = make()
      state, specs = parallel.init_opt_state(opt, params, mesh)
      step = jax.jit(jax.shard_map(lambda g, s: opt.update({"w": g[0]}, s, params), mesh=mesh,
                                   in_specs=(P("data"), specs), out_specs=({"w": P()}, specs)))
      g = _on_devices(mesh, grads)
      out, state = step(g, state)
      out2, _ = step(g, state)
      return np.asarray(out["w"]), np.asarray(out2["w"]), _ops(comm.compiled_collectives(
          step, g, state))

  for make in (lambda: loco(axis_name="data"),
               lambda: loco(axis_name="data", gather="quantized"),
               lambda: loco_jax_bf16()):
    whole_1, whole_2, whole_ops = run(None, make)
    cut_1, cut_2, cut_ops = run(64, make)
    assert len(cut_ops) > len(whole_ops) and set(cut_ops) == set(whole_ops)
    # Pure data movement around the same arithmetic: equal up to the compiler's rounding.
    np.testing.assert_allclose(cut_1, whole_1, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(cut_2, whole_2, rtol=1e-6, atol=1e-9)


def loco_jax_bf16() -> optax.GradientTransformation:
  from loco_jax.transforms import baselines
  return baselines.bf16("data")


def test_the_default_chunks_cross_process_cpu_collectives_only(monkeypatch):
  monkeypatch.delenv(wire.ENV, raising=False)
  assert wire.chunk_bytes("cpu", processes=2) == wire.DEFAULT_CPU_CHUNK_BYTES
  assert wire.chunk_bytes("cpu", processes=1) is None
  assert wire.chunk_bytes("gpu", processes=4) is None
  assert wire.chunk_bytes("tpu", processes=4) is None
  monkeypatch.setenv(wire.ENV, "65536")
  assert wire.chunk_bytes("gpu", processes=4) == 65536
  monkeypatch.setenv(wire.ENV, "none")
  assert wire.chunk_bytes("cpu", processes=2) is None
  with wire.chunking(4096):
    assert wire.chunk_bytes("cpu", processes=2) == 4096
    with wire.chunking(None):
      assert wire.chunk_bytes("cpu", processes=2) is None


@pytest.mark.parametrize("bad", [0, -5, 1.5, True, "1mb"])
def test_a_bad_chunk_size_is_refused(bad, monkeypatch):
  with pytest.raises(ValueError, match="positive number of bytes"):
    with wire.chunking(bad):
      pass
  monkeypatch.setenv(wire.ENV, str(bad))
  if str(bad) not in ("0",):
    with pytest.raises(ValueError, match=wire.ENV):
      wire.chunk_bytes("cpu", processes=2)


@pytest.mark.parametrize("chunk", [None, 100])
def test_reduce_scatter_sums_each_row_on_its_device(mesh, chunk):
  # Whole: psum_scatter; in pieces (gloo's path): an all-to-all of the rows and a local sum,
  # which sends each peer exactly its row. Both against the float64 sum.
  x = np.random.default_rng(3).standard_normal((N * N, 37)).astype(np.float32)
  step = jax.jit(jax.shard_map(lambda v: wire.reduce_scatter(v, "data", chunk), mesh=mesh,
                               in_specs=P("data"), out_specs=P("data")))
  xs = _on_devices(mesh, x)
  want = x.astype(np.float64).reshape(N, N, 37).sum(0)
  np.testing.assert_allclose(np.asarray(step(xs)), want, rtol=1e-5, atol=1e-5)
  ops = {c.op for c in comm.compiled_collectives(step, xs)}
  assert ops == ({"reduce-scatter"} if chunk is None else {"all-to-all"})
