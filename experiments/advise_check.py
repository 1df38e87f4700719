"""Holds `loco-jax advise` to netbench's measured steps (issue 48): per record, the model's step
against the measured median, and what advise would have chosen there against the fastest
measured method and fp32. The model's step is computed here from the record's compiled
collectives and the calibration probe measured on the same hosts and links
(docs/records/calibration/netbench_<hosts>hosts_<rate>.json), as netbench --calibration does.

  python experiments/advise_check.py docs/records/advise_4hosts_*.json [--json OUT]

A setting run more than once (netbench again, the same hosts and options) is measured by the
median of its runs' medians: at 10 Gb/s on hosts that share two cores, three identical runs of
a method span 17-23% (the median over methods) and up to 2x (docs/results/advise.md).

Targets: every method's step predicted within 15%; the advised method's measured step within
10% of the fastest measured method whose fidelity holds (advise recommends no other) and at
most 5% over fp32's. Exit 1 if a target is missed.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from loco_jax.apps import advise, fidelity, netbench_report, netns, step_model  # noqa: E402
from loco_jax.apps import calibration as calib  # noqa: E402
from loco_jax.train import files  # noqa: E402

PREDICTION_TOLERANCE = 0.15
BEST_TOLERANCE = 0.10
FP32_TOLERANCE = 0.05
# What runs of one method at one setting share: the compiled program and how the hosts ran.
SAME_SETTING = ("collectives", "host_cpus", "host_malloc")


def settings(records: list[dict], calibrations: Path) -> dict[tuple, list[dict]]:
  """The exchange records by (hosts, rate, params), one a method, each with the model's
  `predicted_step_s` from its setting's calibration; a method run more than once has the
  median of its runs' steps as `step_s` and every run's in `runs_s`."""
  runs: dict[tuple, list[dict]] = {}
  for r in records:
    if r.get("kind", "result") != "train":
      runs.setdefault((r["hosts"], r["rate"], r["n_params"], r["method"]), []).append(r)
  found: dict[tuple, list[dict]] = {}
  for (hosts, rate, n_params, method), same in runs.items():
    for key in SAME_SETTING:
      if any(r.get(key) != same[0].get(key) for r in same):
        raise SystemExit(f"the runs of {method} at {hosts} hosts, {rate}, {n_params} params "
                         f"differ in {key}: they are not one setting")
    cal = calib.read(calibrations / f"netbench_{hosts}hosts_{rate}.json")
    runs_s = [r["step_s"] for r in same]
    found.setdefault((hosts, rate, n_params), []).append(dict(
        same[0], step_s=statistics.median(runs_s), runs_s=runs_s,
        predicted_step_s=netbench_report.predicted_step(cal, method, same[0]["collectives"],
                                                        n_params)))
  return found


def check(rows: list[dict]) -> dict:
  """One setting's summary: each method's error, the advised method and how it fared."""
  fid = fidelity.fidelity([r["method"] for r in rows])
  measured = {r["method"]: r["step_s"] for r in rows}
  fp32 = next(r for r in rows if r["method"] == "fp32")
  advice = [advise.MethodAdvice(
      r["method"], step_model.StepPrediction(r["predicted_step_s"], 0.0, 0.0, 0.0),
      r["predicted_step_s"] / fp32["predicted_step_s"], r["predicted_bits_per_param"],
      fid[r["method"]]) for r in rows]
  chosen, why = advise.recommend(advice)
  best = min((m for m in measured if fid[m].holds), key=measured.get)
  fastest = min(measured, key=measured.get)
  return {
      "hosts": rows[0]["hosts"], "rate": rows[0]["rate"], "n_params": rows[0]["n_params"],
      "errors": {r["method"]: r["step_s"] / r["predicted_step_s"] - 1 for r in rows},
      "measured_s": measured, "runs_s": {r["method"]: r["runs_s"] for r in rows},
      "predicted_s": {r["method"]: r["predicted_step_s"] for r in rows},
      "advised": chosen, "why": why, "best_measured": best, "fastest_any_fidelity": fastest,
      "advised_vs_best": measured[chosen] / measured[best] - 1,
      "advised_vs_fp32": measured[chosen] / measured["fp32"] - 1}


def _runs(runs_s: list[float]) -> str:
  """' (the median of runs of A, B, C ms)' for a method run more than once, else ''."""
  if len(runs_s) == 1:
    return ""
  return f" (the median of runs of {', '.join(f'{t * 1e3:.1f}' for t in runs_s)} ms)"


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("records", nargs="+", help="netbench --json files (one level)")
  p.add_argument("--calibrations", default=str(advise.CALIBRATIONS),
                 help="the folder of probe's calibrations, netbench_<hosts>hosts_<rate>.json")
  p.add_argument("--json", default=None, help="write the summaries here (atomically)")
  args = p.parse_args(argv)
  records = [r for path in args.records for r in json.loads(Path(path).read_text())]
  summaries = sorted((check(rows) for rows in settings(records, Path(args.calibrations)).values()),
                     key=lambda s: (s["hosts"], netns.rate_bits(s["rate"]), s["n_params"]))
  if not summaries:
    print("no exchange records in the files")
    return 1
  failures = []
  print("| hosts | rate | params | runs | methods within 15% | worst (method) | advised | "
        "fastest measured whose fidelity holds | advised vs it | advised vs fp32 |")
  print("|---|---|---|---|---|---|---|---|---|---|")
  for s in summaries:
    where = f"{s['hosts']} hosts, {s['rate']}, {s['n_params']} params"
    worst = max(s["errors"], key=lambda m: abs(s["errors"][m]))
    held = sum(abs(off) <= PREDICTION_TOLERANCE for off in s["errors"].values())
    runs = max(map(len, s["runs_s"].values()))
    print(f"| {s['hosts']} | {s['rate']} | {s['n_params']} | {runs} | {held} of "
          f"{len(s['errors'])} | {s['errors'][worst]:+.1%} ({worst}) | {s['advised']} | "
          f"{s['best_measured']} | "
          f"{s['advised_vs_best']:+.1%} | {s['advised_vs_fp32']:+.1%} |")
    failures += [f"{where}: {method} measured {s['measured_s'][method] * 1e3:.1f} ms"
                 f"{_runs(s['runs_s'][method])}, {off:+.1%} off its prediction "
                 f"({s['predicted_s'][method] * 1e3:.1f} ms)"
                 for method, off in s["errors"].items() if abs(off) > PREDICTION_TOLERANCE]
    if s["advised_vs_best"] > BEST_TOLERANCE or s["advised_vs_fp32"] > FP32_TOLERANCE:
      against = f"against the fastest, {s['best_measured']}"
      if s["best_measured"] != "fp32":
        against += f", and {s['advised_vs_fp32']:+.1%} against fp32"
      failures.append(f"{where}: advised {s['advised']} took {s['advised_vs_best']:+.1%} "
                      f"{against}")
  for f in failures:
    print(f"MISSED: {f}")
  if args.json:
    files.write_json_atomic(args.json, summaries, indent=1)
  return 1 if failures else 0


if __name__ == "__main__":
  sys.exit(main())
