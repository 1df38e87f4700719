"""What an overlapped DiLoCo run holds a device, beside the blocking run's: the state's bytes on
a compute device and on a communication device (from the arrays), and each program's peak
(XLA's memory analysis of the compiled program: arguments + outputs + temporaries - aliased).

  python experiments/diloco_overlap_memory.py --model 512,1,3072,8 --overlap 2 [--json F]

netbench's GPT (4.5M parameters) by default, 4 workers on devices 0-3, their communication
devices 4-7, LoCo's outer average.
"""

import argparse
import json
import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from loco_jax import loco  # noqa: E402
from loco_jax.apps import demo  # noqa: E402
from loco_jax.apps.models import num_params  # noqa: E402
from loco_jax.train import files, parallel  # noqa: E402

WORKERS = 4


def held_bytes(state, devices: set) -> int:
  """Bytes of `state`'s arrays on the first device of `devices` that holds any."""
  per_device = {}
  for x in jax.tree.leaves(state):
    for shard in x.addressable_shards:
      if shard.device in devices:
        per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
  return max(per_device.values(), default=0)


def peak_bytes(lowered) -> int:
  stats = lowered.compile().memory_analysis()
  return int(stats.argument_size_in_bytes + stats.output_size_in_bytes
             + stats.temp_size_in_bytes - stats.alias_size_in_bytes)


def measure(model: str, overlap: int, inner_steps: int) -> dict:
  d_model, n_layers, d_ff, n_heads = (int(v) for v in model.split(","))
  config = demo.DemoConfig(devices=WORKERS, batch_per_device=1, d_model=d_model,
                           n_layers=n_layers, d_ff=d_ff, n_heads=n_heads)
  _, params, loss_fn = demo.make_model(config)
  mesh, optimizer = parallel.data_mesh(WORKERS), demo.make_optimizer(config)
  batch = jnp.zeros((WORKERS, config.seq_len + 1), jnp.int32)
  compute, comm = set(jax.devices()[:WORKERS]), set(jax.devices()[WORKERS:2 * WORKERS])
  rows = {}
  for tau in (0, overlap):
    options = dict(compressor=loco(axis_name="data"), mode="diloco", inner_steps=inner_steps,
                   overlap=tau)
    state, _ = parallel.init_train_state(params, optimizer, mesh, **options)
    step = parallel.make_train_step(loss_fn, optimizer, mesh, params, **options)
    programs = step.lowered(state, batch)
    names = (["inner", "inner + sync"] if not tau else
             ["inner"] + [n for _ in programs[1::2] for n in ("inner + merge", "sync")])
    rows[f"overlap={tau}"] = {
        "state_bytes_compute_device": held_bytes(state, compute),
        "state_bytes_comm_device": held_bytes(state, comm),
        "program_peak_bytes": {name: peak_bytes(lowered)
                               for name, (lowered, _) in zip(names, programs)}}
  return {"model": model, "n_params": num_params(params), "workers": WORKERS,
          "inner_steps": inner_steps, "overlap": overlap, "runs": rows}


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--model", default="512,1,3072,8", help="d_model,n_layers,d_ff,n_heads")
  p.add_argument("--overlap", type=int, default=2)
  p.add_argument("--inner-steps", type=int, default=32)
  p.add_argument("--json", default=None)
  args = p.parse_args(argv)
  if args.json:
    files.check_writable(args.json, "--json")
  result = measure(args.model, args.overlap, args.inner_steps)
  mib = lambda n: f"{n / 2**20:.1f} MiB"
  print(f"{result['n_params']:,} parameters, {WORKERS} workers, LoCo's outer average")
  for name, row in result["runs"].items():
    peaks = ", ".join(f"{k} {mib(v)}" for k, v in row["program_peak_bytes"].items())
    print(f"{name}: state {mib(row['state_bytes_compute_device'])} on a compute device, "
          f"{mib(row['state_bytes_comm_device'])} on a communication device; peaks: {peaks}")
  if args.json:
    files.write_json_atomic(args.json, result)
  return 0


if __name__ == "__main__":
  sys.exit(main())
