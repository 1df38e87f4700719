"""What co3's coded slots need on netbench's gradients: the source of its fitted slot sizes.

  python experiments/co3_slot_needs.py [--devices 4] [--params 4194304] [--steps 12]

Runs netbench's co3-fp4-coded step (`netbench_methods.exchange_step`) on n simulated devices of
one process, each device with the gradient its netbench host has (`netbench_worker.gradient`),
and reads every stream's length where the coded exchange fills its slots (`stream_lengths`).
For each stream: the bits a symbol (an element, for the gather's sums) that its slot must
reserve beyond the coder's overhead (`comm.coded.needed_bits_per_byte`). Per step
the largest over the all-to-all's streams and over the gather's (at 2 devices: the all-gather
of whole gradients), since one stream that does not fit sends the step raw. Prints one JSON
record: the range over the steps of that largest need.
"""

import argparse
import json
import os
from pathlib import Path
import sys
import threading

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled
sys.path.insert(0, str(Path(__file__).resolve().parent))  # common.py beside it

from common import stream_lengths  # noqa: E402


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--devices", type=int, default=4)
  p.add_argument("--params", type=int, default=4 * 1024 * 1024)
  p.add_argument("--steps", type=int, default=12)
  args = p.parse_args(argv)
  if "jax" not in sys.modules:  # a fresh process: make the devices (a test brings its own)
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
  import jax
  if jax.device_count() < args.devices:
    p.error(f"--devices {args.devices}: this process has {jax.device_count()} devices")
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec
  from loco_jax.apps import netbench_methods, netbench_worker
  from loco_jax.comm import coded
  from loco_jax.codecs import huffman_deflate
  from loco_jax.train import parallel
  n, size = args.devices, args.params
  mesh = parallel.data_mesh(n)
  step, state = netbench_methods.exchange_step("co3-fp4-coded", size, mesh)
  grads = jax.device_put(np.concatenate([netbench_worker.gradient(r, size) for r in range(n)]),
                         NamedSharding(mesh, PartitionSpec("data")))
  # At 2 devices co3 all-gathers whole coded gradients (`collective="auto"`): one kind of stream.
  per_shard = n > 2
  lock, lengths = threading.Lock(), []

  def record(to_one, length):
    with lock:
      lengths.append((to_one, length))

  def need(length: int, symbols: int, per_byte: int) -> float:
    """Bits a symbol, for streams of `symbols` symbols, `per_byte` of them a byte."""
    bits = coded.needed_bits_per_byte(length, symbols // per_byte, huffman_deflate)
    return bits / per_byte

  kinds = ({"all_to_all": (True, size // n, 2), "gather": (False, size // n, 1)} if per_shard
           else {"all_gather": (False, size, 2)})
  worst = {kind: [] for kind in kinds}
  with stream_lengths(record):
    for _ in range(args.steps):
      lengths.clear()
      out, state = step(grads, state)
      jax.block_until_ready(out)
      for kind, (to_one, symbols, per_byte) in kinds.items():
        worst[kind].append(max(need(k, symbols, per_byte) for a2a, k in lengths if a2a == to_one))
  print(json.dumps({"devices": n, "params": size, "steps": args.steps,
                    "overflows": int(state.overflows),
                    **{f"{kind}_worst_need": [round(min(v), 4), round(max(v), 4)]
                       for kind, v in worst.items()}}))


if __name__ == "__main__":
  main()
