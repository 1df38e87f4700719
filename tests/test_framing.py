"""comm.framing: arrays of any dtype through one byte buffer and back, bit for bit."""

import jax.numpy as jnp
import numpy as np
import pytest

from loco_jax.comm import framing


@pytest.mark.parametrize("unit", [jnp.uint8, jnp.uint16, jnp.int32])
def test_parts_of_any_dtype_come_back_bit_for_bit(unit):
  rng = np.random.default_rng(0)
  parts = [jnp.asarray(rng.integers(0, 256, (3, 2, 5)), jnp.uint8),
           jnp.asarray(rng.integers(-128, 128, (3, 6)), jnp.int8),
           jnp.asarray(rng.standard_normal((3, 6)), jnp.bfloat16),
           jnp.asarray([np.nan, -0.0, np.inf], jnp.float32),        # one value a row
           jnp.asarray(rng.integers(-2 ** 31, 2 ** 31, (3, 1)), jnp.int32)]
  buffer, layout = framing.frame(parts, unit)
  assert buffer.dtype == unit and buffer.shape[0] == 3
  assert buffer.size * buffer.dtype.itemsize == 3 * (10 + 6 + 12 + 4 + 4)
  # What a gather delivers: more rows than were sent, each framed alike.
  gathered = jnp.concatenate([buffer, buffer[::-1]])
  for got, sent in zip(framing.unframe(gathered, layout), parts):
    assert got.dtype == sent.dtype and got.shape == (6, *sent.shape[1:])
    as_bits = lambda x: np.asarray(framing.to_bytes(x))
    np.testing.assert_array_equal(as_bits(got), as_bits(jnp.concatenate([sent, sent[::-1]])))


def test_cut_splits_columns():
  x = jnp.arange(12).reshape(2, 6)
  a, b = framing.cut(x, [2, 4])
  assert a.shape == (2, 2) and b.shape == (2, 4) and int(b[1, 0]) == 8
