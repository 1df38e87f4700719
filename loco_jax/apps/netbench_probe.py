"""netbench's --probe and --calibration: their checks, and the probe each host runs."""

import shlex
import sys

from loco_jax.apps import netns


def check_args(args, rates: list[str]) -> None:
  """--probe and --calibration: one level; a probe runs at one rate and times no training;
  a calibration must be of this many devices and hold every method's work."""
  if args.probe is None and args.calibration is None:
    return
  if args.nodes > 1:
    raise ValueError("--probe and --calibration cover one level: the probe times collectives "
                     "over every device, not inside and between nodes")
  if args.probe is not None and (len(rates) != 1 or not args.exchange_only or args.calibration):
    raise ValueError("--probe writes one calibration: give one --rate and --exchange-only, "
                     "without --calibration")
  if args.probe is not None:   # the hosts' probe options, checked here as each host will
    from loco_jax.apps import probe
    probe.check_args(probe.parse_args(["--out", args.probe, "--methods", args.methods,
                                       *shlex.split(args.probe_args)]))
  if args.calibration is not None:
    from loco_jax.apps import calibration as calib
    found = calib.read(args.calibration)
    devices = args.hosts * args.devices_per_host
    missing = [m for m in args.methods.split(",") if m not in {w.method for w in found.work}]
    if found.devices != devices or missing:
      raise ValueError(f"--calibration {args.calibration!r} is of {found.devices} devices and "
                       f"methods {[w.method for w in found.work]}: these hosts have {devices} "
                       f"devices{f' and it lacks {missing}' if missing else ''}")


def command(net: netns.Network, args, i: int, coordinator: str) -> list[str]:
  """Host i's `loco-jax probe`, joined to the others as training would be."""
  host = net.hosts[i]
  return [*net.exec_prefix(i), sys.executable, "-m", "loco_jax.apps.probe", "--out", args.probe,
          "--coordinator", coordinator, "--processes", str(len(net.hosts)), "--process-id",
          str(i), "--address", host.address, "--cpu-devices", str(args.devices_per_host),
          "--methods", args.methods, "--timeout", str(args.timeout),
          *shlex.split(args.probe_args)]
