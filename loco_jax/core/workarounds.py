"""XLA:CPU workarounds, in one place: what the CPU backend needs and GPU/TPU do not.

Each is on where `enabled()` is, and docs/results/backend_workarounds.md measures what
it buys; `LOCO_JAX_WORKAROUNDS=0` turns them all off.
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
  """`offsets` as values XLA cannot fold into constants, where `enabled()`.

  XLA:CPU compiles each distinct fusion once: a slice at a constant offset is distinct for
  every leaf, and slices of one shape at run-time offsets share one kernel. The offsets come
  out of a while loop that runs once (`count`, a step counter, is never negative).
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
  """Whether every gradient value is finite, checked before the step, which then keeps its
  own state on a skipped step: a select after it would copy a leaf that is a whole bucket, and
  its error. None where the step finds out by itself (not `enabled()`, an axis, no such leaf)."""
  if not (enabled() and local and has_bare_leaf):
    return None
  return functools.reduce(jnp.logical_and, [quant.all_finite(g) for g in gradient_buckets])
