"""How closely each exchange method trains like fp32: read from the long runs' records.

A long run (experiments/long_run.py, docs/records/long_runs*) trains one method for 10,000
steps; its fidelity is its final eval loss against `none` (float32 averaging) at the same seed
and step, in percent, averaged over seeds. An exchange method inherits the fidelity of the long
run whose numerics it shares (`SAME_NUMERICS`); one with no such run is "not measured".
"""

import json
import statistics
from pathlib import Path
from typing import NamedTuple

RECORDS = Path(__file__).resolve().parents[2] / "docs" / "records"
# Exchange method -> the long run with the same arithmetic on the gradient. Lossless coding and
# the order of a float32 sum change nothing a run can see; anything that rounds differently
# (LoCo's 4-bit gather, CO3's coded gather with its own error, int4 without feedback, ZeRO-2's
# bf16 parameter gather) is another method and needs its own run.
SAME_NUMERICS = {"fp32": "none", "zero2-fp32": "none", "bf16": "bf16", "loco": "loco4",
                 "loco-entropy": "loco4", "co3-fp4": "co3-fp4"}
MAX_GAP_PCT = 1.0   # the default bound on the final eval gap for a method's fidelity to hold


class Fidelity(NamedTuple):
  """A method's measured fidelity: the long run it is read from, its final gap in % (mean over
  seeds), the seeds, and whether it holds (gap <= the bound). gap_pct None: not measured."""
  run_method: str | None
  gap_pct: float | None
  seeds: int
  holds: bool


def _final_evals(folder: Path) -> dict[tuple[str, int], tuple[int, float]]:
  """{(method, seed): (last evaluated step, its eval loss)} of the runs under `folder`."""
  found = {}
  for config_path in sorted(folder.glob("*/config.json")):
    config = json.loads(config_path.read_text())
    last = None
    for line in (config_path.parent / "records.jsonl").read_text().splitlines():
      record = json.loads(line)
      if record.get("eval_loss") is not None:
        last = (record["step"], record["eval_loss"])
    if last is not None:
      found[(config["method"], config["seed"])] = last
  return found


def long_run_gaps(folder: Path = RECORDS / "long_runs") -> dict[str, tuple[float, int]]:
  """{long-run method: (final eval gap to `none` in %, mean over seeds; seeds)}, each run
  against `none` of its seed at the same last step (runs without one are left out)."""
  if not folder.is_dir():
    raise ValueError(f"no long-run records at {str(folder)!r} (docs/records/long_runs of the "
                     f"repository): pass the folder that holds them")
  finals = _final_evals(folder)
  gaps: dict[str, list[float]] = {}
  for (method, seed), (step, loss) in finals.items():
    reference = finals.get(("none", seed))
    if reference is not None and reference[0] == step:
      gaps.setdefault(method, []).append(100 * (loss / reference[1] - 1))
  return {m: (statistics.fmean(g), len(g)) for m, g in gaps.items()}


def fidelity(methods: list[str], max_gap_pct: float = MAX_GAP_PCT,
             folder: Path = RECORDS / "long_runs") -> dict[str, Fidelity]:
  """Each exchange method's fidelity from the long runs (`SAME_NUMERICS`)."""
  if not max_gap_pct >= 0:
    raise ValueError(f"max_gap_pct must be >= 0, got {max_gap_pct}")
  gaps = long_run_gaps(folder)
  out = {}
  for method in methods:
    run = SAME_NUMERICS.get(method)
    gap, seeds = gaps.get(run, (None, 0))
    out[method] = Fidelity(run if gap is not None else None, gap, seeds,
                           gap is not None and gap <= max_gap_pct)
  return out
