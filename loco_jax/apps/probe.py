"""`loco-jax probe`: measures a cluster's calibration for `loco-jax advise`, on its own links.

Every process of the job runs it, as it runs training (jax.distributed; one process alone needs
no coordinator). It compiles each method's exchange step at --work-params, finds which
collectives they run, times each of those ops over all devices at the sizes the steps run
them at and at growing buffer sizes (until a call takes --max-call-s), and times each
method's step and its collectives alone at --work-params: the difference is the method's
work. Process 0 writes the calibration (docs/guides/advise.md).
"""

import argparse
import json
import math
import signal
import statistics
import sys
import time
from typing import Any, Callable, Iterable, NamedTuple, Sequence

from loco_jax.apps import calibration as calib
from loco_jax.apps import netbench_methods, step_model
from loco_jax.apps.netbench_methods import FLAT_DEFAULT, METHODS

# Buffer bytes, smallest first: dense where the steps' pieces are (wire chunking cuts them to
# 0.4-1 MB), where a collective's time is far from linear in its bytes (2 hosts at 100 Mb/s:
# interpolating between 256 KB and 1 MB put bf16's 512 KB pieces 16% over their time).
SIZES = tuple(2**k for k in (12, 15, 17, 18, 19, 20, 21, 22, 23, 24, 26))
CHAIN = 4   # collectives in the program that times one more of them
MIN_SAMPLE_S = 1.0   # seconds of timed calls a point holds at least: more repeats where fast
MAX_REPEATS = 60
# The work is a step's time less its collectives': at sizes where it is milliseconds, not the
# noise of a TCP round trip (at 2**18 parameters, 2 hosts at 1 Gb/s, loco's was lost in it), and
# up to 16M, since it is not linear in size (step_model.work_seconds).
WORK_PARAMS = (2**20, 2**22, 2**24)
FLAT_METHODS = tuple(n for n, m in METHODS.items() if m.topology == "flat")
HEARTBEAT_TIMEOUT_S = 120   # busy shared cores delay heartbeats (netbench_worker's, likewise)


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="loco-jax probe", description=__doc__.split("\n")[0])
  p.add_argument("--out", required=True, help="the calibration JSON (process 0 writes it)")
  p.add_argument("--coordinator", default=None,
                 help="ADDRESS:PORT of process 0 (omit with --processes 1)")
  p.add_argument("--processes", type=int, default=1)
  p.add_argument("--process-id", type=int, default=0)
  p.add_argument("--address", default=None,
                 help="this host's address for gloo's collectives on CPU (multi-homed hosts)")
  p.add_argument("--cpu-devices", type=int, default=None,
                 help="on CPU: devices a process (jax_num_cpu_devices; default: jax's)")
  p.add_argument("--methods", default=",".join(FLAT_DEFAULT),
                 help=f"comma-separated, from {','.join(FLAT_METHODS)}")
  p.add_argument("--work-params", default=",".join(map(str, WORK_PARAMS)),
                 help="parameters at which each method's work is timed, increasing")
  p.add_argument("--sizes", default=",".join(map(str, SIZES)),
                 help="buffer bytes at which each collective is timed, increasing")
  p.add_argument("--max-call-s", type=float, default=0.5,
                 help="stop a collective's sizes after the first whose call takes this long")
  p.add_argument("--max-step-s", type=float, default=2.0,
                 help="skip a --work-params size (but the first) whose collectives alone would "
                      "take longer a step, by the collectives' timings")
  p.add_argument("--repeats", type=int, default=7, help="timed calls per point (the median)")
  p.add_argument("--timeout", type=int, default=1800, help="seconds before a process gives up")
  return p


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
  """The probe's options; a ValueError (not an exit) for ones its parser does not take."""
  parser = _parser()
  args, unknown = parser.parse_known_args(argv)
  if unknown:
    raise ValueError(f"unknown probe options {unknown}; `loco-jax probe --help` lists them")
  return args


def _ints(text: str, option: str) -> tuple[int, ...]:
  try:
    values = tuple(int(v) for v in text.split(","))
  except ValueError:
    raise ValueError(f"{option} must be comma-separated integers, got {text!r}") from None
  if not values or values[0] < 1 or any(b <= a for a, b in zip(values, values[1:])):
    raise ValueError(f"{option} must be positive and increasing, got {text!r}")
  return values


