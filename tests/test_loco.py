"""The `loco` transformation in local mode: exact semantics, feedback, bad input, memory."""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from loco_jax import kernels, loco


def _np_compress(x, s, p):
  return np.clip(np.round(s * x), -(2 ** (p - 1)), 2 ** (p - 1) - 1).astype(np.int8)


def _np_absmax(blocks, p):
  absmax = np.abs(blocks).max(axis=-1, keepdims=True)
  return np.where(absmax > 0, np.float32(2 ** (p - 1) - 1) / np.where(absmax > 0, absmax, 1),
                  0).astype(np.float32)


def _np_decompress(q, s):
  return np.where(s > 0, q.astype(np.float32) / np.where(s > 0, s, 1), 0).astype(np.float32)


class NumpyLoco:
  """An independent implementation of DESIGN.md's step semantics (local mode)."""

  def __init__(self, n, bits, scale, error_bits, error_scale, beta, reset_interval, block):
    self.__dict__.update(bits=bits, s=scale, eb=error_bits, se=error_scale, beta=np.float32(beta),
                         t=reset_interval, block=block)
    self.e_int = np.zeros(n, np.int8)
    self.e_scale = np.zeros((n // block, 1), np.float32)
    self.k = 0

  def _q(self, x, s, p):
    if s is None:
      blocks = x.reshape(-1, self.block)
      s = _np_absmax(blocks, p)
      return _np_compress(blocks, s, p).reshape(-1), s
    return _np_compress(x, np.float32(s), p), np.float32(s)

  def _dq(self, q, s):
    if q.size and np.ndim(s) == 2:
      return _np_decompress(q.reshape(-1, self.block), s).reshape(-1)
    return _np_decompress(q, s)

  def step(self, g):
    if self.t > 0 and self.k > 0 and self.k % self.t == 0:
      self.e_int[:] = 0
    e = self._dq(self.e_int, self.se if self.se is not None else self.e_scale)
    h = (g + e).astype(np.float32)
    q, s = self._q(h, self.s, self.bits)
    d = self._dq(q, s)
    residual = (self.beta * e + np.float32(1 - self.beta) * (h - d)).astype(np.float32)
    self.e_int, e_scale = self._q(residual, self.se, self.eb)
    if self.se is None:
      self.e_scale = e_scale
    self.k += 1
    return d


@pytest.mark.parametrize("scale,error_scale", [(64.0, 256.0), (None, None), (64.0, None)])
def test_matches_numpy_reference(scale, error_scale):
  n, steps = 4096, 9
  kwargs = dict(bits=4, scale=scale, error_bits=8, error_scale=error_scale, beta=0.8,
                reset_interval=4, block_size=1024)
  ref = NumpyLoco(n, kwargs["bits"], scale, 8, error_scale, 0.8, 4, 1024)
  opt = loco(**kwargs)
  state = opt.init(jnp.zeros(n))
  update = jax.jit(opt.update)
  rng = np.random.default_rng(0)
  for _ in range(steps):
    g = (rng.standard_normal(n) * 0.05).astype(np.float32)
    out, state = update(jnp.asarray(g), state)
    want = ref.step(g)
    np.testing.assert_allclose(np.asarray(out), want, rtol=0, atol=1e-6)
    np.testing.assert_array_equal(np.abs(np.asarray(state.error).astype(int) - ref.e_int), 0)
  assert int(state.count) == steps


def test_whole_block_leaves_take_the_fused_kernel_with_the_same_numbers(monkeypatch):
  loco_module = importlib.import_module("loco_jax.loco")
  fused_sizes = []
  compress_step = kernels.compress_step
  monkeypatch.setattr(kernels, "compress_step",
                      lambda g, *a, **k: fused_sizes.append(g.size) or compress_step(g, *a, **k))
  params = {"aligned": jnp.zeros((4, 1024)), "ragged": jnp.zeros(1000)}
  rng = np.random.default_rng(1)
  grads = [jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape), jnp.float32), params)
           for _ in range(5)]

  def run(opt):
    state, outs = opt.init(params), []
    for g in grads:
      out, state = jax.jit(opt.update)(g, state)
      outs.append(out)
    return outs, state

  fused, fused_state = run(loco(block_size=1024, reset_interval=3))
  assert fused_sizes == [4096]  # traced once; the ragged leaf and fixed scales stay unfused
  run(loco(block_size=1024, scale=64.0))
  assert fused_sizes == [4096]
  monkeypatch.setattr(loco_module, "_fusable", lambda *a: False)
  plain, plain_state = run(loco(block_size=1024, reset_interval=3))
  for a, b in zip(fused, plain):
    np.testing.assert_allclose(np.asarray(a["aligned"]), np.asarray(b["aligned"]), atol=1e-6)
    np.testing.assert_array_equal(np.asarray(a["ragged"]), np.asarray(b["ragged"]))
  codes = np.asarray(fused_state.error["aligned"]).astype(int)
  assert np.abs(codes - np.asarray(plain_state.error["aligned"])).max() <= 1


