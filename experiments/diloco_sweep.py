"""DiLoCo's inner steps H and outer learning rate on the demo GPT (issue 46): the eval loss of
each (method, H, outer lr) against the same run of `none` (a float32 all-reduce every step),
and the wire bits a parameter per step averaged over the run.

  python experiments/diloco_sweep.py --steps 2000 --inner-steps 8,16,32 --outer-lrs 0.5,0.7,1.0 \
      --methods diloco --out docs/records/diloco_sweep.json

Every run sees the same batches in the same order (the demo's corpus and seed). The record is
written whole after every run, so an interrupted sweep keeps what it measured; run again with
the same --out (and --steps, --devices), a sweep adds the runs the record does not hold yet.
"""

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from loco_jax.apps import demo
from loco_jax.train import files


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--steps", type=int, default=2000)
  p.add_argument("--methods", default="diloco", help="comma-separated demo DiLoCo methods")
  p.add_argument("--inner-steps", default="8,16,32", help="comma-separated H")
  p.add_argument("--outer-lrs", default="0.5,0.7,1.0", help="comma-separated outer rates")
  p.add_argument("--devices", type=int, default=8)
  p.add_argument("--out", type=Path, required=True, help="the JSON record")
  return p


def main(argv=None) -> int:
  args = parser().parse_args(argv)
  methods = args.methods.split(",")
  unknown = [m for m in methods if m not in demo.DILOCO_METHODS]
  if unknown:
    print(f"diloco_sweep: unknown methods {unknown}; accepted: {list(demo.DILOCO_METHODS)}",
          file=sys.stderr)
    return 2
  demo.setup_devices(args.devices)
  config = demo.DemoConfig(steps=args.steps, devices=args.devices)
  corpus = demo.load_corpus(config)
  record = {"config": dataclasses.asdict(config), "runs": []}
  if args.out.exists():
    record = json.loads(args.out.read_text())
    if record["config"] != dataclasses.asdict(config):
      print(f"diloco_sweep: {args.out} holds runs of another config", file=sys.stderr)
      return 2

  def run(method: str, **changes) -> None:
    if any(r["method"] == method and all(r.get(k) == v for k, v in changes.items())
           for r in record["runs"]):
      return
    run_config = dataclasses.replace(config, **changes)
    result = demo.run_method(method, demo.make_compressor(method, run_config), run_config,
                             corpus, **demo.train_options(method, run_config))
    record["runs"].append({"method": method, **changes, "eval_loss": result.eval_loss,
                           "final_loss": result.final_loss,
                           "wire_bits_per_param": result.wire_bits_per_param})
    files.write_json_atomic(args.out, record)
    print(json.dumps(record["runs"][-1]), flush=True)

  run("none")
  for method in methods:
    for h in (int(v) for v in args.inner_steps.split(",")):
      for lr in (float(v) for v in args.outer_lrs.split(",")):
        run(method, inner_steps=h, outer_lr=lr)
  return 0


if __name__ == "__main__":
  sys.exit(main())
