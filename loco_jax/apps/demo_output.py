"""The demo's results: the table and its summary, loss_curves.csv and .png, written as one set."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, NamedTuple, Sequence

import numpy as np

from loco_jax.train import files

OUTPUTS = ("results.json", "loss_curves.csv", "loss_curves.png")
RESULT_KEYS = ("method", "final_loss", "eval_loss", "gradient_bits_per_param",
               "wire_bits_per_param", "step_time_s")


class MethodResult(NamedTuple):
  """One method's run. `as_json` gives the results.json record."""
  method: str
  final_loss: float              # mean train loss over the last 10% of steps
  eval_loss: float               # mean loss on the held-out batches after the last step
  gradient_bits_per_param: float  # the gradient collective's buffer (payload + scales), from HLO
  wire_bits_per_param: float      # sent per device per step, every collective, from HLO (co3:
                                  # the mean over the steps, with the conditional ones run)
  step_time_s: float             # median wall time of a step (after compilation)
  losses: list[float]            # train loss of every step
  compile_s: float
  state_bytes_per_device: int    # the compressor's state on one device
  collectives: list[Any]         # comm.Collective of the lowered step
  co3: dict | None = None        # co3 methods: `co3_record`

  def as_json(self) -> dict[str, Any]:
    """The results.json record; a diverged (non-finite) loss is null."""
    finite = lambda v: v if not isinstance(v, float) or math.isfinite(v) else None
    record = {k: finite(getattr(self, k)) for k in RESULT_KEYS}
    return record if self.co3 is None else {**record, "co3": self.co3}


def clock(seconds: float) -> str:
  seconds = int(seconds) if math.isfinite(seconds) else 0
  return f"{seconds // 60}:{seconds % 60:02d}"


def write_outputs(folder: Path, results: Sequence[MethodResult], title: str) -> bool:
  """results.json, loss_curves.csv and loss_curves.png into `folder`; False if no PNG
  (matplotlib missing)."""
  files.write_json_atomic(folder / "results.json", [r.as_json() for r in results])
  write_curves(folder / "loss_curves.csv", results)
  return plot_curves(folder / "loss_curves.png", results, title)


def format_table(results: Sequence[MethodResult], unavailable: dict[str, str] | None = None) -> str:
  """The demo's table: losses (and their change against `none`), bits, step time."""
  base = next((r for r in results if r.method == "none"), None)
  rel = lambda v, b: "" if base is None or not math.isfinite(v) else f"{100 * (v / b - 1):+.1f}%"
  width = max([12] + [len(r.method) for r in results])
  header = (f"{'method':<{width}} {'train loss':>10} {'vs none':>8} {'eval loss':>10} {'vs none':>8} "
            f"{'grad bits':>9} {'wire bits':>9} {'step s':>7}")
  lines = [header, "-" * len(header)]
  for r in results:
    lines.append(
        f"{r.method:<{width}} {r.final_loss:>10.4f} "
        f"{rel(r.final_loss, base.final_loss if base else 1):>8} {r.eval_loss:>10.4f} "
        f"{rel(r.eval_loss, base.eval_loss if base else 1):>8} "
        f"{r.gradient_bits_per_param:>9.2f} {r.wire_bits_per_param:>9.2f} {r.step_time_s:>7.3f}")
  for method, why in (unavailable or {}).items():
    lines.append(f"{method:<{width}} unavailable: {why}")
  lines.append("grad bits: the gradient collective's buffer (codes + scales) * 8 / params; wire "
               "bits: what each device sends per parameter and step, over every collective "
               "(ring all-reduce 2(n-1)/n; co3: the mean over the steps, with the conditional "
               "ones on the steps that ran them); both read from the step's lowered HLO.")
  return "\n".join(lines)


def write_curves(path: Path, results: Sequence[MethodResult]) -> None:
  """loss_curves.csv: step, then one train-loss column per method (written atomically)."""
  rows = ["step," + ",".join(r.method for r in results)]
  for i in range(max((len(r.losses) for r in results), default=0)):
    rows.append(f"{i + 1}," + ",".join(f"{r.losses[i]:.5f}" if i < len(r.losses) else ""
                                       for r in results))
  files.write_atomic(path, "\n".join(rows) + "\n")


def plot_curves(path: Path, results: Sequence[MethodResult], title: str = "") -> bool:
  """loss_curves.png with matplotlib (False, and nothing written, if it is not installed)."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return False
  base = next((np.asarray(r.losses) for r in results if r.method == "none"), None)
  fig, axes = plt.subplots(1, 2 if base is not None else 1, figsize=(12, 4.8), dpi=100,
                           squeeze=False)
  ax, diff = axes[0][0], (axes[0][1] if base is not None else None)
  for r in results:
    y = np.asarray(r.losses)
    k = max(len(y) // 25, 1)  # moving average over ~4% of the run
    smooth = lambda v: np.convolve(v, np.ones(k) / k, mode="valid")
    line, = ax.plot(np.arange(k, len(y) + 1), smooth(y), lw=1.6,
                    label=f"{r.method} (eval {r.eval_loss:.3f}, {r.wire_bits_per_param:.0f} b/p)")
    ax.plot(np.arange(1, len(y) + 1), y, lw=0.5, alpha=0.25, color=line.get_color())
    if diff is not None and len(y) == len(base):
      diff.plot(np.arange(k, len(y) + 1), smooth(y - base), lw=1.4, color=line.get_color(),
                label=r.method)
  finite = [v for r in results for v in r.losses[len(r.losses) // 5:] if math.isfinite(v)]
  if finite:
    lo, hi = min(finite), max(finite)
    ax.set_ylim(lo - 0.05 * (hi - lo), hi + 0.3 * (hi - lo))
  ax.set_xlabel("step")
  ax.set_ylabel("train loss (nats / byte)")
  ax.set_title(title or "loco-jax demo: train loss per method", fontsize=10)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  if diff is not None:
    gaps = [v for r in results if len(r.losses) == len(base)
            for v in (np.asarray(r.losses) - base)[len(base) // 5:] if math.isfinite(v)]
    if gaps:
      spread = max(np.percentile(np.abs(gaps), 98), 1e-3)
      diff.set_ylim(-spread, spread)
    diff.axhline(0, color="k", lw=0.6)
    diff.set_xlabel("step")
    diff.set_ylabel("train loss minus none's (same batches)")
    diff.set_title("the cost of compression (below 0: better than fp32)", fontsize=10)
    diff.grid(alpha=0.3)
  fig.tight_layout()
  files.save_figure_atomic(fig, path)
  plt.close(fig)
  return True


def summary(results: Sequence[MethodResult]) -> str:
  """Two sentences that read the table for a newcomer."""
  by = {r.method: r for r in results}
  if "none" not in by:
    return ""
  base = by["none"].eval_loss
  pct = lambda m: 100 * (by[m].eval_loss / base - 1)
  parts = []
  if "loco4" in by:
    parts.append(f"LoCo-4 sends {by['loco4'].gradient_bits_per_param:.2f} gradient bits a "
                 f"parameter instead of {by['none'].gradient_bits_per_param:.0f} and ends "
                 f"{pct('loco4'):+.1f}% from uncompressed on held-out text")
  if "int4-noef" in by:
    parts.append(f"the same 4 bits without error feedback end {pct('int4-noef'):+.1f}%")
  if "ef4" in by:
    parts.append(f"classic error feedback {pct('ef4'):+.1f}%")
  return ("; ".join(parts) + ". One seed: differences under ~1% are within seed noise "
          "(docs/results/training.md has the sweep).") if parts else ""
