"""Tests for loco_jax.codecs.fp: small-float levels, rounding, symbols, numpy/jit agreement."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loco_jax.codecs import fp

FORMATS = [fp.FP4, fp.FP8, fp.FloatFormat(3, 2), fp.FloatFormat(1, 3), fp.FloatFormat(4, 0)]


def _wide_range_values(rng: np.random.Generator, size: int, dtype=np.float64) -> np.ndarray:
  """Signed values spanning 1e-9 .. 1e7, i.e. below the subnormals to beyond saturation."""
  magnitudes = 10.0 ** rng.uniform(-9, 7, size)
  return (magnitudes * rng.choice([-1.0, 1.0], size)).astype(dtype)


@pytest.mark.numerics
def test_fp4_levels_are_exactly_the_papers():
  np.testing.assert_array_equal(fp.levels(fp.FP4), [0.0, 0.5, 1.0, 1.5, 2.0, 3.0])
  assert fp.FP4.bits == 4 and fp.FP4.bias == 1
  values = fp.decode(np.arange(16, dtype=np.uint8), fp.FP4)
  finite = set(values[np.isfinite(values)].tolist())
  assert finite == {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, -0.5, -1.0, -1.5, -2.0, -3.0}
  assert fp.max_value(fp.FP4) == 3.0


@pytest.mark.numerics
def test_fp8_max_and_smallest_subnormal():
  assert fp.FP8.bias == 15 and fp.FP8.bits == 8
  assert fp.max_value(fp.FP8) == 57344.0
  levels = fp.levels(fp.FP8)
  assert levels[1] == 2.0 ** -16  # smallest subnormal: 0.01b * 2**(1 - 15)
  assert levels[4] == 2.0 ** -14  # smallest normal
  assert levels.size == 31 * 4  # exponent fields 0..30 (31 is reserved), 4 mantissas each
  assert np.all(np.diff(levels) > 0)


@pytest.mark.numerics
def test_levels_are_a_copy():
  fp.levels(fp.FP4)[1] = 7.0
  assert fp.levels(fp.FP4)[1] == 0.5


@pytest.mark.numerics
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("scale", [1.0, 0.37, 3.0e3])
def test_quantize_is_the_nearest_level(fmt, scale):
  x = _wide_range_values(np.random.default_rng(0), 20_000)
  levels = fp.levels(fmt)
  nearest = np.argmin(np.abs(np.abs(x)[:, None] * scale - levels[None, :]), axis=1)
  expected = np.sign(x) * levels[nearest] * (1.0 / scale)  # fp dequantizes as level * (1/scale)
  np.testing.assert_array_equal(fp.quantize(x, fmt, scale), expected)


def test_ties_go_to_the_even_mantissa():
  x = np.array([0.25, 0.75, 1.25, 1.75, 2.5, -1.25, -2.5])
  np.testing.assert_array_equal(fp.quantize(x, fp.FP4), [0.0, 1.0, 1.0, 2.0, 2.0, -1.0, -2.0])
  # FP8 steps of 0.25 in [1, 2): 1.125 -> 1.0 (mantissa 0), 1.375 -> 1.5 (mantissa 2).
  np.testing.assert_array_equal(fp.quantize(np.array([1.125, 1.375]), fp.FP8), [1.0, 1.5])


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_every_symbol_roundtrips(fmt):
  symbols = np.arange(2 ** fmt.bits, dtype=np.uint8)
  values = fp.decode(symbols, fmt)
  finite = np.isfinite(values)
  assert finite.sum() == 2 * fp.levels(fmt).size - 1  # one zero, +- every other level
  np.testing.assert_array_equal(fp.encode(values[finite], fmt), symbols[finite])
  # The non-finite ones are negative zero and the reserved all-ones exponent.
  sign_bit = 1 << (fmt.bits - 1)
  exponent_field = (symbols >> fmt.mantissa_bits) & (2 ** fmt.exponent_bits - 1)
  reserved = exponent_field == 2 ** fmt.exponent_bits - 1
  np.testing.assert_array_equal(~finite, reserved | (symbols == sign_bit))
  # Symbols beyond the format's width are not values either.
  assert np.all(np.isnan(fp.decode(np.arange(2 ** fmt.bits, 256, dtype=np.uint8), fmt)))


@pytest.mark.numerics
def test_symbol_layout_is_sign_exponent_mantissa():
  # -1.5 in FP8: sign 1, exponent field 15, mantissa 0b10.
  assert int(fp.encode(np.array([-1.5]), fp.FP8)[0]) == (1 << 7) | (15 << 2) | 0b10
  assert int(fp.encode(np.array([-1.5]), fp.FP4)[0]) == (1 << 3) | (1 << 1) | 0b1


@pytest.mark.numerics
@pytest.mark.parametrize("fmt", [fp.FP4, fp.FP8], ids=str)
def test_decode_of_encode_is_quantize_bit_for_bit(fmt):
  x = _wide_range_values(np.random.default_rng(1), 50_000, np.float32)
  for scale in (1.0, 0.37, np.float32(1234.5)):
    roundtrip = fp.decode(fp.encode(x, fmt, scale), fmt, scale)
    quantized = fp.quantize(x, fmt, scale)
    assert roundtrip.dtype == quantized.dtype == np.float32
    np.testing.assert_array_equal(roundtrip.view(np.uint32), quantized.view(np.uint32))
    # The jitted encode (integer operations on the bits, as numpy's) gives the same symbols.
    jitted = jax.jit(lambda v, s=scale: fp.encode(v, fmt, s))(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(jitted), fp.encode(x, fmt, scale))


@pytest.mark.numerics
@pytest.mark.parametrize("fmt", [fp.FP4, fp.FP8], ids=str)
def test_saturation(fmt):
  top = fp.max_value(fmt)
  x = np.array([np.inf, -np.inf, 1e30, -1e30, top, 1.07 * top, -1.07 * top], np.float32)
  np.testing.assert_array_equal(fp.quantize(x, fmt), [top, -top, top, -top, top, top, -top])
  symbols = fp.encode(x, fmt)
  top_symbol = fp.levels(fmt).size - 1
  sign_bit = 1 << (fmt.bits - 1)
  np.testing.assert_array_equal(symbols, [top_symbol, top_symbol + sign_bit] * 2
                                + [top_symbol] * 2 + [top_symbol + sign_bit])
  # FP8 has no level between 57344 and 2**16: just under 2**16 still saturates.
  assert fp.quantize(np.float32(65535.0), fp.FP8) == 57344.0


@pytest.mark.numerics
def test_nan_stays_nan_and_never_becomes_a_number():
  x = np.array([1.0, np.nan, -2.0], np.float32)
  assert np.isnan(fp.quantize(x, fp.FP4)[1])
  assert np.isnan(jax.jit(lambda v: fp.quantize(v, fp.FP4))(x)[1])
  with pytest.raises(ValueError, match="NaN"):
    fp.encode(x, fp.FP4)
  for fmt in (fp.FP4, fp.FP8):
    symbols = jax.jit(lambda v, f=fmt: fp.encode(v, f))(jnp.asarray(x))
    assert int(symbols[1]) == 1 << (fmt.bits - 1)  # negative zero
    decoded = np.asarray(fp.decode(symbols, fmt))
    assert np.isnan(decoded[1]) and decoded[0] == 1.0 and decoded[2] == -2.0


def test_small_negatives_round_to_positive_zero():
  x = np.array([-0.1, -0.0], np.float32)
  assert np.all(np.signbit(fp.quantize(x, fp.FP4)) == False)  # noqa: E712
  np.testing.assert_array_equal(fp.encode(x, fp.FP4), [0, 0])


@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.parametrize("fmt", [fp.FP4, fp.FP8], ids=str)
def test_jit_matches_numpy_bit_for_bit(fmt):
  rng = np.random.default_rng(2)
  x = np.concatenate([
      _wide_range_values(rng, 30_000, np.float32),
      np.array([0.0, -0.0, 1e-45, -1e-40, np.inf, -np.inf], np.float32),
      fp.levels(fmt).astype(np.float32),  # exact levels
      (0.5 * (fp.levels(fmt)[1:] + fp.levels(fmt)[:-1])).astype(np.float32),  # exact ties
  ])
  quantize_jit = jax.jit(lambda v, s: fp.quantize(v, fmt, s))
  encode_jit = jax.jit(lambda v, s: fp.encode(v, fmt, s))
  decode_jit = jax.jit(lambda v, s: fp.decode(v, fmt, s))
  for scale in (1.0, 0.37, 1234.5):
    expected = fp.quantize(x, fmt, scale)
    got = np.asarray(quantize_jit(jnp.asarray(x), jnp.float32(scale)))
    np.testing.assert_array_equal(got.view(np.uint32), expected.view(np.uint32))
    symbols = fp.encode(x, fmt, scale)
    np.testing.assert_array_equal(np.asarray(encode_jit(jnp.asarray(x), jnp.float32(scale))),
                                  symbols)
    np.testing.assert_array_equal(
        np.asarray(decode_jit(jnp.asarray(symbols), jnp.float32(scale))).view(np.uint32),
        fp.decode(symbols, fmt, scale).view(np.uint32))
    # Eager jax with a Python scale takes the same path.
    np.testing.assert_array_equal(np.asarray(fp.quantize(jnp.asarray(x), fmt, scale)), expected)


@pytest.mark.numerics
def test_output_types():
  assert fp.quantize(np.array([0.3]), fp.FP4).dtype == np.float64
  assert fp.quantize(np.array([1, 2]), fp.FP4).dtype == np.float32
  assert fp.quantize(jnp.array([0.3], jnp.bfloat16), fp.FP4).dtype == jnp.bfloat16
  assert isinstance(fp.quantize(jnp.array([0.3]), fp.FP4), jax.Array)
  assert isinstance(fp.quantize(np.array([0.3]), fp.FP4), np.ndarray)
  assert fp.encode(np.array([0.3]), fp.FP8).dtype == np.uint8
  assert fp.decode(np.array([3], np.uint8), fp.FP8, 2.0).dtype == np.float32


@pytest.mark.numerics
def test_scale_broadcasts_per_row():
  x = _wide_range_values(np.random.default_rng(3), 40, np.float32).reshape(4, 10)
  scales = np.array([[0.5], [1.0], [7.0], [1e-3]], np.float32)
  rows = np.stack([fp.quantize(x[i], fp.FP4, scales[i, 0]) for i in range(4)])
  np.testing.assert_array_equal(fp.quantize(x, fp.FP4, scales), rows)


@pytest.mark.parametrize("bits", [(0, 3), (2, -1), (4, 4), (7, 1), (1, 0), (2.0, 1), (True, 1)])
def test_bad_format_raises(bits):
  with pytest.raises(ValueError, match="exponent_bits"):
    fp.FloatFormat(*bits)


@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan"), float("inf"), np.array([1.0, 0.0])])
def test_bad_scale_raises(scale):
  x = np.ones(2, np.float32)
  with pytest.raises(ValueError, match="scale must be positive and finite"):
    fp.quantize(x, fp.FP4, scale)
  with pytest.raises(ValueError, match="scale must be positive and finite"):
    fp.encode(x, fp.FP4, scale)
  with pytest.raises(ValueError, match="scale must be positive and finite"):
    fp.decode(np.zeros(2, np.uint8), fp.FP4, scale)


def test_decode_rejects_float_symbols():
  with pytest.raises(ValueError, match="integer"):
    fp.decode(np.array([1.0]), fp.FP4)


def test_format_is_hashable_and_static_under_jit():
  fn = jax.jit(fp.quantize, static_argnums=1)
  np.testing.assert_array_equal(np.asarray(fn(jnp.array([0.7]), fp.FP4, 1.0)), [0.5])
  assert fp.FloatFormat(2, 1) == fp.FP4 and hash(fp.FloatFormat(2, 1)) == hash(fp.FP4)


# ----------------------------------------------------------------------------- scale range


@pytest.mark.numerics
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_scales_outside_the_range_raise(fmt):
  low, high = fp.scale_range(fmt)
  x = np.ones(2, np.float32)
  for scale in (1e-45, low / 2, high * 2, np.array([1.0, high * 4])):
    with pytest.raises(ValueError, match=r"scale must be positive and finite, in \["):
      fp.quantize(x, fmt, scale)
    with pytest.raises(ValueError, match="scale must be"):
      fp.encode(x, fmt, scale)
    with pytest.raises(ValueError, match="scale must be"):
      fp.decode(np.zeros(2, np.uint8), fmt, scale)
  # float64 values have float64's wider range.
  assert fp.quantize(np.array([fp.max_value(fmt) * 1e200]), fmt, 1e-200)[0] == pytest.approx(
      fp.max_value(fmt) * 1e200, rel=1e-12)


@pytest.mark.numerics
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_range_ends_dequantize_every_level_to_a_finite_normal(fmt):
  symbols = fp.encode(np.concatenate([fp.levels(fmt), -fp.levels(fmt)[1:]]), fmt)
  tiny = np.finfo(np.float32).tiny
  for scale in fp.scale_range(fmt):
    values = fp.decode(symbols, fmt, scale)
    jitted = np.asarray(jax.jit(lambda s, c: fp.decode(s, fmt, c))(symbols, np.float32(scale)))
    for v in (values, jitted):
      assert np.all(np.isfinite(v))
      assert np.all((v == 0) == (fp.decode(symbols, fmt) == 0))  # no level flushed to 0
      assert np.all((v == 0) | (np.abs(v) >= tiny))
  low = fp.scale_range(fmt)[0]
  # The bound is tight: below it the largest level overflows, or the scale is not normal.
  below = np.nextafter(np.nextafter(np.float32(low), np.float32(0)), np.float32(0))
  with np.errstate(over="ignore"):
    largest = np.float32(fp.max_value(fmt)) * (np.float32(1) / below)
  assert not np.isfinite(largest) or below < tiny


# One compiled quantize per format (a fresh lambda would compile again for every example).
_QUANTIZE_JIT = jax.jit(fp.quantize, static_argnums=1)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(FORMATS), st.floats(0.0, 1.0), st.floats(-45.0, 38.5))
def test_quantize_is_finite_across_the_scale_range(fmt, position, log_x):
  low, high = fp.scale_range(fmt)
  scale = float(np.float32(np.exp(np.log(low) + position * (np.log(high) - np.log(low)))))
  scale = min(max(scale, low), high)
  x = np.float32(10.0 ** log_x) * np.array([1, -1, 0], np.float32)
  for out in (fp.quantize(x, fmt, scale),
              np.asarray(_QUANTIZE_JIT(x, fmt, np.float32(scale)))):
    assert np.all(np.isfinite(out))
    assert out[2] == 0 and out[0] == -out[1]
