"""The model of one exchange step: its compiled collectives timed by a calibration, plus work.

A step's seconds = each collective the compiled program runs every step, at the calibrated
seconds of its op over its group at its buffer size (piecewise linear between the probed sizes,
the last segment's rate beyond them), plus what the first of them costs more, plus the
method's work outside the collectives (piecewise linear in the parameters through the probed
sizes), less what overlaps: collectives that the compiled program starts asynchronously, with
work scheduled before they finish, hide behind that work.
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
  """The method's work outside its collectives at `n_params`: piecewise linear through its
  probed sizes, since its cost a parameter changes with size (2 hosts, 1 Gb/s: loco's was 3.3 ns
  at 4M parameters and 5.1 ns at 16M, whose buffers outgrow the caches and the heap that stays
  mapped); beyond them, the nearest segment's slope (one size: proportional); never below 0.

  Example:
    >>> w = calib.MethodWork("loco", (2**20, 2**22, 2**24), (0.003, 0.010, 0.086))
    >>> round(work_seconds(w, 2**23), 4), round(work_seconds(w, 2**25), 4)
    (0.0353, 0.1873)
  """
  return max(_interpolate(work.n_params, work.seconds, n_params, floor=False), 0.0)


def find_work(calibration: calib.Calibration, method: str) -> calib.MethodWork:
  """The calibrated work of `method` (a ValueError listing the probed methods if absent)."""
  for w in calibration.work:
    if w.method == method:
      return w
  raise ValueError(f"the calibration has no work of method {method!r}; it holds "
                   f"{', '.join(w.method for w in calibration.work) or 'none'}: probe it")


def wire_seconds(calibration: calib.Calibration, found: Sequence,
                 overlapped: Sequence[bool] | None = None) -> tuple[float, float]:
  """(seconds of the synchronous collectives, of the overlapped ones) of one step.

  found: `comm.collectives_per_step` of the step's compiled program (op, dtype, nbytes,
  group_size, conditional). The conditional ones (CO3's raw resend after an overflow) are left
  out: a step that runs them is the exception. overlapped: per collective, whether it runs
  asynchronously with work scheduled before its end (`comm.async_collectives`).
  """
  overlapped = overlapped or [False] * len(found)
  if len(overlapped) != len(found):
    raise ValueError(f"overlapped must have one flag a collective ({len(found)}), got "
                     f"{len(overlapped)}")
  seconds = [0.0, 0.0]
  for c, hidden in zip(found, overlapped):
    if not c.conditional and c.group_size > 1:
      timing = find_timing(calibration, c.op, c.dtype, c.group_size)
      seconds[bool(hidden)] += collective_seconds(timing, c.nbytes)
  return seconds[0], seconds[1]


def predict(calibration: calib.Calibration, method: str, found: Sequence, n_params: int,
            overlapped: Sequence[bool] | None = None) -> StepPrediction:
  """The predicted exchange step of `method` at `n_params`, from its compiled collectives
  (`wire_seconds`): the overlapped ones hide behind the method's work, up to all of it."""
  synchronous, asynchronous = wire_seconds(calibration, found, overlapped)
  if any(not c.conditional and c.group_size > 1 for c in found):
    synchronous += calibration.first_s
  work = work_seconds(find_work(calibration, method), n_params)
  hidden_s = min(asynchronous, work)
  return StepPrediction(synchronous + asynchronous + work - hidden_s,
                        synchronous + asynchronous, work, hidden_s)
