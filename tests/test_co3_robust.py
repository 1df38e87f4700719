"""co3 on hostile and extreme input: peer streams, scalars, magnitudes up to the dtype max."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

from loco_jax.codecs import fp
from loco_jax.train import parallel
from loco_jax.transforms.co3 import co3

N = 8


# ----------------------------------------------------------------------------- peer streams


@pytest.mark.parametrize("coded", [0, 1, 2, 4999])
def test_a_peer_stream_of_another_symbol_count_is_refused(coded):
  """A well-formed stream with fewer bytes than the row would be broadcast by numpy: it is
  counted as corrupt, its row left empty."""
  from loco_jax.comm import coded_host
  from loco_jax.transforms import co3_exchange
  rng = np.random.default_rng(coded)
  total = 5000
  good = rng.integers(0, 16, total).astype(np.uint8)
  streams = [co3_exchange.CODER.encode(good),
             co3_exchange.CODER.encode(rng.integers(0, 16, coded).astype(np.uint8))]
  slots = np.zeros((3, max(map(len, streams))), np.uint8)
  for d, s in enumerate(streams):
    slots[d, :len(s)] = np.frombuffer(s, np.uint8)
  lengths = np.array([len(s) for s in streams] + [0], np.int32)
  rows, missing = coded_host.read_slots(slots, lengths, good, np.int32(2), co3_exchange.CODER)
  assert missing.tolist() == [0, 1]
  np.testing.assert_array_equal(rows[0], good)
  assert not np.any(rows[1])


# ----------------------------------------------------------------------------- scalars


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["fp4", "fp8"])
def test_scalars_and_single_value_leaves_track_the_gradient(fmt):
  """The tester's case: a scalar 50 came out 3.0 every step and 1e-3 came out 0.0."""
  params = {"s": jnp.zeros(()), "one_hot": jnp.zeros(64)}
  opt = co3(fmt, refit_interval=100)
  update = jax.jit(opt.update)
  state = opt.init(params)
  gamma = 0.7
  for value in [50.0, 1e-3, 60.0, -7.5, 1e-3, 2e5]:  # changes between refits too
    grads = {"s": jnp.float32(value), "one_hot": jnp.zeros(64).at[5].set(value)}
    compensated = {k: np.asarray(grads[k]).reshape(-1) + gamma * np.asarray(state.error[k])
                   for k in grads}
    out, state = update(grads, state)
    for k in grads:  # q(a) with the leaf's absmax scale is a itself, to rounding
      np.testing.assert_allclose(np.asarray(out[k]).reshape(-1), compensated[k], rtol=1e-5)
      assert np.all(np.abs(np.asarray(state.error[k])) <= 1e-5 * abs(value))
    assert float(out["s"]) == pytest.approx(value, rel=0.01)


# ----------------------------------------------------------------------------- magnitudes

DTYPES = {"float32": (jnp.float32, -30.0, 38.5), "bfloat16": (jnp.bfloat16, -30.0, 38.5),
          "float16": (jnp.float16, -4.0, 4.8)}  # decades of |g| each dtype holds as normals
_UPDATES = {}


def _update(fmt: str, dtype_name: str):
  """One jitted update per format and dtype: hypothesis examples reuse the compilation."""
  key = (fmt, dtype_name)
  if key not in _UPDATES:
    opt = co3(fmt, refit_interval=2)
    _UPDATES[key] = opt, jax.jit(opt.update)
  return _UPDATES[key]


def _params(dtype):
  return {"w": jnp.zeros((8, 32), dtype), "s": jnp.zeros((), dtype)}


@pytest.mark.slow
@settings(max_examples=40, deadline=None)
@given(st.sampled_from(["fp4", "fp8"]), st.sampled_from(sorted(DTYPES)), st.floats(0.0, 1.0),
       st.integers(0, 2**31))
def test_finite_in_finite_out_over_magnitudes(fmt, dtype_name, position, seed):
  dtype, low, high = DTYPES[dtype_name]
  largest = float(jnp.finfo(dtype).max)
  magnitude = min(10.0 ** (low + position * (high - low)), largest)
  opt, update = _update(fmt, dtype_name)
  state = opt.init(_params(dtype))
  rng = np.random.default_rng(seed)
  for step in range(3):  # steps 0 and 2 refit; 1 and 2 add the stored error
    w = np.clip(rng.standard_normal((8, 32)) * magnitude, -largest, largest)
    grads = {"w": jnp.asarray(w, dtype), "s": jnp.asarray(magnitude * (1 - 0.3 * step), dtype)}
    out, state = update(grads, state)
    for k in grads:
      got = np.asarray(out[k]).astype(np.float64)
      want = np.asarray(grads[k]).astype(np.float64)
      assert np.all(np.isfinite(got)), (k, step)
      # fp4 with error feedback: ~0.2 relative error on normal data (fp8: ~0.06), never a
      # zeroed (1.0) or exploded output. The scalar has no average over values: its output
      # Q(g + e) is off by up to half a grid step of g + e plus the carried error e, at most
      # half a step of the previous value (fp4: 1/5 + 1.3 x 0.29 ~ 0.58; fp8: 1/16 + 1.4 x
      # 1/16 ~ 0.15, before bfloat16's rounding).
      bound = {("w", "fp4"): 0.35, ("w", "fp8"): 0.12, ("s", "fp4"): 0.7, ("s", "fp8"): 0.25}
      relative = np.linalg.norm((got - want) / magnitude) / np.linalg.norm(want / magnitude)
      assert relative < bound[k, fmt], (k, step, relative)
    for leaf in jax.tree.leaves(state):
      assert np.all(np.isfinite(np.asarray(leaf, np.float64)))
    assert all(float(s[0]) > 0 for s in jax.tree.leaves(state.scale))


