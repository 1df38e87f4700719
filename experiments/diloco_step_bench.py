"""DiLoCo's inner step against the same training with no exchange at all, on one device.

  python experiments/diloco_step_bench.py                       # netbench's GPT, one CPU device
  python experiments/diloco_step_bench.py --inner-steps 32 --repeats 5 --json out.json

A netbench host runs one device: there the inner step should cost what the compute-only step
costs, and the round's extra time is the sync alone. Each repeat times, in a rotated order:
`compute` (value_and_grad and adamw on the params, donated: netbench's step with no exchange),
`inner` (DiLoCo's inner program, `step.jitted`), `sync` (an inner step followed by the sync,
`step.syncs[0]`, LoCo's outer average on a one-device axis) and `round` (the whole step over a
round of --inner-steps: the mean of its calls). Prints the medians over repeats and their ratios to
`compute`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import common


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--inner-steps", type=int, default=32)
  p.add_argument("--steps", type=int, default=20, help="timed calls per candidate and repeat")
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--model", default="512,1,3072,8", help="d_model,n_layers,d_ff,n_heads")
  p.add_argument("--json", default=None, help="write the medians here")
  return p


def _call_s(fn, state, batch, steps: int, reduce):
  """(`reduce` over the seconds of `steps` calls of fn(state, batch) -> (state, loss), the last
  state)."""
  import numpy as np
  times = []
  for _ in range(steps):
    t0 = time.perf_counter()
    state, loss = fn(state, batch)
    float(np.asarray(loss.addressable_data(0)).ravel()[0])
    times.append(time.perf_counter() - t0)
  return reduce(times), state


def main(argv=None) -> int:
  args = _parser().parse_args(argv)
  common.setup(1)
  import jax
  import optax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P
  from loco_jax import loco
  from loco_jax.apps import demo
  from loco_jax.train import parallel

  d_model, n_layers, d_ff, n_heads = (int(v) for v in args.model.split(","))
  config = demo.DemoConfig(steps=1000, devices=1, batch_per_device=2, seq_len=64,
                           d_model=d_model, n_layers=n_layers, d_ff=d_ff, n_heads=n_heads)
  _, params, loss_fn = demo.make_model(config)
  optimizer = demo.make_optimizer(config)
  mesh = parallel.data_mesh(1)
  batch = jax.device_put(demo.load_corpus(config).train_SxBxL[0], NamedSharding(mesh, P("data")))

  def compute(carry, batch):
    params, opt_state = carry
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss

  options = dict(compressor=loco(axis_name="data"), mode="diloco", inner_steps=args.inner_steps)
  step = parallel.make_train_step(loss_fn, optimizer, mesh, params, **options)
  median, mean = statistics.median, statistics.fmean
  candidates = {"compute": (jax.jit(compute, donate_argnums=0), args.steps, median),
                "inner": (step.jitted, args.steps, median),
                "sync": (step.syncs[0], args.steps, median),
                "round": (step, args.inner_steps, mean)}
  states = {"compute": (params, optimizer.init(params))}
  for name in ("inner", "sync", "round"):
    states[name] = parallel.init_train_state(params, optimizer, mesh, **options)[0]
  names, seconds = list(candidates), {name: [] for name in candidates}
  for repeat in range(args.repeats + 1):  # the first repeat compiles and is not kept
    for name in names[repeat % len(names):] + names[:repeat % len(names)]:
      fn, calls, reduce = candidates[name]
      s, states[name] = _call_s(fn, states[name], batch, calls, reduce)
      if repeat:
        seconds[name].append(s)
  medians = {name: statistics.median(v) for name, v in seconds.items()}
  for name, s in medians.items():
    print(f"{name:8s} {s * 1e3:7.2f} ms  {s / medians['compute']:.2f}x compute")
  if args.json:
    common.write_text_atomic(Path(args.json), json.dumps(
        {"inner_steps": args.inner_steps, "model": args.model, "median_s": medians,
         "backend": jax.default_backend()}, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
