"""LoCo's settings: defaults by bit width and argument checks.

`loco` and `two_hop` resolve their arguments here once, when the transformation is built.

Arguments left at None take the default for `bits` (chosen by the sweep in
docs/results/training.md, "Low-bit LoCo"):

  bits     scale_method  clip_rms  block_size  beta  error_bits   payload bits/param
  2        rms           1.5       128         0.8   8            2 + 32/128 = 2.25
  3        rms           3.0       256         0.8   8            3 + 32/256 = 3.125
  others   absmax        -         2048        0.8   8            bits + 32/2048

(the scales are float32, one per block, sent with the codes). `loco(bits=4)` is the paper's
recipe.
"""

from typing import NamedTuple

import jax
import numpy as np

from loco_jax.core import args, quant

GATHER_MODES = ("bf16", "quantized")

BIT_WIDTH_DEFAULTS = {
    2: dict(scale_method="rms", clip_rms=1.5, block_size=128, beta=0.8, error_bits=8),
    3: dict(scale_method="rms", clip_rms=3.0, block_size=256, beta=0.8, error_bits=8),
}
PAPER_DEFAULTS = dict(scale_method="absmax", clip_rms=None, block_size=2048, beta=0.8,
                      error_bits=8)


def defaults_for(bits: int) -> dict:
  """The settings `loco(bits=bits)` uses for arguments left at None.

  Example:
    >>> defaults_for(2)["scale_method"], defaults_for(4)["block_size"]
    ('rms', 2048)
  """
  return dict(BIT_WIDTH_DEFAULTS.get(bits, PAPER_DEFAULTS))


class LocoSettings(NamedTuple):
  """LoCo's step settings, every default filled in."""
  bits: int
  scale: float | None          # None: absmax (or rms) block scales; a float: the fixed scale
  error_bits: int
  error_scale: float | None    # None: absmax block scales for the stored error
  beta: float | jax.Array      # traced under optax.inject_hyperparams
  reset_interval: int
  block_size: int
  scale_method: str
  clip_rms: float | None


def _scaling(bits: int, scale, scale_method, clip_rms, table: dict) -> tuple[str, float | None]:
  """(scale_method, clip_rms) with the width's defaults; ValueError where they contradict."""
  if scale is not None:
    if scale_method not in (None, "absmax") or clip_rms is not None:
      raise ValueError(f"a fixed scale={scale!r} replaces the block scales: scale_method="
                       f"{scale_method!r} and clip_rms={clip_rms!r} do not apply to it")
    return "absmax", None
  if scale_method is None:
    scale_method = table["scale_method"]
    if clip_rms is not None and scale_method != "rms":
      raise ValueError(f"clip_rms={clip_rms!r} needs scale_method='rms' (the default at "
                       f"bits={bits} is {scale_method!r})")
  if scale_method == "rms" and clip_rms is None:
    if table["clip_rms"] is None:
      raise ValueError(f"scale_method='rms' at bits={bits} has no default clip_rms: pass one "
                       f"(the top code sits at clip_rms x the block's rms; 2 bits use "
                       f"{BIT_WIDTH_DEFAULTS[2]['clip_rms']}, 3 bits "
                       f"{BIT_WIDTH_DEFAULTS[3]['clip_rms']})")
    clip_rms = table["clip_rms"]
  if not args.is_concrete(clip_rms):
    raise ValueError("clip_rms must be a Python float: the kernel bakes it in (under "
                     "optax.inject_hyperparams pass it in static_args)")
  args.check_scale_method(scale_method, clip_rms)
  return scale_method, clip_rms


def _check_scale(name: str, value) -> None:
  # Both s and 1 / s must be normal float32 numbers: CPUs and GPUs flush subnormals, and then
  # q / s is NaN (0 / 0) or inf for s below 2**-126, and silently 0 for s above 2**126.
  if value is not None and args.is_concrete(value) and not (
      np.isfinite(value) and quant.TINY <= float(value) <= 1 / quant.TINY):
    raise ValueError(f"{name} must be None (block scales) or a float in [2**-126, 2**126] "
                     f"(s and 1 / s normal float32), got {value}")


def resolve(bits: int = 4, scale: float | None = None, error_bits: int | None = None,
            error_scale: float | None = None, beta: float | None = None,
            reset_interval: int = 1024, block_size: int | None = None,
            scale_method: str | None = None, clip_rms: float | None = None) -> LocoSettings:
  """LoCo's arguments checked and completed with `defaults_for(bits)`.

  Raises:
    ValueError: an argument out of range, of the wrong kind, or contradicting another.

  Example:
    >>> resolve(bits=2).block_size, resolve(bits=4, beta=0.5).beta
    (128, 0.5)
  """
  args.check_bits(bits)
  table = defaults_for(int(bits))
  pick = lambda value, name: table[name] if value is None else value
  block_size, beta, error_bits = (pick(block_size, "block_size"), pick(beta, "beta"),
                                  pick(error_bits, "error_bits"))
  scale_method, clip_rms = _scaling(bits, scale, scale_method, clip_rms, table)
  args.check_bits(error_bits, "error_bits")
  args.check_int(reset_interval, "reset_interval (0 never resets)", 0)
  args.check_int(block_size, "block_size", 1)
  args.check_fraction(beta, "beta (0 is classic error feedback)", 0.0, 1.0)
  _check_scale("scale", scale)
  _check_scale("error_scale", error_scale)
  return LocoSettings(int(bits), scale, int(error_bits), error_scale, beta,
                      int(reset_interval), int(block_size), scale_method, clip_rms)
