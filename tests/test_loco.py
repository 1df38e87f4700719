"""The `loco` transformation in local mode: exact semantics, feedback, bad input, memory."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from loco_jax import kernels, loco
from loco_jax.transforms.loco_state import error_by_leaf


def _np_absmax(blocks, p):
  absmax = np.abs(blocks).max(axis=-1, keepdims=True)
  return np.where(absmax > 0, (2 ** (p - 1) - 1) / np.where(absmax > 0, absmax, 1), 0)


def _np_decompress(q, s):
  return np.where(s > 0, q / np.where(s > 0, s, 1), 0)


def _assert_codes(got, x, p, tol):
  """`got` = clip(round(x)) of the float64 reference x, but for a step of one where x lies
  within `tol` of a rounding boundary (float32 rounding of x's inputs may land either side)."""
  want = np.clip(np.round(x), -(2 ** (p - 1)), 2 ** (p - 1) - 1)
  off = got != want
  assert np.all(np.abs(got - want) <= 1), np.abs(got - want).max()
  assert np.all(np.abs(np.abs(x[off]) % 1 - 0.5) <= np.broadcast_to(tol, x.shape)[off]), (
      "codes differ away from a rounding boundary")


class NumpyLoco:
  """An independent float64 implementation of DESIGN.md's step semantics (local mode).

  Each step starts from the implementation's stored error (codes and scales), so that a code
  that rounds the other way on a boundary does not carry into later steps; the check is then
  that of one step, within float32 rounding.
  """

  def __init__(self, bits, scale, error_bits, error_scale, beta, reset_interval, block):
    self.__dict__.update(bits=bits, s=scale, eb=error_bits, se=error_scale, beta=beta,
                         t=reset_interval, block=block)

  def _scale(self, x, fixed, p):
    blocks = x.reshape(-1, self.block)
    s = _np_absmax(blocks, p) if fixed is None else np.full((blocks.shape[0], 1), fixed)
    return blocks, s

  def check_step(self, k, g, error, error_scale, out, new_error, new_error_scale):
    """Asserts that (out, new_error, new_error_scale) is step k from (error, error_scale)."""
    f64 = lambda x: np.asarray(x, np.float64)
    codes = f64(error).reshape(-1, self.block)
    if self.t > 0 and k > 0 and k % self.t == 0:
      codes = codes * 0
    se = (np.full((codes.shape[0], 1), self.se) if self.se is not None
          else f64(error_scale).reshape(-1, 1))
    e = _np_decompress(codes, se)
    h, s = self._scale(f64(g) + e.reshape(-1), self.s, self.bits)
    x = s * h
    ulp = 2.0 ** -22   # a few float32 roundings, relative
    q = np.round(f64(out).reshape(h.shape) * s)
    _assert_codes(q, x, self.bits, ulp * (np.abs(x) + 1))
    np.testing.assert_allclose(f64(out).reshape(h.shape), _np_decompress(q, s), rtol=ulp,
                               atol=0)
    d = _np_decompress(q, s)                  # the codes sent, as the implementation chose them
    residual = self.beta * e + (1 - self.beta) * (h - d)
    r, s_e = self._scale(residual.reshape(-1), self.se, self.eb)
    if self.se is None:
      np.testing.assert_allclose(f64(new_error_scale).reshape(-1, 1), s_e, rtol=1e-5)
    y = s_e * r
    # h - d cancels: its float32 rounding is relative to |h| and |e|, not to the residual.
    tol = s_e * ulp * (np.abs(h) + np.abs(e) + np.abs(d)) + ulp * np.abs(y)
    _assert_codes(f64(new_error).reshape(y.shape), y, self.eb, tol)


@pytest.mark.numerics
@pytest.mark.parametrize("scale,error_scale", [(64.0, 256.0), (None, None), (64.0, None)])
def test_matches_numpy_reference(scale, error_scale):
  n, steps = 4096, 9
  kwargs = dict(bits=4, scale=scale, error_bits=8, error_scale=error_scale, beta=0.8,
                reset_interval=4, block_size=1024)
  ref = NumpyLoco(4, scale, 8, error_scale, 0.8, 4, 1024)
  opt = loco(**kwargs)
  state = opt.init(jnp.zeros(n))
  update = jax.jit(opt.update)
  rng = np.random.default_rng(0)
  for k in range(steps):
    g = (rng.standard_normal(n) * 0.05).astype(np.float32)
    out, new_state = update(jnp.asarray(g), state)
    ref.check_step(k, g, *error_by_leaf(state, g, 1024), out,
                   *error_by_leaf(new_state, g, 1024))
    state = new_state
  assert int(state.count) == steps
  assert np.any(np.asarray(state.groups[""].error[0]) != 0)


@pytest.mark.slow
@pytest.mark.numerics
def test_leaves_are_compressed_per_bucket_not_per_leaf(monkeypatch):
  calls = []
  compress_step = kernels.compress_step
  monkeypatch.setattr(kernels, "compress_step",
                      lambda g, *a, **k: calls.append((g.size, k["block_size"]))
                      or compress_step(g, *a, **k))
  params = {f"w{i}": jnp.zeros((4, 1024)) for i in range(6)}
  params.update({f"b{i}": jnp.zeros(96) for i in range(6)}, ragged=jnp.zeros(1000))
  opt = loco(block_size=1024)
  out, state = jax.jit(opt.update)(jax.tree.map(jnp.ones_like, params), opt.init(params))
  # One call per bucket, traced once: 6 * 4096 + 1000 (padded to a block) in blocks of 1024,
  # the 96-value leaves in 3 blocks of 32 each (no block straddles two leaves; blocks of 64 and
  # 32 would save 24 bytes of scales, not worth a third bucket).
  assert sorted(calls) == [(6 * 96, 32), (25 * 1024, 1024)]
  for k, x in out.items():
    np.testing.assert_allclose(np.asarray(x), 1.0, err_msg=k)
  # The state is one array per bucket, and per leaf as the leaves lie in them.
  assert [e.shape for e in state.groups[""].error] == [(25 * 1024,), (6 * 96,)]
  error, error_scale = error_by_leaf(state, params, block_size=1024)
  assert error["ragged"].shape == (1000,) and error_scale["b0"].shape == (3,)
  # Sorted keys: b0..b5 and ragged (its one block) lie before w3 in the bucket of 1024s.
  np.testing.assert_array_equal(np.asarray(error["w3"]),
                                np.asarray(state.groups[""].error[0])[4 * 4096: 5 * 4096])


@pytest.mark.slow
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


@pytest.mark.slow
@pytest.mark.numerics
def test_feedback_keeps_drift_bounded_while_plain_rounding_drifts_linearly():
  # beta = 1 never updates the error: plain 4-bit rounding without feedback.
  no_feedback = [_drift(1.0, k) for k in (100, 400)]
  loco_drift = [_drift(0.8, k) for k in (100, 400)]
  assert no_feedback[1] > 3.5 * no_feedback[0]         # grows with the step count
  assert loco_drift[1] < 1.5 * loco_drift[0] + 0.05    # does not
  assert loco_drift[1] < no_feedback[1] / 20


@pytest.mark.slow
def test_reset_zeroes_the_error_before_the_step():
  opt = loco(bits=4, scale=4.0, error_scale=64.0, reset_interval=2)
  state = opt.init(jnp.zeros(8))
  g = jnp.full(8, 0.1)
  _, state = opt.update(g, state)
  _, state = opt.update(g, state)
  assert np.any(np.asarray(state.groups[""].error[0]) != 0)
  fresh = opt.init(jnp.zeros(8))
  _, after_fresh = opt.update(g, fresh)
  _, after_reset = opt.update(g, state)  # k = 2: reset, so the same as a first step
  # Exact: one program (update, run op by op) on the same g with e exactly 0 in both.
  np.testing.assert_array_equal(np.asarray(after_reset.groups[""].error[0]),
                                np.asarray(after_fresh.groups[""].error[0]))


@pytest.mark.slow
@pytest.mark.numerics
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
  assert np.all(np.isfinite(np.asarray(state.groups[""].error_scale[0])))


@pytest.mark.slow
def test_non_finite_gradient_outputs_nan_and_keeps_state():
  opt = loco()
  state = opt.init({"a": jnp.zeros(100), "b": jnp.zeros(3)})
  update = jax.jit(opt.update)  # op by op, the first step took 8 s of the suite
  good = {"a": jnp.linspace(-1, 1, 100), "b": jnp.ones(3)}
  _, state = update(good, state)
  bad = {"a": good["a"].at[3].set(jnp.nan), "b": jnp.ones(3)}
  out, after = update(bad, state)
  assert np.all(np.isnan(np.asarray(out["a"]))) and np.all(np.isnan(np.asarray(out["b"])))
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)),
               after, state)


