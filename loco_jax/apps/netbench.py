"""`loco-jax netbench`: gradient exchanges between real hosts on shaped links, bytes counted.

Builds --hosts network namespaces (netns.Network: one shaped link each, or with --nodes two
levels: nodes of hosts on fast links, joined by slower ones), starts one jax process per host
bound to its address (parallel.initialize(gloo_hostname=...)), and measures per method the
median step time of a gradient exchange, the bits per parameter each host really sent (its
interface's tx_bytes over the timed steps; on two levels also every node's bytes to the others,
on its inter-node link) against what the compiled program predicts, and the step's collectives
alone (replayed as compiled); with --calibration, the step `loco-jax advise`'s model predicts
beside it. Then, unless --exchange-only, trains the demo's GPT end to end per method: tokens per
second, eval loss, and the step's split into compute and exchange (docs/results/network.md).
--probe runs `loco-jax probe` on the hosts instead. Each argument, and that --json and --png can
be written, is checked before anything is built. Needs root and iproute2; exits 2 saying what
is missing otherwise.
"""

import argparse
import ctypes
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

from loco_jax.apps import netbench_report as report
from loco_jax.apps import netbench_probe, netns
from loco_jax.apps.netbench_methods import FLAT_DEFAULT, METHODS, TWO_LEVEL_DEFAULT
from loco_jax.apps.netbench_worker import PARAM_GATHERS, TRAIN_METHODS
from loco_jax.train import files

COORDINATOR_PORT = 12355      # inside our own namespaces: no other listener can hold it
MIN_RATE_FRACTION = 0.9       # the fp32 all-reduce must reach 90% of the nominal rate
FLOAT32_COPIES = 4            # of the gradient a device holds at least (--params' upper bound)
# XLA:CPU takes a step's temporaries from malloc. With glibc's defaults, blocks over its
# (adaptive, at most 32 MiB) mmap threshold are mapped anew and page-faulted every step, and
# freed heap is trimmed back to the kernel: at 4 hosts this took loco's 4M-parameter exchange
# from 48-50 to 66-70 ms of CPU a host (docs/results/network.md). Every host gets heap that stays
# mapped, in transparent huge pages, for every method alike.
HOST_MALLOC = ("glibc.malloc.hugetlb=1:glibc.malloc.mmap_threshold=33554432:"
               "glibc.malloc.trim_threshold=4294967296")
_PACKAGE_ROOT = str(Path(__file__).resolve().parent.parent)


