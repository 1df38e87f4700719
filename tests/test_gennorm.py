"""Tests for loco_jax.codecs.gennorm: fit, sampling, quantiles, fp symbol entropy, W2 validation."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from loco_jax.codecs import fp
from loco_jax.codecs import gennorm

BETAS = [0.4, 0.7, 1.0, 2.0, 3.0]


def _empirical_entropy_bits(symbols: np.ndarray) -> float:
  frequencies = np.bincount(symbols.ravel(), minlength=256) / symbols.size
  frequencies = frequencies[frequencies > 0]
  return float(-np.sum(frequencies * np.log2(frequencies)))


@pytest.mark.numerics
@pytest.mark.parametrize("beta", BETAS)
def test_fit_recovers_beta_and_alpha(beta):
  alpha = 3e-3
  x = gennorm.sample(np.random.default_rng(int(beta * 10)), beta, alpha, (200_000,))
  result = gennorm.fit(x)
  assert result.loc == 0.0
  assert abs(result.beta / beta - 1) < 0.03, result
  assert abs(result.alpha / alpha - 1) < 0.06, result  # alpha's spread is 1.3% at beta 0.4


@pytest.mark.slow
@pytest.mark.numerics
def test_fit_of_jax_samples_and_estimated_loc():
  x = gennorm.sample(jax.random.key(0), 0.8, 2.0, (100_000,), loc=0.5)
  assert isinstance(x, jax.Array) and x.dtype == jnp.float32
  result = gennorm.fit(x, loc=None)
  assert abs(result.loc - 0.5) < 0.02
  assert abs(result.beta / 0.8 - 1) < 0.03 and abs(result.alpha / 2.0 - 1) < 0.05


@pytest.mark.numerics
def test_fixed_beta_gives_the_closed_form_alpha():
  x = gennorm.sample(1, 1.5, 1.0, (10_000,))
  normal = gennorm.fit(x, beta=2.0)
  laplace = gennorm.fit(x, beta=1.0)
  assert normal.beta == 2.0 and laplace.beta == 1.0
  np.testing.assert_allclose(normal.alpha, math.sqrt(2 * np.mean(x * x)), rtol=1e-12)
  np.testing.assert_allclose(laplace.alpha, np.mean(np.abs(x)), rtol=1e-12)


def test_fit_maximizes_the_likelihood():
  x = gennorm.sample(2, 0.6, 1.0, (20_000,))
  best = gennorm.fit(x)

  def log_likelihood(beta, alpha):
    return np.sum(math.log(beta / (2 * alpha)) - math.lgamma(1 / beta)
                  - (np.abs(x) / alpha) ** beta)

  top = log_likelihood(best.beta, best.alpha)
  for db, da in [(1.01, 1), (0.99, 1), (1, 1.01), (1, 0.99), (1.01, 1.01), (0.99, 0.99)]:
    assert log_likelihood(best.beta * db, best.alpha * da) < top


@pytest.mark.numerics
def test_fit_agrees_with_scipy():
  x = gennorm.sample(3, 0.9, 0.1, (20_000,))
  ours = gennorm.fit(x)
  beta, _, alpha = stats.gennorm.fit(x, floc=0.0)
  assert abs(ours.beta / beta - 1) < 2e-3 and abs(ours.alpha / alpha - 1) < 2e-3
  assert (np.sum(stats.gennorm.logpdf(x, ours.beta, scale=ours.alpha))
          >= np.sum(stats.gennorm.logpdf(x, beta, scale=alpha)) - 1e-6)


@pytest.mark.numerics
def test_fit_keeps_zeros_and_bounds_beta():
  x = gennorm.sample(4, 1.0, 1.0, (10_000,))
  x[:2000] = 0.0  # dead units give exact zeros; the density is finite there
  assert gennorm.BETA_RANGE[0] <= gennorm.fit(x).beta < 1.0
  uniform = np.random.default_rng(5).uniform(-1, 1, 10_000)
  assert gennorm.fit(uniform).beta > 8.0


@pytest.mark.parametrize("bad", [np.array([1.0, np.nan, 2.0]), np.array([1.0, np.inf, 2.0]),
                                 np.zeros(100), np.array([0.0, 0.0, 3.0]), np.array([])])
def test_fit_rejects_unusable_input(bad):
  with pytest.raises(ValueError, match="fit needs"):
    gennorm.fit(bad)


def test_fit_rejects_bad_beta():
  with pytest.raises(ValueError, match="beta must be positive"):
    gennorm.fit(np.array([1.0, -2.0, 3.0]), beta=-1.0)


@pytest.mark.numerics
def test_cdf_and_ppf_agree_with_scipy():
  quantiles = np.array([1e-9, 1e-4, 0.1, 0.3, 0.5, 0.7, 0.9, 1 - 1e-4, 1 - 1e-9])
  for beta in [0.3, 1.0, 2.0, 5.0]:
    np.testing.assert_allclose(gennorm.ppf(quantiles, beta, 1.3, 0.2),
                               stats.gennorm.ppf(quantiles, beta, loc=0.2, scale=1.3),
                               rtol=1e-10, atol=1e-12)
    x = np.linspace(-8, 8, 41)
    np.testing.assert_allclose(gennorm.cdf(x, beta, 1.3, 0.2),
                               stats.gennorm.cdf(x, beta, loc=0.2, scale=1.3), rtol=1e-12)


@pytest.mark.numerics
def test_cdf_and_ppf_known_values():
  # Normal (beta 2, alpha sqrt 2) and Laplace (beta 1) closed forms, no scipy needed.
  assert abs(gennorm.ppf(0.975, 2.0, math.sqrt(2.0)) - 1.959963984540054) < 1e-12
  assert abs(gennorm.cdf(1.0, 2.0, math.sqrt(2.0)) - 0.8413447460685429) < 1e-14
  q = np.array([1e-12, 0.01, 0.25, 0.6, 0.99, 1 - 1e-12])
  laplace = np.where(q < 0.5, np.log(2 * q), -np.log(2 * (1 - q)))
  np.testing.assert_allclose(gennorm.ppf(q, 1.0, 1.0), laplace, rtol=1e-10)
  for beta in [0.4, 3.0]:
    np.testing.assert_allclose(gennorm.cdf(gennorm.ppf(q, beta, 2.0), beta, 2.0), q, rtol=1e-9)
  edges = gennorm.ppf(np.array([0.0, 0.5, 1.0, 1.5]), 0.7, 1.0)
  assert edges[0] == -np.inf and edges[1] == 0.0 and edges[2] == np.inf and np.isnan(edges[3])


@pytest.mark.slow
@pytest.mark.numerics
def test_sample_moments():
  beta, alpha = 0.7, 2.0
  expected_abs_mean = alpha * math.exp(math.lgamma(2 / beta) - math.lgamma(1 / beta))
  numpy_sample = gennorm.sample(np.random.default_rng(6), beta, alpha, (200_000,))
  # Same shape as the other jax sample: jax.random.gamma compiles once per shape (seconds).
  jax_sample = np.asarray(gennorm.sample(jax.random.key(6), beta, alpha, (100_000,)))
  for x in (numpy_sample, jax_sample):
    assert abs(np.mean(np.abs(x)) / expected_abs_mean - 1) < 0.015
    assert abs(np.mean(x > 0) - 0.5) < 0.005


@pytest.mark.numerics
def test_fp4_scale_polynomial():
  assert abs(gennorm.fp4_scale(0.5, 1.0) - 0.054) < 1e-3
  assert abs(gennorm.fp4_scale(1.0, 1.0) - 0.65) < 1e-9
  assert abs(gennorm.fp4_scale(2.0, 1.0) - 1.76) < 1e-9
  assert abs(gennorm.fp4_scale(1.0, 4.0) - 0.65 / 4.0) < 1e-9
  betas = np.linspace(0.0, 5.0, 501)
  assert np.all(gennorm.fp4_scale(betas, 1.0) >= 0.0009)
  scales = jax.jit(gennorm.fp4_scale)(jnp.asarray([0.5, 1.0, 2.0]), 1.0)
  np.testing.assert_allclose(np.asarray(scales), [0.05375, 0.65, 1.76], rtol=1e-5)


def test_fp4_scale_is_near_the_mse_optimum():
  for beta in [0.5, 1.0, 2.0]:
    x = gennorm.sample(np.random.default_rng(7), beta, 1.0, (100_000,))
    candidates = gennorm.fp4_scale(beta, 1.0) * np.array([0.7, 1.0, 1.4])
    errors = [np.mean((fp.quantize(x, fp.FP4, s) - x) ** 2) for s in candidates]
    assert np.argmin(errors) == 1


@pytest.mark.numerics
@pytest.mark.parametrize("fmt", [fp.FP4, fp.FP8], ids=["fp4", "fp8"])
@pytest.mark.parametrize("beta", [0.5, 1.0, 2.0])
def test_symbol_probabilities_match_encoded_samples(fmt, beta):
  alpha = 0.01
  scale = gennorm.fp4_scale(beta, alpha) if fmt == fp.FP4 else 1.0 / alpha
  probabilities = gennorm.symbol_probabilities(fmt, beta, alpha, scale)
  assert probabilities.shape == (256,)
  assert abs(probabilities.sum() - 1.0) < 1e-12 and np.all(probabilities >= 0)
  possible = np.isfinite(fp.decode(np.arange(256, dtype=np.uint8), fmt))
  assert np.all(probabilities[~possible] == 0)
  symbols = fp.encode(gennorm.sample(np.random.default_rng(8), beta, alpha, (200_000,)), fmt,
                      scale)
  frequencies = np.bincount(symbols, minlength=256) / symbols.size
  assert np.max(np.abs(frequencies - probabilities)) < 0.004
  assert abs(gennorm.entropy_bits(fmt, beta, alpha, scale)
             - _empirical_entropy_bits(symbols)) < 0.01


@pytest.mark.numerics
def test_entropy_matches_the_papers_fp4_numbers():
  # CO3 (REFERENCES.md): fp4 entropy at the MSE-optimal scale 1.82, 2.78, 3.25 bits.
  for beta, bits in [(0.5, 1.82), (1.0, 2.78), (2.0, 3.25)]:
    assert abs(gennorm.entropy_bits(fp.FP4, beta, 1.0, gennorm.fp4_scale(beta, 1.0))
               - bits) < 0.01
  assert 5.4 < gennorm.entropy_bits(fp.FP8, 1.0, 1.0, 1.0) < 6.3


@pytest.mark.numerics
def test_symbol_probabilities_keep_tail_mass():
  # Far-tail symbols get their small but non-zero mass (a Huffman table needs them).
  # beta 2, alpha 1, scale 0.5: |x| * 0.5 > 2.5 (midway from 2 to 3) has mass erfc(5) ~ 1.5e-12.
  probabilities = gennorm.symbol_probabilities(fp.FP4, 2.0, 1.0, 0.5)
  top = fp.encode(np.array([3.0, -3.0]), fp.FP4)
  np.testing.assert_allclose(probabilities[top], 0.5 * math.erfc(5.0), rtol=1e-9)


def test_bad_scale_raises():
  with pytest.raises(ValueError, match="scale must be positive"):
    gennorm.symbol_probabilities(fp.FP4, 1.0, 1.0, 0.0)


@pytest.mark.numerics
def test_wasserstein_is_zero_for_exact_quantiles():
  n = 1000
  dist = gennorm.GenNormFit(0.8, 1.5, 0.3)
  x = gennorm.ppf((np.arange(n) + 0.5) / n, *dist)
  assert gennorm.wasserstein2(np.random.default_rng(9).permutation(x), dist) < 1e-12
  assert gennorm.wasserstein2(x + 0.1, dist) == pytest.approx(0.1, rel=1e-9)


@pytest.mark.numerics
def test_validate_picks_the_right_family():
  rng = np.random.default_rng(10)
  grads = {
      "laplace": jnp.asarray(rng.laplace(0.0, 1e-3, (300, 300)), jnp.float32),
      "normal": rng.normal(0.0, 1e-3, (20_000,)),
      "peaked": {"w": gennorm.sample(rng, 0.5, 1e-3, (20_000,))},
      "bias": np.ones(10),  # too small to fit: left out
      "frozen": np.zeros(1000),  # nothing to fit: left out
  }
  report = gennorm.validate(grads, max_samples=20_000)
  assert set(report) == {"['laplace']", "['normal']", "['peaked']['w']"}
  laplace, normal, peaked = report["['laplace']"], report["['normal']"], report["['peaked']['w']"]
  assert abs(laplace["beta"] - 1.0) < 0.05 and abs(normal["beta"] - 2.0) < 0.15
  assert laplace["w2_laplace"] < 0.3 * laplace["w2_normal"]
  assert laplace["w2_gennorm"] < 0.3 * laplace["w2_normal"]
  assert normal["w2_normal"] < 0.3 * normal["w2_laplace"]
  assert normal["w2_gennorm"] < 0.3 * normal["w2_laplace"]
  assert peaked["w2_gennorm"] < min(peaked["w2_normal"], peaked["w2_laplace"])
  # Subsampling is deterministic and per leaf: a leaf alone gives the same numbers.
  alone = gennorm.validate({"laplace": grads["laplace"]}, max_samples=20_000)
  assert alone["['laplace']"] == laplace


# ----------------------------------------------------------------------------- parameters

BAD_PARAMETERS = [  # (beta, alpha, loc), the parameter named in the error
    ((0.0, 1.0, 0.0), "beta"), ((-1.0, 1.0, 0.0), "beta"), ((float("nan"), 1.0, 0.0), "beta"),
    ((float("inf"), 1.0, 0.0), "beta"), ((1e4, 1.0, 0.0), "beta"),
    ((1.0, 0.0, 0.0), "alpha"), ((1.0, -2.0, 0.0), "alpha"), ((1.0, float("nan"), 0.0), "alpha"),
    ((1.0, float("inf"), 0.0), "alpha"), ((1.0, 1.0, float("nan")), "loc"),
    ((1.0, 1.0, float("inf")), "loc")]


@pytest.mark.parametrize("params,name", BAD_PARAMETERS)
def test_distribution_functions_reject_bad_parameters(params, name):
  beta, alpha, loc = params
  calls = [lambda: gennorm.cdf(0.3, beta, alpha, loc), lambda: gennorm.ppf(0.7, beta, alpha, loc),
           lambda: gennorm.sample(0, beta, alpha, (3,), loc),
           lambda: gennorm.sample(jax.random.key(0), beta, alpha, (3,), loc),
           lambda: gennorm.wasserstein2(np.ones(3), gennorm.GenNormFit(beta, alpha, loc))]
  if loc == 0.0:  # the symbol model is centred at 0: no loc argument
    calls += [lambda: gennorm.symbol_probabilities(fp.FP4, beta, alpha, 1.0),
              lambda: gennorm.entropy_bits(fp.FP8, beta, alpha, 1.0)]
  for call in calls:
    with pytest.raises(ValueError, match=f"{name} must be"):
      call()


@pytest.mark.numerics
def test_fit_rejects_bad_loc_and_unrepresentable_spreads():
  x = np.array([1.0, -2.0, 3.0, 0.5])
  for loc in (float("nan"), float("inf")):
    with pytest.raises(ValueError, match="loc must be finite"):
      gennorm.fit(x, loc=loc)
  with pytest.raises(ValueError, match="beta must be positive"):
    gennorm.fit(x, beta=float("nan"))
  with pytest.raises(ValueError, match="overflows"):
    gennorm.fit(np.array([1e308, 5e307, -1e308]), loc=-1e308)
  denormal = np.random.default_rng(0).normal(size=1000) * 5e-324  # alpha would be 0.0
  with pytest.raises(ValueError, match="normal float64"):
    gennorm.fit(denormal)
  tiny = np.random.default_rng(0).normal(size=1000) * 1e-300  # small but normal: fits
  assert gennorm.fit(tiny).alpha == pytest.approx(np.sqrt(2) * 1e-300, rel=0.1)


def test_fp4_scale_rejects_bad_parameters():
  for beta, alpha in [(float("nan"), 1.0), (-1.0, 1.0), (1.0, 0.0), (1.0, float("inf")),
                      (np.array([1.0, 2.0]), np.array([1.0, -1.0]))]:
    with pytest.raises(ValueError, match="fp4_scale needs"):
      gennorm.fp4_scale(beta, alpha)


@pytest.mark.numerics
@settings(max_examples=60, deadline=None)
@given(st.floats(-3.0, 3.0), st.floats(-300.0, 300.0), st.floats(-300.0, 300.0),
       st.floats(0.0, 1.0))
def test_distribution_functions_terminate_and_stay_consistent(log_beta, log_alpha, log_x, q):
  """Across the accepted range: finite probabilities, no hang, ppf inverts cdf where the
  inverse is well conditioned."""
  beta, alpha = 10.0 ** log_beta, 10.0 ** log_alpha
  if not gennorm.BETA_LIMITS[0] < beta <= gennorm.BETA_LIMITS[1]:
    return
  x = 10.0 ** log_x
  p = gennorm.cdf(np.array([-x, x]), beta, alpha)
  assert np.all((p >= 0) & (p <= 1)) and p[0] <= 0.5 <= p[1]
  assert np.isclose(p[0] + p[1], 1.0, rtol=0, atol=1e-12)
  quantile = gennorm.ppf(q, beta, alpha)
  assert not np.isnan(quantile)
  if 1e-6 < q < 1 - 1e-6 and 0.1 <= beta <= 10 and np.isfinite(quantile) and quantile != 0:
    assert float(gennorm.cdf(quantile, beta, alpha)) == pytest.approx(q, rel=1e-6)
  probabilities = gennorm.symbol_probabilities(fp.FP4, beta, 1.0, 1.0)
  assert np.all(np.isfinite(probabilities)) and probabilities.sum() == pytest.approx(1.0)


@pytest.mark.numerics
def test_ppf_with_nan_beta_returns_promptly():
  """The tester's hang: ppf(0.7, nan, 1.0) never returned."""
  with pytest.raises(ValueError, match="beta must be"):
    gennorm.ppf(0.7, float("nan"), 1.0)
  # At the smallest shapes the true quantile (~1000**1000) overflows: +inf, not NaN.
  assert gennorm.ppf(0.7, gennorm.BETA_LIMITS[0] * 1.001, 1.0) == np.inf
  assert 0 < gennorm.ppf(0.7, gennorm.BETA_LIMITS[1], 1.0) < 1
