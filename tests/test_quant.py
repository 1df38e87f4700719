"""Eq. (1) quantizer, absmax block scales and bit packing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loco_jax.core import quant


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


def test_absmax_scale_zero_vanishing_and_nonfinite_blocks_give_zero():
  blocks = jnp.array([[0.0, 0.0], [1e-40, -1e-39], [3.0, -1.5], [jnp.inf, 1.0], [jnp.nan, 1.0]])
  s = quant.absmax_scale(blocks, 4)
  np.testing.assert_allclose(np.asarray(s), [0, 0, 7 / 3, 0, 0], rtol=1e-6)
  d = quant.decompress(quant.compress(blocks[:3], s[:3, None], 4), s[:3, None])
  assert np.all(np.isfinite(np.asarray(d)))
  np.testing.assert_array_equal(np.asarray(d[:2]), 0)


def test_one_bit_scale_is_finite():
  s = quant.absmax_scale(jnp.array([[2.0, -1.0]]), 1)
  assert float(s[0]) == 0.5