@pytest.mark.slow
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


@pytest.mark.numerics
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_keeps_dtype(dtype):
  g = jnp.linspace(-1, 1, 300).astype(dtype)
  opt = loco()
  out, _ = jax.jit(opt.update)(g, opt.init(g))
  assert out.dtype == dtype
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(g, np.float32), atol=0.08)


@pytest.mark.slow
@pytest.mark.numerics
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
  error, _ = error_by_leaf(state, params)
  assert error["int"].shape == (0,) and error["empty"].shape == (0,)
  assert error["w"].shape == (15,) and error["scalar"].shape == (1,)


@pytest.mark.parametrize("kwargs,match", [
    (dict(bits=0), "bits"), (dict(bits=9), "bits"), (dict(error_bits=12), "error_bits"),
    (dict(beta=-0.1), "beta"), (dict(beta=1.5), "beta"), (dict(block_size=0), "block_size"),
    (dict(reset_interval=-1), "reset_interval"), (dict(scale=0.0), "scale"),
    (dict(error_scale=-2.0), "error_scale"), (dict(gather="fp32"), "gather"),
    (dict(gather="quantized"), "axis_name"), (dict(bits=4.0), "bits"),
    (dict(scatter=True), "scatter=True needs an axis_name"),
    (dict(scatter=True, axis_name="data", gather="quantized"), "no effect with scatter=True"),
])
def test_bad_arguments_raise(kwargs, match):
  with pytest.raises(ValueError, match=match):
    loco(**kwargs)


