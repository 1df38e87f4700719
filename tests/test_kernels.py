"""kernels: every implementation of the compress step and the receive-side mean against the
float64 reference (loco_jax.kernels.reference), determinism, and how `auto` chooses."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loco_jax import kernels
from loco_jax.core import quant
from loco_jax.kernels import arithmetic, pallas, reference
from loco_jax.kernels import step as kernel_step

BLOCK = 2048
F32 = np.float32
IMPLEMENTATIONS = ["jnp", "pallas"] if pallas.pl is not None else ["jnp"]


def _gradients(seed: int, blocks: int, block: int = BLOCK, spread: float = 3.0) -> np.ndarray:
  """Normal values whose blocks differ in magnitude by about e**(2 * spread); one zero block."""
  rng = np.random.default_rng(seed)
  magnitude = np.exp(spread * rng.standard_normal((blocks, 1)))
  g = rng.standard_normal((blocks, block)) * magnitude
  g[blocks // 2] = 0.0
  return g.astype(F32).reshape(-1)


@functools.cache
def _jit_step(implementation: str, **options):
  extra = dict(interpret=True) if implementation == "pallas" else {}
  return jax.jit(lambda g, e, s, reset: kernels.compress_step(
      g, e, s, reset=reset, decompressed=True, implementation=implementation, **extra,
      **options))


def _check(out, g, error, error_scale, blocks, *, bits, error_bits, beta, reset, fixed_scale=None,
           fixed_error_scale=None) -> reference.StepCheck:
  codes = np.asarray(quant.unpack(out.packed, bits))
  return reference.check_step(
      g.reshape(blocks, -1), np.asarray(error).reshape(blocks, -1),
      None if error_scale is None else np.asarray(error_scale), codes, np.asarray(out.scales),
      np.asarray(out.error).reshape(blocks, -1), np.asarray(out.error_scale),
      np.asarray(out.decompressed).reshape(blocks, -1), bits=bits, error_bits=error_bits,
      beta=beta, reset=reset, fixed_scale=fixed_scale, fixed_error_scale=fixed_error_scale)


def _run_steps(implementation, blocks, block, bits, error_bits, beta, steps=3, **fixed):
  """Steps from each one's own error (a reset at step 2); asserts each against the reference."""
  options = dict(bits=bits, error_bits=error_bits, beta=beta, block_size=block, **fixed)
  step = _jit_step(implementation, **options)
  error = np.zeros(blocks * block, np.int8)
  error_scale = None if fixed.get("fixed_error_scale") else np.zeros(blocks, F32)
  for k in range(steps):
    g, reset = _gradients(k, blocks, block), k == 2
    out = step(g, error, error_scale, jnp.bool_(reset))
    found = _check(out, g, error, error_scale, blocks, bits=bits, error_bits=error_bits,
                   beta=beta, reset=reset, **fixed)
    assert found.passed, (implementation, k, found)
    assert bool(out.finite)
    error = np.asarray(out.error)
    error_scale = None if error_scale is None else np.asarray(out.error_scale)
  assert np.any(error != 0)


@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("blocks,block,bits,error_bits,beta", [
    (12, BLOCK, 4, 8, 0.8), (16, BLOCK, 2, 6, 0.5), (6, 256, 8, 8, 0.9), (8, 32, 4, 8, 0.0),
    (4, 8, 1, 8, 0.8)])
def test_step_matches_the_float64_reference(implementation, blocks, block, bits, error_bits,
                                            beta):
  _run_steps(implementation, blocks, block, bits, error_bits, beta)


@pytest.mark.slow
@pytest.mark.numerics
def test_jnp_step_of_bit_plane_widths_matches_the_reference():
  _run_steps("jnp", 8, 64, 3, 5, 0.7)


@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_fixed_scales_match_the_reference(implementation):
  _run_steps(implementation, 4, 256, 4, 8, 0.8, fixed_scale=4.0, fixed_error_scale=64.0)
  _run_steps(implementation, 4, 256, 4, 8, 0.8, fixed_scale=4.0)


@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.parametrize("blocks", [16, 18])  # 4 tiles; 5, the last overlapping the one before
def test_tiled_cpu_path_matches_the_reference(monkeypatch, blocks):
  monkeypatch.setattr(arithmetic, "CPU_TILE_BLOCKS", 4)
  _jit_step.cache_clear()
  try:
    _run_steps("jnp", blocks, BLOCK, 4, 8, 0.8)
  finally:
    _jit_step.cache_clear()