def check_args(args) -> None:
  """Every argument checked before jax starts: a ValueError saying what is accepted."""
  methods = args.methods.split(",")
  if [m for m in methods if m not in FLAT_METHODS] or len(set(methods)) != len(methods):
    raise ValueError(f"--methods must be distinct names from {FLAT_METHODS}, got "
                     f"{args.methods!r}")
  _ints(args.work_params, "--work-params")
  _ints(args.sizes, "--sizes")
  if args.processes < 1 or not 0 <= args.process_id < args.processes:
    raise ValueError(f"--process-id must be in 0..{args.processes - 1} of --processes "
                     f"{args.processes} (>= 1), got {args.process_id}")
  if args.processes > 1 and not args.coordinator:
    raise ValueError("--coordinator ADDRESS:PORT is needed with --processes > 1")
  if args.repeats < 1 or args.timeout < 1 or not args.max_call_s > 0 or not args.max_step_s > 0:
    raise ValueError(f"--repeats and --timeout must be >= 1, --max-call-s and --max-step-s > 0, "
                     f"got {args.repeats}, {args.timeout}, {args.max_call_s}, {args.max_step_s}")
  if args.cpu_devices is not None and args.cpu_devices < 1:
    raise ValueError(f"--cpu-devices must be >= 1, got {args.cpu_devices}")
  if args.process_id == 0:
    from loco_jax.train import files
    files.check_writable(args.out, "--out")


def _rounds(job: "_Job", fns: Sequence[Callable[[], object]], repeats: int) -> list[list[float]]:
  """Wall seconds of each of `fns`, called in turn, round after round (interleaved: a drift of
  the machine hits them alike). As many rounds as every process agrees on: at least
  `repeats`, more where a round is short, up to MAX_REPEATS, so that a point holds about
  MIN_SAMPLE_S of calls."""
  import jax
  for fn in fns:   # compiled and warm
    jax.block_until_ready(fn())
  start = time.perf_counter()
  for fn in fns:
    jax.block_until_ready(fn())
  round_s = job.slowest(time.perf_counter() - start)
  count = int(min(MAX_REPEATS, max(repeats, math.ceil(MIN_SAMPLE_S / max(round_s, 1e-6)))))
  times: list[list[float]] = [[] for _ in fns]
  for _ in range(count):
    for fn, seconds in zip(fns, times):
      start = time.perf_counter()
      jax.block_until_ready(fn())
      seconds.append(time.perf_counter() - start)
  return times


class _Job:
  """The flat mesh of every device, and the cross-process agreement programs on it."""

  def __init__(self):
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from loco_jax.train import parallel
    self.jax, self.mesh = jax, parallel.data_mesh()
    self.sharding = NamedSharding(self.mesh, P("data"))
    self._max = jax.jit(jax.shard_map(lambda x: jax.lax.pmax(x, "data"), mesh=self.mesh,
                                      in_specs=P("data"), out_specs=P()))

  def slowest(self, seconds: float) -> float:
    """The largest of every process's `seconds` (all processes get the same answer)."""
    import numpy as np
    n = self.mesh.size
    x = self.jax.make_array_from_callback(
        (n,), self.sharding, lambda idx: np.full(n, seconds, np.float32)[idx])
    return float(np.asarray(self._max(x).addressable_data(0))[0])

  def ones(self):
    import numpy as np
    n = self.mesh.size
    return self.jax.make_array_from_callback((n,), self.sharding,
                                             lambda idx: np.ones(n, np.float32)[idx])


class _Step(NamedTuple):
  """A method's exchange step at one size, compiled once: for its collectives and its runs."""
  method: str
  n_params: int
  compiled: Any      # jax.stages.Compiled
  found: list        # comm.collectives_per_step of its program