def test_unbound_axis_names_the_axis():
  opt = loco(axis_name="data")
  with pytest.raises(ValueError, match="'data'"):
    opt.update(jnp.ones(8), opt.init(jnp.ones(8)))


@pytest.mark.numerics
def test_state_costs_about_one_byte_per_parameter():
  params = {"w": jnp.zeros((512, 512)), "b": jnp.zeros(512), "e": jnp.zeros((1000, 64))}
  n = sum(x.size for x in jax.tree.leaves(params))
  state = loco().init(params)
  nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
  assert all(x.dtype == jnp.int8 for x in jax.tree.leaves(state.groups[""].error))
  assert 1.0 <= nbytes / n < 1.01, nbytes / n


PARAMS_2 = {"w": jnp.zeros((4, 8)), "b": jnp.zeros(8)}


@pytest.mark.parametrize("grads,match", [
    ({"w": jnp.ones((4, 9)), "b": jnp.ones(8)}, r"leaf \['w'\] has shape \(4, 9\).* \(4, 8\)"),
    ({"w": jnp.ones((4, 7)), "b": jnp.ones(8)}, r"leaf \['w'\] has shape \(4, 7\)"),  # smaller
    ({"w": jnp.ones((4, 8))}, r"lacks leaf \['b'\]"),
    ({"w": jnp.ones((4, 8)), "b": jnp.ones(8), "c": jnp.ones(2)}, r"has leaf \['c'\]"),
    ([jnp.ones(8), jnp.ones((4, 8))], r"tree structures differ|has leaf \[0\]"),
    ({"w": {"x": jnp.ones((4, 8))}, "b": jnp.ones(8)}, r"has leaf \['w'\]\['x'\]"),
    ({"w": jnp.ones((4, 8), jnp.int32), "b": jnp.ones(8)}, r"leaf \['w'\] is int32"),
])
def test_a_gradient_tree_unlike_inits_params_is_refused_naming_the_leaf(grads, match):
  # Every optax transformation raises here; LoCo's bucketed state alone would take a list
  # where a dict was, or a leaf padded into the same blocks, and apply its error to it.
  opt = loco()
  state = opt.init(PARAMS_2)
  with pytest.raises(ValueError, match=match):
    jax.jit(opt.update)(grads, state)


@pytest.mark.slow
def test_float_widths_may_differ_from_inits_params():
  # Mixed precision: float32 params, bfloat16 gradients, as every optax transformation allows.
  opt = loco()
  out, _ = opt.update(jax.tree.map(lambda x: jnp.ones_like(x, jnp.bfloat16), PARAMS_2),
                      opt.init(PARAMS_2))
  assert out["w"].dtype == jnp.bfloat16


def test_the_check_costs_the_step_nothing():
  # The params' structure and shapes are static metadata of the state: no array, no op.
  opt = loco()
  state = opt.init(PARAMS_2)
  assert sum(x.size for x in jax.tree.leaves(state)) == sum(
      x.size for x in jax.tree.leaves((state.count, state.groups)))
  hlo = jax.jit(opt.update).lower(PARAMS_2, state).as_text()
  assert "signature" not in hlo


def test_a_state_of_another_loco_says_what_it_needs():
  state = loco(block_size=16).init(PARAMS_2)
  with pytest.raises(ValueError, match=r"the state holds 4 arrays of shapes \[\(32,\), \(8,\), \(2,\), "
                     r"\(1,\)\], .* needs 4 arrays of shapes \[\(32,\), \(8,\), \(1,\), \(1,\)\]"):
    jax.jit(loco().update)(PARAMS_2, state)


def test_a_state_of_another_kind_or_layout_is_refused():
  params = {"w": jnp.zeros((4, 8)), "b": jnp.zeros(8)}
  opt = loco()
  with pytest.raises(ValueError, match="must be a LocoState"):
    opt.update(params, {"error": {}})
  # The per-leaf state of earlier releases (and checkpoints of it) no longer fits.
  per_leaf = opt.init(params)._replace(groups={k: jnp.zeros(x.size, jnp.int8)
                                               for k, x in params.items()})
  with pytest.raises(ValueError, match=r"the state holds 2 arrays .* needs 4 arrays"):
    opt.update(params, per_leaf)
  state = opt.init(params)
  with pytest.raises(ValueError, match="block_size and rows"):
    error_by_leaf(state, params, block_size=16)
  with pytest.raises(ValueError, match="block_size and rows"):
    error_by_leaf(state, params, rows=2)
  with pytest.raises(ValueError, match="groups \\['', 'model'\\]"):
    error_by_leaf(state._replace(groups={"": state.groups[""], "model": state.groups[""]}), params)
