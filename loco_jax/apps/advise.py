"""`loco-jax advise`: which exchange method to train with on a calibrated cluster, and why.

For --params parameters it compiles each method's exchange step for the calibration's devices
(XLA:CPU, the compiler `probe` ran under on netbench's hosts), predicts its step with
`step_model`, and prints per method the step, its ratio to fp32's, the bits a device sends per
parameter, and the fidelity the long runs measured for it (`fidelity`). It recommends the
fastest method whose fidelity holds; fp32 or bf16 where no other is faster by --margin.
"""

import argparse
import sys
from pathlib import Path
from typing import NamedTuple, Sequence

from loco_jax.apps import calibration as calib
from loco_jax.apps import fidelity as fidelity_lib
from loco_jax.apps import step_model
from loco_jax.apps.netbench_methods import METHODS

CALIBRATIONS = fidelity_lib.RECORDS / "calibration"   # probe's runs on netbench's hosts
PLAIN = ("fp32", "bf16")   # what to keep when compression does not pay
MARGIN = 0.03              # a plain method within 3% of the fastest is preferred to it


class MethodAdvice(NamedTuple):
  """One method's row: its predicted step, its ratio to fp32's, its bits and its fidelity."""
  method: str
  prediction: step_model.StepPrediction
  vs_fp32: float
  bits_per_param: float
  fidelity: fidelity_lib.Fidelity


class Advice(NamedTuple):
  """Every method's row, the recommended method and the reason for it."""
  rows: tuple[MethodAdvice, ...]
  recommended: str
  why: str


def stored_calibration(hosts: int, rate: str) -> Path:
  """The calibration probe measured on `hosts` netbench hosts at `rate` (docs/records); a
  ValueError listing those there are if there is none."""
  path = CALIBRATIONS / f"netbench_{hosts}hosts_{rate}.json"
  if not path.is_file():
    have = sorted(p.stem.removeprefix("netbench_") for p in CALIBRATIONS.glob("netbench_*.json"))
    raise ValueError(f"no stored calibration for --hosts {hosts} --rate {rate}; stored: "
                     f"{', '.join(have) or 'none'} (or run `loco-jax probe` on your cluster "
                     f"and pass --calibration)")
  return path


def compiled_collectives(method: str, n_params: int, devices: int,
                         chunk_bytes: int | None) -> list:
  """The collectives one exchange step of `method` runs on `devices` devices, its collectives
  cut as the cluster cuts them (`chunk_bytes`, `comm.wire.chunking`). Compiled here: this
  process needs that many devices, e.g. jax_num_cpu_devices."""
  import jax
  from loco_jax import comm
  from loco_jax.comm import wire
  from loco_jax.apps import netbench_methods
  from loco_jax.train import parallel
  if jax.device_count() < devices:
    raise ValueError(f"compiling for {devices} devices needs them here, found "
                     f"{jax.device_count()}: set jax_num_cpu_devices before jax starts")
  mesh = parallel.data_mesh(devices)
  step, state = netbench_methods.exchange_step(method, n_params, mesh)
  grads = jax.ShapeDtypeStruct((devices, n_params), jax.numpy.float32,
                               sharding=jax.sharding.NamedSharding(mesh, jax.P("data")))
  with wire.chunking(chunk_bytes):   # at trace time, where the pieces are cut
    text = step.lower(grads, state).compile().as_text()
  return comm.collectives_per_step(text, devices)


def recommend(rows: Sequence[MethodAdvice], margin: float = MARGIN) -> tuple[str, str]:
  """(method, why): the fastest whose fidelity holds; a plain one within `margin` of it wins."""
  holding = [r for r in rows if r.fidelity.holds]
  if not holding:
    raise ValueError("no method's fidelity holds: none can be recommended")
  best = min(holding, key=lambda r: r.prediction.step_s)
  plain = [r for r in holding if r.method in PLAIN]
  if best.method not in PLAIN and plain:
    simple = min(plain, key=lambda r: r.prediction.step_s)
    if simple.prediction.step_s <= best.prediction.step_s * (1 + margin):
      return simple.method, (f"{best.method} is at most {margin:.0%} faster than "
                             f"{simple.method}: compression does not pay")
  return best.method, (f"the fastest method whose fidelity holds, at {best.vs_fp32:.2f}x "
                       f"fp32's step")