def _methods_help() -> str:
  return "; ".join(f"{name}: {m.help}" + (" (--nodes > 1)" if m.topology == "nodes" else "")
                   for name, m in METHODS.items())


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog="loco-jax netbench", description=__doc__.split("\n")[0],
      epilog="two levels, e.g.: loco-jax netbench --nodes 2 --hosts 4 --rate 10gbit "
             "--inter-rate 1gbit --exchange-only (2 nodes of 2 hosts; docs/results/network.md)")
  p.add_argument("--hosts", type=int, default=2,
                 help=f"hosts (namespaces, one jax process each), 2..{netns.MAX_HOSTS}")
  p.add_argument("--nodes", type=int, default=1,
                 help="split the hosts into this many nodes of --hosts/--nodes consecutive "
                      "hosts: two levels, --rate inside a node, --inter-rate between nodes "
                      "(default 1: one level, every host on a --rate link)")
  p.add_argument("--rate", default="1gbit",
                 help="link rate(s), comma-separated, as tc writes them: 100mbit,1gbit; on "
                      "two levels the links inside a node (e.g. 10gbit)")
  p.add_argument("--inter-rate", default=None,
                 help="with --nodes > 1: the rate(s) of the links between nodes, "
                      "comma-separated (e.g. 1gbit); every pair with --rate is run")
  p.add_argument("--delay", default=None, help="one-way delay added to every link, e.g. 5ms")
  p.add_argument("--burst", type=int, default=None,
                 help=f"tbf bucket in bytes (default: {netns.BURST_S * 1e3:g} ms of the rate, "
                      f"at least {netns.MIN_BURST_BYTES})")
  p.add_argument("--params", type=int, default=4 * 2**20, help="float32 gradient parameters")
  p.add_argument("--methods", default=None,
                 help=f"comma-separated (default: {','.join(FLAT_DEFAULT)}; with --nodes > 1: "
                      f"{','.join(TWO_LEVEL_DEFAULT)}). {_methods_help()}")
  p.add_argument("--devices-per-host", type=int, default=1)
  p.add_argument("--steps", type=int, default=5, help="timed steps (the median is reported)")
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument("--profile", type=int, default=0,
                 help="after the timed steps, trace this many more on every host (jax.profiler) "
                      "and split the step into collectives, host callbacks and compute "
                      "(default 0: no trace)")
  p.add_argument("--timeout", type=int, default=900,
                 help="seconds a rate's whole run may take before every host is stopped")
  p.add_argument("--min-rate-fraction", type=float, default=MIN_RATE_FRACTION,
                 help="calibration check: the share of the nominal rate (of the inter-node "
                      "rate on two levels) that one TCP stream between two hosts must carry "
                      "(0 turns the lower bound off)")
  p.add_argument("--exchange-only", action="store_true",
                 help="measure the gradient exchanges only, skip end-to-end training "
                      "(required with --nodes > 1)")
  p.add_argument("--train-methods", default=",".join(TRAIN_METHODS[:8]),
                 help=f"end-to-end training, comma-separated: {','.join(TRAIN_METHODS)} "
                      f"(default: all but the diloco ones)")
  p.add_argument("--train-steps", type=int, default=30,
                 help="training steps per method (the first 2 are not timed; diloco methods: "
                      "a multiple of --inner-steps, the first round not timed)")
  p.add_argument("--inner-steps", type=int, default=32,
                 help="the diloco methods' steps between two syncs")
  p.add_argument("--train-model", default="512,1,3072,8",
                 help="the demo GPT: d_model,n_layers,d_ff,n_heads (default: 4.5M parameters)")
  p.add_argument("--batch-per-host", type=int, default=2,
                 help="sequences per host and step (2: fp32's step is 2/3 exchange at 4 hosts, "
                      "1 Gb/s, docs/results/network.md)")
  p.add_argument("--seq-len", type=int, default=64)
  p.add_argument("--param-gather", default="float32",
                 help=f"zero2 and fsdp's parameter gathers, one of {','.join(PARAM_GATHERS)}: "
                      "the compute dtype, or int8 with block scales")
  p.add_argument("--pin-cores", action="store_true",
                 help="run host i on core i %% (this process's cores) only: each host's XLA:CPU "
                      "then runs one thread, as a host that has its cores to itself does "
                      "(unpinned, hosts sharing the cores preempt each other's threads)")
  p.add_argument("--default-malloc", dest="host_malloc", action="store_false",
                 help=f"run the hosts with glibc's default malloc settings instead of "
                      f"GLIBC_TUNABLES={HOST_MALLOC} (a GLIBC_TUNABLES already set is kept)")
  p.add_argument("--probe", default=None, metavar="FILE",
                 help="instead of timing the exchanges, run `loco-jax probe` on the hosts (one "
                      "--rate, one level) for --methods and write its calibration to FILE")
  p.add_argument("--probe-args", default="",
                 help="more options for every host's probe, e.g. \"--work-params 65536,262144 "
                      "--max-call-s 0.5\" (`loco-jax probe --help`)")
  p.add_argument("--calibration", default=None, metavar="FILE",
                 help="a calibration `loco-jax probe` wrote on these hosts and links: each "
                      "exchange's step is predicted from it beside the measured one")
  p.add_argument("--json", default=None,
                 help="write the records to this file (checked writable before the run, "
                      "written whole or not at all)")
  p.add_argument("--png", default=None,
                 help="plot step time against link rate (matplotlib; checked as --json)")
  return p


def _positive(args, *names: str) -> None:
  for name in names:
    if getattr(args, name) < 1:
      raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")


def _check_methods(args) -> None:
  if args.methods is None:
    args.methods = ",".join(TWO_LEVEL_DEFAULT if args.nodes > 1 else FLAT_DEFAULT)
  methods = args.methods.split(",")
  if [m for m in methods if m not in METHODS] or len(set(methods)) != len(methods):
    raise ValueError(f"--methods must be distinct names from {tuple(METHODS)}, got "
                     f"{args.methods!r}")
  two_level = [m for m in methods if METHODS[m].topology == "nodes"]
  if two_level and args.nodes < 2:
    raise ValueError(f"--methods {','.join(two_level)} run on two levels: they need --nodes "
                     f">= 2, got --nodes {args.nodes}")


