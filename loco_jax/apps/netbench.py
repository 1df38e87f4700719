"""`loco-jax netbench`: gradient exchanges between real hosts on shaped links, bytes counted.

Builds --hosts network namespaces (netns.Network), starts one jax process per host bound to
its address (parallel.initialize(gloo_hostname=...)), and measures per method the median step
time of a gradient exchange, the bits per parameter each host really sent (its interface's
tx_bytes over the timed steps) and what the compiled program predicts (comm accounting),
and the step's collectives alone (replayed as compiled). Then, unless --exchange-only, trains
the demo's GPT end to end per method: tokens per second, eval loss, the step's split into
compute and exchange, and the cost model's prediction beside it (docs/NETWORK.md).
Needs root and iproute2; exits 2 saying what is missing otherwise.
"""

import argparse
import ctypes
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

from loco_jax.apps import netns
from loco_jax.train import files
from loco_jax.apps.netbench_worker import METHODS, PARAM_GATHERS, TRAIN_METHODS

DEFAULT_METHODS = ",".join(METHODS)
COORDINATOR_PORT = 12355      # inside our own namespaces: no other listener can hold it
BITS_TOLERANCE = 0.02         # measured within 2% of the compiled program's prediction
MIN_RATE_FRACTION = 0.9       # the fp32 all-reduce must reach 90% of the nominal rate
# XLA:CPU takes a step's temporaries from malloc. With glibc's defaults, blocks over its
# (adaptive, at most 32 MiB) mmap threshold are mapped anew and page-faulted every step, and
# freed heap is trimmed back to the kernel: at 4 hosts this took loco's 4M-parameter exchange
# from 48-50 to 66-70 ms of CPU a host (docs/NETWORK.md). Every host gets heap that stays
# mapped, in transparent huge pages, for every method alike.
HOST_MALLOC = ("glibc.malloc.hugetlb=1:glibc.malloc.mmap_threshold=33554432:"
               "glibc.malloc.trim_threshold=4294967296")
_PACKAGE_ROOT = str(Path(__file__).resolve().parent.parent)


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="loco-jax netbench", description=__doc__.split("\n")[0])
  p.add_argument("--hosts", type=int, default=2, help="hosts (namespaces), 2..64")
  p.add_argument("--rate", default="1gbit",
                 help="link rate(s), comma-separated, as tc writes them: 100mbit,1gbit")
  p.add_argument("--delay", default=None, help="one-way delay added to every link, e.g. 5ms")
  p.add_argument("--burst", type=int, default=None,
                 help=f"tbf bucket in bytes (default: {netns.BURST_S * 1e3:g} ms of the rate, "
                      f"at least {netns.MIN_BURST_BYTES})")
  p.add_argument("--params", type=int, default=4 * 2**20, help="float32 gradient parameters")
  p.add_argument("--methods", default=DEFAULT_METHODS, help=f"comma-separated: {DEFAULT_METHODS}")
  p.add_argument("--devices-per-host", type=int, default=1)
  p.add_argument("--steps", type=int, default=5, help="timed steps (the median is reported)")
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument("--timeout", type=int, default=900,
                 help="seconds a rate's whole run may take before every host is stopped")
  p.add_argument("--min-rate-fraction", type=float, default=MIN_RATE_FRACTION,
                 help="calibration check: the fp32 all-reduce's share of the nominal rate "
                      "(0 turns the check off)")
  p.add_argument("--exchange-only", action="store_true",
                 help="measure the gradient exchanges only, skip end-to-end training")
  p.add_argument("--train-methods", default=",".join(TRAIN_METHODS),
                 help=f"end-to-end training, comma-separated: {','.join(TRAIN_METHODS)}")
  p.add_argument("--train-steps", type=int, default=30,
                 help="training steps per method (the first 2 are not timed)")
  p.add_argument("--train-model", default="512,1,3072,8",
                 help="the demo GPT: d_model,n_layers,d_ff,n_heads (default: 4.5M parameters)")
  p.add_argument("--batch-per-host", type=int, default=2,
                 help="sequences per host and step (2: fp32's step is 2/3 exchange at 4 hosts, "
                      "1 Gb/s, docs/NETWORK.md)")
  p.add_argument("--seq-len", type=int, default=64)
  p.add_argument("--param-gather", default="float32",
                 help=f"zero2 and fsdp's parameter gathers, one of {','.join(PARAM_GATHERS)}: "
                      "the compute dtype, or int8 with block scales")
  p.add_argument("--default-malloc", dest="host_malloc", action="store_false",
                 help=f"run the hosts with glibc's default malloc settings instead of "
                      f"GLIBC_TUNABLES={HOST_MALLOC} (a GLIBC_TUNABLES already set is kept)")
  p.add_argument("--json", default=None, help="write the records to this file")
  p.add_argument("--png", default=None, help="plot step time against link rate (matplotlib)")
  return p


