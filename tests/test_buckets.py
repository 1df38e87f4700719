"""buckets: the layout of leaves in buckets, its round trips, and LoCo's bucketed mesh step
(the receive side in kernels.dequantize_mean, wire bits, compile cost per leaf)."""

import hashlib
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

from loco_jax import comm, kernels, loco
from loco_jax.apps import bench
from loco_jax.core import buckets, layout
from loco_jax.kernels import reference
from loco_jax.train import parallel

N = 8
SIZES = st.lists(st.one_of(st.integers(0, 40), st.integers(0, 5000)), min_size=1, max_size=10)


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(sizes=SIZES, rows=st.sampled_from([1, 2, 3, 8]),
       block_size=st.sampled_from([8, 64, 100, 2048]))
def test_every_leaf_row_lies_in_whole_blocks_of_its_own(sizes, rows, block_size):
  p = buckets.plan(tuple(sizes), rows, block_size)
  full = 8 * math.ceil(block_size / 8)
  assert all(n % 8 == 0 and n <= full for n in p.block_lens)
  assert len(p.block_lens) <= 3  # full blocks, and two shorter lengths for what is left
  taken = [np.zeros(b, int) for b in p.blocks]
  for size, leaf in zip(sizes, p.leaves):
    if not size:
      assert leaf is None
      continue
    assert leaf.row_len == layout.shard_len(size, rows)
    at = 0
    for q in leaf.pieces:
      assert q.start == at
      taken[q.bucket][q.block0: q.block0 + q.blocks] += 1
      at += q.blocks * p.block_lens[q.bucket]
    # The pieces cover the row; a leaf's padding stays under one block (a remainder rounded up
    # only where that saves scales).
    assert leaf.row_len <= at < leaf.row_len + full
  assert all(np.all(t == 1) for t in taken)  # every block belongs to exactly one leaf


def test_small_leaves_are_not_padded_to_a_full_block():
  p = buckets.plan((96, 256, 4096, 2040, 2048 + 32), 1, 2048)
  # 96 = 3 x 32, 256 = 8 x 32 (one block of 256 would save 28 bytes of scales, under 0.5% of
  # the plan's: not worth a third bucket), 32 past a full block in one of 32; 2040 padded to a
  # full block (8 values of padding cost less than the scales of shorter blocks).
  assert p.block_lens == (2048, 32)
  assert [leaf.blocks for leaf in p.leaves] == [3, 8, 2, 1, 2]
  # The GPT-2-shaped tree on 8 devices: shards of 32, 96 and 128 values and whole blocks.
  p = buckets.plan((256, 768, 1024, 65536, 196608), 8, 2048)
  assert p.block_lens == (2048, 32)
  assert all(leaf.row_len == sum(q.blocks * p.block_lens[q.bucket] for q in leaf.pieces)
             for leaf in p.leaves)


def test_a_second_short_length_is_taken_where_it_saves_bytes():
  sizes = (256, 768, 1024, 65536, 196608)
  # Over 64 devices the big leaves' shards (1024 and 3072 values) are shorter than a block too.
  rests = [layout.shard_len(n, 64) % 2048 for n in sizes]
  many = buckets.plan(sizes, 64, 2048)
  assert len(many.block_lens) == 3
  sent = lambda lengths: sum(buckets._remainder_pieces(r, 2048, lengths)[0] for r in rests)
  shorter = tuple(n for n in many.block_lens if n < 2048)
  row_bytes = sum(layout.shard_len(n, 64) for n in sizes) * 2.5
  single = min(sent((8 * 2 ** k,)) for k in range(8))
  assert single > sent(shorter) + 0.01 * row_bytes  # more than 1% more bytes with one length


def _scales_in_buckets(per_leaf: list, p: buckets.Plan) -> list[jax.Array]:
  """Per-leaf block scales [rows * blocks] placed where the plan's pieces say (numpy)."""
  out = [np.zeros((p.rows, b), np.float32) for b in p.blocks]
  for s, leaf in zip(per_leaf, p.leaves):
    if leaf is None:
      continue
    s, at = np.asarray(s).reshape(p.rows, leaf.blocks), 0
    for q in leaf.pieces:
      out[q.bucket][:, q.block0: q.block0 + q.blocks] = s[:, at: at + q.blocks]
      at += q.blocks
  return [jnp.asarray(b) for b in out]


