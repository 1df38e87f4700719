"""Host work of one device's co3 step, per parameter, split into its parts.

  flock /work/wt/timing.lock python experiments/co3_host_bench.py --params 4194304 --devices 8

One device's step at `--params` parameters (4 leaves), fp4, the per-shard exchange with the
bf16 gather, on gradients drawn from GenNorm(beta=1) (CO3's coded rate on them is ~2.6 bits):
- convert: the jitted a = g + gamma e, fp4 symbols, the new error, the rows of symbol pairs;
- encode / decode: the coder alone (`comm.coded.fill_slots` of the n - 1 rows this device
  sends, `read_slots` of the n - 1 slots it receives), one thread;
- callbacks: the jitted step's two host calls with a coder that does nothing (each call's cost
  and the copies of its arguments and results);
- average: the jitted receive side (symbols of the n rows -> values -> float32 mean -> bf16 ->
  float32 of the gathered shards);
- step: the whole step on a mesh of `--devices` simulated CPU devices (collectives included),
  CPU time of the process / devices, and the same step without coding (entropy_code=False);
  `--gather coded` times the step with the exact-sum coded gather instead of the bf16 one.
The steps run with the state carried from step to step and no refit (the GenNorm fit runs
every `refit_interval` steps; its cost a refit step is reported apart, `refit_step`).

Times are medians of `--repeats`, CPU time (user + system of every thread) per parameter;
wall times beside. Prints one JSON record.
"""

import argparse
import importlib
import json
import os
from pathlib import Path
import resource
import sys
import time
import types

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled


def _cpu_s() -> float:
  usage = resource.getrusage(resource.RUSAGE_SELF)
  return usage.ru_utime + usage.ru_stime