def _check_args(args) -> list[str]:
  methods = args.methods.split(",")
  unknown = [m for m in methods if m not in METHODS]
  if unknown or len(set(methods)) != len(methods):
    raise ValueError(f"--methods must be distinct names from {METHODS}, got {args.methods!r}")
  for name in ("steps", "params", "devices_per_host", "timeout"):
    if getattr(args, name) < 1:
      raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
  if args.warmup < 0:
    raise ValueError(f"--warmup must be >= 0, got {args.warmup}")
  if not 0 <= args.min_rate_fraction <= 1:
    raise ValueError(f"--min-rate-fraction must be in [0, 1], got {args.min_rate_fraction}")
  rates = args.rate.split(",")
  for r in rates:
    netns.rate_bits(r)
  if not args.exchange_only:
    train = args.train_methods.split(",")
    if [m for m in train if m not in TRAIN_METHODS] or len(set(train)) != len(train):
      raise ValueError(f"--train-methods must be distinct names from {TRAIN_METHODS}, got "
                       f"{args.train_methods!r}")
    model = args.train_model.split(",")
    if len(model) != 4 or not all(v.isdigit() and int(v) > 0 for v in model) or \
        int(model[0]) % int(model[3]):
      raise ValueError(f"--train-model must be four positive ints d_model,n_layers,d_ff,n_heads "
                       f"with n_heads dividing d_model, got {args.train_model!r}")
    for name in ("train_steps", "batch_per_host", "seq_len"):
      if getattr(args, name) < 1:
        raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.param_gather not in PARAM_GATHERS:
      raise ValueError(f"--param-gather must be one of {PARAM_GATHERS}, got "
                       f"{args.param_gather!r}")
    if args.train_steps < 3:
      raise ValueError(f"--train-steps must be >= 3 (2 are not timed), got {args.train_steps}")
    if args.batch_per_host % args.devices_per_host:
      raise ValueError(f"--batch-per-host ({args.batch_per_host}) must be a multiple of "
                       f"--devices-per-host ({args.devices_per_host})")
  return rates


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
  procs, logs = [], []
  try:
    for i, host in enumerate(net.hosts):
      log = open(os.path.join(workdir, f"host{i}.log"), "w+")
      logs.append(log)
      cmd = [*net.exec_prefix(i), sys.executable, "-m", "loco_jax.apps.netbench_worker",
             "--process-id", str(i), "--hosts", str(len(net.hosts)),
             "--coordinator", coordinator, "--address", host.address,
             "--interface", host.interface, "--params", str(args.params),
             "--methods", args.methods, "--steps", str(args.steps), "--warmup", str(args.warmup),
             "--devices-per-host", str(args.devices_per_host), "--timeout", str(args.timeout),
             "--namespace", host.namespace]
      if not args.exchange_only:
        cmd += ["--train-methods", args.train_methods, "--train-steps", str(args.train_steps),
                "--train-model", args.train_model, "--batch-per-host", str(args.batch_per_host),
                "--seq-len", str(args.seq_len), "--param-gather", args.param_gather]
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


