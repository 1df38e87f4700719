"""Host work of one device's co3 step, per parameter: the coder alone, the jitted convert and
receive-side mean, and the whole step on a mesh of simulated CPU devices (CPU time per device).

  python experiments/co3_host_bench.py --params 4194304 --devices 8 --repeats 5

Prints one JSON record. Times are medians; run it with the machine otherwise idle (other work
on the cores shows up in every figure).
"""

import argparse
import json
import os
import resource
import time


def _median_s(fn, repeats):
  import numpy as np
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return float(np.median(times))


def _cpu_s() -> float:
  usage = resource.getrusage(resource.RUSAGE_SELF)
  return usage.ru_utime + usage.ru_stime


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--params", type=int, default=4 * 1024 * 1024)
  p.add_argument("--devices", type=int, default=8)
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--gather", default="bf16", choices=("bf16", "coded"))
  args = p.parse_args(argv)
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             f" --xla_force_host_platform_device_count={args.devices}")
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import PartitionSpec as P

  from loco_jax.codecs import fp, gennorm
  from loco_jax.comm import coded_host
  from loco_jax.train import parallel
  from loco_jax.transforms import co3_exchange
  from loco_jax.transforms.co3 import co3

  n, size = args.devices, args.params
  per_ns = lambda seconds: round(seconds / size * 1e9, 2)
  rng = np.random.default_rng(0)
  g = gennorm.sample(rng, 1.0, 1e-3, (size,)).astype(np.float32)
  scale = np.float32(gennorm.fp4_scale(1.0, 1e-3))
  symbols = np.asarray(fp.encode(g, fp.FP4, scale)).astype(np.uint8)
  rows = (symbols[0::2] << 4 | symbols[1::2]).reshape(n, -1)
  coder = co3_exchange.CODER
  capacity = coded_host.slot_bytes(rows.shape[1], 2 * co3_exchange.co3_host.default_capacity_bits(
      fp.FP4), coder)
  slots, lengths = coded_host.fill_slots(rows, np.int32(0), capacity, coder, 0)
  record = {"params": size, "devices": n, "coded_bits": float(8 * lengths.sum() /
                                                              (2 * rows[1:].size))}
  record["encode_ns"] = per_ns(_median_s(
      lambda: coded_host.fill_slots(rows, np.int32(0), capacity, coder, 0), args.repeats))
  record["decode_ns"] = per_ns(_median_s(
      lambda: coded_host.read_slots(slots, lengths, rows[0], np.int32(0), coder), args.repeats))

  params = {f"w{i}": jnp.zeros((size // 4,)) for i in range(4)}
  mesh = parallel.data_mesh(n)
  opt = co3("fp4", axis_name="data", exchange="all_to_all", gather=args.gather)
  state, specs = parallel.init_opt_state(opt, params, mesh)
  grads = {k: jnp.asarray(np.tile(g.reshape(4, -1)[i], (n, 1))) for i, k in enumerate(params)}
  step = jax.jit(jax.shard_map(lambda x, s: opt.update(jax.tree.map(lambda v: v[0], x), s),
                               mesh=mesh, in_specs=(jax.tree.map(lambda _: P("data"), params),
                                                    specs),
                               out_specs=(jax.tree.map(lambda _: P(), params), specs)))
  jax.block_until_ready(step(grads, state))
  walls, cpus = [], []
  for _ in range(args.repeats):
    cpu, wall = _cpu_s(), time.perf_counter()
    jax.block_until_ready(step(grads, state))
    walls.append(time.perf_counter() - wall)
    cpus.append(_cpu_s() - cpu)
  record["step_wall_ms"] = round(1e3 * float(np.median(walls)), 1)
  record["step_cpu_per_device_ns"] = per_ns(float(np.median(cpus)) / n)
  print(json.dumps(record))
  return record


if __name__ == "__main__":
  main()
