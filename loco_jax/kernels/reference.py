"""LoCo's step in float64 numpy: the one criterion every implementation (jnp, Pallas) is held to."""

from typing import NamedTuple

import numpy as np

from loco_jax.core import quant

#: A few float32 roundings, relative: what separates a float32 implementation from float64.
ULP = 2.0 ** -21


class StepCheck(NamedTuple):
  """How far one implementation's step is from the float64 reference (0 everywhere: passes).

  Codes may differ by one step only where the reference sits within float32 rounding of a
  rounding boundary; scales, decompressed values and averages agree to float32 rounding.
  """
  codes_off: int          # payload codes not within one step, or off by one away from a boundary
  error_codes_off: int    # the same for the stored error's codes
  scales_off: int         # payload or error scales beyond float32 rounding
  values_off: int         # decompressed values (d = q / s) beyond float32 rounding

  @property
  def passed(self) -> bool:
    return not any(self)


def absmax_scale(x_BxL: np.ndarray, bits: int) -> np.ndarray:
  """[blocks, 1] float64 qmax / max|x| (0 for zero or vanishing blocks), as quant.absmax_scale
  (whose float32 scale may be subnormal: below 2**-126 it keeps 21 bits or more)."""
  absmax = np.abs(x_BxL).max(axis=1, keepdims=True)
  usable = absmax > quant.VANISHING
  qmax = max(2 ** (bits - 1) - 1, 1)
  return np.where(usable, qmax / np.where(usable, absmax, 1.0), 0.0)


def rms_scale(x_BxL: np.ndarray, bits: int, clip_rms: float) -> np.ndarray:
  """[blocks, 1] float64 qmax / min(clip_rms x rms, max|x|) (0 for zero or vanishing blocks),
  as quant.rms_scale."""
  absmax = np.abs(x_BxL).max(axis=1, keepdims=True)
  usable = absmax > quant.VANISHING
  rms = np.sqrt(np.mean(np.square(x_BxL), axis=1, keepdims=True))
  clip = np.minimum(clip_rms * rms, absmax)
  qmax = max(2 ** (bits - 1) - 1, 1)
  return np.where(usable, qmax / np.where(usable, clip, 1.0), 0.0)


def saturate(x: np.ndarray) -> np.ndarray:
  """x clipped to float32's finite range, where every implementation saturates."""
  return np.clip(x, -quant.FLOAT32_MAX, quant.FLOAT32_MAX)


def decompress(q: np.ndarray, s: np.ndarray) -> np.ndarray:
  """q / s, saturated; 0 where s is 0."""
  return np.where(s > 0, saturate(q / np.where(s > 0, s, 1.0)), 0.0)


def _codes_off(got: np.ndarray, x: np.ndarray, bits: int, tol: np.ndarray) -> int:
  """Codes that are not clip(round(x)) of the float64 x, except one step off where x lies
  within `tol` of a half-integer (float32 rounding of x's inputs may land either side)."""
  qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
  want = np.clip(np.round(x), qmin, qmax)
  diff = np.abs(got - want)
  near = np.abs(np.abs(x) % 1 - 0.5) <= tol
  clipped = (x <= qmin + 0.5 + tol) & (got == qmin) | (x >= qmax - 0.5 - tol) & (got == qmax)
  return int(np.sum((diff > 1) | ((diff == 1) & ~near & ~clipped)))