def _check_training(args) -> None:
  if args.nodes > 1:
    raise ValueError("end-to-end training is measured on one level only: with --nodes > 1 "
                     "pass --exchange-only")
  train = args.train_methods.split(",")
  if [m for m in train if m not in TRAIN_METHODS] or len(set(train)) != len(train):
    raise ValueError(f"--train-methods must be distinct names from {TRAIN_METHODS}, got "
                     f"{args.train_methods!r}")
  model = args.train_model.split(",")
  if len(model) != 4 or not all(v.isdigit() and int(v) > 0 for v in model) or \
      int(model[0]) % int(model[3]):
    raise ValueError(f"--train-model must be four positive ints d_model,n_layers,d_ff,n_heads "
                     f"with n_heads dividing d_model, got {args.train_model!r}")
  _positive(args, "train_steps", "batch_per_host", "seq_len")
  if args.param_gather not in PARAM_GATHERS:
    raise ValueError(f"--param-gather must be one of {PARAM_GATHERS}, got {args.param_gather!r}")
  if args.train_steps < 3:
    raise ValueError(f"--train-steps must be >= 3 (2 are not timed), got {args.train_steps}")
  if any(m.startswith("diloco") for m in train):
    _positive(args, "inner_steps")
    if args.train_steps % args.inner_steps or args.train_steps < 2 * args.inner_steps:
      raise ValueError(f"--train-steps {args.train_steps} must be a multiple of --inner-steps "
                       f"{args.inner_steps}, at least 2 of them, for the diloco methods (the "
                       f"first round compiles, the others are timed whole), e.g. "
                       f"{3 * args.inner_steps}")
  if args.batch_per_host % args.devices_per_host:
    raise ValueError(f"--batch-per-host ({args.batch_per_host}) must be a multiple of "
                     f"--devices-per-host ({args.devices_per_host})")


def check_writable(path: str, option: str) -> None:
  """ValueError unless a file can be created at `path` (its folder exists and takes a new file,
  and `path` is not a folder): tried with a temp file beside it, removed at once."""
  target = Path(path)
  if not path or target.is_dir():
    raise ValueError(f"{option} must name a file, got {path!r}")
  folder = target.parent
  if not folder.is_dir():
    raise ValueError(f"{option} {path!r}: the folder {str(folder)!r} does not exist")
  try:
    with tempfile.NamedTemporaryFile(dir=folder, prefix=f".{target.name}.", suffix=".probe"):
      pass
  except OSError as e:
    raise ValueError(f"{option} {path!r} cannot be written: {e.strerror or e}") from None


def _check_args(args) -> list[tuple[str, str | None]]:
  """Every argument checked before anything is built; -> the (rate, inter-node rate) settings."""
  netns.check_topology(args.hosts, args.nodes, args.delay, args.burst)
  _check_methods(args)
  _positive(args, "steps", "params", "devices_per_host", "timeout")
  # Each device holds at least its gradient, its output and a step's temporaries in float32.
  needed = FLOAT32_COPIES * 4 * args.params * args.devices_per_host * args.hosts
  memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  if needed > memory:
    raise ValueError(f"--params {args.params} on {args.hosts} hosts x {args.devices_per_host} "
                     f"devices needs at least {needed / 2**30:.1f} GiB, more than this machine's "
                     f"{memory / 2**30:.1f} GiB")
  for name in ("warmup", "profile"):
    if getattr(args, name) < 0:
      raise ValueError(f"--{name} must be >= 0, got {getattr(args, name)}")
  if not 0 <= args.min_rate_fraction <= 1:
    raise ValueError(f"--min-rate-fraction must be in [0, 1], got {args.min_rate_fraction}")
  if (args.nodes > 1) != (args.inter_rate is not None):
    raise ValueError(f"--inter-rate is the rate between nodes: give it exactly when --nodes > 1 "
                     f"(--nodes {args.nodes}, --inter-rate {args.inter_rate!r})")
  rates = args.rate.split(",")
  inter_rates = [None] if args.inter_rate is None else args.inter_rate.split(",")
  for r in rates + [i for i in inter_rates if i is not None]:
    netns.rate_bits(r)
  if not args.exchange_only:
    _check_training(args)
  netbench_probe.check_args(args, rates)
  for option, path in (("--json", args.json), ("--png", args.png), ("--probe", args.probe)):
    if path is not None:
      check_writable(path, option)
  if args.json is not None and args.png is not None and \
      os.path.abspath(args.json) == os.path.abspath(args.png):
    raise ValueError(f"--json and --png name the same file {args.json!r}")
  if args.png is not None and importlib.util.find_spec("matplotlib") is None:
    raise ValueError("--png needs matplotlib (a dev dependency: pip install loco-jax[dev]), "
                     "which is not installed")
  return [(r, i) for r in rates for i in inter_rates]


