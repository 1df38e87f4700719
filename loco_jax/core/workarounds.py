"""XLA:CPU workarounds, in one place: what the CPU backend needs and GPU/TPU do not.

Each one is on where `enabled()` is, and each is justified by a measurement in
docs/PERFORMANCE.md ("Backend workarounds"). Setting `LOCO_JAX_WORKAROUNDS=0` turns them all
off, so that a benchmark can measure what they still buy:

- `opaque_offsets`: bucket take-out offsets XLA cannot see as constants. XLA:CPU compiles
  each distinct fusion once, and a slice at a constant offset is distinct for every leaf.
- `finite_first`: in local mode, a leaf that is a whole bucket is checked for finiteness
  before the step, which then keeps its own state on a skipped step. A select after the step
  would copy the bucket and the error.
"""

import functools
import os
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from loco_jax.core import quant


def enabled() -> bool:
  """Whether the workarounds apply: on XLA:CPU, unless `LOCO_JAX_WORKAROUNDS=0`."""
  return jax.default_backend() == "cpu" and os.environ.get("LOCO_JAX_WORKAROUNDS") != "0"


def opaque_offsets(offsets: Sequence[int], count: jax.Array) -> list:
  """`offsets` as values XLA cannot fold into constants, where `enabled()`; else as they are.

  Leaves of one shape at offsets known only at run time share one compiled kernel. The
  offsets come out of a while loop that runs once (`count`, a step counter, is never
  negative) and passes them through a max with its index.
  """
  if not enabled():
    return list(offsets)

  def body(carry):
    i, k, values = carry
    return i + 1, k, [jnp.maximum(v, i) for v in values]

  _, _, values = jax.lax.while_loop(lambda c: c[0] < 1 + jnp.minimum(c[1], 0), body,
                                    (jnp.int32(0), count.astype(jnp.int32),
                                     [np.int32(b) for b in offsets]))
  return values


def finite_first(gradient_buckets: Sequence[jax.Array], local: bool,
                 has_bare_leaf: bool) -> jax.Array | None:
  """Whether every gradient value is finite, checked before the step; None where the step
  should find out by itself (not `enabled()`, an axis, or no leaf that is a whole bucket)."""
  if not (enabled() and local and has_bare_leaf):
    return None
  return functools.reduce(jnp.logical_and, [quant.all_finite(g) for g in gradient_buckets])
