"""GenNorm gradient model: fit, sampling, quantiles, small-float symbol entropy, W2 validation."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import numpy as np
from scipy import special

from loco_jax.codecs import fp

ArrayLike = Any  #: numpy or jax array

#: Shapes the fit searches: 0.05 is a spike at zero, 20 is close to uniform.
BETA_RANGE = (0.05, 20.0)
#: Shapes the distribution functions accept: beyond them 1/beta or beta overflows the special
#: functions' float64 arithmetic, and no gradient is that shape.
BETA_LIMITS = (1e-3, 1e3)


class GenNormFit(NamedTuple):
  """Density `beta / (2 alpha Gamma(1/beta)) exp(-(|x - loc| / alpha)**beta)`.

  beta = 2 is a normal with sigma = alpha / sqrt(2); beta = 1 is a Laplace with scale alpha.
  """
  beta: float   # shape: smaller is more peaked at loc with heavier tails
  alpha: float  # scale
  loc: float


def _check_parameters(beta: float | None, alpha: float | None, loc: float = 0.0) -> None:
  """ValueError naming the first parameter outside its accepted range (None: not checked)."""
  low, high = BETA_LIMITS
  checks = (("beta", beta, lambda b: low < b <= high, f"finite, in ({low:g}, {high:g}]"),
            ("alpha", alpha, lambda a: 0 < a < math.inf, "finite and > 0"),
            ("loc", loc, math.isfinite, "finite"))
  for name, value, accepted, description in checks:
    if value is None or isinstance(value, jax.core.Tracer):
      continue  # not given, or under jit (sample with a jax key): cannot be checked
    try:
      number = float(value)
    except (TypeError, ValueError):
      raise ValueError(f"{name} must be a real number, got {value!r}.") from None
    if not accepted(number):  # NaN fails every comparison
      raise ValueError(f"{name} must be {description}, got {value!r}.")


def cdf(x: ArrayLike, beta: float, alpha: float, loc: float = 0.0) -> np.ndarray:
  """GenNorm cumulative distribution at x (float64, accurate in both tails).

  beta must be in BETA_LIMITS, alpha > 0 and loc finite (ValueError otherwise).

  Example:
    >>> float(cdf(0.0, 1.3, 2.0))
    0.5
  """
  _check_parameters(beta, alpha, loc)
  with np.errstate(over="ignore"):  # z**beta = inf is the tail: P = 1, Q = 0
    z = (np.asarray(x, np.float64) - loc) / alpha
    t = np.abs(z) ** beta
  return np.where(z >= 0, 0.5 + 0.5 * special.gammainc(1.0 / beta, t),
                  0.5 * special.gammaincc(1.0 / beta, t))


def ppf(quantile: ArrayLike, beta: float, alpha: float, loc: float = 0.0) -> np.ndarray:
  """GenNorm quantile function (inverse cdf); 0 and 1 map to -inf and +inf.

  `t = (|x - loc| / alpha)**beta` solves `P(1 / beta, t) = |2 quantile - 1|`, through whichever of
  P and Q = 1 - P is small. Parameters are checked as in `cdf`; quantiles outside [0, 1] give NaN.

  Example:
    >>> float(ppf(0.5, 0.7, 1.0))
    0.0
  """
  _check_parameters(beta, alpha, loc)
  quantile = np.asarray(quantile, np.float64)
  a = 1.0 / beta
  p = np.abs(2.0 * quantile - 1.0)
  upper_mass = 2.0 * np.minimum(quantile, 1.0 - quantile)  # 1 - p without cancellation
  solvable = (p > 0) & (upper_mass > 0)
  log_t = np.where(upper_mass == 0, np.inf, -np.inf)
  if solvable.any():
    log_t[solvable] = _log_gamma_quantile(a, p[solvable], upper_mass[solvable])
  with np.errstate(over="ignore"):  # a quantile beyond float64 is +-inf
    magnitude = alpha * np.exp(log_t / beta)
  x = loc + np.where(quantile < 0.5, -magnitude, magnitude)
  return np.where((quantile >= 0) & (quantile <= 1), x, np.nan)


def _log_gamma_quantile(a: float, p: np.ndarray, q: np.ndarray) -> np.ndarray:
  """log t with P(a, t) = p and Q(a, t) = q = 1 - p, for 0 < p < 1."""
  t = np.where(p <= 0.5, special.gammaincinv(a, p), special.gammainccinv(a, q))
  # Small a puts t below float64 while t**a is not: there P(a, t) ~ t**a / Gamma(a + 1).
  underflow = t < np.finfo(np.float64).tiny
  return np.where(underflow, (np.log(p) + special.gammaln(a + 1.0)) / a,
                  np.log(np.where(underflow, 1.0, t)))


def sample(key_or_rng: Any, beta: float, alpha: float, shape: tuple[int, ...],
           loc: float = 0.0) -> ArrayLike:
  """GenNorm samples: `|x - loc| = alpha * G**(1/beta)`, `G ~ Gamma(1/beta)`, random sign.

  A jax PRNG key gives a float32 jax array; a numpy Generator or an int seed gives a float64
  numpy array. beta must be in BETA_LIMITS, alpha > 0 and loc finite (ValueError otherwise).

  Example:
    >>> sample(np.random.default_rng(0), 0.7, 1e-3, (1000,)).shape
    (1000,)
  """
  _check_parameters(beta, alpha, loc)
  if isinstance(key_or_rng, jax.Array):
    gamma_key, sign_key = jax.random.split(key_or_rng)
    g = jax.random.gamma(gamma_key, 1.0 / beta, shape)
    sign = jax.random.rademacher(sign_key, shape, dtype=g.dtype)
    return loc + sign * alpha * g ** (1.0 / beta)
  rng = key_or_rng if isinstance(key_or_rng, np.random.Generator) else np.random.default_rng(
      key_or_rng)
  g = rng.standard_gamma(1.0 / beta, shape)
  sign = rng.integers(0, 2, shape) * 2 - 1
  return loc + sign * alpha * g ** (1.0 / beta)


def fit(x: ArrayLike, loc: float | None = 0.0, beta: float | None = None) -> GenNormFit:
  """Maximum-likelihood GenNorm fit of the values of x.

  Given beta, `alpha = (beta * mean(|x - loc|**beta))**(1/beta)`; beta, in BETA_RANGE,
  maximises the profile likelihood (safeguarded Newton steps from the moments' estimate).
  x must be finite, with two non-zero `|x - loc|` and a normal float64 alpha (else ValueError).
  loc None is the median; a given beta (2.0: a normal, 1.0: a Laplace) is in BETA_LIMITS.

  Example:
    >>> fit(sample(np.random.default_rng(0), 0.7, 1e-3, (100_000,)))  # doctest: +ELLIPSIS
    GenNormFit(beta=0.70..., alpha=0.0010..., loc=0.0)
  """
  x = np.asarray(x, np.float64).ravel()
  if not np.all(np.isfinite(x)):
    raise ValueError(f"fit needs finite values; got {int(np.sum(~np.isfinite(x)))} non-finite "
                     f"of {x.size}.")
  if x.size < 2:
    raise ValueError(f"fit needs at least 2 values, got {x.size}.")
  if loc is not None:
    _check_parameters(beta=None, alpha=None, loc=loc)
  loc = float(np.median(x)) if loc is None else float(loc)
  with np.errstate(over="ignore"):
    z = np.abs(x - loc)
  unit = z.max() if z.size else 0.0
  if not math.isfinite(unit):
    raise ValueError(f"fit needs |x - loc| to be finite in float64; it overflows for loc={loc}.")
  if np.count_nonzero(z) < 2:
    raise ValueError(f"fit needs at least 2 values different from loc={loc}; got "
                     f"{np.count_nonzero(z)} of {x.size}.")
  # Working with z / max keeps z**beta in [0, 1] for every beta, and mean(z**beta) >= 1/n.
  z = z / unit
  if beta is None:
    beta = _likelihood_beta(z, start=_moment_beta(z))
  elif not (BETA_LIMITS[0] < beta <= BETA_LIMITS[1]):  # False for NaN too
    raise ValueError(f"beta must be positive and finite, in ({BETA_LIMITS[0]:g}, "
                     f"{BETA_LIMITS[1]:g}], or None (fit it), got {beta!r}.")
  with np.errstate(over="ignore", under="ignore"):
    alpha = (beta * np.mean(z ** beta)) ** (1.0 / beta) * unit
  if not np.finfo(np.float64).tiny <= alpha < math.inf:
    raise ValueError(f"fit needs data whose spread is a normal float64 (alpha in "
                     f"[{np.finfo(np.float64).tiny:.3g}, {np.finfo(np.float64).max:.3g}]); "
                     f"these data give alpha = {float(alpha)!r} (max |x - loc| = "
                     f"{float(unit)!r}).")
  return GenNormFit(float(beta), float(alpha), loc)


def _moment_beta(z: np.ndarray) -> float:
  """beta whose mean(|X|)**2 / mean(X**2) = Gamma(2/b)**2 / (Gamma(1/b) Gamma(3/b)) matches z's."""
  ratio = np.mean(z) ** 2 / np.mean(z * z)

  def model_ratio(b: float) -> float:
    return math.exp(2 * math.lgamma(2 / b) - math.lgamma(1 / b) - math.lgamma(3 / b))

  low, high = math.log(BETA_RANGE[0]), math.log(BETA_RANGE[1])
  for _ in range(60):  # the model ratio increases with beta; bisect in log beta
    middle = 0.5 * (low + high)
    low, high = (middle, high) if model_ratio(math.exp(middle)) < ratio else (low, middle)
  return math.exp(0.5 * (low + high))


def _likelihood_beta(z: np.ndarray, start: float) -> float:
  """Root of beta**2 d/dbeta of the profile log-likelihood (alpha eliminated).

  g(b) = b + log b + log S + psi(1/b) - b S'/S with S(b) = mean(z**b), S' = dS/db; g > 0 below
  the maximum and < 0 above. Newton steps, replaced by bisection when they leave the bracket.
  """
  log_z = np.log(z[z > 0])  # zeros add nothing to S, S', S'' but count in the means
  n = z.size

  def g_and_slope(b: float) -> tuple[float, float]:
    w = np.exp(b * log_z)
    s0, s1, s2 = w.sum() / n, (w * log_z).sum() / n, (w * log_z * log_z).sum() / n
    r1 = s1 / s0
    g = b + math.log(b) + math.log(s0) + float(special.digamma(1 / b)) - b * r1
    slope = 1 + 1 / b - float(special.polygamma(1, 1 / b)) / b ** 2 - b * (s2 / s0 - r1 * r1)
    return g, slope

  low, high = BETA_RANGE
  if g_and_slope(low)[0] <= 0:
    return low
  if g_and_slope(high)[0] >= 0:
    return high
  b = min(max(start, low), high)
  for _ in range(100):
    g, slope = g_and_slope(b)
    if g > 0:
      low = b
    else:
      high = b
    newton = b - g / slope if slope < 0 else -1.0
    b_next = newton if low < newton < high else math.sqrt(low * high)
    if abs(b_next - b) < 1e-10 * b:
      return b_next
    b = b_next
  return b


def fp4_scale(beta: ArrayLike, alpha: ArrayLike) -> ArrayLike:
  """CO3's MSE-optimal fp4 scale p(beta) / alpha, p(b) = 0.46 - 2.85b + 5.37b^2 - 2.85b^3 + 0.52b^4.

  p, a fit for beta >= ~0.35, is floored at 0.0009. Numbers and numpy arrays need finite
  beta >= 0 and alpha > 0 (ValueError); jax arrays are not checked.

  Example:
    >>> round(fp4_scale(1.0, 2.0), 3)
    0.325
  """
  xp = fp.array_module(beta, alpha)
  if xp is np:  # the polynomial is defined at beta = 0; the scale needs alpha > 0
    for name, value, smallest in (("beta", beta, ">= 0"), ("alpha", alpha, "> 0")):
      values = np.asarray(value, np.float64)
      if not (np.all(np.isfinite(values)) and np.all(values > 0 if name == "alpha" else
                                                         values >= 0)):
        raise ValueError(f"fp4_scale needs {name} finite and {smallest}, got {value!r}.")
  p = 0.46 + beta * (-2.85 + beta * (5.37 + beta * (-2.85 + beta * 0.52)))
  scale = xp.maximum(p, 0.0009) / alpha
  return float(scale) if xp is np and np.ndim(scale) == 0 else scale


def symbol_probabilities(fmt: fp.FloatFormat, beta: float, alpha: float,
                         scale: float) -> np.ndarray:
  """float64[256]: probability of each uint8 symbol of fp.encode(x, fmt, scale), x ~ GenNorm.

  The source is centred at 0 (loc = 0). Symbols encode never makes have probability 0, and far
  tail symbols may underflow to 0.

  Example:
    >>> float(symbol_probabilities(fp.FP4, 1.0, 1.0, 0.65).sum())
    1.0
  """
  _check_parameters(beta, alpha)
  fp.check_scale(scale, fmt, np.float64)
  levels = fp.levels(fmt)
  # |x| in [edges[c-1], edges[c]) rounds to magnitude code c (ties have probability 0).
  edges = 0.5 * (levels[1:] + levels[:-1]) / scale
  with np.errstate(over="ignore"):  # an edge beyond float64 is the tail: P = 1, Q = 0
    t = (edges / alpha) ** beta
  p, q = special.gammainc(1.0 / beta, t), special.gammaincc(1.0 / beta, t)
  p, q = np.concatenate([[0.0], p, [1.0]]), np.concatenate([[1.0], q, [0.0]])
  # Differences of whichever of P, Q is small keep tail masses accurate.
  magnitude_mass = np.where(p[:-1] < 0.5, p[1:] - p[:-1], q[:-1] - q[1:])
  magnitude_mass = np.maximum(magnitude_mass, 0.0)
  probabilities = np.zeros(256)
  probabilities[fp.encode(levels, fmt)] = magnitude_mass * np.where(levels > 0, 0.5, 1.0)
  probabilities[fp.encode(-levels[1:], fmt)] = 0.5 * magnitude_mass[1:]
  return probabilities


def entropy_bits(fmt: fp.FloatFormat, beta: float, alpha: float, scale: float) -> float:
  """Entropy in bits per symbol of fp.encode(x, fmt, scale) for x ~ GenNorm(beta, alpha, 0).

  Example:
    >>> round(entropy_bits(fp.FP4, 1.0, 1.0, fp4_scale(1.0, 1.0)), 2)
    2.78
  """
  probabilities = symbol_probabilities(fmt, beta, alpha, scale)
  probabilities = probabilities[probabilities > 0]
  return float(-np.sum(probabilities * np.log2(probabilities)))


def wasserstein2(x: ArrayLike, dist: GenNormFit) -> float:
  """1-D W2 distance between the sample x and `dist`: sorted x against quantiles at (i+0.5)/n.

  A normal is GenNormFit(2.0, sigma * sqrt(2), loc), a Laplace GenNormFit(1.0, b, loc).

  Example:
    >>> x = sample(0, 1.0, 1.0, (10_000,))
    >>> wasserstein2(x, fit(x, beta=1.0)) < wasserstein2(x, fit(x, beta=2.0))
    True
  """
  x = np.sort(np.asarray(x, np.float64).ravel())
  if x.size == 0:
    raise ValueError("wasserstein2 needs a non-empty sample.")
  _check_parameters(dist.beta, dist.alpha, dist.loc)
  model = ppf((np.arange(x.size) + 0.5) / x.size, dist.beta, dist.alpha, dist.loc)
  return float(np.sqrt(np.mean((x - model) ** 2)))


def validate(grads: Any, max_samples: int = 100_000, min_size: int = 64,
             loc: float | None = 0.0, seed: int = 0) -> dict[str, dict[str, float]]:
  """Fits every leaf of a gradient pytree and measures how well GenNorm, normal, Laplace fit.

  Leaves over `max_samples` values are subsampled with a fixed seed; leaves under `min_size`
  or with fewer than 2 non-zero values are left out. Returns
  {leaf path: {"beta", "alpha", "w2_normal", "w2_laplace", "w2_gennorm"}}.

  Example:
    >>> report = validate({"w": sample(0, 0.8, 1e-3, (4096,))})
    >>> sorted(report["['w']"])
    ['alpha', 'beta', 'w2_gennorm', 'w2_laplace', 'w2_normal']
  """
  report = {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(grads):
    values = np.asarray(leaf, np.float64).ravel()
    if values.size > max_samples:
      rng = np.random.default_rng(seed)  # per leaf, so a leaf's result ignores its neighbours
      values = values[np.sort(rng.integers(0, values.size, max_samples))]
    centre = float(np.median(values)) if loc is None and values.size else loc
    if values.size < min_size or np.count_nonzero(values - centre) < 2:
      continue
    gennorm = fit(values, loc=centre)
    report[jax.tree_util.keystr(path)] = {
        "beta": gennorm.beta,
        "alpha": gennorm.alpha,
        "w2_normal": wasserstein2(values, fit(values, loc=gennorm.loc, beta=2.0)),
        "w2_laplace": wasserstein2(values, fit(values, loc=gennorm.loc, beta=1.0)),
        "w2_gennorm": wasserstein2(values, gennorm),
    }
  return report