def _median(fn, repeats, per):
  """(cpu ns, wall ns) per `per` units, medians over `repeats` calls of fn (after one warm-up)."""
  import numpy as np
  fn()
  cpus, walls = [], []
  for _ in range(repeats):
    cpu, wall = _cpu_s(), time.perf_counter()
    fn()
    walls.append(time.perf_counter() - wall)
    cpus.append(_cpu_s() - cpu)
  return (round(float(np.median(cpus)) / per * 1e9, 2),
          round(float(np.median(walls)) / per * 1e9, 2))


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--params", type=int, default=4 * 1024 * 1024)
  p.add_argument("--devices", type=int, default=8)
  p.add_argument("--repeats", type=int, default=7)
  p.add_argument("--parts", default="convert,coder,callbacks,average,step")
  p.add_argument("--gather", choices=("bf16", "coded"), default="bf16",
                 help="the step's gather of the averaged shards")
  args = p.parse_args(argv)
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             f" --xla_force_host_platform_device_count={args.devices}")
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import PartitionSpec as P

  from loco_jax.codecs import fp, gennorm
  from loco_jax.comm import coded
  from loco_jax.core import layout, quant
  from loco_jax.train import parallel
  from loco_jax.transforms import co3_exchange, co3_host, co3_settings
  co3_module = importlib.import_module("loco_jax.transforms.co3")  # the package exports co3()

  n, size, parts = args.devices, args.params, args.parts.split(",")
  timed = lambda fn, per=size: _median(fn, args.repeats, per)
  rng = np.random.default_rng(0)
  g = gennorm.sample(rng, 1.0, 1e-3, (size,)).astype(np.float32)
  leaf_grads = [jnp.asarray(x) for x in g.reshape(4, -1)]
  settings = co3_settings.Co3Settings(fp.FP4, 0.7, 100, True, "data",
                                      co3_host.default_capacity_bits(fp.FP4), "bf16",
                                      "all_to_all", None, None)
  layouts = [layout.leaf_layout(x.size, n, None) for x in leaf_grads]
  scales = jnp.full((4,), gennorm.fp4_scale(1.0, 1e-3), jnp.float32)
  record = {"params": size, "devices": n, "repeats": args.repeats, "gather": args.gather}

  @jax.jit
  def convert(grads, errors):
    out = co3_module.convert(settings, grads, errors, list(scales[:, None]), jnp.bool_(False))
    sent = [fp.decode(q, settings.fmt, s) for q, s in zip(out.symbols, out.scales)]
    return (co3_exchange.symbol_rows(out.symbols, layouts, settings.fmt),
            [a - q for a, q in zip(out.compensated, sent)])

  rows, errors = convert(leaf_grads, [jnp.zeros_like(x) for x in leaf_grads])
  rows = np.asarray(rows)
  if "convert" in parts:
    record["convert"] = timed(lambda: jax.block_until_ready(convert(leaf_grads, errors)))

  coder = co3_exchange.CODER
  capacity = coded.slot_bytes(rows.shape[1], 2 * co3_host.default_capacity_bits(fp.FP4), coder)
  slots, lengths = coded.fill_slots(rows, np.int32(0), capacity, coder, 0)
  record["coded_bits"] = round(float(8 * lengths.sum() / (2 * rows[1:].size)), 4)
  if "coder" in parts:
    record["encode"] = timed(lambda: coded.fill_slots(rows, np.int32(0), capacity, coder, 0))
    record["decode"] = timed(lambda: coded.read_slots(slots, lengths, rows[0], np.int32(0),
                                                      coder))
  if "callbacks" in parts:
    nothing = types.SimpleNamespace(encode=lambda row: b"", overhead=coder.overhead,
                                    decode=lambda stream, size: np.zeros(size, np.uint8))
    device = jax.devices()[0]
    on_device = lambda x: jax.device_put(x, device)
    lengths_0 = np.zeros_like(lengths)

    @jax.jit
    def callbacks(rows_NxB, slots_NxC):
      encoded = coded.host_call(lambda r, s: coded.fill_slots(r, s, capacity, nothing, 0),
                                (jax.ShapeDtypeStruct(slots.shape, jnp.uint8),
                                 jax.ShapeDtypeStruct(lengths.shape, jnp.int32)),
                                rows_NxB, jnp.int32(0))
      decoded = coded.host_call(
          lambda s, l, o, m: coded.read_slots(s, l, o, m, nothing),
          (jax.ShapeDtypeStruct(rows.shape, jnp.uint8), jax.ShapeDtypeStruct((2,), jnp.int32)),
          slots_NxC, jnp.asarray(lengths_0), rows_NxB[0], jnp.int32(0))
      return encoded, decoded

    args_on = (on_device(rows), on_device(slots))
    record["callbacks"] = timed(lambda: jax.block_until_ready(callbacks(*args_on)))

  if "average" in parts:
    @jax.jit
    def average(rows_NxB, scales_NxL):
      shards = [quant.mean_over_peers(v) for v in co3_exchange.row_values(
          rows_NxB, scales_NxL, layouts, settings.fmt)]
      shard = quant.saturate(jnp.concatenate(shards), jnp.bfloat16).astype(jnp.bfloat16)
      gathered = jnp.broadcast_to(shard, (n, shard.size)).astype(jnp.float32)
      ends = np.cumsum([lay.row_len for lay in layouts])
      return [layout.from_rows(gathered[:, e - lay.row_len:e], lay)
              for e, lay in zip(ends, layouts)]
    scales_NxL = jnp.broadcast_to(scales, (n, 4))
    rows_on = jnp.asarray(rows)
    record["average"] = timed(lambda: jax.block_until_ready(average(rows_on, scales_NxL)))

  if "step" in parts:
    params = {f"w{i}": jnp.zeros((size // 4,)) for i in range(4)}
    mesh = parallel.data_mesh(n)
    grads = {k: jnp.asarray(np.tile(np.asarray(x), (n, 1))) for k, x in zip(params,
                                                                               leaf_grads)}
    for name, coded_step in (("step", True), ("raw_step", False)):
      opt = co3_module.co3("fp4", axis_name="data", collective="all_to_all",
                           gather=args.gather, entropy_code=coded_step)
      state, specs = parallel.init_opt_state(opt, params, mesh)
      step = jax.jit(jax.shard_map(
          lambda x, s: opt.update(jax.tree.map(lambda v: v[0], x), s), mesh=mesh,
          in_specs=(jax.tree.map(lambda _: P("data"), params), specs),
          out_specs=(jax.tree.map(lambda _: P(), params), specs)))
      refit_state = state
      state = jax.block_until_ready(step(grads, state))[1]  # count 1: no refit from here on
      carried = [state]

      def run():
        carried[0] = jax.block_until_ready(step(grads, carried[0]))[1]
      record[name] = timed(run, size * n)
      if coded_step:
        record["refit_step"] = timed(lambda: jax.block_until_ready(step(grads, refit_state)),
                                     size * n)
  print(json.dumps(record))
  return record


if __name__ == "__main__":
  main()