def summarize(results: list[dict], hosts: int, rate: str, n_params: int) -> list[dict]:
  """One record per method: the slowest host's median step, the mean bits the hosts sent."""
  records = []
  results = [r for r in results if r.get("kind", "result") == "result"]
  for method in dict.fromkeys(r["method"] for r in results):
    rows = [r for r in results if r["method"] == method]
    if len(rows) != hosts:
      raise RuntimeError(f"{method}: {len(rows)} of {hosts} hosts reported")
    predicted = rows[0]["predicted_bits_per_param"]
    records.append({
        "method": method, "hosts": hosts, "rate": rate, "n_params": n_params,
        "step_s": max(r["step_s"] for r in rows),
        "cpu_s": max(r["cpu_s"] for r in rows),
        "collectives_s": max(r["collectives_s"] for r in rows),
        "measured_bits_per_param": statistics.mean(r["measured_bits_per_param"] for r in rows),
        "measured_bits_per_host": [r["measured_bits_per_param"] for r in rows],
        "predicted_bits_per_param": predicted,
        "predicted_wire_s": predicted * n_params / netns.rate_bits(rate),
        "finite": all(r["finite"] for r in rows),
        "host_malloc": rows[0]["malloc"],
        "collectives": rows[0]["collectives"]})
  return records


# The LoCo paper's Table I widths (b_g, b_w) of each training method, for bench.comm_seconds.
TABLE_I_BITS = {"fp32": (32, 32), "bf16": (16, 16), "loco": (4, 16), "loco-quantized": (4, 4)}


def summarize_training(results: list[dict], hosts: int, rate: str) -> list[dict]:
  """One record per training method: the slowest host's median step, tokens per second, eval
  loss, its split into compute (the same step with no exchange, method "compute") and exchange
  (of which `collectives_s`: the step's collectives alone, replayed as compiled),
  and beside it the step the compiled program's bytes predict (compute + bits at the rate)
  and the cost model's (compute + bench.comm_seconds with Table I's widths)."""
  from loco_jax.apps import bench
  rows = [r for r in results if r.get("kind") == "train"]
  compute = [r for r in rows if r["method"] == "compute"]
  if len(compute) != hosts:
    raise RuntimeError(f"training: {len(compute)} of {hosts} hosts reported the compute step")
  compute_s = max(r["step_s"] for r in compute)
  bits_per_s = netns.rate_bits(rate)
  records = []
  for method in dict.fromkeys(r["method"] for r in rows):
    mine = [r for r in rows if r["method"] == method]
    if len(mine) != hosts:
      raise RuntimeError(f"training {method}: {len(mine)} of {hosts} hosts reported")
    first, step_s = mine[0], max(r["step_s"] for r in mine)
    n = first["n_params"]
    record = {
        "method": method, "kind": "train", "hosts": hosts, "rate": rate, "n_params": n,
        "step_s": step_s, "tokens_per_s": first["tokens_per_step"] / step_s,
        "eval_loss": statistics.mean(r["eval_loss"] for r in mine),
        "final_loss": statistics.mean(r["final_loss"] for r in mine),
        "compute_s": compute_s, "exchange_s": max(step_s - compute_s, 0.0),
        "collectives_s": max(r["collectives_s"] for r in mine),
        "measured_bits_per_param": statistics.mean(r["measured_bits_per_param"] for r in mine),
        "measured_bits_per_host": [r["measured_bits_per_param"] for r in mine],
        "predicted_bits_per_param": first["predicted_bits_per_param"],
        "predicted_step_s": compute_s + first["predicted_bits_per_param"] * n / bits_per_s,
        "overlapped_collectives": first.get("overlapped_collectives", 0)}
    if method in TABLE_I_BITS:
      record["cost_model_step_s"] = compute_s + bench.comm_seconds(
          *TABLE_I_BITS[method], n, hosts, bits_per_s / 1e9)
    records.append(record)
  return records