@pytest.mark.numerics
def test_tiled_cpu_path_without_decompressed_values_and_with_a_nan(monkeypatch):
  """The mesh path's call (no decompressed output): the outputs overwrite the error in place,
  tile by tile; blocks that two tiles share are judged once; a NaN in them is still seen."""
  monkeypatch.setattr(arithmetic, "CPU_TILE_BLOCKS", 4)
  blocks = 18
  step = jax.jit(lambda g, e, s: kernels.compress_step(g, e, s, implementation="jnp"))
  error, error_scale = np.zeros(blocks * BLOCK, np.int8), np.zeros(blocks, F32)
  for k in range(2):
    g = _gradients(k, blocks)
    out = step(g, error, error_scale)
    with_d = _jit_step("jnp")(g, error, error_scale, jnp.bool_(False))
    found = _check(out._replace(decompressed=with_d.decompressed), g, error, error_scale,
                   blocks, bits=4, error_bits=8, beta=0.8, reset=False)
    assert found.passed, (k, found)
    error, error_scale = np.asarray(out.error), np.asarray(out.error_scale)
  assert np.any(error != 0)
  g = _gradients(2, blocks)
  g[15 * BLOCK + 7] = np.nan  # block 15: in the last tile (14-17) and the one before (12-15)
  assert not bool(step(g, error, error_scale).finite)


@pytest.mark.slow
@pytest.mark.numerics
@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**16), spread=st.floats(0.0, 6.0), beta=st.floats(0.0, 1.0),
       bits=st.sampled_from([2, 4, 8]), log_block=st.integers(3, 9))
def test_jnp_step_matches_the_reference_on_any_data(seed, spread, beta, bits, log_block):
  block = 2 ** log_block
  blocks = 4
  rng = np.random.default_rng(seed)
  g = (rng.standard_normal((blocks, block)) * np.exp(spread * rng.standard_normal((blocks, 1)))
       ).astype(F32).reshape(-1)
  error = rng.integers(-128, 128, blocks * block).astype(np.int8)
  error_scale = np.exp(rng.standard_normal(blocks) * spread + 4).astype(F32)
  out = jax.jit(lambda *a: kernels.compress_step(
      *a, bits=bits, beta=beta, block_size=block, decompressed=True, implementation="jnp"))(
          g, error, error_scale)
  found = _check(out, g, error, error_scale, blocks, bits=bits, error_bits=8, beta=beta,
                 reset=False)
  assert found.passed, found