@pytest.mark.slow
@settings(max_examples=5, deadline=None)
@given(sizes=SIZES.filter(any), rows=st.sampled_from([1, 3, 8]), seed=st.integers(0, 99))
def test_buckets_round_trip_and_rows_are_the_per_leaf_shards(sizes, rows, seed):
  p = buckets.plan(tuple(sizes), rows, 64)
  rng = np.random.default_rng(seed)
  flats = [None if not n else jnp.asarray(rng.standard_normal(n), jnp.float32) for n in sizes]

  scales = [None if x is None else np.arange(rows * leaf.blocks, dtype=np.float32) + i
            for i, (x, leaf) in enumerate(zip(flats, p.leaves))]

  @jax.jit
  def round_trip(flats, s_b, count):
    firsts = buckets.starts(p, count)
    b = buckets.to_buckets(flats, p)
    rows_of = [buckets.shards([x[j].reshape(-1) for x in b], p, firsts) for j in range(rows)]
    return (buckets.from_buckets(b, p, firsts), rows_of,
            buckets.scales_from_buckets(s_b, p, firsts))

  back, rows_of, scales_back = round_trip(flats, _scales_in_buckets(scales, p), jnp.int32(seed))
  for i, (x, leaf) in enumerate(zip(flats, p.leaves)):
    if x is None:
      assert back[i] is None
      continue
    np.testing.assert_array_equal(np.asarray(back[i]), np.asarray(x))
    np.testing.assert_array_equal(np.asarray(scales_back[i]), np.asarray(scales[i]))
    want = layout.shard_rows(x, layout.leaf_layout(leaf.size, rows, None))
    for j in range(rows):
      np.testing.assert_array_equal(np.asarray(rows_of[j][i]), np.asarray(want[j]))


# --- LoCo's bucketed step on the mesh -----------------------------------------------------------

PARAMS = {"w": jnp.zeros((64, 96)), "b": jnp.zeros(96), "odd": jnp.zeros((7, 13)),
          "s": jnp.zeros(())}


def _mesh_step(opt, params, mesh, out_spec=P()):
  state, specs = parallel.init_opt_state(opt, params, mesh)
  grad_specs = jax.tree.map(lambda _: P("data"), params)
  update = lambda g, s: opt.update(jax.tree.map(lambda x: x[0], g), s)
  step = jax.jit(jax.shard_map(update, mesh=mesh, in_specs=(grad_specs, specs),
                               out_specs=(jax.tree.map(lambda _: out_spec, params), specs)))
  return step, state


def _grads(params, seed):
  rng = np.random.default_rng(seed)
  return {k: jnp.asarray(rng.standard_normal((N, *x.shape)) * np.exp(rng.standard_normal()),
                         x.dtype) for k, x in params.items()}


def _reference_first_step(grads, p, block_size):
  """The float64 mean over devices of each device's d (first step: the error is zero), laid
  out as the buckets lay it out."""
  sent = sorted(PARAMS)
  firsts = [[q.block0 for q in leaf.pieces] for leaf in p.leaves]
  per_device = []
  for d in range(N):
    flats = [np.asarray(grads[k][d], np.float64).reshape(-1) for k in sent]
    b = [np.asarray(x, np.float64) for x in buckets.to_buckets(
        [jnp.asarray(f, jnp.float32) for f in flats], p)]
    dec = []
    for x in b:
      blocks = x.reshape(-1, x.shape[-1])
      s = reference.absmax_scale(blocks, 4)
      dec.append(reference.decompress(np.clip(np.round(blocks * s), -8, 7), s).reshape(x.shape))
    per_device.append(dec)
  mean = [np.mean([dev[c] for dev in per_device], axis=0) for c in range(len(p.block_lens))]
  return dict(zip(sent, [np.asarray(x) for x in buckets.from_buckets(
      [jnp.asarray(m) for m in mean], p, firsts)]))


