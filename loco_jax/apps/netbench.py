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

import ctypes
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
from loco_jax.apps import netbench_args, netbench_probe, netns
from loco_jax.train import files

COORDINATOR_PORT = 12355      # inside our own namespaces: no other listener can hold it
# XLA:CPU takes a step's temporaries from malloc. With glibc's defaults, blocks over its
# (adaptive, at most 32 MiB) mmap threshold are mapped anew and page-faulted every step, and
# freed heap is trimmed back to the kernel: at 4 hosts this took loco's 4M-parameter exchange
# from 48-50 to 66-70 ms of CPU a host (docs/results/network.md). Every host gets heap that stays
# mapped, in transparent huge pages, for every method alike.
HOST_MALLOC = ("glibc.malloc.hugetlb=1:glibc.malloc.mmap_threshold=33554432:"
               "glibc.malloc.trim_threshold=4294967296")
_PACKAGE_ROOT = str(Path(__file__).resolve().parent.parent)


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
                "--inner-steps", str(args.inner_steps), "--fragments", str(args.fragments),
                "--overlap", str(args.overlap)]
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
    diloco = report.format_diloco_table(training)
    if diloco:
      print("\nDiLoCo's steps by kind (the slowest host's):")
      print("\n".join(diloco))
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
  args = netbench_args.parser().parse_args(argv)
  try:
    settings = netbench_args.check(args)
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
