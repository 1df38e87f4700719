"""The model of one exchange step: its compiled collectives timed by a calibration, plus work.

A step's seconds = each collective the compiled program runs every step, at the calibrated
seconds of its op over its group at its buffer size (piecewise linear between the probed sizes,
the last segment's rate beyond them), plus the method's work outside the collectives (linear in
the parameters through the probed sizes), less what overlaps: collectives that the compiled
program starts asynchronously, with work scheduled before they finish, hide behind that work.
Nothing in it is set by hand: every number comes from `loco-jax probe` (`calibration`).
"""

import bisect
from typing import NamedTuple, Sequence

from loco_jax.apps import calibration as calib


class StepPrediction(NamedTuple):
  """A method's predicted exchange step and its parts, in seconds."""
  step_s: float
  collectives_s: float
  work_s: float
  hidden_s: float        # collectives' time overlapped by work (0 on XLA:CPU: all synchronous)


def _interpolate(xs: Sequence[float], ys: Sequence[float], x: float, floor: bool) -> float:
  """ys at x, piecewise linear through the points; beyond the last, the last segment's slope;
  below the first, the first value (`floor`: a latency) or the line through the first two."""
  if len(xs) == 1:
    return ys[0] if floor else ys[0] * x / xs[0]
  i = bisect.bisect_left(xs, x)
  if i == 0 and floor:
    return ys[0]
  i = min(max(i, 1), len(xs) - 1)
  x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
  return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def collective_seconds(timing: calib.CollectiveTiming, nbytes: float) -> float:
  """Seconds of one collective of `nbytes` (its whole buffer) by its calibrated timing.

  Example:
    >>> t = calib.CollectiveTiming("all-gather", "*", 4, (1e3, 1e6, 4e6), (1e-3, 0.02, 0.08))
    >>> round(collective_seconds(t, 8e6), 3), collective_seconds(t, 10)
    (0.16, 0.001)
  """
  return max(_interpolate(timing.nbytes, timing.seconds, nbytes, floor=True), 0.0)


def find_timing(calibration: calib.Calibration, op: str, dtype: str,
                group_size: int) -> calib.CollectiveTiming:
  """The calibrated timing of `op` over `group_size` devices (a reduction: in `dtype`); a
  ValueError naming the collective and what the calibration holds if it has none."""
  key = (op, calib.key_dtype(op, dtype), group_size)
  for t in calibration.collectives:
    if (t.op, t.dtype, t.group_size) == key:
      return t
  held = sorted({f"{t.op}:{t.dtype}:{t.group_size}" for t in calibration.collectives})
  raise ValueError(f"the calibration has no timing of {op} ({key[1]}) over {group_size} "
                   f"devices; it holds {', '.join(held) or 'none'}: probe that collective")


def work_seconds(work: calib.MethodWork, n_params: int) -> float:
  """The method's work outside its collectives at `n_params`, linear through the probed sizes
  (through zero with one size), never below zero.

  Example:
    >>> work_seconds(calib.MethodWork("loco", (2**18, 2**20), (0.004, 0.013)), 2**22)
    0.049
  """
  return max(_interpolate(work.n_params, work.seconds, n_params, floor=False), 0.0)


def find_work(calibration: calib.Calibration, method: str) -> calib.MethodWork:
  """The calibrated work of `method` (a ValueError listing the probed methods if absent)."""
  for w in calibration.work:
    if w.method == method:
      return w
  raise ValueError(f"the calibration has no work of method {method!r}; it holds "
                   f"{', '.join(w.method for w in calibration.work) or 'none'}: probe it")


def predict(calibration: calib.Calibration, method: str, found: Sequence, n_params: int,
            overlapped: Sequence[bool] | None = None) -> StepPrediction:
  """The predicted exchange step of `method` at `n_params`, from its compiled collectives.

  found: `comm.collectives_per_step` of the step's compiled program (op, dtype, nbytes,
  group_size, conditional). The conditional ones (CO3's raw resend after an overflow) are left
  out, as a step that runs them is the exception. overlapped: per collective, whether it runs
  asynchronously with work scheduled before its end (`comm.async_collectives`); those hide
  behind the work, up to all of it.
  """
  overlapped = overlapped or [False] * len(found)
  if len(overlapped) != len(found):
    raise ValueError(f"overlapped must have one flag a collective ({len(found)}), got "
                     f"{len(overlapped)}")
  synchronous = asynchronous = 0.0
  for c, hidden in zip(found, overlapped):
    if c.conditional or c.group_size < 2:
      continue
    seconds = collective_seconds(find_timing(calibration, c.op, c.dtype, c.group_size),
                                 c.nbytes)
    if hidden:
      asynchronous += seconds
    else:
      synchronous += seconds
  work = work_seconds(find_work(calibration, method), n_params)
  hidden_s = min(asynchronous, work)
  return StepPrediction(synchronous + asynchronous + work - hidden_s,
                        synchronous + asynchronous, work, hidden_s)
