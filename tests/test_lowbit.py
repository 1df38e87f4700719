"""Low-bit LoCo (issue 15): the clipped-rms block scale, loco's defaults by bit width, the fused
kernel against the float64 reference, a mesh round trip at 2 and 3 bits, and the demo's names."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

from loco_jax import comm, kernels, loco
from loco_jax.apps import demo
from loco_jax.core import buckets, quant
from loco_jax.kernels import reference
from loco_jax.train import parallel
from loco_jax.transforms import baselines
from loco_jax.transforms import settings as loco_settings

N = 8


def _numpy_rms_scale(x_BxL: np.ndarray, bits: int, clip_rms: float) -> np.ndarray:
  """Written from the definition, apart from the library: qmax / min(c * rms, max|x|)."""
  qmax = max(2 ** (bits - 1) - 1, 1)
  out = np.zeros(x_BxL.shape[0])
  for i, block in enumerate(np.asarray(x_BxL, np.float64)):
    top = min(clip_rms * np.sqrt(np.mean(block ** 2)), np.abs(block).max())
    out[i] = qmax / top if top > 0 else 0.0
  return out


def _numpy_dequantized(x_BxL: np.ndarray, bits: int, clip_rms: float) -> np.ndarray:
  s = _numpy_rms_scale(x_BxL, bits, clip_rms)[:, None]
  q = np.clip(np.round(x_BxL * s), -(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
  return np.where(s > 0, q / np.where(s > 0, s, 1.0), 0.0)


# --- Options and defaults ---------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    (dict(scale_method="max"), "scale_method must be one of"),
    (dict(bits=4, clip_rms=2.0), "needs scale_method='rms'"),
    (dict(bits=4, scale_method="rms"), "no default clip_rms"),
    (dict(bits=2, scale_method="absmax", clip_rms=1.5), "applies to scale_method='rms' only"),
    (dict(bits=2, scale_method="rms", clip_rms=0.0), "finite float > 0"),
    (dict(bits=2, clip_rms=float("nan")), "finite float > 0"),
    (dict(bits=2, clip_rms="1.5"), "finite float > 0"),
    (dict(bits=2, scale=2.0 ** 17, scale_method="rms"), "fixed scale"),
    (dict(bits=3, scale=2.0 ** 17, clip_rms=3.0), "fixed scale"),
])
def test_loco_rejects_bad_scale_options(kwargs, message):
  with pytest.raises(ValueError, match=message):
    loco(**kwargs)


@pytest.mark.parametrize("make", [
    lambda: baselines.error_feedback(2, scale_method="rms"),
    lambda: baselines.error_feedback(2, scale_method="RMS", clip_rms=1.5),
    lambda: baselines.int_quantized(3, clip_rms=3.0),
    lambda: kernels.compress_step(jnp.zeros(256), jnp.zeros(256, jnp.int8), jnp.zeros(1),
                                  block_size=256, fixed_scale=4.0, scale_method="rms",
                                  clip_rms=1.5),
])
def test_baselines_and_kernel_reject_bad_scale_options(make):
  with pytest.raises(ValueError, match="scale_method|clip_rms"):
    make()


@pytest.mark.numerics
def test_defaults_by_bit_width_table():
  assert loco_settings.defaults_for(2) == dict(scale_method="rms", clip_rms=1.5, block_size=128,
                                             beta=0.8, error_bits=8)
  assert loco_settings.defaults_for(3) == dict(scale_method="rms", clip_rms=3.0, block_size=256,
                                             beta=0.8, error_bits=8)
  for bits in (1, 4, 5, 8):  # the paper's recipe
    assert loco_settings.defaults_for(bits) == loco_settings.PAPER_DEFAULTS
  # The docstring's table states the same numbers.
  doc = " ".join(loco_settings.__doc__.split())
  assert "2 rms 1.5 128 0.8 8" in doc and "3 rms 3.0 256 0.8 8" in doc


def _tree():
  rng = np.random.default_rng(0)
  params = {"w": jnp.zeros((64, 48)), "b": jnp.zeros((300,))}
  grads = {k: jnp.asarray(rng.standard_normal(x.shape) * np.exp(rng.standard_normal(x.shape)),
                          jnp.float32) for k, x in params.items()}
  return params, grads


def _two_steps(opt, grads):
  state = opt.init(grads)
  out = []
  for _ in range(2):
    o, state = jax.jit(opt.update)(grads, state)
    out.append(o)
  return out, state


@pytest.mark.slow
@pytest.mark.parametrize("bits, explicit", [
    (2, dict(scale_method="rms", clip_rms=1.5, block_size=128, beta=0.8, error_bits=8)),
    (3, dict(scale_method="rms", clip_rms=3.0, block_size=256, beta=0.8, error_bits=8)),
    (4, dict(scale_method="absmax", block_size=2048, beta=0.8, error_bits=8)),
])
def test_none_arguments_are_the_width_defaults(bits, explicit):
  _, grads = _tree()
  got, got_state = _two_steps(loco(bits=bits), grads)
  want, want_state = _two_steps(loco(bits=bits, **explicit), grads)
  # One jaxpr traced twice: the same program, so the same numbers.
  for a, b in zip(jax.tree.leaves((got, got_state)), jax.tree.leaves((want, want_state))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
@pytest.mark.numerics
def test_two_bit_default_is_not_the_papers_recipe():
  rng = np.random.default_rng(7)
  grads = {"w": jnp.asarray(rng.standard_normal((64, 48)), jnp.float32)}
  new, _ = _two_steps(loco(bits=2), grads)
  paper, _ = _two_steps(loco(bits=2, scale_method="absmax", block_size=2048), grads)
  g = np.asarray(grads["w"])
  err = lambda out: np.sqrt(np.mean((np.asarray(out[0]["w"]) - g) ** 2))
  # The clipped-rms scale keeps most values off zero: its one-step error is far smaller.
  assert err(new) < 0.8 * err(paper)


# --- The scale against an independent numpy reference -----------------------------------------

@pytest.mark.slow
@pytest.mark.numerics
@settings(max_examples=30, deadline=None)
@given(bits=st.sampled_from([1, 2, 3, 4, 8]), clip_rms=st.floats(0.5, 6.0),
       seed=st.integers(0, 2 ** 16), tail=st.floats(0.0, 3.0),
       magnitude=st.floats(-30.0, 30.0))
def test_rms_scale_matches_numpy(bits, clip_rms, seed, tail, magnitude):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((6, 64)) * np.exp(tail * rng.standard_normal((6, 64)))
  x = (x * 2.0 ** magnitude).astype(np.float32)
  x[2] = 0.0                 # a zero block: scale 0
  x[3] = np.where(np.arange(64) % 3, 7.0, -7.0)   # rms = max|x|: clip_rms >= 1 is capped
  got = np.asarray(quant.rms_scale(jnp.asarray(x), bits, clip_rms), np.float64)
  want = _numpy_rms_scale(x, bits, clip_rms)
  np.testing.assert_allclose(got, want, rtol=64 * 2.0 ** -23)
  assert got[2] == 0.0
  np.testing.assert_allclose(got[3], max(2 ** (bits - 1) - 1, 1) / (min(clip_rms, 1.0) * 7.0),
                             rtol=2.0 ** -21)
  # The library's float64 reference is the same function.
  np.testing.assert_allclose(reference.rms_scale(x.astype(np.float64), bits, clip_rms)[:, 0],
                             want, rtol=1e-12)


@pytest.mark.slow
@pytest.mark.numerics
def test_rms_scale_does_not_overflow_near_the_float32_maximum():
  x = jnp.stack([jnp.full((16,), 1e37, jnp.float32).at[0].set(-1e37),
                 jnp.full((16,), 3e38, jnp.float32).at[0].set(-3e38)])
  s = np.asarray(quant.rms_scale(x, 2, 1.5))   # rms = max|x| there: the max bounds the range
  assert float(s[0]) == pytest.approx(1e-37, rel=1e-6)
  # 1 / 3e38 is below the smallest normal float32: the scale is the subnormal nearest it.
  assert float(s[1]) == pytest.approx(1 / 3e38, rel=2.0 ** -21) and float(s[1]) < quant.TINY


@pytest.mark.slow
@pytest.mark.numerics
def test_error_feedback_with_rms_scale_quantizes_as_numpy():
  rng = np.random.default_rng(3)
  g = jnp.asarray(rng.standard_normal(4 * 128), jnp.float32)
  opt = baselines.error_feedback(2, 128, scale_method="rms", clip_rms=1.5)
  out, state = opt.update({"g": g}, opt.init({"g": g}))
  want = _numpy_dequantized(np.asarray(g, np.float64).reshape(4, 128), 2, 1.5).reshape(-1)
  np.testing.assert_allclose(np.asarray(out["g"]), want, rtol=2.0 ** -20, atol=1e-7)
  # The clipped part goes into the error: e' = h - d exactly.
  np.testing.assert_allclose(np.asarray(state.error["g"]), np.asarray(g) - want, atol=1e-6)
  assert np.abs(want).max() < np.abs(np.asarray(g)).max()  # the top values were clipped


# --- The fused kernel against the float64 reference -------------------------------------------

@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.parametrize("implementation, bits, clip_rms, block_size, extra", [
    ("jnp", 2, 1.5, 128, {}),
    ("jnp", 3, 3.0, 256, {}),
    ("pallas", 2, 1.5, 128, dict(interpret=True, tile_blocks=2)),
    ("pallas", 4, 4.0, 256, dict(interpret=True, tile_blocks=2)),
])
def test_compress_step_with_rms_scale_passes_the_reference(implementation, bits, clip_rms,
                                                           block_size, extra):
  report = kernels.implementation_report(implementation, "cpu", bits, 8, 0.8, block_size,
                                         scale_method="rms", clip_rms=clip_rms, **extra)
  assert report == "pass", report


@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.parametrize("implementation", ["jnp", "pallas"])
def test_rms_scale_in_the_kernel_near_the_float32_maximum(implementation):
  rng = np.random.default_rng(5)
  g = rng.standard_normal((4, 128)).astype(np.float32)
  g *= np.array([[3e38], [1e37], [1.0], [1e-30]], np.float32) / np.abs(g).max(1, keepdims=True)
  extra = dict(interpret=True) if implementation == "pallas" else {}
  out = kernels.compress_step(jnp.asarray(g.reshape(-1)), jnp.zeros(g.size, jnp.int8),
                              jnp.zeros(4), bits=2, block_size=128, decompressed=True,
                              scale_method="rms", clip_rms=1.5, implementation=implementation,
                              **extra)
  assert np.isfinite(np.asarray(out.scales)).all() and np.isfinite(out.decompressed).all()
  found = reference.check_step(
      g, np.zeros_like(g), np.zeros(4), np.asarray(quant.unpack(out.packed, 2)), out.scales,
      np.asarray(out.error).reshape(4, -1), out.error_scale,
      np.asarray(out.decompressed).reshape(4, -1), bits=2, error_bits=8, beta=0.8,
      scale_method="rms", clip_rms=1.5)
  assert found.passed, found


@pytest.mark.slow
@pytest.mark.numerics
def test_reference_rejects_absmax_scales_where_rms_was_asked():
  rng = np.random.default_rng(1)
  g = rng.standard_normal((4, 128)).astype(np.float32)
  out = kernels.compress_step(jnp.asarray(g.reshape(-1)), jnp.zeros(g.size, jnp.int8),
                              jnp.zeros(4), bits=2, block_size=128, decompressed=True,
                              implementation="jnp")
  codes = np.asarray(quant.unpack(out.packed, 2))
  check = lambda **k: reference.check_step(
      g, np.zeros_like(g), np.zeros(4), codes, out.scales, np.asarray(out.error).reshape(4, -1),
      out.error_scale, np.asarray(out.decompressed).reshape(4, -1), bits=2, error_bits=8,
      beta=0.8, **k)
  assert check().passed
  wrong = check(scale_method="rms", clip_rms=1.5)
  assert not wrong.passed and wrong.scales_off == 4


# --- On a mesh of 8 devices: the new defaults' round trip and their wire bits -------------------

PARAMS = {"w": jnp.zeros((32, 128)), "v": jnp.zeros((N * 256,))}


@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.parametrize("bits", [2, 3])
def test_mesh_round_trip_with_the_new_defaults(mesh, bits):
  d = loco_settings.defaults_for(bits)
  opt = loco(bits=bits, axis_name="data")
  state, specs = parallel.init_opt_state(opt, PARAMS, mesh)
  grad_specs = jax.tree.map(lambda _: P("data"), PARAMS)
  update = lambda g, s: opt.update(jax.tree.map(lambda x: x[0], g), s)
  step = jax.jit(jax.shard_map(update, mesh=mesh, in_specs=(grad_specs, specs),
                               out_specs=(jax.tree.map(lambda _: P(), PARAMS), specs)))
  rng = np.random.default_rng(bits)
  grads = {k: jnp.asarray(rng.standard_normal((N, *x.shape)) *
                          np.exp(rng.standard_normal((N, 1) + (1,) * (x.ndim - 1))), jnp.float32)
           for k, x in PARAMS.items()}
  out, new_state = step(grads, state)
  for k, x in PARAMS.items():
    # Every leaf is 8 rows of whole blocks: a device's blocks are consecutive runs of block_size.
    blocks = lambda i: np.asarray(grads[k][i], np.float64).reshape(-1, d["block_size"])
    per_device = [_numpy_dequantized(blocks(i), bits, d["clip_rms"]).reshape(x.shape)
                  for i in range(N)]
    want = np.mean(per_device, axis=0)
    got = np.asarray(out[k], np.float64)
    # bf16 gather: 2**-8 relative; a code may round the other way on a boundary (float32 h).
    close = np.abs(got - want) <= 2 ** -8 * np.abs(want) + 1e-30
    assert np.mean(close) > 0.999, (k, np.mean(close))
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(new_state))
  # The gradient's all-to-all: the codes, one float32 scale per block, one float32 flag a row.
  size = sum(x.size for x in PARAMS.values())
  found = comm.lowered_collectives(step, grads, state, num_devices=N)
  all_to_all = [c for c in found if c.op == "all-to-all"]
  assert sum(c.nbytes for c in all_to_all) == size * bits // 8 + size // d["block_size"] * 4 + N * 4


# --- The demo names the widths ------------------------------------------------------------------

def test_demo_accepts_the_width_names():
  methods, unavailable = demo._choose_methods("none,loco2,loco3,ef2,ef3")
  assert methods == ["none", "loco2", "loco3", "ef2", "ef3"] and not unavailable
  default, _ = demo._choose_methods(None)
  assert "loco2" not in default and "loco4" in default  # the default demo is unchanged
  for m in ("loco2", "loco3"):
    d = loco_settings.defaults_for(int(m[-1]))
    assert f"blocks of {d['block_size']}" in demo.DESCRIPTIONS[m]
    assert f"{d['clip_rms']:g} x rms" in demo.DESCRIPTIONS[m]
  with pytest.raises(demo.DemoError, match="unknown method 'loco5'"):
    demo._choose_methods("loco2,loco5")


@pytest.mark.slow
@pytest.mark.parametrize("method, bits", [("loco2", 2), ("loco3", 3), ("ef2", 2), ("ef3", 3)])
def test_demo_width_methods_compress_to_their_width(method, bits):
  grads = {"w": jnp.asarray(np.random.default_rng(2).standard_normal((16, 128)), jnp.float32)}
  opt = demo.make_compressor(method, axis_name=None)
  out, _ = opt.update(grads, opt.init(grads))
  # A 2- or 3-bit grid: each block of the output holds at most 2**bits distinct values.
  block = loco_settings.defaults_for(bits)["block_size"] if method.startswith("loco") else 2048
  for w in np.asarray(out["w"]).reshape(-1, block):
    assert 1 < len(np.unique(w)) <= 2 ** bits and np.isfinite(w).all()


# --- Gradients near the float32 maximum: delivered whole at every width ------------------------

F32_MAX = float(np.finfo(np.float32).max)
EXTREMES = np.array([1e38, 2e38, 3e38, F32_MAX])
EXTREME_BLOCK = 64
WIDTHS = [(bits, method, clip) for bits in (2, 3, 4, 8)
          for method, clip in (("absmax", None), ("rms", 4.0))]


def _extreme_grads() -> dict:
  """Blocks of +-magnitude alternating, one magnitude of EXTREMES a block: every block's max|g|
  and rms are its magnitude, a code of its grid (+-1 step) at every width and scale method."""
  i = np.arange(N * 4 * EXTREME_BLOCK)
  g = np.where(i % 2, -1.0, 1.0) * EXTREMES[i // EXTREME_BLOCK % EXTREMES.size]
  return {"w": jnp.asarray(g, jnp.float32)}


def _extreme_loco(bits, scale_method, clip_rms, **kwargs):
  return loco(bits=bits, scale_method=scale_method, clip_rms=clip_rms,
              block_size=EXTREME_BLOCK, **kwargs)


@pytest.mark.numerics
@pytest.mark.parametrize("bits, scale_method, clip_rms", WIDTHS)
def test_gradients_near_the_maximum_come_out_whole_in_local_mode(bits, scale_method, clip_rms):
  """The scale qmax / max|h| is subnormal above qmax * 2**126: floored at 2**-126 it capped a
  2-bit output at 8.5e37 (1e38 came out as 0.85x, for ever) and a 3-bit one at 2.55e38."""
  grads = _extreme_grads()
  opt = _extreme_loco(bits, scale_method, clip_rms)
  update, state = jax.jit(opt.update), opt.init(grads)
  for _ in range(3):
    out, state = update(grads, state)
    np.testing.assert_allclose(np.asarray(out["w"]), np.asarray(grads["w"]), rtol=2.0 ** -20)


@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.parametrize("bits, scale_method, clip_rms", WIDTHS)
def test_gradients_near_the_maximum_come_out_whole_through_the_mesh_mean(mesh, bits,
                                                                          scale_method, clip_rms):
  grads = _extreme_grads()
  opt = _extreme_loco(bits, scale_method, clip_rms, axis_name="data")
  state, specs = parallel.init_opt_state(opt, grads, mesh)
  update = lambda g, s: opt.update(jax.tree.map(lambda x: x[0], g), s)
  step = jax.jit(jax.shard_map(update, mesh=mesh, in_specs=({"w": P("data")}, specs),
                               out_specs=({"w": P()}, specs)))
  stacked = {"w": jnp.stack([grads["w"]] * N)}
  for _ in range(2):
    out, state = step(stacked, state)
    # The mean of 8 equal gradients, gathered in bfloat16.
    np.testing.assert_allclose(np.asarray(out["w"]), np.asarray(grads["w"]), rtol=2.0 ** -7)