def _die_with_parent() -> None:
  """In the child: SIGKILL when netbench dies, however it dies (Linux prctl PR_SET_PDEATHSIG)."""
  ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)


def host_env(host_malloc: bool) -> dict[str, str]:
  """The hosts' environment: this one's, on CPU, without XLA_FLAGS, with `HOST_MALLOC` unless
  `host_malloc` is False (a GLIBC_TUNABLES set here is kept either way)."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["JAX_PLATFORMS"] = "cpu"
  if host_malloc:
    env.setdefault("GLIBC_TUNABLES", HOST_MALLOC)
  env["PYTHONPATH"] = os.pathsep.join([_PACKAGE_ROOT, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
  return env


def run_hosts(net: netns.Network, args, workdir: str) -> list[dict]:
  """Starts one worker per host, waits for all (bounded), returns their result records.

  A host that fails or outlives `args.timeout` stops every other host and raises.
  """
  env = host_env(args.host_malloc)
  coordinator = f"{net.hosts[0].address}:{COORDINATOR_PORT}"
  procs, logs, cores = [], [], sorted(os.sched_getaffinity(0))
  try:
    for i, host in enumerate(net.hosts):
      log = open(os.path.join(workdir, f"host{i}.log"), "w+")
      logs.append(log)
      if args.probe is not None:
        procs.append(subprocess.Popen(netbench_probe.command(net, args, i, coordinator),
                                      stdout=log, stderr=subprocess.STDOUT, env=env,
                                      preexec_fn=_die_with_parent))
        continue
      cmd = [*net.exec_prefix(i), sys.executable, "-m", "loco_jax.apps.netbench_worker",
             "--process-id", str(i), "--hosts", str(len(net.hosts)),
             "--coordinator", coordinator, "--address", host.address,
             "--interface", host.interface, "--params", str(args.params),
             "--methods", args.methods, "--steps", str(args.steps), "--warmup", str(args.warmup),
             "--devices-per-host", str(args.devices_per_host), "--timeout", str(args.timeout),
             "--namespace", host.namespace, "--nodes", str(args.nodes),
             "--profile", str(args.profile)]
      if args.pin_cores:
        cmd += ["--cpu", str(cores[i % len(cores)])]
      if i == 0 and net.uplinks:   # host 0 reads every node's inter-node counter
        cmd += ["--uplinks", ",".join(f"{u.namespace}:{u.interface}" for u in net.uplinks)]
      if not args.exchange_only:
        cmd += ["--train-methods", args.train_methods, "--train-steps", str(args.train_steps),
                "--train-model", args.train_model, "--batch-per-host", str(args.batch_per_host),
                "--seq-len", str(args.seq_len), "--param-gather", args.param_gather,
                "--inner-steps", str(args.inner_steps)]
      procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                    preexec_fn=_die_with_parent))
    deadline = time.monotonic() + args.timeout + 10
    while any(p.poll() is None for p in procs):
      failed = [i for i, p in enumerate(procs) if p.poll() not in (None, 0)]
      if failed:
        raise RuntimeError(f"host {failed[0]} exited with {procs[failed[0]].returncode}:\n"
                           + _tail(logs[failed[0]]))
      if time.monotonic() > deadline:
        raise TimeoutError(f"the hosts did not finish within {args.timeout} s; host 0 said:\n"
                           + _tail(logs[0]))
      time.sleep(0.2)
    for i, p in enumerate(procs):
      if p.returncode:
        raise RuntimeError(f"host {i} exited with {p.returncode}:\n" + _tail(logs[i]))
    results = []
    for log in logs:
      log.seek(0)
      for line in log:
        if line.startswith(('{"result"', '{"train"')):
          kind, record = next(iter(json.loads(line).items()))
          results.append({**record, "kind": kind})
    return results
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait(timeout=10)
    for log in logs:
      log.close()


def _tail(log, chars: int = 3000) -> str:
  log.flush()
  log.seek(0)
  return log.read()[-chars:]


def _raise_on_signal(signum, frame):
  raise SystemExit(128 + signum)


def _measure_all(args, settings: list[tuple[str, str | None]]) -> list[dict]:
  """Builds each link setting's hosts in turn and runs them; the records of every setting.
  Ctrl-C raises KeyboardInterrupt, SIGTERM / SIGHUP SystemExit: either way the `with` blocks
  remove every namespace and process this run made."""
  previous = {s: signal.signal(s, _raise_on_signal) for s in (signal.SIGTERM, signal.SIGHUP)}
  previous[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)
  try:
    stale = netns.remove_stale()
    if stale:
      print(f"removed {len(stale)} namespaces left by an earlier run: {', '.join(stale)}")
    records, malloc = [], host_env(args.host_malloc).get("GLIBC_TUNABLES", "")
    calibration = None
    if args.calibration is not None:
      from loco_jax.apps import calibration as calib
      calibration = calib.read(args.calibration)
    with tempfile.TemporaryDirectory(prefix="netbench-") as workdir:
      for rate, inter_rate in settings:
        with netns.Network(args.hosts, rate, args.delay, args.burst, args.nodes,
                           inter_rate) as net:
          print(f"{args.hosts} hosts: {net.shaping}; hosts' GLIBC_TUNABLES={malloc!r}",
                flush=True)
          # The shaper's calibration: what one TCP stream carries on the link the rate is of.
          tcp = net.tcp_goodput(0, net.hosts_per_node if args.nodes > 1 else 1)
          results = run_hosts(net, args, workdir)
          if args.probe is not None:
            print(f"wrote the calibration {args.probe}")
            continue
          exchanges = report.summarize(results, args.hosts, rate, args.params, args.nodes,
                                       inter_rate, calibration)
          records += [dict(r, link_tcp_bits_per_s=tcp) for r in exchanges]
          if not args.exchange_only:
            records += report.summarize_training(results, args.hosts, rate)
    return records
  finally:
    for s, handler in previous.items():
      signal.signal(s, handler)


def _print_tables(args, exchanges: list[dict], training: list[dict]) -> None:
  print("\n".join(report.format_table(exchanges)))
  state = report.format_state_table(exchanges)
  if state:
    print("\nWhat ran, and the methods' own counts over the timed steps:")
    print("\n".join(state))
  if args.profile:
    print(f"\nWhere a step's time goes ({args.profile} traced steps, the mean of the hosts):")
    print("\n".join(report.format_profile_table(exchanges)))
  if args.nodes > 1:
    print("\nTwo levels (inter-node bits: every node's uplink counter, all nodes together):")
    print("\n".join(report.format_two_level_table(exchanges)))
  if training:
    print("\nEnd-to-end training (ddp, adamw; compute = the same step with no exchange):")
    print("\n".join(report.format_training_table(training)))
  for setting, (share, fp32) in report.calibrations(exchanges).items():
    print(f"calibration at {setting}: one TCP stream carried {share:.1%} of the nominal rate "
          f"(check: {args.min_rate_fraction:.0%} to 100%)"
          + (f"; the fp32 all-reduce {fp32:.1%} ({fp32 / share:.0%} of the TCP stream)"
             if fp32 is not None else ""))
  if not all(report.payload_checked(r) for r in exchanges):
    print(f"(not checked): under {report.MIN_CHECKED_BYTES} bytes a host a step, gloo's own "
          f"messages are over 1% of the payload")


def _write_outputs(args, records: list[dict], exchanges: list[dict]) -> bool:
  """--json and --png, each written whole or not at all; False (the records printed instead)
  when one could not be written after all."""
  try:
    if args.json:
      files.write_atomic(args.json, json.dumps(records, indent=1))
    if args.png:
      report.plot(exchanges, args.png)
      print(f"wrote {args.png}")
  except OSError as e:
    print(f"netbench: could not write the results: {e}; the records:\n"
          + json.dumps(records, indent=1), file=sys.stderr)
    return False
  return True


def main(argv: Sequence[str] | None = None) -> int:
  args = _parser().parse_args(argv)
  try:
    settings = _check_args(args)
  except ValueError as e:
    print(f"netbench: {e}", file=sys.stderr)
    return 2
  missing = netns.missing_requirements()
  if missing:
    print("netbench: cannot build hosts here; missing: " + "; ".join(missing), file=sys.stderr)
    return 2
  try:
    records = _measure_all(args, settings)
  except (RuntimeError, TimeoutError) as e:
    print(f"netbench: {e}", file=sys.stderr)
    return 1
  if args.probe is not None:
    return 0
  exchanges = [r for r in records if r.get("kind") != "train"]
  training = [r for r in records if r.get("kind") == "train"]
  _print_tables(args, exchanges, training)
  written = _write_outputs(args, records, exchanges)
  failures = report.check(exchanges, args.min_rate_fraction) + report.check_training(training)
  for f in failures:
    print(f"FAIL: {f}")
  return 1 if failures or not written else 0