def format_training_table(records: list[dict]) -> list[str]:
  lines = ["| method | hosts | rate | params | step ms | compute ms | exchange ms (share) | "
           "collectives ms | tokens/s | eval loss | predicted ms | cost model ms | "
           "bits/param sent (pred.) | overlapped |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in records:
    cost = f"{r['cost_model_step_s'] * 1e3:.1f}" if "cost_model_step_s" in r else "-"
    lines.append(
        f"| {r['method']} | {r['hosts']} | {r['rate']} | {r['n_params']} | "
        f"{r['step_s'] * 1e3:.1f} | {r['compute_s'] * 1e3:.1f} | {r['exchange_s'] * 1e3:.1f} "
        f"({r['exchange_s'] / r['step_s']:.0%}) | {r['collectives_s'] * 1e3:.1f} | "
        f"{r['tokens_per_s']:.0f} | "
        f"{r['eval_loss']:.4f} | {r['predicted_step_s'] * 1e3:.1f} | {cost} | "
        f"{r['measured_bits_per_param']:.2f} ({r['predicted_bits_per_param']:.2f}) | "
        f"{r['overlapped_collectives']} |")
  return lines


def check(records: list[dict], min_rate_fraction: float) -> list[str]:
  """The failures: bits off the prediction by more than 2%, a NaN output, an fp32 all-reduce
  under `min_rate_fraction` of the nominal rate (the shaper's calibration)."""
  failures = []
  for r in records:
    worst = max(abs(b / r["predicted_bits_per_param"] - 1) for b in r["measured_bits_per_host"])
    if worst > BITS_TOLERANCE:
      failures.append(f"{r['method']} at {r['rate']}: a host sent {worst:.1%} off the "
                      f"predicted {r['predicted_bits_per_param']:.2f} bits/param")
    if not r["finite"]:
      failures.append(f"{r['method']} at {r['rate']}: non-finite output")
  for r in records:
    if r["method"] == "fp32" and rate_fraction(r) < min_rate_fraction:
      failures.append(f"calibration at {r['rate']}: the fp32 all-reduce reached "
                      f"{rate_fraction(r):.0%} of the rate, under {min_rate_fraction:.0%}")
  return failures


def check_training(records: list[dict]) -> list[str]:
  """Training failures: a host's bytes off the compiled program's by more than 2% (the
  compute step sends almost nothing and is left out), a non-finite eval loss."""
  failures = []
  for r in records:
    if r["method"] != "compute":
      worst = max(abs(b / r["predicted_bits_per_param"] - 1) for b in r["measured_bits_per_host"])
      if worst > BITS_TOLERANCE:
        failures.append(f"training {r['method']} at {r['rate']}: a host sent {worst:.1%} off "
                        f"the predicted {r['predicted_bits_per_param']:.2f} bits/param")
    if not math.isfinite(r["eval_loss"]):
      failures.append(f"training {r['method']} at {r['rate']}: eval loss {r['eval_loss']}")
  return failures


def rate_fraction(record: dict) -> float:
  """The share of the nominal rate a method's step achieved (bits sent / step time / rate)."""
  sent_bits = max(record["measured_bits_per_host"]) * record["n_params"]
  return sent_bits / record["step_s"] / netns.rate_bits(record["rate"])


def format_table(records: list[dict]) -> list[str]:
  lines = ["| method | hosts | rate | params | step ms | cpu ms | collectives ms | "
           "wire ms (pred.) | % of rate | bits/param sent | predicted | diff |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in records:
    diff = r["measured_bits_per_param"] / r["predicted_bits_per_param"] - 1
    lines.append(
        f"| {r['method']} | {r['hosts']} | {r['rate']} | {r['n_params']} | "
        f"{r['step_s'] * 1e3:.1f} | {r['cpu_s'] * 1e3:.1f} | {r['collectives_s'] * 1e3:.1f} | "
        f"{r['predicted_wire_s'] * 1e3:.1f} | "
        f"{rate_fraction(r):.0%} | {r['measured_bits_per_param']:.3f} | "
        f"{r['predicted_bits_per_param']:.3f} | {diff:+.2%} |")
  return lines


def plot(records: list[dict], path: str) -> str | None:
  """Step time against link rate per method, measured (solid) and predicted wire time (dashed).

  matplotlib is a dev dependency, imported here only: returns why not when it is missing."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return "matplotlib (a dev dependency: pip install loco-jax[dev]) is not installed"
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for i, method in enumerate(dict.fromkeys(r["method"] for r in records)):
    rows = sorted((r for r in records if r["method"] == method),
                  key=lambda r: netns.rate_bits(r["rate"]))
    x = [netns.rate_bits(r["rate"]) / 1e6 for r in rows]
    color = f"C{i}"
    ax.plot(x, [r["step_s"] * 1e3 for r in rows], "o-", color=color, label=f"{method}")
    ax.plot(x, [r["predicted_wire_s"] * 1e3 for r in rows], "x--", color=color, alpha=0.6)
  ax.set(xscale="log", yscale="log", xlabel="link rate (Mb/s)", ylabel="step time (ms)",
         title=f"{records[0]['hosts']} hosts, {records[0]['n_params']} params "
               "(dashed: predicted wire time)")
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return None


def _raise_on_signal(signum, frame):
  raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
  args = _parser().parse_args(argv)
  try:
    rates = _check_args(args)
  except ValueError as e:
    print(f"netbench: {e}", file=sys.stderr)
    return 2
  missing = netns.missing_requirements()
  if missing:
    print("netbench: cannot build hosts here; missing: " + "; ".join(missing), file=sys.stderr)
    return 2
  # Ctrl-C raises KeyboardInterrupt; SIGTERM / SIGHUP become SystemExit: either way the
  # `with` blocks below remove every namespace and process this run made.
  previous = {s: signal.signal(s, _raise_on_signal) for s in (signal.SIGTERM, signal.SIGHUP)}
  previous[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)
  try:
    stale = netns.remove_stale()
    if stale:
      print(f"removed {len(stale)} namespaces left by an earlier run: {', '.join(stale)}")
    records, malloc = [], host_env(args.host_malloc).get("GLIBC_TUNABLES", "")
    with tempfile.TemporaryDirectory(prefix="netbench-") as workdir:
      for rate in rates:
        with netns.Network(args.hosts, rate, args.delay, args.burst) as net:
          print(f"{args.hosts} hosts at {rate}: {net.shaping}; hosts' GLIBC_TUNABLES={malloc!r}",
                flush=True)
          results = run_hosts(net, args, workdir)
          records += summarize(results, args.hosts, rate, args.params)
          if not args.exchange_only:
            records += summarize_training(results, args.hosts, rate)
  except (RuntimeError, TimeoutError) as e:
    print(f"netbench: {e}", file=sys.stderr)
    return 1
  finally:
    for s, handler in previous.items():
      signal.signal(s, handler)
  exchanges = [r for r in records if r.get("kind") != "train"]
  training = [r for r in records if r.get("kind") == "train"]
  print("\n".join(format_table(exchanges)))
  if training:
    print("\nEnd-to-end training (ddp, adamw; compute = the same step with no exchange):")
    print("\n".join(format_training_table(training)))
  for r in exchanges:
    if r["method"] == "fp32":
      print(f"calibration at {r['rate']}: the fp32 all-reduce reached {rate_fraction(r):.0%} "
            f"of the nominal rate (check: >= {args.min_rate_fraction:.0%})")
  if args.json:
    files.write_atomic(args.json, json.dumps(records, indent=1))
  if args.png:
    why = plot(exchanges, args.png)
    print(f"PNG not written: {why}" if why else f"wrote {args.png}")
  failures = check(exchanges, args.min_rate_fraction) + check_training(training)
  for f in failures:
    print(f"FAIL: {f}")
  return 1 if failures else 0
