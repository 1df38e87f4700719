"""Argument checks shared by the transformations: ValueErrors that say what was accepted."""

import jax
import numpy as np

from loco_jax.core import quant

# Arguments that fix shapes or kernels must be Python values, also under inject_hyperparams.
STATIC_HINT = (" (under optax.inject_hyperparams pass it in static_args, e.g. static_args=("
               "'bits', 'error_bits', 'reset_interval', 'block_size', 'axis_name', 'gather', "
               "'scatter', 'scale_method', 'clip_rms'))")


def is_concrete(x) -> bool:
  """Whether `x` is a Python or numpy value, not a tracer (inject_hyperparams traces floats)."""
  return not isinstance(x, jax.core.Tracer)


def check_int(value, name: str, minimum: int) -> None:
  """ValueError unless `value` is a Python int >= `minimum`."""
  kind = "a positive int" if minimum == 1 else f"an int >= {minimum}"
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise ValueError(f"{name} must be {kind} (a Python int), got {value!r}{STATIC_HINT}")
  if value < minimum:
    raise ValueError(f"{name} must be {kind}, got {value}")


def check_bits(value, name: str = "bits") -> None:
  """`quant.check_bits`, with the inject_hyperparams hint."""
  try:
    quant.check_bits(value, name)
  except ValueError as e:
    raise ValueError(str(e) + STATIC_HINT) from None


def check_scale_method(scale_method: str, clip_rms) -> None:
  """`quant.check_scale_method`, with the inject_hyperparams hint."""
  try:
    quant.check_scale_method(scale_method, clip_rms)
  except ValueError as e:
    raise ValueError(str(e) + STATIC_HINT) from None


def check_fraction(value, name: str, low: float, high: float, closed_low: bool = True) -> None:
  """ValueError unless a concrete `value` lies in [low, high] ((low, high] without
  `closed_low`); traced values (inject_hyperparams) pass."""
  if not is_concrete(value):
    return
  try:
    x = float(value)
  except (TypeError, ValueError):
    raise ValueError(f"{name} must be a float, got {value!r}") from None
  if not (low <= x if closed_low else low < x) or not x <= high:
    raise ValueError(f"{name} must be in {'[' if closed_low else '('}{low:g}, {high:g}], got "
                     f"{value}")
