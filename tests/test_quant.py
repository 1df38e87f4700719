"""Eq. (1) quantizer, absmax block scales and bit packing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loco_jax.core import quant


@pytest.mark.slow
@pytest.mark.parametrize("bits", range(1, 9))
def test_compress_matches_numpy(bits):
  rng = np.random.default_rng(bits)
  x = rng.normal(size=1000).astype(np.float32) * 3
  x[:4] = [0.5, 1.5, -0.5, -2.5]  # ties round to even
  s = np.float32(2.0)
  want = np.clip(np.round(s * x), -(2 ** (bits - 1)), 2 ** (bits - 1) - 1).astype(np.int8)
  np.testing.assert_array_equal(np.asarray(quant.compress(jnp.asarray(x), s, bits)), want)
  np.testing.assert_array_equal(np.asarray(quant.decompress(jnp.asarray(want), s)), want / s)


@pytest.mark.parametrize("bits", range(1, 9))
def test_pack_roundtrip(bits):
  qmin, qmax = quant.int_range(bits)
  q = np.random.default_rng(0).integers(qmin, qmax + 1, size=(3, 5, 64)).astype(np.int8)
  packed = jax.jit(quant.pack, static_argnums=1)(jnp.asarray(q), bits)
  assert packed.dtype == jnp.uint8 and packed.shape == (3, 5, 64 * bits // 8)
  np.testing.assert_array_equal(np.asarray(quant.unpack(packed, bits)), q)


def test_four_bits_put_two_values_in_a_byte():
  q = jnp.array([[1, 2, 3, 4, -8, -7, 7, 0]], jnp.int8)
  packed = np.asarray(quant.pack(q, 4))
  assert packed.shape == (1, 4)
  # Element j shares a byte with element j + 4, offset by 8 into 0..15.
  np.testing.assert_array_equal(packed[0], [(1 + 8) | (0 << 4), (2 + 8) | (1 << 4),
                                            (3 + 8) | (15 << 4), (4 + 8) | (8 << 4)])


def test_pack_rejects_ragged_length():
  with pytest.raises(ValueError, match="multiple of 8"):
    quant.pack(jnp.zeros((5,), jnp.int8), 4)


@pytest.mark.parametrize("bits", [0, 9, 2.5, True])
def test_check_bits(bits):
  with pytest.raises(ValueError, match="1..8"):
    quant.check_bits(bits)


@pytest.mark.slow
@pytest.mark.numerics
def test_absmax_scale_zero_vanishing_and_nonfinite_blocks_give_zero():
  blocks = jnp.array([[0.0, 0.0], [1e-40, -1e-39], [3.0, -1.5], [jnp.inf, 1.0], [jnp.nan, 1.0]])
  s = quant.absmax_scale(blocks, 4)
  np.testing.assert_allclose(np.asarray(s), [0, 0, 7 / 3, 0, 0], rtol=1e-6)
  d = quant.decompress(quant.compress(blocks[:3], s[:3, None], 4), s[:3, None])
  assert np.all(np.isfinite(np.asarray(d)))
  np.testing.assert_array_equal(np.asarray(d[:2]), 0)


@pytest.mark.numerics
def test_one_bit_scale_is_finite():
  s = quant.absmax_scale(jnp.array([[2.0, -1.0]]), 1)
  assert float(s[0]) == 0.5


# --- Scales below the smallest normal float32 (blocks above qmax * 2**126) --------------------

F32_MAX = float(np.finfo(np.float32).max)
NEAR_MAX = [1e38, 2e38, 3e38, F32_MAX]


@pytest.mark.numerics
@pytest.mark.parametrize("bits", [1, 2, 3])
def test_block_scales_of_blocks_near_the_maximum_are_the_float32_nearest_qmax_over_top(bits):
  """qmax / max|x| is subnormal there (below 2**-126 = quant.TINY): it is kept, to float32's
  subnormal resolution (numpy's float32 does not flush), not floored at TINY (which delivered
  a 2-bit 1e38 as 8.5e37)."""
  qmax = max(2 ** (bits - 1) - 1, 1)
  x = np.array(NEAR_MAX, np.float32)[:, None] * np.array([1.0, -0.5, 0.25, -1.0], np.float32)
  want = (qmax / np.abs(x).max(1).astype(np.float64)).astype(np.float32)
  for method, scale in (("absmax", quant.absmax_scale),
                        ("rms", lambda x, bits: quant.rms_scale(x, bits, 4.0))):
    got = np.asarray(jax.jit(scale, static_argnums=1)(jnp.asarray(x), bits))
    units = lambda s: s.view(np.int32).astype(np.int64)   # a subnormal's bits count 2**-149s
    assert np.all(np.abs(units(got) - units(want)) <= 1), (method, got, want)
    assert np.all((got > 0) & (got < quant.TINY) | (want >= quant.TINY)), method


@pytest.mark.numerics
@pytest.mark.parametrize("bits", [1, 2, 3])
def test_compress_and_decompress_with_subnormal_scales(bits):
  x = np.array([[v, -v, v / 3, 0.0] for v in NEAR_MAX], np.float32)
  s = jax.jit(quant.absmax_scale, static_argnums=1)(jnp.asarray(x), bits)
  q = np.asarray(jax.jit(quant.compress, static_argnums=2)(jnp.asarray(x), s[:, None], bits))
  s64 = np.asarray(s).astype(np.float64)[:, None]
  qmin, qmax = quant.int_range(bits)
  np.testing.assert_array_equal(q, np.clip(np.round(x * s64), qmin, qmax))
  d = np.asarray(jax.jit(quant.decompress)(jnp.asarray(q), s[:, None]))
  want = np.clip(q / s64, -F32_MAX, F32_MAX)
  np.testing.assert_allclose(d, want, rtol=2.0 ** -22)
  if bits > 1:  # the top code is the block's max (1 bit's grid {-1, 0} has no positive code)
    np.testing.assert_allclose(d[:, 0], NEAR_MAX, rtol=2.0 ** -20)


@pytest.mark.numerics
def test_decompress_takes_any_scale_from_the_wire():
  """A peer's scale is untrusted: subnormal ones decompress (saturated), non-positive and
  non-finite ones give 0, never NaN or inf."""
  tiny = np.float32(2.0 ** -149)   # the smallest subnormal: q / s is far beyond the maximum
  scales = np.array([tiny, 7e-39, 3e-39, 0.0, -3e-39, -1.0, np.inf, np.nan], np.float32)
  q = jnp.asarray(np.array([[1], [-2], [-2], [1], [1], [1], [1], [1]], np.int8))
  d = np.asarray(jax.jit(quant.decompress)(q, jnp.asarray(scales)[:, None]))[:, 0]
  np.testing.assert_allclose(d[:3], [F32_MAX, -2 / scales[1].astype(np.float64), -F32_MAX],
                             rtol=2.0 ** -22)
  np.testing.assert_array_equal(d[3:], 0.0)