def advise(calibration: calib.Calibration, n_params: int, methods: Sequence[str] | None = None,
           max_gap_pct: float = fidelity_lib.MAX_GAP_PCT, margin: float = MARGIN,
           records: Path = fidelity_lib.RECORDS / "long_runs") -> Advice:
  """Each calibrated method's predicted step at `n_params`, and the recommendation.

  Example:
    >>> advice = advise(calib.read("cal.json"), 4 * 2**20)   # doctest: +SKIP
  """
  if n_params < 1:
    raise ValueError(f"n_params must be >= 1, got {n_params}")
  methods = list(methods or [w.method for w in calibration.work])
  if "fp32" not in methods:
    raise ValueError(f"the methods must include fp32 (the reference), got {methods}")
  unknown = [m for m in methods if m not in METHODS]
  if unknown:
    raise ValueError(f"unknown methods {unknown}; known: {', '.join(METHODS)}")
  from loco_jax import comm
  fidelities = fidelity_lib.fidelity(methods, max_gap_pct, records)
  predicted = {}
  for method in methods:
    found = compiled_collectives(method, n_params, calibration.devices,
                                 calibration.chunk_bytes)
    predicted[method] = (step_model.predict(calibration, method, found, n_params),
                         comm.wire_bits_per_param(found, n_params))
  fp32_s = predicted["fp32"][0].step_s
  rows = tuple(MethodAdvice(m, p, p.step_s / fp32_s, bits, fidelities[m])
               for m, (p, bits) in predicted.items())
  return Advice(rows, *recommend(rows, margin))


def format_advice(advice: Advice, n_params: int) -> list[str]:
  lines = [f"{n_params} parameters: predicted exchange step per method", "",
           "| method | step ms | vs fp32 | collectives ms | work ms | bits/param sent | "
           "fidelity: final eval gap vs fp32 (long run) |", "|---|---|---|---|---|---|---|"]
  for r in sorted(advice.rows, key=lambda r: r.prediction.step_s):
    f = r.fidelity
    fid = ("not measured" if f.gap_pct is None else
           f"{f.gap_pct:+.2f}% ({f.run_method}, {f.seeds} seed{'s' * (f.seeds > 1)}): "
           f"{'holds' if f.holds else 'does not hold'}")
    p = r.prediction
    lines.append(f"| {r.method} | {p.step_s * 1e3:.1f} | {r.vs_fp32:.2f}x | "
                 f"{p.collectives_s * 1e3:.1f} | {p.work_s * 1e3:.1f} | "
                 f"{r.bits_per_param:.2f} | {fid} |")
  return lines + ["", f"recommended: {advice.recommended} ({advice.why})"]


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="loco-jax advise", description=__doc__.split("\n")[0])
  p.add_argument("--params", type=int, required=True, help="gradient parameters a step")
  p.add_argument("--calibration", default=None, help="a file `loco-jax probe` wrote")
  p.add_argument("--hosts", type=int, default=None,
                 help="with --rate instead of --calibration: the stored calibration probe "
                      "measured on this many netbench hosts")
  p.add_argument("--rate", default=None, help="with --hosts: their link rate, e.g. 1gbit")
  p.add_argument("--methods", default=None,
                 help="comma-separated (default: every method the calibration holds)")
  p.add_argument("--max-gap", type=float, default=fidelity_lib.MAX_GAP_PCT,
                 help="a method's fidelity holds if its long run's final eval loss is at most "
                      "this many %% above fp32's")
  p.add_argument("--margin", type=float, default=MARGIN,
                 help="fp32 or bf16 is kept unless another method is faster by this fraction")
  return p


def _calibration(args) -> calib.Calibration:
  if args.calibration is not None and (args.hosts is not None or args.rate is not None):
    raise ValueError("--calibration and --hosts/--rate exclude each other: give one of them")
  if args.calibration is None and (args.hosts is None or args.rate is None):
    raise ValueError("give either --calibration FILE or both --hosts H and --rate R")
  return calib.read(args.calibration or stored_calibration(args.hosts, args.rate))


def main(argv: Sequence[str] | None = None) -> int:
  args = _parser().parse_args(argv)
  try:
    if args.params < 1:
      raise ValueError(f"--params must be >= 1, got {args.params}")
    if not args.margin >= 0:
      raise ValueError(f"--margin must be >= 0, got {args.margin}")
    calibration = _calibration(args)
    import jax
    try:   # XLA:CPU with the calibration's devices, where jax has not started yet
      jax.config.update("jax_platforms", "cpu")
      jax.config.update("jax_num_cpu_devices", calibration.devices)
    except RuntimeError:   # started (a caller's process): compiled_collectives checks its devices
      pass
    advice = advise(calibration, args.params, args.methods and args.methods.split(","),
                    args.max_gap, args.margin)
  except ValueError as e:
    print(f"advise: {e}", file=sys.stderr)
    return 2
  print("\n".join(format_advice(advice, args.params)))
  return 0


if __name__ == "__main__":
  sys.exit(main())
