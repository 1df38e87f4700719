"""Holds `loco-jax advise` to netbench's measured steps (issue 48): per record, the model's step
against the measured median, and what advise would have chosen there against the fastest
measured method and fp32. The model's step is computed here from the record's compiled
collectives and the calibration probe measured on the same hosts and links
(docs/records/calibration/netbench_<hosts>hosts_<rate>.json), as netbench --calibration does.

  python experiments/advise_check.py docs/records/advise_4hosts_*.json [--json OUT]

Targets: every method's step predicted within 15%; the advised method's measured step within
10% of the fastest measured method whose fidelity holds (advise recommends no other) and at
most 5% over fp32's. Exit 1 if a target is missed.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from loco_jax.apps import advise, fidelity, netbench_report, netns, step_model  # noqa: E402
from loco_jax.apps import calibration as calib  # noqa: E402
from loco_jax.train import files  # noqa: E402

PREDICTION_TOLERANCE = 0.15
BEST_TOLERANCE = 0.10
FP32_TOLERANCE = 0.05


def settings(records: list[dict], calibrations: Path) -> dict[tuple, list[dict]]:
  """The exchange records by (hosts, rate, params), each with the model's `predicted_step_s`
  from its setting's calibration."""
  found: dict[tuple, list[dict]] = {}
  for r in records:
    if r.get("kind", "result") == "train":
      continue
    cal = calib.read(calibrations / f"netbench_{r['hosts']}hosts_{r['rate']}.json")
    predicted = netbench_report.predicted_step(cal, r["method"], r["collectives"], r["n_params"])
    rows = found.setdefault((r["hosts"], r["rate"], r["n_params"]), [])
    if any(row["method"] == r["method"] for row in rows):
      raise SystemExit(f"two records of {r['method']} at {r['hosts']} hosts, {r['rate']}, "
                       f"{r['n_params']} params: give one file a setting")
    rows.append(dict(r, predicted_step_s=predicted))
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
      "measured_s": measured, "predicted_s": {r["method"]: r["predicted_step_s"] for r in rows},
      "advised": chosen, "why": why, "best_measured": best, "fastest_any_fidelity": fastest,
      "advised_vs_best": measured[chosen] / measured[best] - 1,
      "advised_vs_fp32": measured[chosen] / measured["fp32"] - 1}


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
  print("| hosts | rate | params | methods within 15% | worst (method) | advised | "
        "fastest measured whose fidelity holds | advised vs it | advised vs fp32 |")
  print("|---|---|---|---|---|---|---|---|---|")
  for s in summaries:
    where = f"{s['hosts']} hosts, {s['rate']}, {s['n_params']} params"
    worst = max(s["errors"], key=lambda m: abs(s["errors"][m]))
    held = sum(abs(off) <= PREDICTION_TOLERANCE for off in s["errors"].values())
    print(f"| {s['hosts']} | {s['rate']} | {s['n_params']} | {held} of {len(s['errors'])} | "
          f"{s['errors'][worst]:+.1%} ({worst}) | {s['advised']} | {s['best_measured']} | "
          f"{s['advised_vs_best']:+.1%} | {s['advised_vs_fp32']:+.1%} |")
    failures += [f"{where}: {method} measured {s['measured_s'][method] * 1e3:.1f} ms, "
                 f"{off:+.1%} off its prediction ({s['predicted_s'][method] * 1e3:.1f} ms)"
                 for method, off in s["errors"].items() if abs(off) > PREDICTION_TOLERANCE]
    if s["advised_vs_best"] > BEST_TOLERANCE or s["advised_vs_fp32"] > FP32_TOLERANCE:
      failures.append(f"{where}: advised {s['advised']} took {s['advised_vs_best']:+.1%} "
                      f"against {s['best_measured']} and {s['advised_vs_fp32']:+.1%} "
                      f"against fp32")
  for f in failures:
    print(f"MISSED: {f}")
  if args.json:
    files.write_json_atomic(args.json, summaries, indent=1)
  return 1 if failures else 0


if __name__ == "__main__":
  sys.exit(main())
