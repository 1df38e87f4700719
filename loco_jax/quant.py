"""Integer quantizer of LoCo's Eq. (1), absmax block scales and bit packing into uint8."""

import jax
import jax.numpy as jnp
import numpy as np

# A block whose absmax is below this is flushed to zero: qmax / absmax would overflow float32
# to inf there, and 0 * inf = NaN (blocks that stop receiving gradient decay towards it).
VANISHING = float(np.finfo(np.float32).tiny) * 256.0

PACK_UNIT = 8  # values per packing unit: 8 p-bit values fill exactly p bytes, for every p.


def check_bits(bits: int, name: str = "bits") -> None:
  if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or not 1 <= bits <= 8:
    raise ValueError(f"{name} must be an integer in 1..8, got {bits!r}")


def int_range(bits: int) -> tuple[int, int]:
  """The signed p-bit range of Eq. (1): (-2**(p-1), 2**(p-1) - 1)."""
  return -(2 ** (bits - 1)), 2 ** (bits - 1) - 1


def compress(x: jax.Array, scale: jax.Array | float, bits: int) -> jax.Array:
  """Eq. (1): clip(round_half_to_even(scale * x), -2**(p-1), 2**(p-1) - 1) as int8.

  Example:
    >>> compress(jnp.array([0.26, -1.0]), 4.0, 4)   # [1, -4]
  """
  qmin, qmax = int_range(bits)
  return jnp.clip(jnp.round(scale * x), qmin, qmax).astype(jnp.int8)


def decompress(q: jax.Array, scale: jax.Array | float) -> jax.Array:
  """q / scale in float32; a zero scale (an all-zero or vanishing block) gives exactly 0."""
  scale = jnp.asarray(scale, jnp.float32)
  safe = jnp.where(scale > 0, scale, 1.0)
  return jnp.where(scale > 0, q.astype(jnp.float32) / safe, 0.0)


def absmax_scale(x_blocks: jax.Array, bits: int) -> jax.Array:
  """Per-block scale qmax / max|x| over the last axis; 0 for zero, vanishing or non-finite blocks.

  For bits=1 the grid is {-1, 0} and qmax is 0; the scale then uses 1 so that it stays finite.
  """
  qmax = max(int_range(bits)[1], 1)
  absmax = jnp.max(jnp.abs(x_blocks), axis=-1)
  usable = (absmax > VANISHING) & jnp.isfinite(absmax)
  return jnp.where(usable, qmax / jnp.where(usable, absmax, 1.0), 0.0).astype(jnp.float32)


def pack(q: jax.Array, bits: int) -> jax.Array:
  """Packs signed `bits`-bit integers (last axis a multiple of 8) into uint8, losslessly.

  For bits in {1, 2, 4, 8} a byte holds 8 // bits values (two 4-bit values per byte); values are
  taken plane by plane (element j and j + L/2 share a byte at 4 bits) so the work is contiguous.
  Other widths use bit planes: 8 values fill `bits` bytes, byte b holding bit b of each value.
  Example:
    >>> pack(jnp.zeros((4, 16), jnp.int8), 4).shape   # (4, 8)
  """
  *lead, length = q.shape
  if length % PACK_UNIT:
    raise ValueError(f"pack needs a last axis that is a multiple of {PACK_UNIT}, got {length}")
  unsigned = (q.astype(jnp.int32) - int_range(bits)[0]).astype(jnp.uint8)
  if 8 % bits == 0:
    per_byte = 8 // bits
    planes = unsigned.reshape(*lead, per_byte, length // per_byte)
    out = planes[..., 0, :]
    for t in range(1, per_byte):
      out = out | (planes[..., t, :] << (t * bits))
    return out
  planes = unsigned.reshape(*lead, PACK_UNIT, length // PACK_UNIT)
  out = []
  for b in range(bits):
    byte = (planes[..., 0, :] >> b) & 1
    for t in range(1, PACK_UNIT):
      byte = byte | (((planes[..., t, :] >> b) & 1) << t)
    out.append(byte)
  return jnp.concatenate(out, axis=-1)


def unpack(packed: jax.Array, bits: int) -> jax.Array:
  """Inverse of `pack`: uint8 [..., L*bits/8] back to int8 [..., L]."""
  *lead, nbytes = packed.shape
  qmin = int_range(bits)[0]
  if 8 % bits == 0:
    per_byte = 8 // bits
    mask = (1 << bits) - 1
    planes = [(packed >> (t * bits)) & mask for t in range(per_byte)]
  else:
    if nbytes % bits:
      raise ValueError(f"unpack: {nbytes} bytes is not a multiple of bits={bits}")
    byte_planes = packed.reshape(*lead, bits, nbytes // bits)
    planes = []
    for t in range(PACK_UNIT):
      value = (byte_planes[..., 0, :] >> t) & 1
      for b in range(1, bits):
        value = value | (((byte_planes[..., b, :] >> t) & 1) << b)
      planes.append(value)
  unsigned = jnp.stack(planes, axis=-2).reshape(*lead, -1)
  return (unsigned.astype(jnp.int32) + qmin).astype(jnp.int8)


def packed_bytes(length: int, bits: int) -> int:
  """Bytes that `pack` produces for `length` values (a multiple of 8) of `bits` bits."""
  return length * bits // 8
