"""CO3's scales: the GenNorm fit of each leaf (on the host, every `refit_interval` steps), the
absmax fallback for leaves with nothing to fit, and the capacity the fitted model implies."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from loco_jax.codecs import fp, gennorm
from loco_jax.comm import coded
from loco_jax.core import leaves

FIT_SAMPLES = 65_536      #: per leaf, strided: the fit needs the shape, not every value
CAPACITY_MARGIN_BITS = 0.3
#: fp8 only: what a stream of every leaf's shard codes to beyond its leaves' own entropies
#: (`default_capacity_bits`).
LEAF_MIXTURE_MARGIN_BITS = 0.4
MIN_BETA = 0.35           #: below it p(beta) is not a fit any more
SATURATION_QUANTILE = 0.99


def fitted_scale(fmt: fp.FloatFormat, beta: float, alpha: float) -> float:
  """The scale CO3 uses for a GenNorm(beta, alpha) layer: p(beta)/alpha for fp4, else 1/alpha.

  p is fitted for beta >= 0.35 (REFERENCES.md), so smaller shapes use p(0.35). fp8's MSE
  hardly depends on the scale in range, and 1/alpha keeps far from both its ends.
  """
  return gennorm.fp4_scale(max(beta, MIN_BETA), alpha) if fmt == fp.FP4 else 1.0 / alpha


BETAS = np.linspace(0.2, 3.0, 15)  #: the shapes of gradients seen in practice
#: A slot's usual size holds the fitted model's entropy for shapes in [MIN_BETA, USUAL_BETA]
#: (Laplace); the others (towards the Gaussian that late training tends to, CO3 paper Fig. 4,
#: or below where the model fits) take the slot's extension on the steps that need it
#: (`comm.coded`).
USUAL_BETA = 1.0
USUAL_BETAS = BETAS[(BETAS >= MIN_BETA) & (BETAS <= USUAL_BETA)]


def _capacity(fmt: fp.FloatFormat, betas) -> float:
  worst = max(gennorm.entropy_bits(fmt, b, 1.0, fitted_scale(fmt, b, 1.0)) for b in betas)
  mixture = LEAF_MIXTURE_MARGIN_BITS if fmt.exponent_bits > fp.FP4.exponent_bits else 0.0
  return min(worst + CAPACITY_MARGIN_BITS + mixture, float(fmt.bits))


def default_capacity_bits(fmt: fp.FloatFormat) -> float:
  """Bits per symbol that a coded slot holds with its extension: the largest entropy of the
  fitted model over beta in BETAS, plus a margin for Huffman's own overhead.

  fp8 reserves LEAF_MIXTURE_MARGIN_BITS more: one code table codes a shard of every leaf, and
  fp8's leaves sit on different binades, a mixture no per-leaf model sees; sized to the model
  alone its slots sent nearly every step raw (docs/results/co3.md). fp4's leaves share six
  magnitudes.
  """
  return _capacity(fmt, BETAS)


def usual_capacity_bits(fmt: fp.FloatFormat) -> float:
  """Bits per symbol that a coded slot always sends: as `default_capacity_bits`, over the
  shapes in USUAL_BETAS (fp4: 3.08 against 3.76; fp8: 7.02 against 7.26)."""
  return _capacity(fmt, USUAL_BETAS)


def _sum_entropy(n: int, beta: float) -> float:
  """Entropy of the sum of n independent fp4 symbols of the fitted GenNorm(beta) model."""
  fmt = fp.FP4
  values = fp.decode(np.arange(256, dtype=np.uint8), fmt)
  valid = np.isfinite(values)
  halves = np.rint(values[valid] * 2).astype(int)  # fp4 levels are halves
  p = gennorm.symbol_probabilities(fmt, beta, 1.0, fitted_scale(fmt, beta, 1.0))
  one = np.bincount(halves - halves.min(), weights=p[valid])
  total = functools.reduce(np.convolve, [one] * n)
  total = total[total > 0]
  return float(-(total * np.log2(total)).sum())


def _sum_capacity(n: int, betas) -> float:
  return min(max(_sum_entropy(n, b) for b in betas) + CAPACITY_MARGIN_BITS, 8.0)


@functools.lru_cache(maxsize=None)
def default_sum_capacity_bits(n: int) -> float:
  """Bits an element of a coded slot of the sums of n devices' fp4 levels, with its extension
  (gather="coded"): the largest entropy over BETAS of the sum of n independent symbols (the
  widest sum: shared signal narrows it), plus its margin."""
  return _sum_capacity(n, BETAS)


@functools.lru_cache(maxsize=None)
def usual_sum_capacity_bits(n: int) -> float:
  """Bits an element that a coded slot of the sums always sends: as
  `default_sum_capacity_bits`, over the shapes in USUAL_BETAS (4 devices: 4.19 against
  5.51)."""
  return _sum_capacity(n, USUAL_BETAS)


def absmax_scale(fmt: fp.FloatFormat, absmax, fallback):
  """max_value / absmax inside fp.scale_range (numpy or jnp); `fallback` where absmax is 0."""
  xp = jnp if isinstance(absmax, jax.Array) else np
  low, high = fp.scale_range(fmt)
  with np.errstate(divide="ignore", over="ignore"):  # absmax 0: replaced by the fallback
    scale = xp.clip(fp.max_value(fmt) / absmax, low, high).astype(np.float32)
  return xp.where(absmax > 0, scale, fallback)


def fit_scales(fmt: fp.FloatFormat, sizes: tuple[int, ...], previous: np.ndarray,
               absmax: np.ndarray, samples: np.ndarray) -> np.ndarray:
  """Host side: one GenNorm fit per leaf, inside fp.scale_range.

  A leaf that cannot be fitted (fewer than two non-zero sampled values) takes the absmax
  scale of the whole leaf, or keeps its scale if the leaf is all zeros.
  """
  scales, start = np.array(previous, np.float32), 0
  low, high = fp.scale_range(fmt)
  for i, n in enumerate(sizes):
    x = samples[start:start + n]
    start += n
    # Exact zeros (dead units, unused embedding rows) are coded exactly at any scale; left in,
    # a few percent of them pull the fitted beta to its floor and the scale with it.
    x = x[x != 0]
    try:
      fit = gennorm.fit(x)
    except ValueError:  # all zeros or a single value: nothing to fit
      scales[i] = absmax_scale(fmt, np.float32(absmax[i]), scales[i])
      continue
    # Where the data are heavier-tailed than the fit (tiny beta), cap the scale so that at
    # most 1% of the values saturate.
    tail = np.quantile(np.abs(x), SATURATION_QUANTILE)
    cap = fp.max_value(fmt) / tail if tail > 0 else np.inf
    # Clipped so that no level overflows on the way back, nor the scale underflows (fp8's
    # 1 / alpha of data near float32's maximum would be a denormal, flushed to 0).
    scales[i] = np.clip(min(fitted_scale(fmt, fit.beta, fit.alpha), cap), low, high)
  return scales


def _refit(fmt: fp.FloatFormat, samples: list[jax.Array], old_scales: jax.Array,
           absmax: jax.Array) -> jax.Array:
  """New per-leaf scales from one host call over the leaves' samples."""
  sizes = tuple(s.size for s in samples)
  fitted = coded.host_call(functools.partial(fit_scales, fmt, sizes),
                           jax.ShapeDtypeStruct(old_scales.shape, jnp.float32),
                           old_scales, absmax, jnp.concatenate(samples))
  return leaves.vary_like(fitted, old_scales)  # typed replicated; it is this device's own


def leaf_scales(fmt: fp.FloatFormat, values: list[jax.Array], old_scales: jax.Array,
                refit: jax.Array) -> jax.Array:
  """float32 [leaves]: each leaf's scale, refitted where `refit`, else kept; a leaf with fewer
  than two non-zero values has no shape to fit and takes max_value / max|x| every step."""
  absmax = jnp.stack([jnp.max(jnp.abs(a)) for a in values])
  # Strided samples, taken outside the cond: handed the whole leaves, XLA:CPU copies them into
  # the cond's operands on every step, refit or not.
  samples = [a[:: max(1, a.size // FIT_SAMPLES)][:FIT_SAMPLES] for a in values]
  fitted = jax.lax.cond(refit, lambda: _refit(fmt, samples, old_scales, absmax),
                        lambda: old_scales)
  unfittable = jnp.stack([jnp.count_nonzero(a) < 2 for a in values])
  return jnp.where(unfittable, absmax_scale(fmt, absmax, fitted), fitted)
