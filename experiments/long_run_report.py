"""Tables and plots of experiments/long_run.py's runs (issue 27).

  python experiments/long_run_report.py runs/long            # writes runs/long/report/

Reads OUT/<run>/config.json and records.jsonl of every run; writes report.md (the final eval
loss against fp32's, `none`, at the same seed and step; the trend of that gap over the second
half; what each LoCo reset did; every run's wall time) and, with matplotlib, eval_loss.png,
gap.png and resets.png. A run still in progress is reported at its last evaluation.

The gap of a run at step t is 100 (eval(t) / eval_none(t) - 1) %, with `none` of its seed.
A reset at count k (the step that starts from a zeroed error) is judged on the train losses
of the `--window` steps before it and the `--window` steps from it: the change of their mean,
less the change of fp32's over the same steps (the same batches), in % of the loss before.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import NamedTuple

import numpy as np

import common

REFERENCE = "none"


class Run(NamedTuple):
  name: str
  config: dict
  records: list[dict]

  @property
  def method(self) -> str:
    return self.config["method"]

  @property
  def seed(self) -> int:
    return self.config["seed"]

  def eval_at(self) -> dict[int, float]:
    return {r["step"]: r["eval_loss"] for r in self.records if r["eval_loss"] is not None}

  def step_losses(self) -> np.ndarray:
    """Train loss of the step with count k at index k (NaN where not finite)."""
    return np.array([np.nan if x is None else x for r in self.records for x in r["train_losses"]])


def load_runs(out: Path) -> list[Run]:
  runs = []
  for config_path in sorted(out.glob("*/config.json")):
    records = common.read_jsonl(config_path.parent / "records.jsonl")
    if records:
      runs.append(Run(config_path.parent.name, json.loads(config_path.read_text()), records))
  if not runs:
    raise ValueError(f"no runs under {out}: expected folders <method>-s<seed> holding "
                     f"config.json and records.jsonl (experiments/long_run.py)")
  return runs


def reset_interval(run: Run) -> int:
  """The run's LoCo reset interval (0: none, or not LoCo), from its method's -r<N> or default."""
  import long_run
  return long_run.parse_method(run.method)[1] or 0


def reference(run: Run, runs: list[Run]) -> Run | None:
  return next((r for r in runs if r.method == REFERENCE and r.seed == run.seed), None)


def gaps(run: Run, ref: Run) -> tuple[np.ndarray, np.ndarray]:
  """(steps, gap in %) at the evaluations both runs have."""
  mine, theirs = run.eval_at(), ref.eval_at()
  steps = np.array(sorted(set(mine) & set(theirs)), dtype=int)
  return steps, np.array([100 * (mine[s] / theirs[s] - 1) for s in steps])


def trend(steps: np.ndarray, gap: np.ndarray, total: int, band: float) -> tuple[float, str]:
  """(change of the gap over the second half in points, from a least-squares line, and
  'grows' / 'shrinks' / 'holds' against `band` points)."""
  late = steps >= total / 2
  if late.sum() < 3:
    return float("nan"), "too short"
  slope = np.polyfit(steps[late], gap[late], 1)[0]
  change = float(slope * (steps[late].max() - steps[late].min()))
  return change, "grows" if change > band else "shrinks" if change < -band else "holds"


class ResetEffect(NamedTuple):
  count: int            # the reset's step (the count before it)
  train_effect: float   # % of the loss before: the change of the window's mean less fp32's
  eval_effect: float    # % : eval after over eval before, relative to fp32's same ratio


def reset_effects(run: Run, ref: Run, window: int, shift: int = 0) -> list[ResetEffect]:
  """Each reset's effect; with `shift`, the same measure that many steps after each reset
  (halfway between two: what the measure gives where nothing happens, its noise)."""
  interval, losses, base = reset_interval(run), run.step_losses(), ref.step_losses()
  mine, theirs = run.eval_at(), ref.eval_at()
  out = []
  for k in range(interval + shift, len(losses), interval) if interval else ():
    if k - window < 0 or k + window > min(len(losses), len(base)):
      continue
    before, after = slice(k - window, k), slice(k, k + window)
    change = lambda x: np.mean(x[after]) - np.mean(x[before])
    train = 100 * (change(losses) - change(base)) / np.mean(losses[before])
    prior = max((s for s in mine if s <= k and s in theirs), default=None)
    later = min((s for s in mine if s > k and s in theirs), default=None)
    evaluated = float("nan") if prior is None or later is None else 100 * (
        mine[later] / mine[prior] / (theirs[later] / theirs[prior]) - 1)
    out.append(ResetEffect(k, float(train), evaluated))
  return out


# --- Markdown -------------------------------------------------------------------------------------

def runs_table(runs: list[Run]) -> str:
  lines = ["| run | steps | final eval | fp32 eval | gap % | wall h:mm | segments | step ms |",
           "|---|---|---|---|---|---|---|---|"]
  for run in runs:
    last, ref = run.records[-1], reference(run, runs)
    theirs = ref.eval_at().get(last["step"]) if ref else None
    gap = "n/a" if theirs is None or last["eval_loss"] is None else \
        f"{100 * (last['eval_loss'] / theirs - 1):+.2f}"
    steps = f"{last['step']}/{run.config['steps']}"
    ms = [r["step_time_s"] for r in run.records if r["step_time_s"]]
    wall = int(last["wall_s"])
    lines.append(f"| {run.name} | {steps} | {last['eval_loss']:.4f} | "
                 f"{'n/a' if theirs is None else f'{theirs:.4f}'} | {gap} | "
                 f"{wall // 3600}:{wall % 3600 // 60:02d} | {last['segment'] + 1} | "
                 f"{f'{1e3 * np.median(ms):.0f}' if ms else 'n/a'} |")
  return "\n".join(lines)


def methods_table(runs: list[Run], band: float) -> str:
  lines = [f"| method | seeds | final gap %, mean ± std | gap change over the second half, "
           f"points (per seed) | trend (band ±{band}) |", "|---|---|---|---|---|"]
  methods = list(dict.fromkeys(r.method for r in runs if r.method != REFERENCE))
  for method in methods:
    finals, changes, labels = [], [], []
    for run in (r for r in runs if r.method == method):
      ref = reference(run, runs)
      if ref is None:
        continue
      steps, gap = gaps(run, ref)
      if not len(steps):
        continue
      finals.append(gap[-1])
      change, label = trend(steps, gap, run.config["steps"], band)
      changes.append(change)
      labels.append(label)
    if finals:
      lines.append(f"| {method} | {len(finals)} | {common.mean_std(finals)} | "
                   + ", ".join(f"{c:+.2f}" for c in changes) + f" | {', '.join(labels)} |")
  return "\n".join(lines)


def resets_table(runs: list[Run], window: int) -> str:
  lines = ["| run | reset at step | train loss, change vs fp32, % | eval after/before vs fp32, % "
           "|", "|---|---|---|---|"]
  for run in runs:
    ref = reference(run, runs)
    for effect in reset_effects(run, ref, window) if ref else ():
      lines.append(f"| {run.name} | {effect.count} | {effect.train_effect:+.2f} | "
                   f"{effect.eval_effect:+.2f} |")
    halfway = reset_effects(run, ref, window, reset_interval(run) // 2) if ref else []
    if halfway:
      lines.append(f"| {run.name} | halfway between resets (none there), {len(halfway)} "
                   f"places | {common.mean_std([e.train_effect for e in halfway])} | "
                   f"{common.mean_std([e.eval_effect for e in halfway])} |")
  return "\n".join(lines)


def report(runs: list[Run], window: int, band: float) -> str:
  return "\n\n".join([
      "# Long runs", "## Runs (final evaluation; gap: against none at the same seed and step)",
      runs_table(runs), "## Methods: final gap and its trend over the second half",
      methods_table(runs, band),
      f"## LoCo's resets ({window} steps before against {window} from the reset step)",
      resets_table(runs, window)]) + "\n"


# --- Plots ----------------------------------------------------------------------------------------

def plot(runs: list[Run], folder: Path, window: int) -> bool:
  """eval_loss.png, gap.png, resets.png; False without matplotlib."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return False
  from loco_jax.train import files
  fig, ax = plt.subplots(figsize=(8, 5))
  for run in runs:
    at = run.eval_at()
    ax.plot(list(at), list(at.values()), label=run.name, lw=1)
  ax.set(xlabel="step", ylabel="held-out loss", title="Eval loss", yscale="log")
  ax.legend(fontsize=7)
  ax.grid(alpha=0.3)
  files.save_figure_atomic(fig, folder / "eval_loss.png")
  plt.close(fig)

  fig, ax = plt.subplots(figsize=(8, 5))
  for run in runs:
    ref = reference(run, runs)
    if run.method != REFERENCE and ref is not None:
      steps, gap = gaps(run, ref)
      ax.plot(steps, gap, label=run.name, lw=1)
  ax.axhline(0, color="k", lw=0.8)
  ax.set(xlabel="step", ylabel="eval loss vs none at the same seed, %", title="Gap to fp32")
  ax.legend(fontsize=7)
  ax.grid(alpha=0.3)
  files.save_figure_atomic(fig, folder / "gap.png")
  plt.close(fig)

  fig, ax = plt.subplots(figsize=(8, 5))
  offsets = np.arange(-window, window)
  for run in runs:
    ref = reference(run, runs)
    if ref is None:
      continue
    losses, base = run.step_losses(), ref.step_losses()
    around = [losses[e.count - window:e.count + window] - base[e.count - window:e.count + window]
              for e in reset_effects(run, ref, window)]
    color = f"C{runs.index(run) % 10}"
    for line in around:
      ax.plot(offsets, line, lw=0.5, alpha=0.3, color=color)
    if around:
      ax.plot(offsets, np.mean(around, axis=0), lw=2, color=color,
              label=f"{run.name} (mean of {len(around)} resets)")
  ax.axvline(0, color="k", lw=0.8)
  ax.set(xlabel="steps from the reset (0: the step from a zeroed error)",
         ylabel="train loss - none's on the same batch", title="Around each reset")
  ax.legend(fontsize=7)
  ax.grid(alpha=0.3)
  files.save_figure_atomic(fig, folder / "resets.png")
  plt.close(fig)
  return True


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("runs", help="the --out folder of experiments/long_run.py")
  ap.add_argument("--out", default=None, help="where to write (default RUNS/report)")
  ap.add_argument("--window", type=int, default=25, help="steps on each side of a reset")
  ap.add_argument("--band", type=float, default=0.25,
                  help="gap change (points) over the second half below which it holds")
  args = ap.parse_args(argv)
  try:
    runs = load_runs(Path(args.runs))
  except ValueError as e:
    print(f"long_run_report: error: {e}", file=sys.stderr)
    return 2
  folder = Path(args.out or Path(args.runs) / "report")
  folder.mkdir(parents=True, exist_ok=True)
  text = report(runs, args.window, args.band)
  common.write_text_atomic(folder / "report.md", text)
  plotted = plot(runs, folder, args.window)
  print(text + (f"\nwrote {folder}" + ("" if plotted else " (no plots: no matplotlib)")))
  return 0


if __name__ == "__main__":
  sys.exit(main())
