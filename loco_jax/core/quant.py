"""Integer quantizer of LoCo's Eq. (1), absmax block scales and bit packing into uint8."""

import jax
import jax.numpy as jnp
import numpy as np

#: A block whose absmax is below this is flushed to zero: qmax / absmax would overflow float32
#: to inf there, and 0 * inf = NaN (blocks that stop receiving gradient decay towards it).
VANISHING = float(np.finfo(np.float32).tiny) * 256.0

PACK_UNIT = 8  #: values per packing unit: 8 p-bit values fill exactly p bytes, for every p.

#: The smallest normal float32, 2**-126. A block scale qmax / max|x| falls below it on blocks
#: above qmax * 2**126 (8.5e37 at 1 and 2 bits, 2.6e38 at 3; never at 4 bits and more) and is
#: then kept as the subnormal float32 it is (21 bits or more: s >= 1 / float32 max > 2**-128),
#: never as an operand: XLA:CPU reads subnormal operands as 0 (1 / 3e-39 gave inf, 3e-39 > 0
#: False) and GPUs may flush them. `scale_of`, `positive_scale`, `scale_split` and `reciprocal`
#: work from its bits instead.
TINY = float(np.finfo(np.float32).tiny)
FLOAT32_MAX = float(np.finfo(np.float32).max)
_SUBNORMAL_BITS = 1 << 23  # bit patterns below it (and above 0) are the positive subnormals


def check_bits(bits: int, name: str = "bits") -> None:
  if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or not 1 <= bits <= 8:
    raise ValueError(f"{name} must be an integer in 1..8, got {bits!r}")


def int_range(bits: int) -> tuple[int, int]:
  """The signed p-bit range of Eq. (1): (-2**(p-1), 2**(p-1) - 1)."""
  return -(2 ** (bits - 1)), 2 ** (bits - 1) - 1


def saturate(x: jax.Array, dtype=jnp.float32) -> jax.Array:
  """x clipped to the finite range of `dtype` (NaN stays NaN, +-inf becomes +-max), which x's
  dtype must hold exactly: where arithmetic would overflow, one clip fused into the producer.

  Example:
    >>> saturate(jnp.array([7e4, -1.0]), jnp.float16).tolist()
    [65504.0, -1.0]
  """
  largest = float(jnp.finfo(dtype).max)
  return jnp.clip(x, -largest, largest)


def saturating_cast(x: jax.Array, dtype) -> jax.Array:
  """x.astype(dtype), finite values beyond dtype's range saturating (see `saturate`).

  The clip runs in float32 at least: float16's 65504 is not a bfloat16 number (it rounds up to
  65536, which float16 reads as inf).
  """
  if jnp.finfo(dtype).max >= jnp.finfo(x.dtype).max:
    return x.astype(dtype)
  return saturate(x.astype(jnp.promote_types(x.dtype, jnp.float32)), dtype).astype(dtype)


def mean_factors(n: int) -> tuple[float, float]:
  """(2**-k, 2**k / n in float32) for the smallest 2**k >= n.

  The mean of n values as sum(x * 2**-k) * (2**k / n) cannot overflow (each term is at most
  max / n) and, scaling by a power of two being exact, equals sum(x) * (1 / n) bit for bit
  wherever no term is subnormal.
  """
  k = max(n - 1, 0).bit_length()
  return 2.0 ** -k, float(np.float32(2.0 ** k) * (np.float32(1) / np.float32(n)))


def mean_over_peers(x_NxX: jax.Array) -> jax.Array:
  """The mean over axis 0 of float32 values, without overflow (`mean_factors`), saturated.

  Example:
    >>> np.allclose(mean_over_peers(jnp.full((8, 2), 3e38)), 3e38)   # x.mean(0) is inf
    True
  """
  down, up = mean_factors(x_NxX.shape[0])
  return saturate(sum_rows(x_NxX * down) * up)


def sum_rows(x_NxX: jax.Array) -> jax.Array:
  """The sum over axis 0, row by row in row order.

  XLA:CPU runs a reduce over the major axis about 20x slower than these N - 1 elementwise adds
  (24 ms against 1 ms for 4 x 1M floats); elsewhere they cost the same.
  """
  total = x_NxX[0]
  for row in range(1, x_NxX.shape[0]):
    total = total + x_NxX[row]
  return total


def all_finite(x: jax.Array) -> jax.Array:
  """Whether every value of `x` is finite: a sum of x - x, one pass that XLA:CPU reduces as it
  reads, half the time of `all(isfinite(x))`."""
  return jnp.isfinite(jnp.sum(x - x))


