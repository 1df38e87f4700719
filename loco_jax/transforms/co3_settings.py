"""CO3's settings: `co3()`'s arguments checked and resolved once, when it is built."""

from typing import Any, NamedTuple

import jax

from loco_jax.codecs import fp
from loco_jax.transforms.co3_host import default_capacity_bits, usual_capacity_bits

GATHERS = ("bf16", "coded")
COLLECTIVES = ("auto", "all_to_all", "all_gather")
FORMATS = {"fp4": fp.FP4, "fp8": fp.FP8}


class Co3Settings(NamedTuple):
  """`co3()`'s arguments, checked and resolved."""
  fmt: fp.FloatFormat
  gamma: float
  refit_interval: int
  entropy_code: bool
  axis_name: Any
  capacity_bits: float     # per symbol, of a coded slot
  gather: str
  collective: str
  specs: Any
  gather_capacity_bits: float | None  # per element, of the coded gather's slots (None: default)
  capacity_reach_bits: float | None = None  # per symbol, a slot with its extension (None: none)



def resolve(fmt, gamma, refit_interval, entropy_code, axis_name, capacity_bits, gather,
            collective, specs, gather_capacity_bits) -> Co3Settings:
  """`co3()`'s arguments checked and resolved; ValueError naming the argument otherwise."""
  if fmt not in FORMATS:
    raise ValueError(f"fmt must be one of {tuple(FORMATS)}, got {fmt!r}")
  if not (isinstance(gamma, jax.core.Tracer) or 0.0 <= float(gamma) <= 1.0):
    raise ValueError(f"gamma must be in [0, 1] (1 is classic error feedback, 0 none), "
                     f"got {gamma}")
  if isinstance(refit_interval, bool) or not isinstance(refit_interval, int) or refit_interval < 1:
    raise ValueError(f"refit_interval must be an int >= 1, got {refit_interval!r}")
  for name, bits in (("capacity_bits", capacity_bits),
                     ("gather_capacity_bits", gather_capacity_bits)):
    if bits is not None and not 0 < bits <= 8:
      raise ValueError(f"{name} must be in (0, 8] bits per symbol or None, got {bits}")
  if gather not in GATHERS or collective not in COLLECTIVES:
    raise ValueError(f"gather must be one of {GATHERS} and collective one of {COLLECTIVES}, "
                     f"got gather={gather!r}, collective={collective!r}")
  if gather_capacity_bits is not None and (gather != "coded" or not entropy_code):
    raise ValueError(f"gather_capacity_bits sizes the coded gather's slots: it needs "
                     f"gather='coded' and entropy_code=True, got gather={gather!r}, "
                     f"entropy_code={entropy_code}")
  if axis_name is None and (gather != "bf16" or collective != "auto"):
    raise ValueError("gather= and collective= choose how devices exchange: they need an "
                     "axis_name")
  if gather == "coded" and collective == "all_gather":
    raise ValueError("gather='coded' gathers averaged shards, which collective='all_gather' "
                     "does not make: choose one")
  if gather == "coded" and fmt != "fp4":
    raise ValueError(f"gather='coded' sends the exact sums of the devices' fp4 levels in a "
                     f"byte; {fmt}'s levels span too many steps for that: use gather='bf16'")
  small_float = FORMATS[fmt]
  if capacity_bits is None:
    capacity, reach = usual_capacity_bits(small_float), default_capacity_bits(small_float)
  else:
    capacity, reach = capacity_bits, None
  return Co3Settings(small_float, gamma, refit_interval, entropy_code, axis_name,
                     float(capacity), gather, collective, specs,
                     None if gather_capacity_bits is None else float(gather_capacity_bits),
                     reach)