def _compile(job: _Job, method: str, n_params: int) -> _Step:
  import jax.numpy as jnp
  from loco_jax import comm
  step, state = netbench_methods.exchange_step(method, n_params, job.mesh)
  grads = job.jax.ShapeDtypeStruct((job.mesh.size, n_params), jnp.float32, sharding=job.sharding)
  compiled = step.lower(grads, state).compile()
  return _Step(method, n_params, compiled,
               comm.collectives_per_step(compiled.as_text(), job.mesh.size))


def _runner(job: _Job, step: _Step) -> Callable[[], object]:
  """Runs `step` on the same gradients a call, its state carried from call to call. Made here,
  not held with the compiled step, so that one method's arrays at a time are in memory."""
  from loco_jax.apps.netbench_worker import gradient
  grads = job.jax.make_array_from_callback((job.mesh.size, step.n_params), job.sharding,
                                           lambda idx: gradient(idx[0].start or 0, step.n_params))
  box = [netbench_methods.exchange_step(step.method, step.n_params, job.mesh)[1]]

  def run():
    out, box[0] = step.compiled(grads, box[0])
    return out

  return run


def timed_sizes(op: str, run_at: Iterable[float], sizes: Sequence[int], n: int) -> list[int]:
  """The buffer bytes at which `op` is timed over `n` devices: `sizes`, and the sizes a
  method's step runs it at (`run_at`), where the steps' own time is read, not interpolated: a
  collective's time is not monotone in its bytes (4 hosts, 1 Gb/s: an all-gather of 512 KB took
  5.5 ms a call, one of 683 KB 4.5 ms), and a scalar all-reduce is not a 4 KB one (at 4 hosts,
  1 Gb/s: co3-fp4-coded's three took 2.1 ms together in its step, where one of 16 bytes cost
  4.4 ms). Whole 4-byte elements, in `n` equal pieces but for an all-reduce; increasing.

  Example:
    >>> timed_sizes("all-reduce", [4.0, 8.0, 5000.0], (4096, 65536), 4)
    [4, 8, 4096, 5000, 65536]
    >>> timed_sizes("all-gather", [12.0, 699060.0, 699064.0], (4096, 65536), 4)
    [16, 4096, 65536, 699056]
  """
  piece = 4 if op == "all-reduce" else 4 * n
  return sorted({max(int(b) - int(b) % piece, piece) for b in (*run_at, *sizes)})


def measure_collective(job: _Job, op: str, dtype: str, sizes: Sequence[int], repeats: int,
                       max_call_s: float) -> tuple[calib.CollectiveTiming, list[float]]:
  """(`op` over every device at each size (`timed_sizes`), what the first of a program costs
  more at each).

  A step runs its collectives one after the other: one alone costs more (the processes meet
  at it, the shaper's bucket refilled while it waited). So each size is timed as one call and
  as CHAIN calls in one program, in turn (`_rounds`); the median difference over CHAIN - 1 is
  one more call's cost (the slowest process's). Sizes stop after the first whose single call
  takes `max_call_s` (every process stops at the same size).
  """
  from loco_jax import comm
  n, measured, seconds, firsts = job.mesh.size, [], [], []
  for nbytes in sizes:
    one = comm.Collective(op, dtype if op in calib.REDUCING else "u8", nbytes, n)
    alone, chained = (netbench_methods.collectives_replay([one] * k, job.mesh)
                      for k in (1, CHAIN))
    ones = job.ones()
    single, chain = _rounds(job, [lambda: alone(ones), lambda: chained(ones)], repeats)
    seconds.append(job.slowest(max(statistics.median(
        (c - a) / (CHAIN - 1) for a, c in zip(single, chain)), 0.0)))
    firsts.append(job.slowest(statistics.median(single)) - seconds[-1])
    measured.append(nbytes)
    if firsts[-1] + seconds[-1] >= max_call_s:   # a single call's time
      break
  return (calib.CollectiveTiming(op, calib.key_dtype(op, dtype), n, tuple(measured),
                                 tuple(seconds)), firsts)


