"""netbench's command line: its options, each checked before a namespace is built."""

import argparse
import importlib.util
import os

from loco_jax.apps import netbench_probe, netns
from loco_jax.apps.netbench_methods import FLAT_DEFAULT, METHODS, TWO_LEVEL_DEFAULT
from loco_jax.apps.netbench_worker import PARAM_GATHERS, TRAIN_METHODS
from loco_jax.train import files

MIN_RATE_FRACTION = 0.9       # the fp32 all-reduce must reach 90% of the nominal rate
FLOAT32_COPIES = 4            # of the gradient a device holds at least (--params' upper bound)


def _methods_help() -> str:
  return "; ".join(f"{name}: {m.help}" + (" (--nodes > 1)" if m.topology == "nodes" else "")
                   for name, m in METHODS.items())


def parser() -> argparse.ArgumentParser:
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
  p.add_argument("--steps", type=int, default=5,
                 help="timed steps at least: more where they take under a second together "
                      "(the median is reported)")
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
  p.add_argument("--fragments", type=int, default=1,
                 help="the diloco methods' fragments, synced in turn (streaming DiLoCo)")
  p.add_argument("--overlap", type=int, default=0,
                 help="the -overlap diloco methods' inner steps a sync runs beside, on a second "
                      "device of each host (below --inner-steps); given exactly when one of "
                      "them trains")
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
                 help="run the hosts with glibc's default malloc settings instead of "
                      "netbench.HOST_MALLOC's heap that stays mapped (a GLIBC_TUNABLES already "
                      "set is kept)")
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
  overlapped = [m for m in train if m.endswith("-overlap")]
  if bool(overlapped) != (args.overlap != 0):
    raise ValueError(f"--overlap sets the -overlap diloco methods' tau: give it (>= 1) exactly "
                     f"when one of them trains (--overlap {args.overlap}, --train-methods "
                     f"{args.train_methods})")
  if any(m.startswith("diloco") for m in train):
    _positive(args, "inner_steps", "fragments")
    if args.inner_steps % args.fragments:
      raise ValueError(f"--fragments {args.fragments} must divide --inner-steps "
                       f"{args.inner_steps}")
    if not 0 <= args.overlap < args.inner_steps:
      raise ValueError(f"--overlap must be in 0..{args.inner_steps - 1} (below --inner-steps), "
                       f"got {args.overlap}")
    if overlapped and args.train_steps < 3 * args.inner_steps:
      raise ValueError(f"--train-steps {args.train_steps}: the -overlap methods compile their "
                       f"first merge in their second round and time whole rounds from it: "
                       f"give at least 3 rounds, {3 * args.inner_steps}")
    if args.train_steps % args.inner_steps or args.train_steps < 2 * args.inner_steps:
      raise ValueError(f"--train-steps {args.train_steps} must be a multiple of --inner-steps "
                       f"{args.inner_steps}, at least 2 of them, for the diloco methods (the "
                       f"first round compiles, the others are timed whole), e.g. "
                       f"{3 * args.inner_steps}")
  if args.batch_per_host % args.devices_per_host:
    raise ValueError(f"--batch-per-host ({args.batch_per_host}) must be a multiple of "
                     f"--devices-per-host ({args.devices_per_host})")


def check(args) -> list[tuple[str, str | None]]:
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
  elif args.overlap:
    raise ValueError("--overlap is a training option (the -overlap diloco methods): drop it "
                     "with --exchange-only")
  netbench_probe.check_args(args, rates)
  for option, path in (("--json", args.json), ("--png", args.png), ("--probe", args.probe)):
    if path is not None:
      files.check_writable(path, option)
  if args.json is not None and args.png is not None and \
      os.path.abspath(args.json) == os.path.abspath(args.png):
    raise ValueError(f"--json and --png name the same file {args.json!r}")
  if args.png is not None and importlib.util.find_spec("matplotlib") is None:
    raise ValueError("--png needs matplotlib (a dev dependency: pip install loco-jax[dev]), "
                     "which is not installed")
  return [(r, i) for r in rates for i in inter_rates]