def compress(x: jax.Array, scale: jax.Array | float, bits: int) -> jax.Array:
  """Eq. (1): clip(round_half_to_even(scale * x), -2**(p-1), 2**(p-1) - 1) as int8.

  Example:
    >>> compress(jnp.array([0.26, -1.0]), 4.0, 4).tolist()
    [1, -4]
  """
  qmin, qmax = int_range(bits)
  return jnp.clip(jnp.round(times_scale(x, scale, bits)), qmin, qmax).astype(jnp.int8)


def times_scale(x: jax.Array, scale, bits: int) -> jax.Array:
  """scale * x for a `bits`-bit block scale: as (x * f) * n (`scale_split`) at the widths whose
  scales can be subnormal (`subnormal_scales`), else directly."""
  if subnormal_scales(bits):
    f, n = scale_split(scale)
    return (x * f) * n
  return scale * x


def decompress(q: jax.Array, scale: jax.Array | float) -> jax.Array:
  """q / scale in float32, saturated; exactly 0 for a scale that is not positive and finite (an
  all-zero block, or a peer's garbage). Subnormal scales are read exactly."""
  f, n = scale_split(scale)
  positive = positive_scale(scale)
  values = (q.astype(jnp.float32) / jnp.where(positive, n, 1.0)) * (1.0 / f)
  return jnp.where(positive, saturate(values), 0.0)


def subnormal_scales(bits: int) -> bool:
  """Whether `bits`-bit block scales can be subnormal: qmax * 2**126 below float32's maximum."""
  return qmax_of(bits) * 2.0 ** 126 < FLOAT32_MAX


def scale_of(qmax: int, top: jax.Array) -> jax.Array:
  """qmax / top in float32 for top in (0, float32 max]; below `TINY` (top > qmax * 2**126) the
  subnormal float32 within a unit of it, built from its bits."""
  quotient = np.float32(qmax) / top
  if qmax * 2.0 ** 126 >= FLOAT32_MAX:
    return quotient
  # s * 2**149 (in units of the smallest subnormal) as a product of normal factors, < 2**23.
  units = jnp.round(np.float32(qmax) / (top * np.float32(2.0 ** -64)) * np.float32(2.0 ** 85))
  subnormal = jax.lax.bitcast_convert_type(units.astype(jnp.int32), jnp.float32)
  return jnp.where(top > np.float32(qmax * 2.0 ** 126), subnormal, quotient)


def _scale_bits(scale) -> jax.Array:
  return jax.lax.bitcast_convert_type(jnp.asarray(scale, jnp.float32), jnp.int32)


def positive_scale(scale) -> jax.Array:
  """scale > 0 and finite, subnormal scales included (read from the bits: XLA:CPU compares a
  subnormal as 0)."""
  bits = _scale_bits(scale)
  return (bits > 0) & (bits < 0x7F800000)


def scale_split(scale) -> tuple[jax.Array, jax.Array]:
  """(f, n), normal float32 factors with scale * x = (x * f) * n in one rounding: (1, scale),
  or (2**-100, scale * 2**100) for a subnormal scale.

  Example:
    >>> f, n = scale_split(jnp.float32(3e-39))
    >>> float(f) == 2.0 ** -100, round(float(n) * 2.0 ** -100 / 3e-39, 6)
    (True, 1.0)
  """
  bits = _scale_bits(scale)
  subnormal = (bits > 0) & (bits < _SUBNORMAL_BITS)
  n = jnp.where(subnormal, bits.astype(jnp.float32) * np.float32(2.0 ** -49), scale)
  return jnp.where(subnormal, np.float32(2.0 ** -100), np.float32(1.0)), n


def reciprocal(scale: jax.Array) -> jax.Array:
  """1 / scale, saturated, for a positive finite scale (subnormal included), else 1: q / s is
  q * (1 / s), one division a block."""
  f, n = scale_split(scale)
  positive = positive_scale(scale)
  return jnp.where(positive, saturate((1.0 / jnp.where(positive, n, 1.0)) * (1.0 / f)), 1.0)


def qmax_of(bits: int) -> int:
  """The top code of Eq. (1); 1 at bits=1, whose grid {-1, 0} has qmax 0, so scales stay finite."""
  return max(int_range(bits)[1], 1)


def scale_from_absmax(absmax: jax.Array, bits: int) -> jax.Array:
  """qmax / absmax (`scale_of`: subnormal above qmax * 2**126); 0 if vanishing or not finite."""
  usable = (absmax > VANISHING) & jnp.isfinite(absmax)
  return jnp.where(usable, scale_of(qmax_of(bits), jnp.where(usable, absmax, 1.0)), 0.0)


def absmax_scale(x_blocks: jax.Array, bits: int) -> jax.Array:
  """Per-block scale qmax / max|x| over the last axis (`scale_from_absmax`)."""
  return scale_from_absmax(jnp.max(jnp.abs(x_blocks), axis=-1), bits).astype(jnp.float32)


SCALE_METHODS = ("absmax", "rms")