@pytest.mark.slow
@pytest.mark.numerics
def test_mesh_step_averages_every_bucket_through_dequantize_mean(mesh, monkeypatch):
  calls = []
  mean = kernels.dequantize_mean
  monkeypatch.setattr(kernels, "dequantize_mean",
                      lambda r, s, **k: calls.append(r.shape) or mean(r, s, **k))
  opt = loco(axis_name="data", block_size=64)
  step, state = _mesh_step(opt, PARAMS, mesh)
  grads = _grads(PARAMS, 0)
  out, _ = step(grads, state)
  p = buckets.plan(tuple(x.size for x in jax.tree.leaves(PARAMS)), N, 64)
  assert len(calls) == len(p.block_lens) > 1  # one receive-side mean per bucket, traced once
  want = _reference_first_step(grads, p, 64)
  for k, w in want.items():
    got = np.asarray(out[k], np.float64).reshape(-1)
    # bf16 gather: 2**-8 relative; a code may round the other way on a boundary (float32 h).
    close = np.abs(got - w) <= 2 ** -8 * np.abs(w) + 1e-30
    assert np.mean(close) > 0.999, (k, np.mean(close))


@pytest.mark.slow
@pytest.mark.numerics
def test_scatter_gives_each_device_its_per_leaf_shard(mesh):
  opt = loco(axis_name="data", scatter=True, block_size=64)
  step, state = _mesh_step(opt, PARAMS, mesh, out_spec=P("data"))
  full, full_state = _mesh_step(loco(axis_name="data", block_size=64), PARAMS, mesh)
  grads = _grads(PARAMS, 1)
  out, _ = step(grads, state)
  full_out, _ = full(grads, full_state)
  for k, x in PARAMS.items():
    row_len = layout.shard_len(x.size, N)
    assert out[k].shape == (N * row_len,)
    np.testing.assert_allclose(np.asarray(out[k])[: x.size], np.asarray(full_out[k]).reshape(-1),
                               rtol=2 ** -8, atol=1e-6)


@pytest.mark.slow
def test_wire_bits_of_a_gpt2_shaped_tree_stay_at_4_plus_16(mesh):
  params = jax.tree.map(jnp.zeros, bench.gpt2_shapes(d_model=64, layers=2),
                        is_leaf=lambda s: isinstance(s, tuple))
  n = sum(x.size for x in jax.tree.leaves(params))
  opt = loco(axis_name="data")
  step, state = _mesh_step(opt, params, mesh)
  grads = jax.tree.map(lambda x: jax.ShapeDtypeStruct((N, *x.shape), x.dtype), params)
  found = comm.compiled_collectives(step, grads, state)
  bits = {c.op: comm.wire_bits_per_param([c], n) for c in found}
  # 4 bits + scales and 16 bits, 7/8 of each sent; small leaves padded to 8 values a shard.
  assert bits["all-to-all"] < 4 * 7 / 8 * 1.03
  assert bits["all-gather"] < 16 * 7 / 8 * 1.03


def _distinct_fusions(hlo: str) -> int:
  """Fused computations that differ in more than their names (what XLA:CPU compiles once)."""
  bodies = re.findall(r"\n(%fused_computation[^\n]*\{\n.*?\n\})", hlo, re.S)
  strip = lambda body: re.sub(r"%[\w.\-]+|param_[\d.]+|metadata=\{[^}]*\}|, calls=\S+", "",
                              body)
  return len({hashlib.sha1(strip(b).encode()).hexdigest() for b in bodies})


@pytest.mark.slow
def test_compiled_kernels_do_not_grow_with_the_leaf_count():
  def distinct(layers):
    params = jax.tree.map(jnp.zeros, bench.gpt2_shapes(d_model=32, layers=layers),
                          is_leaf=lambda s: isinstance(s, tuple))
    opt = loco(block_size=256)
    return _distinct_fusions(jax.jit(opt.update).lower(params, opt.init(params))
                             .compile().as_text())

  few, many = distinct(2), distinct(8)
  assert many <= few + 4, (few, many)  # 72 more leaves, (almost) no more kernels