@pytest.mark.slow
@pytest.mark.numerics
def test_the_reference_check_catches_wrong_outputs():
  blocks = 4
  g = _gradients(0, blocks)
  error, error_scale = np.zeros(g.size, np.int8), np.zeros(blocks, F32)
  out = _jit_step("jnp")(g, error, error_scale, jnp.bool_(False))
  check = functools.partial(_check, g=g, error=error, error_scale=error_scale, blocks=blocks,
                            bits=4, error_bits=8, beta=0.8, reset=False)
  assert check(out).passed
  codes = np.asarray(quant.unpack(out.packed, 4))
  # One code off by one away from a rounding boundary (an exact 0 has none nearby).
  at = int(np.argmax((codes.reshape(-1) == 0) & (np.asarray(g) != 0)))
  bumped = codes.reshape(-1).copy()
  bumped[at] += 1
  assert check(out._replace(packed=quant.pack(jnp.asarray(bumped.reshape(codes.shape)), 4))
               ).codes_off == 1
  assert check(out._replace(scales=out.scales * F32(1 + 1e-5))).scales_off == blocks - 1
  errors = np.asarray(out.error).copy()
  errors[:: 997] = np.clip(errors[:: 997].astype(int) + 2, -128, 127)
  assert check(out._replace(error=jnp.asarray(errors))).error_codes_off > 0
  assert check(out._replace(decompressed=out.decompressed * F32(1.001))).values_off > 0


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_each_implementation_is_deterministic_run_to_run(implementation):
  step = _jit_step(implementation, bits=4, error_bits=8, beta=0.8, block_size=BLOCK)
  g, error = _gradients(3, 8), np.asarray(np.arange(8 * BLOCK) % 255 - 127, np.int8)
  error_scale = np.full(8, 50.0, F32)
  first = step(g, error, error_scale, jnp.bool_(False))
  again = step(g, error, error_scale, jnp.bool_(False))
  for a, b in zip(first, again):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _peer_payloads(peers: int, blocks: int, bits: int = 4, block: int = BLOCK):
  """Random packed shards (every code equally likely) and scales spread over e**(+-9)."""
  rng = np.random.default_rng(peers)
  received = rng.integers(0, 256, (peers, blocks * block * bits // 8), dtype=np.uint8)
  scales = np.exp(3 * rng.standard_normal((peers, blocks))).astype(F32)
  scales[0, blocks // 2] = 0.0  # a vanishing block decompresses to 0
  codes = np.asarray(quant.unpack(jnp.asarray(received.reshape(peers, blocks, -1)), bits))
  return received, scales, codes


@pytest.mark.numerics
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("peers,block", [(8, BLOCK), (3, BLOCK), (4, 32)])
def test_dequantize_mean_matches_the_float64_mean(implementation, peers, block):
  options = dict(implementation=implementation,
                 interpret=True if implementation == "pallas" else None)
  received, scales, codes = _peer_payloads(peers, 6, block=block)
  got = jax.jit(lambda r, s: kernels.dequantize_mean(r, s, **options))(received, scales)
  assert got.shape == (6 * block,)
  assert reference.mean_off(np.asarray(got), codes, scales) == 0
  # ... and the check can fail: a mean that is off by a part in 1e5 somewhere.
  assert reference.mean_off(np.asarray(got) * F32(1 + 1e-5) + 1e-30, codes, scales) > 0


@pytest.mark.numerics
def test_dequantize_mean_of_bit_plane_widths_and_many_peers():
  received, scales, codes = _peer_payloads(kernels.UNROLLED_PEERS + 2, 1, bits=3)
  got = jax.jit(lambda r, s: kernels.dequantize_mean(r, s, bits=3))(received, scales)
  assert reference.mean_off(np.asarray(got), codes, scales) == 0


@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.parametrize("bits", [4, 3])
def test_unrolled_and_looped_means_are_the_same_sums(bits):
  # GPU and TPU unroll the peers, CPU loops over them (inside jax.shard_map too, where the
  # loop's carry must be typed as varying over the axis): the same adds in the same order.
  received, scales, _ = _peer_payloads(8, 6, bits=bits)
  packed = received.reshape(8, 6, -1)
  mean = lambda unroll: jax.jit(functools.partial(arithmetic.mean_jnp, bits=bits, unroll=unroll))
  unrolled = np.asarray(mean(True)(packed, scales))
  np.testing.assert_array_equal(np.asarray(mean(False)(packed, scales)), unrolled)
  mesh = jax.make_mesh((8,), ("data",), (jax.sharding.AxisType.Explicit,))
  on_mesh = jax.jit(jax.shard_map(lambda r, s: mean(False)(r[0], s[0])[None], mesh=mesh,
                                  in_specs=jax.P("data"), out_specs=jax.P("data")))
  spread = lambda x: jax.device_put(np.stack([x] * 8), jax.NamedSharding(mesh, jax.P("data")))
  for row in np.asarray(on_mesh(spread(packed), spread(scales))):
    np.testing.assert_array_equal(row, unrolled)


@pytest.mark.slow
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("blocks", [4, 18])  # 18: tiles of 4 on CPU, the last overlapping
def test_a_step_known_to_be_skipped_keeps_its_error_and_sends_nan(monkeypatch, implementation,
                                                                  blocks):
  monkeypatch.setattr(arithmetic, "CPU_TILE_BLOCKS", 4)
  extra = dict(interpret=True) if implementation == "pallas" else {}
  step = jax.jit(lambda g, e, s, skip: kernels.compress_step(
      g, e, s, reset=True, decompressed=True, implementation=implementation, skip=skip,
      **extra))
  rng = np.random.default_rng(0)
  g = _gradients(0, blocks)
  error = rng.integers(-127, 128, blocks * BLOCK).astype(np.int8)
  error_scale = np.exp(rng.standard_normal(blocks) + 3).astype(F32)
  skipped = step(g, error, error_scale, jnp.bool_(True))
  # Kept as given although a reset was due; the decompressed values NaN.
  np.testing.assert_array_equal(np.asarray(skipped.error), error)
  np.testing.assert_array_equal(np.asarray(skipped.error_scale), error_scale)
  assert np.all(np.isnan(np.asarray(skipped.decompressed)))
  taken = step(g, error, error_scale, jnp.bool_(False))
  plain = _jit_step(implementation)(g, error, error_scale, jnp.bool_(True))
  for got, want in zip(taken, plain):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert np.any(np.asarray(taken.error) != error)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_gradient_is_reported(implementation, bad):
  g = jnp.asarray(_gradients(0, 4)).at[5 * 997].set(bad)
  out = _jit_step(implementation, bits=4, error_bits=8, beta=0.8, block_size=BLOCK)(
      g, jnp.zeros(g.size, jnp.int8), jnp.zeros(4), jnp.bool_(False))
  assert not bool(out.finite)


@pytest.mark.slow
@pytest.mark.numerics
def test_auto_is_jnp_on_cpu_and_the_pallas_check_passes_in_interpret_mode():
  assert kernels.chosen_implementation() == "jnp"
  if pallas.pl is not None:
    assert kernels.implementation_report("pallas", "cpu", interpret=True) == "pass"
  assert kernels.implementation_report("jnp", "cpu") == "pass"
  assert kernels.pallas_report("gpu").startswith("error: asked about 'gpu'")


@pytest.mark.numerics
def test_auto_takes_pallas_where_it_runs_and_passes_the_check(monkeypatch):
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(pallas, "pl", pallas.pl or object())
  for report, want in (("pass", "pallas"), ("fail: step 0: ...", "jnp"),
                       ("error: pallas: ...", "jnp")):
    monkeypatch.setattr(kernel_step, "pallas_report", lambda *a, report=report, **k: report)
    assert kernels.chosen_implementation() == want, report
  monkeypatch.setattr(kernel_step, "pallas_report", lambda *a, **k: "pass")
  assert kernels.chosen_implementation(bits=3) == "jnp"  # bit planes: jnp only
  assert kernels.chosen_implementation(block_size=kernels.GPU_MIN_BLOCK // 2) == "jnp"


@pytest.mark.slow
@pytest.mark.numerics
def test_a_kernel_that_rounds_wrongly_fails_the_check(monkeypatch):
  # What keeps `auto` off a broken kernel: the same check, on an implementation that rounds
  # half away from zero... and off by one step at every .4.
  monkeypatch.setattr(arithmetic, "_quantize", lambda x, s, bits: jnp.clip(
      jnp.floor(s * x + 0.6), *quant.int_range(bits)))
  _jit_step.cache_clear()
  kernels.implementation_report.cache_clear()
  try:
    assert kernels.implementation_report("jnp", "cpu").startswith("fail: step 0")
  finally:
    _jit_step.cache_clear()
    kernels.implementation_report.cache_clear()


def test_bad_arguments_name_what_was_expected():
  g = jnp.zeros(3 * BLOCK)
  error, error_scale = jnp.zeros(3 * BLOCK, jnp.int8), jnp.zeros(3)
  with pytest.raises(ValueError, match="multiple of block_size"):
    kernels.compress_step(jnp.zeros(BLOCK + 8), jnp.zeros(BLOCK + 8, jnp.int8), error_scale)
  with pytest.raises(ValueError, match="error must be int8"):
    kernels.compress_step(g, error.astype(jnp.int32), error_scale)
  with pytest.raises(ValueError, match="skip must be a bool scalar"):
    kernels.compress_step(g, error, error_scale, skip=jnp.zeros(3, bool))
  with pytest.raises(ValueError, match="error_scale must be"):
    kernels.compress_step(g, error, jnp.zeros(4))
  with pytest.raises(ValueError, match="exactly one of them"):
    kernels.compress_step(g, error, error_scale, fixed_error_scale=4.0)
  with pytest.raises(ValueError, match="exactly one of them"):
    kernels.compress_step(g, error, None)
  with pytest.raises(ValueError, match="implementation must be one of"):
    kernels.compress_step(g, error, error_scale, implementation="cuda")
  with pytest.raises(ValueError, match="bits"):
    kernels.compress_step(g, error, error_scale, bits=9)
  with pytest.raises(ValueError, match="cannot run here"):
    kernels.compress_step(g, error, error_scale, bits=3, implementation="pallas")
  with pytest.raises(ValueError, match=r"\[N, bytes\]"):
    kernels.dequantize_mean(jnp.zeros(8, jnp.uint8), jnp.zeros((1, 1)))


def test_pallas_calls_trace_under_shard_map_with_varying_outputs():
  # Under shard_map (check_vma) a pallas_call needs inputs of one kind and outputs that say how
  # they vary; loco's mesh step on GPU runs the kernel there. (The CPU interpreter itself cannot
  # run under shard_map, so this checks the traced program.)
  if pallas.pl is None:
    pytest.skip("jax.experimental.pallas does not import on this jax")
  mesh = jax.make_mesh((8,), ("data",))
  from jax.sharding import PartitionSpec as P

  def step(g):  # the error and its scales are not varying here: they get cast
    out = kernels.compress_step(g[0], jnp.zeros(g.shape[1], jnp.int8),
                                jnp.zeros(g.shape[1] // 2048), implementation="pallas",
                                interpret=True)
    mean = kernels.dequantize_mean(out.packed.reshape(1, -1), out.scales[None],
                                   implementation="pallas", interpret=True)
    return out.packed[None], mean[None]

  grads = jax.ShapeDtypeStruct((8, 4096), jnp.float32,
                               sharding=jax.sharding.NamedSharding(mesh, P("data")))
  traced = jax.make_jaxpr(jax.shard_map(step, mesh=mesh, in_specs=P("data"),
                                        out_specs=(P("data"), P("data"))))(grads)
  inner = traced.jaxpr.eqns[0].params["jaxpr"]
  calls = [e for e in inner.eqns if e.primitive.name == "pallas_call"]
  assert len(calls) == 2
  for call in calls:
    for var in call.invars + call.outvars:
      assert var.aval.manual_axis_type.varying == {"data"}, (call, var)


# --- Blocks near the float32 maximum: subnormal scales (qmax / max|h| below 2**-126) ---------

NEAR_MAX = np.array([np.finfo(F32).max, 3e38, 2e38, 1e38, 1.0], F32)


def _near_max_gradients(seed: int, block: int) -> np.ndarray:
  """One block per magnitude in NEAR_MAX, uniform below it, its first value the magnitude."""
  g = np.random.default_rng(seed).uniform(-1, 1, (NEAR_MAX.size, block)) * NEAR_MAX[:, None]
  g[:, 0] = NEAR_MAX
  return g.astype(F32).reshape(-1)


@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.parametrize("implementation, bits, error_bits, beta", [
    ("jnp", 2, 8, 0.8), ("jnp", 3, 8, 0.8), ("jnp", 2, 2, 0.0), ("jnp", 1, 8, 0.8),
    *[(impl, 2, e, b) for impl in IMPLEMENTATIONS[1:] for e, b in ((8, 0.8), (2, 0.0))]])
def test_steps_near_the_float32_maximum_match_the_reference(implementation, bits, error_bits,
                                                            beta):
  """Blocks above qmax * 2**126 (8.5e37 at 2 bits, 2.6e38 at 3) have subnormal scales, payload
  and (at 2 error bits) error alike: three steps, each from the one before's error, agree with
  the float64 reference, and the first delivers each block's top value whole."""
  blocks, block = NEAR_MAX.size, 64
  step = _jit_step(implementation, bits=bits, error_bits=error_bits, beta=beta,
                   block_size=block)
  error, error_scale = np.zeros(blocks * block, np.int8), np.zeros(blocks, F32)
  for k in range(3):
    g = _near_max_gradients(k, block)
    out = step(g, error, error_scale, jnp.bool_(False))
    found = _check(out, g, error, error_scale, blocks, bits=bits, error_bits=error_bits,
                   beta=beta, reset=False)
    assert found.passed, (k, found)
    if k == 0 and bits > 1:  # 1 bit's grid {-1, 0} has no positive code
      top = np.asarray(out.decompressed).reshape(blocks, block)[:, 0]
      np.testing.assert_allclose(top, NEAR_MAX, rtol=2.0 ** -20)
    error, error_scale = np.asarray(out.error), np.asarray(out.error_scale)
  if error_bits == 2:
    assert np.any((error_scale > 0) & (error_scale < quant.TINY))  # the case was reached


@pytest.mark.numerics
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_dequantize_mean_of_subnormal_scales(implementation):
  """Peers' scales in [2**-128, 2**-126): their q / s reach the float32 maximum (and beyond it,
  where the mean saturates)."""
  received, _, codes = _peer_payloads(4, 6, bits=2, block=32)
  scales = np.random.default_rng(0).uniform(2.0 ** -128, 2.0 ** -126, (4, 6)).astype(F32)
  options = dict(implementation=implementation,
                 interpret=True if implementation == "pallas" else None)
  got = jax.jit(lambda r, s: kernels.dequantize_mean(r, s, bits=2, **options))(received, scales)
  assert reference.mean_off(np.asarray(got), codes, scales) == 0
  assert np.abs(np.asarray(got)).max() > 1e38