def measure_work(job: _Job, steps: Sequence[_Step], repeats: int, timings: calib.Calibration,
                 max_step_s: float) -> calib.MethodWork:
  """A method's step less its collectives replayed alone (the slowest process's medians), at
  each of its `steps` (one a size, increasing); a size after the first is skipped where
  `timings` put its collectives over `max_step_s`."""
  seconds, measured = [], []
  for step in steps:
    if measured and sum(step_model.wire_seconds(timings, step.found)) > max_step_s:
      break
    measured.append(step.n_params)
    run = _runner(job, step)
    replay, ones = netbench_methods.collectives_replay(step.found, job.mesh), job.ones()
    # Each timed back to back, as training runs steps: interleaved with the replay, the steps
    # ran faster (2 hosts, 1 Gb/s: loco's work 6.6 ms against 24.6 ms in netbench's steps).
    (runs,), (replays,) = _rounds(job, [run], repeats), _rounds(job, [lambda: replay(ones)],
                                                                 repeats)
    seconds.append(max(job.slowest(statistics.median(runs))
                       - job.slowest(statistics.median(replays)), 0.0))
  return calib.MethodWork(steps[0].method, tuple(measured), tuple(seconds))


def _progress(line: str) -> None:
  import jax
  if jax.process_index() == 0:
    print(f"probe: {line}", file=sys.stderr, flush=True)


def probe(methods: Sequence[str], work_params: Sequence[int] = WORK_PARAMS,
          sizes: Sequence[int] = SIZES, repeats: int = 7, max_call_s: float = 0.5,
          max_step_s: float = 2.0, note: str = "") -> calib.Calibration:
  """Measures the calibration on this job's devices (every process calls it alike)."""
  import jax
  job = _Job()
  steps = {m: [_compile(job, m, n) for n in work_params] for m in methods}
  ops = {}   # (op, dtype) of the methods' collectives, first met first: (dtype, bytes they run at)
  for c in (c for at in steps.values() for step in at for c in step.found if c.group_size > 1):
    ops.setdefault((c.op, calib.key_dtype(c.op, c.dtype)), (c.dtype, []))[1].append(c.nbytes)
  timings, firsts = [], []
  for (op, _), (dtype, run_at) in ops.items():
    timing, first = measure_collective(job, op, dtype, timed_sizes(op, run_at, sizes,
                                                                   job.mesh.size),
                                       repeats, max_call_s)
    timings.append(timing)
    firsts += first
    _progress(f"{op} ({timings[-1].dtype}): " + ", ".join(
        f"{b} B {s * 1e3:.2f} ms" for b, s in zip(timings[-1].nbytes, timings[-1].seconds)))
  from loco_jax.comm import wire
  measured = calib.Calibration(jax.process_count(), jax.device_count(), jax.default_backend(),
                               max(statistics.median(firsts), 0.0), tuple(timings), (), note,
                               wire.chunk_bytes())
  work = []
  for method in methods:
    work.append(measure_work(job, steps[method], repeats, measured, max_step_s))
    _progress(f"{method} work: " + ", ".join(
        f"{n} params {s * 1e3:.2f} ms" for n, s in zip(work[-1].n_params, work[-1].seconds)))
  return measured._replace(work=tuple(work))


def main(argv: Sequence[str] | None = None) -> int:
  args = _parser().parse_args(argv)
  try:
    check_args(args)
  except ValueError as e:
    print(f"probe: {e}", file=sys.stderr)
    return 2
  signal.alarm(args.timeout)   # a hung peer fails this process instead of hanging it
  import jax
  if args.cpu_devices is not None:
    jax.config.update("jax_num_cpu_devices", args.cpu_devices)
  if args.processes > 1:
    from loco_jax.train import parallel
    parallel.initialize(args.coordinator, args.processes, args.process_id,
                        gloo_hostname=args.address,
                        initialization_timeout=min(args.timeout, 120),
                        heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S)
  started = time.perf_counter()
  result = probe(args.methods.split(","), _ints(args.work_params, "--work-params"),
                 _ints(args.sizes, "--sizes"), args.repeats, args.max_call_s, args.max_step_s,
                 note=f"loco-jax probe {' '.join(argv if argv is not None else sys.argv[1:])}")
  if args.process_id == 0:
    calib.write(args.out, result)
    print(json.dumps({"probe": args.out, "seconds": round(time.perf_counter() - started, 1)}))
  if args.processes > 1:
    jax.distributed.shutdown()
  return 0


if __name__ == "__main__":
  sys.exit(main())
