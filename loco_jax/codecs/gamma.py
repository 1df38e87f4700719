"""The incomplete gamma function, its inverse, digamma and trigamma, in float64 numpy (scipy is
not a dependency): what the GenNorm fit and quantiles need."""

import math
from typing import Any

import numpy as np

ArrayLike = Any  # numpy or jax array

_EPS = 1e-15
_TINY = 1e-300
_MAX_ITERATIONS = 2000
_MAX_DOUBLINGS = 1100  # past float64's largest number


def digamma(x: float) -> float:
  """psi(x) for x > 0: recurrence up to x >= 6, then the asymptotic series (error ~1e-15)."""
  if not 0 < x < math.inf:  # the recurrence below would never end for x <= -2**53
    raise ValueError(f"digamma is computed for finite x > 0, got {x!r}.")
  shift = 0.0
  while x < 10.0:
    shift -= 1.0 / x
    x += 1.0
  inv2 = 1.0 / (x * x)
  tail = inv2 * (1 / 12 - inv2 * (1 / 120 - inv2 * (1 / 252 - inv2 * (1 / 240 - inv2 / 132))))
  return shift + math.log(x) - 0.5 / x - tail


def trigamma(x: float) -> float:
  """psi'(x) for x > 0, same scheme as digamma."""
  if not 0 < x < math.inf:
    raise ValueError(f"trigamma is computed for finite x > 0, got {x!r}.")
  shift = 0.0
  while x < 10.0:
    shift += 1.0 / (x * x)
    x += 1.0
  inv, inv2 = 1.0 / x, 1.0 / (x * x)
  tail = inv * inv2 * (1 / 6 - inv2 * (1 / 30 - inv2 * (1 / 42 - inv2 * (1 / 30 - inv2 * 5 / 66))))
  return shift + inv + 0.5 * inv2 + tail


def gammainc(a: float, x: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
  """Regularized incomplete gammas (P, Q = 1 - P) of scalar a > 0 at every x >= 0.

  Each is computed where it is the small one: the series gives P for x < a + 1 and the
  continued fraction gives Q above, so both keep full relative precision in their tails.
  """
  x = np.asarray(x, np.float64)
  p, q = np.zeros_like(x), np.ones_like(x)
  log_gamma_a = math.lgamma(a)

  series = (x > 0) & (x < a + 1)
  if series.any():
    xs = x[series]
    term = np.full_like(xs, 1.0 / a)
    total = term.copy()
    denominator = a
    for _ in range(_MAX_ITERATIONS):
      denominator += 1.0
      term *= xs / denominator
      total += term
      if np.all(term < total * _EPS):
        break
    p[series] = total * np.exp(a * np.log(xs) - xs - log_gamma_a)
    q[series] = 1.0 - p[series]

  fraction = (x >= a + 1) & np.isfinite(x)
  if fraction.any():
    xf = x[fraction]
    # Modified Lentz evaluation of the continued fraction for Q (Numerical Recipes gcf).
    b = xf + 1.0 - a
    c = np.full_like(xf, 1.0 / _TINY)
    d = 1.0 / b
    h = d.copy()
    for i in range(1, _MAX_ITERATIONS):
      an = -i * (i - a)
      b += 2.0
      d = an * d + b
      d = np.where(np.abs(d) < _TINY, _TINY, d)
      c = b + an / c
      c = np.where(np.abs(c) < _TINY, _TINY, c)
      d = 1.0 / d
      delta = d * c
      h *= delta
      if np.all(np.abs(delta - 1.0) < _EPS):
        break
    q[fraction] = h * np.exp(a * np.log(xf) - xf - log_gamma_a)
    p[fraction] = 1.0 - q[fraction]

  infinite = x == np.inf
  p[infinite], q[infinite] = 1.0, 0.0
  return p, q


def solve_gammainc(a: float, p: np.ndarray, q: np.ndarray) -> np.ndarray:
  """t with P(a, t) = p (equivalently Q(a, t) = q = 1 - p), for 0 < p < 1."""
  # Table bounds: P ~ t**a / Gamma(a + 1) near 0; Q decays like exp(-t) far out.
  log_t_low = (math.log(p.min()) + math.lgamma(a + 1.0)) / a + math.log(0.25)  # no overflow
  t_low = max(math.exp(log_t_low), _TINY)
  t_high = max(4.0 * a, 4.0)
  for _ in range(_MAX_DOUBLINGS):  # Q(a, t) < exp(-t / 2) far out: a few doublings past a
    if not gammainc(a, t_high)[1] > 0.25 * q.min():
      break
    t_high *= 2.0
  else:
    raise ValueError(f"ppf found no upper bracket for a = 1/beta = {a} (q = {q.min()}).")
  log_t = np.linspace(math.log(t_low), math.log(t_high), 4096)
  table_p, table_q = gammainc(a, np.exp(log_t))
  lower = p <= 0.5  # solve on log P below the median of |X|, on log Q above
  start = np.empty_like(p)
  start[lower] = np.interp(np.log(p[lower]), np.log(np.maximum(table_p, _TINY)), log_t)
  # np.interp needs increasing abscissae: -log Q increases with t.
  start[~lower] = np.interp(-np.log(q[~lower]), -np.log(np.maximum(table_q, _TINY)), log_t)

  log_target = np.where(lower, np.log(p), np.log(q))
  u = start
  for _ in range(3):
    t = np.exp(u)
    pu, qu = gammainc(a, t)
    log_density_t = a * u - t - math.lgamma(a)  # log(t * dP/dt)
    log_value = np.where(lower, np.log(np.maximum(pu, _TINY)), np.log(np.maximum(qu, _TINY)))
    slope = np.where(lower, 1.0, -1.0) * np.exp(log_density_t - log_value)  # d log P / d log t
    step = (log_value - log_target) / np.where(slope == 0, np.inf, slope)
    u = u - np.clip(step, -1.0, 1.0)
  return np.exp(u)
