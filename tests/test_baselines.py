"""Baselines: local semantics, 8-device mean of local decompressions, HLO wire bits, bad args."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from loco_jax import comm, loco
from loco_jax.core import buckets
from loco_jax.transforms import specs
from loco_jax.transforms import baselines

N = 8
BLOCK = 64
METHODS = {
    "uncompressed": baselines.uncompressed,
    "bf16": baselines.bf16,
    "int_quantized": functools.partial(baselines.int_quantized, block_size=BLOCK),
    "error_feedback": functools.partial(baselines.error_feedback, block_size=BLOCK),
    "ef21": functools.partial(baselines.ef21, block_size=BLOCK),
    "sign_ef": functools.partial(baselines.sign_ef, block_size=BLOCK),
    "topk_ef": functools.partial(baselines.topk_ef, fraction=0.05),
}
COMPRESSED = ["int_quantized", "error_feedback", "ef21", "sign_ef", "topk_ef"]
FEEDBACK = ["error_feedback", "sign_ef", "topk_ef"]


def _normal(seed, shape, scale=1.0):
  return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def _np_quantize(x, bits, block):
  """Absmax block quantization in numpy (size a multiple of `block`): d = round(s x) / s."""
  blocks = x.reshape(-1, block)
  qmax = 2 ** (bits - 1) - 1
  s = np.float32(qmax) / np.abs(blocks).max(axis=-1, keepdims=True)
  q = np.clip(np.round(s * blocks), -qmax - 1, qmax)
  return (q / s).astype(np.float32).reshape(-1)


def _assert_tree_equal(a, b):
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


# --- Local mode ---------------------------------------------------------------------------------

def test_uncompressed_is_the_identity_and_bf16_rounds():
  grads = {"w": jnp.asarray(_normal(0, (7, 13))), "h": jnp.asarray(_normal(1, 5), jnp.float16),
           "i": jnp.arange(3), "z": jnp.zeros((0, 4))}
  out, state = jax.jit(baselines.uncompressed().update)(grads, optax.EmptyState())
  _assert_tree_equal(out, grads)
  assert jax.tree.map(lambda x: x.dtype, out) == jax.tree.map(lambda x: x.dtype, grads)
  out, _ = jax.jit(baselines.bf16().update)(grads, optax.EmptyState())
  for k in ("w", "h"):
    assert out[k].dtype == grads[k].dtype
    np.testing.assert_array_equal(np.asarray(out[k]),
                                  np.asarray(grads[k].astype(jnp.bfloat16).astype(grads[k].dtype)))
  assert np.any(np.asarray(out["w"]) != np.asarray(grads["w"]))
  _assert_tree_equal((out["i"], out["z"]), (grads["i"], grads["z"]))


@pytest.mark.slow
@pytest.mark.parametrize("bits", [3, 4])
def test_int_quantized_is_loco_without_feedback(bits):
  params = {"w": jnp.zeros((33, 70)), "s": jnp.zeros(())}
  ours = baselines.int_quantized(bits, 256)
  theirs = loco(bits, beta=1.0, block_size=256, scale_method="absmax")  # 3 bits default: rms
  state, loco_state = ours.init(params), theirs.init(params)
  for seed in range(3):
    grads = jax.tree.map(lambda x: jnp.asarray(_normal(seed, x.shape)), params)
    out, state = jax.jit(ours.update)(grads, state)
    want, loco_state = jax.jit(theirs.update)(grads, loco_state)
    # Exact although two programs: loco's error stays exactly 0 (beta = 1), so both quantize
    # the same g with the same ops (one division for s, one product, a round, one division for
    # d), and no multiply-add is left to contract into an FMA.
    _assert_tree_equal(out, want)
    assert np.any(np.asarray(out["w"]) != np.asarray(grads["w"]))


def _blocks(x, block):
  """A leaf's values in the blocks of loco's buckets (`buckets.plan`, one row), each block
  zero-padded to the longest: [blocks, block] float64."""
  p = buckets.plan((np.size(x),), 1, block)
  lengths = [p.block_lens[q.bucket] for q in p.leaves[0].pieces for _ in range(q.blocks)]
  flat = np.pad(np.asarray(x, np.float64).reshape(-1), (0, sum(lengths) - np.size(x)))
  starts = np.cumsum([0] + lengths[:-1])
  return np.stack([np.pad(flat[a:a + n], (0, block - n)) for a, n in zip(starts, lengths)])


def _assert_block_quantized(d, h, bits, block):
  """d is Q(h) (absmax blocks, as loco's buckets cut them) within float32 rounding, against
  float64: its codes round(s h) (s = qmax / max|h| per block) differ by one only where s h sits
  within float32 rounding of a rounding boundary, and d = codes / s within a few float32
  roundings."""
  h_BxL, d_BxL = _blocks(h, block), _blocks(d, block)
  qmax = 2 ** (bits - 1) - 1
  s = qmax / np.abs(h_BxL).max(axis=-1, keepdims=True)
  x = s * h_BxL
  codes, want = np.round(d_BxL * s), np.clip(np.round(x), -qmax - 1, qmax)
  off = codes != want
  assert np.all(np.abs(codes - want) <= 1)
  assert np.all(np.abs(np.abs(x[off]) % 1 - 0.5) <= 2.0 ** -21 * (np.abs(x[off]) + 1))
  np.testing.assert_allclose(d_BxL, codes / s, rtol=2.0 ** -22, atol=0)


@pytest.mark.numerics
def test_error_feedback_stores_h_minus_d_exactly():
  # Against a float64 reference within float32 rounding, not against int_quantized's program
  # bit for bit: that is another compiled program, whose FMA contraction differs with the CPU's
  # vector ISA (AVX2 and AVX-512 round h = g + e differently in the last bit).
  opt = baselines.error_feedback(bits=4, block_size=256)
  state = opt.init(jnp.zeros((40, 50)))
  for seed in range(3):
    g = _normal(seed, (40, 50)).reshape(-1)
    e = np.asarray(state.error, np.float64)
    out, state = jax.jit(opt.update)(jnp.asarray(g.reshape(40, 50)), state)
    h = g + e
    d = np.asarray(out, np.float64).reshape(-1)
    _assert_block_quantized(d, h, 4, 256)                             # d = Q(g + e)
    np.testing.assert_array_less(                                     # e' = h - d
        np.abs(np.asarray(state.error, np.float64) - (h - d)),
        2.0 ** -23 * (np.abs(h) + np.abs(d)) + 1e-30)
    assert np.any(np.asarray(state.error) != 0)


@pytest.mark.numerics
def test_error_feedback_with_beta_keeps_locos_moving_average_in_float32():
  # e' = beta e + (1 - beta)(h - d), against float64 within float32 rounding; bad beta refused.
  beta = 0.8
  opt = baselines.error_feedback(bits=4, block_size=256, beta=beta)
  state = opt.init(jnp.zeros(1000))
  for seed in range(3):
    g = _normal(seed, 1000)
    e = np.asarray(state.error, np.float64)
    out, state = jax.jit(opt.update)(jnp.asarray(g), state)
    h, d = g + e, np.asarray(out, np.float64)
    _assert_block_quantized(d, h, 4, 256)
    want = beta * e + (1 - beta) * (h - d)  # float32 rounds h, d and the products on the way
    np.testing.assert_array_less(np.abs(np.asarray(state.error, np.float64) - want),
                                 2.0 ** -21 * (np.abs(e) + np.abs(h) + np.abs(d)) + 1e-30)
  with pytest.raises(ValueError, match="beta must be in"):
    baselines.error_feedback(beta=1.0)


@pytest.mark.numerics
def test_ef21_matches_numpy_for_three_steps():
  n, bits = 1024, 4
  opt = baselines.ef21(bits=bits, block_size=256)
  state = opt.init(jnp.zeros(n))
  g_i, g = np.zeros(n, np.float32), np.zeros(n, np.float32)
  for seed in range(3):
    grad = _normal(seed, n)
    out, state = jax.jit(opt.update)(jnp.asarray(grad), state)
    c = _np_quantize(grad - g_i, bits, 256)
    g_i, g = g_i + c, g + c          # one device: the mean of the c_i is c
    np.testing.assert_allclose(np.asarray(state.local), g_i, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(state.estimate), g, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(state.estimate))
  assert np.abs(g - grad).mean() < 0.2 * np.abs(grad).mean()  # g tracks the changing gradient


@pytest.mark.numerics
def test_sign_ef_sends_the_mean_magnitude_of_each_block():
  opt = baselines.sign_ef(block_size=BLOCK)
  g = _normal(0, 300)              # 5 blocks of 64, the last with 44 real elements, 20 padding
  out, state = jax.jit(opt.update)(jnp.asarray(g), opt.init(jnp.zeros(300)))
  for start in range(0, 300, BLOCK):
    block, sent = g[start:start + BLOCK], np.asarray(out)[start:start + BLOCK]
    np.testing.assert_allclose(sent, np.abs(block).mean() * np.where(block < 0, -1, 1), rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(state.error), g - np.asarray(out))
  g2 = _normal(1, 300)
  out2, _ = jax.jit(opt.update)(jnp.asarray(g2), state)
  h = g2 + np.asarray(state.error)
  np.testing.assert_array_equal(np.sign(np.asarray(out2)), np.where(h < 0, -1, 1))


def test_topk_keeps_exactly_the_k_largest():
  opt = baselines.topk_ef(fraction=0.05)
  grads = {"w": jnp.asarray(_normal(0, (20, 50))), "tiny": jnp.asarray(_normal(1, 7))}
  out, state = jax.jit(opt.update)(grads, opt.init(grads))
  for k, (name, g) in zip((50, 1), grads.items()):   # max(1, round(0.05 * size))
    g, sent = np.asarray(g).reshape(-1), np.asarray(out[name]).reshape(-1)
    kept = np.flatnonzero(sent)
    assert kept.size == k
    np.testing.assert_array_equal(np.sort(kept), np.sort(np.argsort(-np.abs(g))[:k]))
    np.testing.assert_array_equal(sent[kept], g[kept])
    np.testing.assert_array_equal(np.asarray(state.error[name]), g - sent)


@pytest.mark.numerics
@pytest.mark.parametrize("name", FEEDBACK)
def test_feedback_loses_nothing(name):
  """sum_k d_k + e_K = sum_k g_k: what is not sent yet is in the error."""
  opt = METHODS[name]()
  state = opt.init(jnp.zeros(640))
  sent, total = 0.0, 0.0
  for seed in range(5):
    g = _normal(seed, 640)
    out, state = jax.jit(opt.update)(jnp.asarray(g), state)
    sent, total = sent + np.asarray(out), total + g
  np.testing.assert_allclose(sent + np.asarray(state.error), total, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", sorted(METHODS))
def test_pass_through_dtypes_and_stable_state(name):
  opt = METHODS[name]()
  grads = {"w": jnp.asarray(_normal(0, (9, 16)), jnp.bfloat16),
           "h": jnp.asarray(_normal(1, 24), jnp.float16), "i": jnp.arange(5, dtype=jnp.int32),
           "z": jnp.zeros((0,))}
  state = opt.init(grads)
  out, new_state = jax.jit(opt.update)(grads, state)
  assert jax.tree.map(lambda x: x.dtype, out) == jax.tree.map(lambda x: x.dtype, grads)
  _assert_tree_equal((out["i"], out["z"]), (grads["i"], grads["z"]))
  shapes = lambda t: jax.tree.map(lambda x: (x.shape, x.dtype), t)
  assert shapes(new_state) == shapes(state)
  only_ints = {"i": jnp.arange(5)}
  out, _ = jax.jit(opt.update)(only_ints, opt.init(only_ints))
  _assert_tree_equal(out, only_ints)


@pytest.mark.parametrize("name", COMPRESSED)
def test_non_finite_gradient_gives_nan_and_keeps_the_state(name):
  opt = METHODS[name]()
  grads = {"w": jnp.asarray(_normal(0, (16, 40))), "b": jnp.asarray(_normal(1, 40)),
           "i": jnp.arange(3)}
  update = jax.jit(opt.update)
  _, state = update(grads, opt.init(grads))
  bad = dict(grads, w=grads["w"].at[2, 3].set(jnp.inf))
  out, after = update(bad, state)
  assert np.all(np.isnan(np.asarray(out["w"]))) and np.all(np.isnan(np.asarray(out["b"])))
  _assert_tree_equal(out["i"], grads["i"])
  _assert_tree_equal(after, state)


@pytest.mark.parametrize("factory,kwargs,match", [
    (baselines.int_quantized, dict(bits=0), "bits must be an integer in 1..8"),
    (baselines.error_feedback, dict(bits=9), "bits must be an integer in 1..8"),
    (baselines.ef21, dict(bits=4.0), "bits must be an integer in 1..8"),
    (baselines.int_quantized, dict(block_size=0), "block_size must be a positive int"),
    (baselines.sign_ef, dict(block_size=-8), "block_size must be a positive int"),
    (baselines.ef21, dict(block_size=True), "block_size must be a positive int"),
    (baselines.topk_ef, dict(fraction=0.0), r"fraction must be in \(0, 1\]"),
    (baselines.topk_ef, dict(fraction=1.5), r"fraction must be in \(0, 1\]"),
    (baselines.topk_ef, dict(fraction=float("nan")), r"fraction must be in \(0, 1\]"),
    (baselines.topk_ef, dict(fraction="1%"), r"fraction must be a Python float in \(0, 1\]"),
])
def test_bad_arguments(factory, kwargs, match):
  with pytest.raises(ValueError, match=match):
    factory(**kwargs)


@pytest.mark.parametrize("name", ["error_feedback", "ef21", "sign_ef", "topk_ef"])
def test_a_gradient_tree_that_does_not_match_the_state_names_the_leaf(name):
  opt = METHODS[name]()
  state = opt.init({"w": jnp.zeros((4, 9)), "b": jnp.zeros(8)})
  with pytest.raises(ValueError, match=rf"{name}: gradient leaf \['w'\] has shape \(4, 8\), "
                                       r"but state\.\w+\['w'\] has shape \(36,\)"):
    jax.jit(opt.update)({"w": jnp.ones((4, 8)), "b": jnp.ones(8)}, state)
  with pytest.raises(ValueError, match=r"lacks leaf \['b'\]"):
    jax.jit(opt.update)({"w": jnp.ones((4, 9))}, state)


def test_unbound_axis_is_explained():
  for name in ("uncompressed", "error_feedback", "topk_ef"):
    opt = METHODS[name](axis_name="data")
    with pytest.raises(ValueError, match="'data' is not bound"):
      opt.update({"w": jnp.ones(8)}, opt.init({"w": jnp.ones(8)}))


# --- On the 8-device mesh -----------------------------------------------------------------------

# Sizes a multiple of N * BLOCK: blocks fall in the same places with 1 and with N rows, so the
# local decompression is what each device sends.
MESH_PARAMS = {"w": jnp.zeros((64, 96)), "b": jnp.zeros(512), "s": jnp.zeros(())}
WIRE_PARAMS = {"w": jnp.zeros((256, 384)), "b": jnp.zeros(384), "odd": jnp.zeros((7, 13)),
               "s": jnp.zeros(())}


def _device_grads(params, seed):
  """Different gradients per device, stacked on a leading device axis: [N, *shape]."""
  return {k: jnp.asarray(_normal(seed + i, (N, *x.shape))
                         * (1 + np.arange(N)).reshape(-1, *[1] * x.ndim).astype(np.float32))
          for i, (k, x) in enumerate(sorted(params.items()))}


def _per_device(tree):
  """The global array of a per-device field stacks N copies: [N * size] -> [N, size]."""
  return jax.tree.map(lambda x: np.asarray(x).reshape(N, -1), tree)


# |mesh - mean of local outputs| <= TOLERANCE * mean_i |local output_i|: bf16 rounding of the
# gathered mean (2**-8), of N partial sums (bf16 all-reduce), none (fp32 sums).
TOLERANCE = {"uncompressed": 1e-6, "bf16": N * 2 ** -9, "topk_ef": 1e-6}


@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.parametrize("name", sorted(METHODS))
def test_mesh_output_is_the_mean_of_local_decompressions(mesh, name, shard_mapped_update):
  step, state = shard_mapped_update(METHODS[name](axis_name="data"), mesh, MESH_PARAMS)
  local = METHODS[name]()
  local_update = jax.jit(local.update)
  local_states = [local.init(MESH_PARAMS)] * N
  tol = TOLERANCE.get(name, 2 ** -8)
  previous = jax.tree.map(np.zeros_like, MESH_PARAMS)   # the mesh output of the step before
  last = [previous] * N                                 # each device's local output, likewise
  for seed in range(3):
    grads = _device_grads(MESH_PARAMS, seed)
    out, state = step(grads, state)
    sent = []
    for d in range(N):
      o, local_states[d] = local_update(jax.tree.map(lambda g: g[d], grads), local_states[d])
      # EF21 outputs g += mean_i c_i, c_i being what g_i (device i's local output) changed by.
      sent.append(jax.tree.map(np.subtract, o, last[d]) if name == "ef21" else o)
      last[d] = o
    for k in MESH_PARAMS:
      sent_k = np.stack([np.asarray(x[k]) for x in sent])
      want = sent_k.mean(0) + (np.asarray(previous[k]) if name == "ef21" else 0.0)
      excess = (np.abs(np.asarray(out[k]) - want) - tol * np.abs(sent_k).mean(0)
                - 1e-6 * np.abs(want))
      assert excess.max() <= 1e-7, (k, excess.max())
    previous = out
    for field in specs.per_device_fields(state):
      mine = _per_device(getattr(state, field))
      for d in range(N):
        theirs = jax.tree.map(np.asarray, getattr(local_states[d], field))
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a[d], b, rtol=1e-6, atol=1e-6),
                     mine, theirs)
  # A non-finite gradient on one device: not finite on every device, no state changes anywhere.
  grads = _device_grads(MESH_PARAMS, 9)
  grads["w"] = grads["w"].at[3, 0, 0].set(jnp.inf)
  out, after = step(grads, state)
  assert not np.any(np.isfinite(np.asarray(out["w"])[0, 0]))
  if name in COMPRESSED:
    assert all(np.all(np.isnan(np.asarray(x))) for x in jax.tree.leaves(out))
  _assert_tree_equal(after, state)


# name -> [(op, dtype, most sent bits a parameter)]: each device's sent bits, from the HLO.
WIRE = {
    "uncompressed": [("all-reduce", "f32", 56.0)],      # ring all-reduce: 2 (N-1)/N * 32
    # On CPU (these tests' backend) bf16 crosses as uint16: all-to-all, f32 sum, all-gather,
    # 2 (N-1)/N * 16 bits in all, as a bf16 ring all-reduce (comm.mean_16bit).
    "bf16": [("all-to-all", "u16", 14.1), ("all-gather", "u16", 14.1)],
    "int_quantized": [("all-to-all", "u8", 4.1), ("all-gather", "u16", 14.1)],
    "error_feedback": [("all-to-all", "u8", 4.1), ("all-gather", "u16", 14.1)],
    "ef21": [("all-to-all", "u8", 4.1), ("all-gather", "u16", 14.1)],
    "sign_ef": [("all-to-all", "u8", 1.0), ("all-gather", "u16", 14.1)],
}


@pytest.mark.parametrize("name", sorted(WIRE))
def test_wire_bits_from_the_hlo(mesh, name, shard_mapped_update):
  factory = getattr(baselines, name)   # default block size, 2048
  step, state = shard_mapped_update(factory(axis_name="data"), mesh, WIRE_PARAMS)
  n_params = sum(x.size for x in jax.tree.leaves(WIRE_PARAMS))
  found = comm.lowered_collectives(step, _device_grads(WIRE_PARAMS, 0), state)
  bits = {}
  for c in found:
    assert c.group_size == N
    bits[(c.op, c.dtype)] = bits.get((c.op, c.dtype), 0.0) + comm.wire_bits_per_param([c], n_params)
  assert sorted(bits) == sorted((op, dtype) for op, dtype, _ in WIRE[name])
  for op, dtype, most in WIRE[name]:
    assert 0.85 * most < bits[(op, dtype)] <= most + 1e-9, (op, bits)


def test_topk_wire_bits_are_proportional_to_the_fraction(mesh, shard_mapped_update):
  n_params = sum(x.size for x in jax.tree.leaves(WIRE_PARAMS))
  grads = _device_grads(WIRE_PARAMS, 0)
  bits = {}
  for fraction in (0.01, 0.1):
    step, state = shard_mapped_update(baselines.topk_ef(fraction, axis_name="data"), mesh,
                                WIRE_PARAMS)
    (gather,) = comm.lowered_collectives(step, grads, state)
    assert (gather.op, gather.dtype) == ("all-gather", "s32")
    k = sum(max(1, round(fraction * x.size)) for x in jax.tree.leaves(WIRE_PARAMS))
    bits[fraction] = comm.wire_bits_per_param([gather], n_params)
    # Every device's (index, value) pairs plus a 4-byte flag go to each of N - 1 peers.
    assert bits[fraction] == pytest.approx((N - 1) * 32 * (2 * k + 1) / n_params)
  assert bits[0.1] / bits[0.01] == pytest.approx(10, rel=0.02)