def test_non_finite_gradient_in_a_fused_leaf_outputs_nan_and_keeps_state():
  opt = loco(block_size=512)
  g = jnp.linspace(-1, 1, 2048)
  _, state = opt.update(g, opt.init(g))
  out, after = jax.jit(opt.update)(g.at[7].set(jnp.inf), state)
  assert np.all(np.isnan(np.asarray(out)))
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)),
               after, state)


def _drift(beta, steps, seed=0):
  """|sum_k (g_k - output_k)| per coordinate; g is mostly below half a rounding step."""
  n = 2048
  opt = loco(bits=4, scale=8.0, beta=beta, reset_interval=0, block_size=n)
  keys = jax.random.split(jax.random.key(seed), steps)
  grads = 0.03 + 0.02 * jax.vmap(lambda k: jax.random.normal(k, (n,)))(keys)

  def body(carry, g):
    state, drift = carry
    out, state = opt.update(g, state)
    return (state, drift + g - out), None

  (_, drift), _ = jax.lax.scan(body, (opt.init(jnp.zeros(n)), jnp.zeros(n)), grads)
  return float(jnp.abs(drift).mean())


def test_feedback_keeps_drift_bounded_while_plain_rounding_drifts_linearly():
  # beta = 1 never updates the error: plain 4-bit rounding without feedback.
  no_feedback = [_drift(1.0, k) for k in (100, 400)]
  loco_drift = [_drift(0.8, k) for k in (100, 400)]
  assert no_feedback[1] > 3.5 * no_feedback[0]         # grows with the step count
  assert loco_drift[1] < 1.5 * loco_drift[0] + 0.05    # does not
  assert loco_drift[1] < no_feedback[1] / 20


def test_reset_zeroes_the_error_before_the_step():
  opt = loco(bits=4, scale=4.0, error_scale=64.0, reset_interval=2)
  state = opt.init(jnp.zeros(8))
  g = jnp.full(8, 0.1)
  _, state = opt.update(g, state)
  _, state = opt.update(g, state)
  assert np.any(np.asarray(state.error) != 0)
  fresh = opt.init(jnp.zeros(8))
  _, after_fresh = opt.update(g, fresh)
  _, after_reset = opt.update(g, state)  # k = 2: reset, so the same as a first step
  np.testing.assert_array_equal(np.asarray(after_reset.error), np.asarray(after_fresh.error))


def test_vanishing_and_zero_blocks_stay_finite_and_go_to_zero():
  n = 4096
  opt = loco(bits=4, block_size=512, reset_interval=0, beta=0.8)
  mask = jnp.arange(n) < 2048  # the second half never gets gradient (unused embedding rows)

  def body(state, t):
    g = jnp.where(mask & (t < 5), jnp.sin(jnp.arange(n) * 1.0) * 1e-3, 0.0)
    out, state = opt.update(g, state)
    return state, out

  state, outs = jax.lax.scan(body, opt.init(jnp.zeros(n)), jnp.arange(3000))
  assert np.all(np.isfinite(np.asarray(outs)))
  np.testing.assert_array_equal(np.asarray(outs[:, 2048:]), 0)
  np.testing.assert_array_equal(np.asarray(outs[-1]), 0)
  assert np.all(np.isfinite(np.asarray(state.error_scale)))