@pytest.mark.parametrize("fmt", ["fp4", "fp8"])
@pytest.mark.parametrize("dtype_name", sorted(DTYPES))
def test_gradients_at_the_dtype_maximum_saturate(fmt, dtype_name):
  """g + gamma * e beyond float32, and outputs beyond fp16, saturate instead of overflowing."""
  dtype = DTYPES[dtype_name][0]
  largest = float(jnp.finfo(dtype).max)
  opt, update = _update(fmt, dtype_name)
  state = opt.init(_params(dtype))
  w = jnp.full((8, 32), largest, dtype).at[0].set(-largest).at[1].set(largest / 3)
  for _ in range(4):
    out, state = update({"w": w, "s": jnp.asarray(largest, dtype)}, state)
    assert np.all(np.isfinite(np.asarray(out["w"], np.float64)))
    assert np.all(np.isfinite(np.asarray(state.error["w"])))
    # Within the format's resolution of the largest value (fp4 also tops out at 2**126 * 3).
    top = min(largest, fp.max_value(fp.FP4) * 2.0 ** 126) if fmt == "fp4" else largest
    assert float(out["s"]) == pytest.approx(top, rel=0.15)
    assert np.sign(np.asarray(out["w"][0], np.float64)).tolist() == [-1.0] * 32


@pytest.mark.slow
def test_fp8_scale_of_huge_data_does_not_underflow():
  """The tester's case: fp8 on N(0, 1) * 7e37 got scale 1/alpha ~ 1e-38, flushed to 0: NaN."""
  opt = co3("fp8")
  x = (np.random.default_rng(0).standard_normal(4096) * 7e37).astype(np.float32)
  out, state = jax.jit(opt.update)({"w": jnp.asarray(x)}, opt.init({"w": jnp.zeros(4096)}))
  scale = float(state.scale["w"][0])
  assert fp.scale_range(fp.FP8)[0] <= scale <= fp.scale_range(fp.FP8)[1]
  got = np.asarray(out["w"], np.float64)
  assert np.all(np.isfinite(got))
  assert np.linalg.norm(got - x) / np.linalg.norm(x.astype(np.float64)) < 0.1


@pytest.mark.slow
def test_mesh_average_of_near_maximum_gradients_stays_finite():
  params = {"w": jnp.zeros(256)}
  opt = co3("fp8", axis_name="data")
  mesh = parallel.data_mesh(N)
  state, specs = parallel.init_opt_state(opt, params, mesh)
  step = jax.jit(jax.shard_map(lambda g, s: opt.update(jax.tree.map(lambda x: x[0], g), s),
                               mesh=mesh, in_specs=({"w": P("data")}, specs),
                               out_specs=({"w": P()}, specs)))
  largest = float(np.finfo(np.float32).max)
  grads = {"w": jnp.full((N, 256), largest * 0.9, jnp.float32)}
  out, state = step(grads, state)
  got = np.asarray(out["w"], np.float64)
  assert np.all(np.isfinite(got))  # a plain sum of 8 such values would be inf
  np.testing.assert_allclose(got, largest * 0.9, rtol=0.1)


# ----------------------------------------------------------------------------- tree checks


def test_a_gradient_tree_that_does_not_match_the_state_names_the_leaf():
  opt = co3()
  state = opt.init({"layer": {"w": jnp.zeros((4, 12)), "b": jnp.zeros(3)}})
  wrong_shape = {"layer": {"w": jnp.zeros((1, 36)), "b": jnp.zeros(3)}}
  with pytest.raises(ValueError, match=r"\['layer'\]\['w'\] has shape \(1, 36\).*\(48,\)"):
    opt.update(wrong_shape, state)
  with pytest.raises(ValueError,
                     match=r"does not match state.error: it lacks leaf \['layer'\]\['b'\]"):
    opt.update({"layer": {"w": jnp.zeros((4, 12))}}, state)
