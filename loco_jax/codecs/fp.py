"""Small IEEE-style floats, no inf/NaN (CO3 fp4 [1,2,1], fp8 [1,5,2]): levels, rounding, symbols."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

ArrayLike = Any  #: numpy or jax array, or a Python/numpy number


@dataclasses.dataclass(frozen=True)
class FloatFormat:
  """A sign bit, `exponent_bits` exponent bits and `mantissa_bits` mantissa bits.

  The bias is 2**(exponent_bits - 1) - 1 and subnormals are kept. The all-ones
  exponent is reserved (no inf, no NaN), so the largest exponent field is
  2**exponent_bits - 2. A value's uint8 symbol is laid out as
  `sign << (e + m) | exponent << m | mantissa`, which needs 1 + e + m <= 8 bits.

  Example:
    >>> FloatFormat(2, 1).bits, FloatFormat(2, 1).bias
    (4, 1)
  """
  exponent_bits: int
  mantissa_bits: int

  def __post_init__(self):
    e, m = self.exponent_bits, self.mantissa_bits
    if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in (e, m)):
      raise ValueError(f"FloatFormat takes integer bit counts, got exponent_bits={e!r}, "
                       f"mantissa_bits={m!r}.")
    if e < 1 or m < 0 or 1 + e + m > 8 or e + m < 2:
      raise ValueError(
          f"FloatFormat(exponent_bits={e}, mantissa_bits={m}) is not supported: accepted are "
          "exponent_bits >= 1, mantissa_bits >= 0, 1 + exponent_bits + mantissa_bits <= 8 "
          "(one uint8 symbol) and exponent_bits + mantissa_bits >= 2 (some non-zero level).")

  @property
  def bits(self) -> int:
    """Bits per symbol: sign + exponent + mantissa."""
    return 1 + self.exponent_bits + self.mantissa_bits

  @property
  def bias(self) -> int:
    return 2 ** (self.exponent_bits - 1) - 1


FP4 = FloatFormat(2, 1)  #: levels {0, ±0.5, ±1, ±1.5, ±2, ±3}
FP8 = FloatFormat(5, 2)  #: max 57344, smallest subnormal 2**-16


@functools.lru_cache(maxsize=None)
def _levels(fmt: FloatFormat) -> np.ndarray:
  m = fmt.mantissa_bits
  # Magnitude codes (exponent << m | mantissa) below the reserved all-ones exponent.
  codes = np.arange((2 ** fmt.exponent_bits - 1) * 2 ** m)
  exponent, mantissa = codes >> m, codes & (2 ** m - 1)
  significand = np.where(exponent == 0, mantissa, 2 ** m + mantissa)  # subnormals lack the 1
  table = np.ldexp(significand.astype(np.float64), np.maximum(exponent, 1) - fmt.bias - m)
  table.setflags(write=False)
  return table


def levels(fmt: FloatFormat) -> np.ndarray:
  """Sorted non-negative magnitudes of `fmt`; index i is the magnitude code i.

  Example:
    >>> levels(FP4)
    array([0. , 0.5, 1. , 1.5, 2. , 3. ])
  """
  return _levels(fmt).copy()


def max_value(fmt: FloatFormat) -> float:
  """Largest representable magnitude (57344.0 for FP8, 3.0 for FP4)."""
  return float(_levels(fmt)[-1])


@functools.lru_cache(maxsize=None)
def _decode_table(fmt: FloatFormat) -> np.ndarray:
  """float32[256]: the value of every uint8 symbol; NaN for symbols encode never makes."""
  mags = _levels(fmt)
  sign_bit = 1 << (fmt.bits - 1)
  table = np.full(256, np.nan, np.float32)
  table[:mags.size] = mags
  # Negative zero (sign_bit + 0) stays NaN: it is the NaN symbol of jit-side encode.
  table[sign_bit + 1:sign_bit + mags.size] = -mags[1:]
  table.setflags(write=False)
  return table


def array_module(*arrays: ArrayLike):
  """jax.numpy if any of the arrays is a jax array, else numpy."""
  return jnp if any(isinstance(a, jax.Array) for a in arrays) else np


@functools.lru_cache(maxsize=None)
def scale_range(fmt: FloatFormat, dtype: Any = np.float32) -> tuple[float, float]:
  """(smallest, largest) scale whose dequantized levels `level * (1 / scale)` are finite normal
  numbers of `dtype`, and so is the scale itself.

  XLA:CPU flushes denormals to zero (1 / scale would become inf); above the range the largest
  level overflows. jax arrays are not checked: callers clip into this range, as co3 does.

  Example:
    >>> scale_range(FP4)  # 2**-126 and 2**125: level 0.5 * 2**-125 is still normal
    (1.1754943508222875e-38, 4.253529586511731e+37)
  """
  dtype = np.dtype(dtype)
  info = np.finfo(dtype)
  smallest_level = dtype.type(_levels(fmt)[1])  # a power of two, as is tiny: high is exact
  high = min(smallest_level, dtype.type(1.0)) / info.tiny
  low = max(info.tiny, dtype.type(max_value(fmt) / float(info.max)))
  with np.errstate(over="ignore"):
    # Up to the first scale whose largest level comes back finite, then one ulp of margin
    # for a backend that divides instead of multiplying by the reciprocal.
    while not np.isfinite(dtype.type(max_value(fmt)) * (dtype.type(1.0) / low)):
      low = np.nextafter(low, dtype.type(np.inf))
  if low > info.tiny:
    low = np.nextafter(low, dtype.type(np.inf))
  return float(low), float(high)


def check_scale(scale: ArrayLike, fmt: FloatFormat | None = None,
                 dtype: Any = np.float32) -> None:
  """ValueError unless scale is positive, finite and, given fmt, inside scale_range."""
  if isinstance(scale, jax.Array):
    return  # may be traced: cannot be checked without a host round trip
  values = np.asarray(scale, dtype=np.float64)
  if not (np.all(np.isfinite(values)) and np.all(values > 0)):
    raise ValueError(f"scale must be positive and finite (a number or an array broadcastable "
                     f"to x), got {scale!r}.")
  if fmt is not None:
    low, high = scale_range(fmt, dtype)
    if not (np.all(values >= low) and np.all(values <= high)):
      raise ValueError(f"scale must be positive and finite, in [{low:.6g}, {high:.6g}] for "
                       f"{fmt} with {np.dtype(dtype).name} values (outside, level / scale "
                       f"overflows or 1 / scale underflows), got {scale!r}.")


def _scaled(x: ArrayLike, fmt: FloatFormat, scale: ArrayLike):
  """(xp, x in the compute dtype, scale, y = |x| * scale saturated at max, NaN zeroed)."""
  xp = array_module(x, scale)
  x = xp.asarray(x)
  compute_dtype = np.float64 if x.dtype == np.float64 else np.float32
  check_scale(scale, fmt, compute_dtype)
  x = x.astype(compute_dtype)
  scale = xp.asarray(scale, compute_dtype)
  # min() saturates +inf (and finite overflow) at max; NaN is zeroed here, restored by callers.
  with np.errstate(over="ignore"):  # an overflow to inf saturates like any large value
    y = xp.minimum(xp.abs(x) * scale, max_value(fmt))
  return xp, x, scale, xp.where(xp.isnan(y), 0.0, y).astype(compute_dtype)


def _scaled_grid(x: ArrayLike, fmt: FloatFormat, scale: ArrayLike):
  """Shared rounding core: returns (xp, x in the compute dtype, scale, n, exponent).

  |x| * scale, saturated at max, is rounded to n * 2**(exponent - m) with n an integral float in
  [0, 2**(m + 1)]: the level grid of its binade (subnormals share the lowest normal binade).
  """
  xp, x, scale, y = _scaled(x, fmt, scale)
  _, frexp_exponent = xp.frexp(y)  # y = f * 2**k with f in [0.5, 1): floor(log2 y) = k - 1
  # Below the smallest normal (zero included, whose frexp exponent is 0) the grid is the
  # subnormal one: set it explicitly rather than trust frexp on (flushed) denormals.
  exponent = xp.where(y < 2.0 ** (1 - fmt.bias), 1 - fmt.bias, frexp_exponent - 1)
  # Exact power-of-two rescale; round() is half to even, i.e. ties go to the even mantissa.
  n = xp.round(xp.ldexp(y, fmt.mantissa_bits - exponent))
  return xp, x, scale, n, exponent


def _magnitude_codes(xp, y, fmt: FloatFormat):
  """`exponent << m | mantissa` of y (>= 0, at most max_value) rounded to `fmt`, half to even.

  Read from y's own bits (encode's path: a few integer operations a value, where frexp and
  ldexp, which `quantize` uses, cost several times more on XLA:CPU); `quantize` is the
  independent reference that the tests hold it to.
  """
  info = np.finfo(y.dtype)
  int_type = np.int32 if info.bits == 32 else np.int64
  m = fmt.mantissa_bits
  shift = info.nmant - m
  bits = (jax.lax.bitcast_convert_type(y, int_type) if xp is jnp else
          np.asarray(y).view(int_type))
  # Half to even at bit `shift`: a carry out of the mantissa moves into the exponent, which is
  # the next level up. What is left is y's exponent field << m | mantissa.
  rounded = (bits + ((1 << (shift - 1)) - 1) + ((bits >> shift) & 1)) >> shift
  normal = rounded - (((info.maxexp - 1) - fmt.bias) << m)
  # Below fmt's smallest normal the levels are multiples of 2**(1 - bias - m): count them.
  smallest_normal = 2.0 ** (1 - fmt.bias)
  subnormal = xp.round(xp.minimum(y, smallest_normal) * (2.0 ** (fmt.bias - 1 + m)))
  return xp.where(y < smallest_normal, subnormal.astype(int_type), normal)


def quantize(x: ArrayLike, fmt: FloatFormat, scale: ArrayLike = 1.0) -> ArrayLike:
  """Rounds `x * scale` to the nearest level of `fmt` and returns `level * (1 / scale)`.

  Ties go to the even mantissa. Values beyond the largest level, ±inf included, saturate;
  NaN stays NaN; zeros are +0. The result has x's float dtype (float32 for integer x); numpy in
  gives numpy out, jax in jax out, bit-identical except for float32 denormal results, which
  XLA:CPU flushes. `scale` (broadcastable to x) must lie in scale_range(fmt) (ValueError).

  Example:
    >>> quantize(np.array([0.2, 0.8, 2.6, 100.0], np.float32), FP4)
    array([0., 1., 3., 3.], dtype=float32)
  """
  out_dtype = _out_dtype(x)
  xp, x, scale, n, exponent = _scaled_grid(x, fmt, scale)
  magnitude = xp.ldexp(n, exponent - fmt.mantissa_bits)
  signed = xp.where((x < 0) & (magnitude > 0), -magnitude, magnitude)  # never -0
  value = xp.where(xp.isnan(x), np.nan, signed * _reciprocal(scale))
  return value.astype(out_dtype)


def encode(x: ArrayLike, fmt: FloatFormat, scale: ArrayLike = 1.0) -> ArrayLike:
  """uint8 symbols of quantize(x, fmt, scale): `sign << (e + m) | exponent << m | mantissa`.

  ±inf saturate. NaN raises ValueError in numpy; in jax it encodes as negative zero, which
  finite values never produce and decode maps back to NaN.
  decode(encode(x, f, s), f, s) == quantize(x, f, s) bit for bit for float32 x.

  Example:
    >>> encode(np.array([0.5, -3.0, 1e9]), FP4)
    array([ 1, 13,  5], dtype=uint8)
  """
  xp, x, _, y = _scaled(x, fmt, scale)
  sign_bit = 1 << (fmt.bits - 1)
  if xp is np and np.isnan(x).any():
    raise ValueError(f"encode got {int(np.isnan(x).sum())} NaN value(s); small floats have no "
                     "NaN. Accepted: finite values or ±inf (which saturate). Under jax.jit NaN "
                     "encodes to the negative-zero symbol instead.")
  code = _magnitude_codes(xp, y, fmt).astype(np.int32)
  negative = (x < 0) & (code > 0)
  symbols = xp.where(negative, code + sign_bit, code)
  symbols = xp.where(xp.isnan(x), sign_bit, symbols)
  return symbols.astype(np.uint8)


def decode(symbols: ArrayLike, fmt: FloatFormat, scale: ArrayLike = 1.0) -> ArrayLike:
  """float32 values `level * (1 / scale)` of uint8 `symbols` made by encode.

  Symbols that encode never makes for finite input decode to NaN. A numpy or Python `scale`
  must lie in scale_range(fmt).

  Example:
    >>> decode(np.array([1, 13, 5], np.uint8), FP4)
    array([ 0.5, -3. ,  3. ], dtype=float32)
  """
  check_scale(scale, fmt)
  xp = array_module(symbols, scale)
  table = xp.asarray(_decode_table(fmt))
  symbols = xp.asarray(symbols)
  if not xp.issubdtype(symbols.dtype, np.integer):
    raise ValueError(f"decode takes integer (uint8) symbols, got dtype {symbols.dtype}.")
  values = table[symbols.astype(np.uint8).astype(np.int32)]
  return values * _reciprocal(xp.asarray(scale, np.float32))


def _reciprocal(scale: ArrayLike) -> ArrayLike:
  # Dequantize as level * (1 / scale), not level / scale: XLA rewrites division by a
  # broadcast scalar into this product, so numpy must do the same to agree bit for bit.
  return 1.0 / scale


def _out_dtype(x: ArrayLike):
  dtype = getattr(x, "dtype", None)
  if dtype is None:
    dtype = np.asarray(x).dtype
  return dtype if jnp.issubdtype(dtype, jnp.floating) else np.dtype(np.float32)