def test_non_finite_gradient_outputs_nan_and_keeps_state():
  opt = loco()
  state = opt.init({"a": jnp.zeros(100), "b": jnp.zeros(3)})
  good = {"a": jnp.linspace(-1, 1, 100), "b": jnp.ones(3)}
  _, state = opt.update(good, state)
  bad = {"a": good["a"].at[3].set(jnp.nan), "b": jnp.ones(3)}
  out, after = jax.jit(opt.update)(bad, state)
  assert np.all(np.isnan(np.asarray(out["a"]))) and np.all(np.isnan(np.asarray(out["b"])))
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)),
               after, state)


def test_apply_if_finite_skips_the_step_and_keeps_the_error():
  opt = optax.apply_if_finite(optax.chain(loco(), optax.sgd(0.1)), max_consecutive_errors=3)
  params = jnp.zeros(64)
  state = opt.init(params)
  _, state = opt.update(jnp.linspace(-1, 1, 64), state, params)
  updates, after = jax.jit(opt.update)(jnp.full(64, jnp.inf), state, params)
  np.testing.assert_array_equal(np.asarray(updates), 0)
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)),
               after.inner_state, state.inner_state)
  assert int(after.total_notfinite) == 1


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_keeps_dtype(dtype):
  g = jnp.linspace(-1, 1, 300).astype(dtype)
  opt = loco()
  out, _ = jax.jit(opt.update)(g, opt.init(g))
  assert out.dtype == dtype
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(g, np.float32), atol=0.08)


def test_non_float_scalar_and_empty_leaves():
  params = {"int": jnp.arange(3), "scalar": jnp.float32(0.0), "empty": jnp.zeros((0, 4)),
            "w": jnp.zeros((5, 3))}
  grads = {"int": jnp.arange(3), "scalar": jnp.float32(0.7), "empty": jnp.zeros((0, 4)),
           "w": jnp.ones((5, 3))}
  opt = loco()
  out, state = jax.jit(opt.update)(grads, opt.init(params))
  np.testing.assert_array_equal(np.asarray(out["int"]), [0, 1, 2])
  assert out["scalar"].shape == () and abs(float(out["scalar"]) - 0.7) < 1e-6
  assert out["empty"].shape == (0, 4)
  np.testing.assert_allclose(np.asarray(out["w"]), 1.0)
  assert state.error["int"].shape == (0,)


@pytest.mark.parametrize("kwargs,match", [
    (dict(bits=0), "bits"), (dict(bits=9), "bits"), (dict(error_bits=12), "error_bits"),
    (dict(beta=-0.1), "beta"), (dict(beta=1.5), "beta"), (dict(block_size=0), "block_size"),
    (dict(reset_interval=-1), "reset_interval"), (dict(scale=0.0), "scale"),
    (dict(error_scale=-2.0), "error_scale"), (dict(gather="fp32"), "gather"),
    (dict(gather="quantized"), "axis_name"), (dict(bits=4.0), "bits"),
])
def test_bad_arguments_raise(kwargs, match):
  with pytest.raises(ValueError, match=match):
    loco(**kwargs)


def test_unbound_axis_names_the_axis():
  opt = loco(axis_name="data")
  with pytest.raises(ValueError, match="'data'"):
    opt.update(jnp.ones(8), opt.init(jnp.ones(8)))


def test_state_costs_about_one_byte_per_parameter():
  params = {"w": jnp.zeros((512, 512)), "b": jnp.zeros(512), "e": jnp.zeros((1000, 64))}
  n = sum(x.size for x in jax.tree.leaves(params))
  state = loco().init(params)
  nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
  assert all(x.dtype == jnp.int8 for x in jax.tree.leaves(state.error))
  assert 1.0 <= nbytes / n < 1.01, nbytes / n