def check_step(g, error, error_scale, out_codes, out_scales, out_error, out_error_scale,
               out_decompressed=None, *, bits: int, error_bits: int, beta: float,
               reset: bool = False, fixed_scale: float | None = None,
               fixed_error_scale: float | None = None, scale_method: str = "absmax",
               clip_rms: float | None = None) -> StepCheck:
  """Checks one LoCo step of an implementation against DESIGN.md's step in float64 (h, d and
  the residual saturated at the float32 maximum, as every implementation's are).

  Inputs are per block ([blocks, block_len]; scales [blocks]): what the implementation started
  from and what it produced. The residual uses the implementation's own codes, so that a code
  rounded the other way on a boundary is judged once. With scale_method="rms" the scale may be
  off by block_len float32 roundings, and the codes are judged against the given scale.

  Example:
    >>> g = np.linspace(-1, 1, 16).reshape(2, 8)
    >>> s = 7 / np.abs(g).max(1)
    >>> q = np.round(g * s[:, None])
    >>> check_step(g, np.zeros((2, 8)), np.zeros(2), q, s, np.zeros((2, 8)), np.zeros(2),
    ...            bits=4, error_bits=8, beta=1.0).passed
    True
  """
  f64 = lambda x: np.asarray(x, np.float64)
  g, codes = f64(g), f64(error)
  blocks = g.shape[0]
  column = lambda x, fixed=None: (np.full((blocks, 1), fixed, np.float64) if fixed is not None
                                  else f64(x).reshape(blocks, 1))
  se = column(error_scale, fixed_error_scale) * (0.0 if reset else 1.0)
  e = decompress(codes, se)
  h = saturate(g + e)
  s_got = column(out_scales, fixed_scale)
  if fixed_scale is not None:
    s = column(None, fixed_scale)
  elif scale_method == "rms":
    s = rms_scale(h, bits, clip_rms)
  else:
    s = absmax_scale(h, bits)
  # A float32 sum of L squares is within L roundings of the float64 one (half of it in the
  # rms); absmax is one value of h, off by float32 rounding only.
  scale_tol = ULP * (1 + g.shape[1] * 2.0 ** -3 if scale_method == "rms" else 1)
  scales_off = int(np.sum(np.abs(s_got - s) > scale_tol * s))
  q = f64(out_codes)
  x = (s_got if scale_method == "rms" else s) * h
  codes_off = _codes_off(q, x, bits, ULP * (np.abs(x) + 1))
  values_off = 0
  d = decompress(q, s_got)
  if out_decompressed is not None:
    values_off = int(np.sum(np.abs(f64(out_decompressed) - d) > ULP * np.abs(d)))
  residual = saturate(beta * e + (1 - beta) * (h - d))
  if fixed_error_scale is None:
    s_e = absmax_scale(residual, error_bits)
    s_e_got = column(out_error_scale)
    # The residual's absmax inherits h - d's cancellation: relative to |h| + |e|, not to it.
    slack = ULP * np.max(np.abs(h) + np.abs(e) + np.abs(d), axis=1, keepdims=True)
    absmax = np.abs(residual).max(axis=1, keepdims=True)
    scales_off += int(np.sum(np.abs(s_e_got - s_e) > ULP * s_e + s_e * slack /
                             np.maximum(absmax, 1e-300)))
  else:
    s_e = s_e_got = column(None, fixed_error_scale)
  y = s_e_got * residual
  tol = s_e_got * ULP * (np.abs(h) + np.abs(e) + np.abs(d)) + ULP * (np.abs(y) + 1)
  error_codes_off = _codes_off(f64(out_error), y, error_bits, tol)
  return StepCheck(codes_off, error_codes_off, scales_off, values_off)


def mean_off(got: np.ndarray, codes_NxBxL: np.ndarray, scales_NxB: np.ndarray) -> int:
  """Elements of a receive-side mean beyond float32 rounding of the float64 mean of `q_j / s_j`
  (relative to the mean of `|q_j / s_j|`: the sum may cancel)."""
  values = decompress(np.asarray(codes_NxBxL, np.float64),
                      np.asarray(scales_NxB, np.float64)[..., None])
  want = values.mean(axis=0).reshape(-1)
  magnitude = np.abs(values).mean(axis=0).reshape(-1)
  return int(np.sum(np.abs(np.asarray(got, np.float64) - want) > 4 * ULP * magnitude))