def check_scale_method(scale_method: str, clip_rms) -> None:
  """ValueError unless `scale_method` is one of SCALE_METHODS and `clip_rms` fits it: a finite
  float > 0 with "rms", None with "absmax"."""
  if scale_method not in SCALE_METHODS:
    raise ValueError(f"scale_method must be one of {SCALE_METHODS}, got {scale_method!r}")
  if scale_method == "absmax" and clip_rms is not None:
    raise ValueError(f"clip_rms={clip_rms!r} applies to scale_method='rms' only (absmax "
                     f"scales clip nothing); pass one or the other")
  if scale_method == "rms" and (isinstance(clip_rms, bool) or not isinstance(
      clip_rms, (int, float, np.integer, np.floating)) or not np.isfinite(clip_rms)
      or clip_rms <= 0):
    raise ValueError(f"scale_method='rms' needs clip_rms, a finite float > 0 (the top code sits "
                     f"at clip_rms x the block's rms), got {clip_rms!r}")


def unit_factors(absmax: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(f, r) with (x * f) * r = x / absmax, every factor a normal float32: f = 2**-64 above 2**64
  (exact), else 1, and r = 1 / (absmax * f). A plain 1 / absmax is subnormal above 8.5e37, and
  XLA:CPU flushes it to 0 (it also rewrites x / absmax as x * (1 / absmax))."""
  big = absmax > np.float32(2.0 ** 64)
  f = jnp.where(big, np.float32(2.0 ** -64), np.float32(1.0))
  return f, 1.0 / (absmax * f)


def clip_range(absmax: jax.Array, mean_square: jax.Array, clip_rms: float) -> jax.Array:
  """min(clip_rms x rms, absmax), the range the top code covers under scale_method="rms";
  `mean_square` is the mean of (x / absmax)**2, which cannot overflow."""
  ratio = jnp.minimum(np.float32(clip_rms) * jnp.sqrt(mean_square), 1.0)
  return absmax * ratio


def rms_scale(x_blocks: jax.Array, bits: int, clip_rms: float) -> jax.Array:
  """Per-block scale qmax / min(clip_rms x rms, max|x|) over the last axis: the top code at
  clip_rms times the block's rms, values beyond it clipped (error feedback carries them);
  subnormal or 0 as `absmax_scale`'s.

  Example:
    >>> x = jnp.array([[1.0, -1.0, 1.0, -8.0]])   # rms 4.09: the top code (1) at 6.14
    >>> round(float(rms_scale(x, 2, 1.5)[0]), 4)
    0.1629
  """
  absmax = jnp.max(jnp.abs(x_blocks), axis=-1, keepdims=True)

  def mean_square(f, r):
    return jnp.mean(jnp.square((x_blocks * f) * r), axis=-1, keepdims=True)
  return scale_from_rms(absmax, mean_square, bits, clip_rms)[..., 0].astype(jnp.float32)


def scale_from_rms(absmax: jax.Array, mean_square, bits: int, clip_rms: float) -> jax.Array:
  """qmax / `clip_range`, `mean_square(f, r)` the block's mean of ((x * f) * r)**2 for
  `unit_factors`; 0 where `scale_from_absmax` gives 0."""
  usable = (absmax > VANISHING) & jnp.isfinite(absmax)
  safe = jnp.where(usable, absmax, 1.0)
  scale = scale_of(qmax_of(bits), clip_range(safe, mean_square(*unit_factors(safe)), clip_rms))
  return jnp.where(usable, scale, 0.0)


def pack(q: jax.Array, bits: int) -> jax.Array:
  """Packs signed `bits`-bit integers (last axis a multiple of 8) into uint8, losslessly.

  For bits in {1, 2, 4, 8} a byte holds 8 // bits values (two 4-bit values per byte); values are
  taken plane by plane (element j and j + L/2 share a byte at 4 bits) so the work is contiguous.
  Other widths use bit planes: 8 values fill `bits` bytes, byte b holding bit b of each value.

  Example:
    >>> pack(jnp.zeros((4, 16), jnp.int8), 4).shape
    (4, 8)
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
  return jnp.concatenate(_transpose_bits(planes, bits), axis=-1)


def _transpose_bits(planes: jax.Array, count: int) -> list[jax.Array]:
  """Bit m of plane k becomes bit k of output m (m < count): 8 p-bit values <-> p bytes."""
  out = []
  for m in range(count):
    word = (planes[..., 0, :] >> m) & 1
    for k in range(1, planes.shape[-2]):
      word = word | (((planes[..., k, :] >> m) & 1) << k)
    out.append(word)
  return out


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
    planes = _transpose_bits(packed.reshape(*lead, bits, nbytes // bits), PACK_UNIT)
  unsigned = jnp.stack(planes, axis=-2).reshape(*lead, -1)
  return (unsigned.astype(jnp.int32) + qmin).astype(jnp.int8)

