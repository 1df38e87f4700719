"""Hosts on a real wire for netbench: network namespaces, veth / bridge links, tbf shaping.

Every name this module creates starts with PREFIX and carries the creating process's pid
("lj-<pid>-h0", "lj-<pid>-br"), so a set whose creator died is recognised and removed before
the next run, and two runs never touch each other's hosts. Needs root and iproute2 (`ip`, `tc`).
"""

import os
import re
import shutil
import signal
import subprocess
from typing import NamedTuple, Sequence

PREFIX = "lj-"
SUBNET = "10.213.0"          # private; these addresses exist only inside our namespaces
INTERFACE = "eth0"           # every host's link, inside its namespace
COMMAND_TIMEOUT_S = 20
_NAME = re.compile(rf"^{re.escape(PREFIX)}(\d+)-(h\d+|br)$")
_RATE = re.compile(r"^(\d+(?:\.\d+)?)(kbit|mbit|gbit)$")
_RATE_UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
# The shaper's bucket holds this much of the rate: ~1 MB at 1 Gb/s, which let a plain fp32
# all-reduce reach ~95% of the rate here; a 64 KB bucket lost half the rate to TCP drops.
# At least 128 KB: tbf splits a 64 KB GSO packet that does not fit its bucket into MTU
# segments, each with its own headers, which put 6% more bytes on the counters at 20 Mb/s.
BURST_S = 0.008
MIN_BURST_BYTES = 128 * 1024
QUEUE_LATENCY_MS = 100


def rate_bits(rate: str) -> float:
  """'100mbit' -> 1e8 bits per second (units kbit, mbit, gbit, as tc writes them)."""
  m = _RATE.match(rate.strip().lower())
  if not m:
    raise ValueError(f"rate must be a number followed by kbit, mbit or gbit (e.g. 100mbit, "
                     f"1gbit), got {rate!r}")
  return float(m.group(1)) * _RATE_UNITS[m.group(2)]


def burst_bytes(rate: str) -> int:
  """The token bucket for `rate`: BURST_S of traffic, at least MIN_BURST_BYTES."""
  return max(int(rate_bits(rate) * BURST_S / 8), MIN_BURST_BYTES)


def missing_requirements() -> list[str]:
  """What netbench lacks here to build hosts: root, `ip`, `tc` (empty when all is present)."""
  missing = []
  if os.geteuid() != 0:
    missing.append("root (network namespaces and tc need it; run as root)")
  for tool in ("ip", "tc"):
    if shutil.which(tool) is None:
      missing.append(f"the `{tool}` command (iproute2)")
  return missing


def _run(args: Sequence[str], timeout: float = COMMAND_TIMEOUT_S) -> str:
  done = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)
  if done.returncode:
    raise RuntimeError(f"`{' '.join(args)}` failed ({done.returncode}): {done.stderr.strip()}")
  return done.stdout


def our_namespaces() -> list[str]:
  """Every namespace with our prefix, whoever created it."""
  names = [line.split()[0] for line in _run(["ip", "netns", "list"]).splitlines() if line.strip()]
  return [n for n in names if _NAME.match(n)]


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


def remove_namespace(name: str) -> None:
  """Kills what still runs inside `name` (only our own workers live there), then deletes it."""
  if not _NAME.match(name):
    raise ValueError(f"refusing to remove {name!r}: not a netbench namespace ({PREFIX}<pid>-...)")
  try:
    pids = [int(p) for p in _run(["ip", "netns", "pids", name]).split()]
  except RuntimeError:
    pids = []
  for pid in pids:
    try:
      os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
      pass
  subprocess.run(["ip", "netns", "delete", name], capture_output=True, timeout=COMMAND_TIMEOUT_S)


def remove_stale() -> list[str]:
  """Removes the namespaces of runs whose creating process is gone; returns their names."""
  stale = [n for n in our_namespaces() if not _alive(int(_NAME.match(n).group(1)))]
  for name in stale:
    remove_namespace(name)
  return stale


class Host(NamedTuple):
  namespace: str
  address: str
  interface: str


class Network:
  """`hosts` namespaces on one shaped link each: a veth pair for 2, a bridge for more.

  Every host's egress is shaped to `rate` by tbf (and delayed by netem when `delay`, e.g.
  "5ms"); with a bridge the bridge's port toward each host is shaped too, as a switch port
  would be. Use as a context manager: the namespaces (and the links in them, and whatever
  still runs there) are removed on leaving it, however it is left.
  """

  def __init__(self, hosts: int, rate: str, delay: str | None = None,
               burst: int | None = None, queue_latency_ms: int = QUEUE_LATENCY_MS):
    if hosts < 2 or hosts > 64:
      raise ValueError(f"hosts must be in 2..64, got {hosts}")
    rate_bits(rate)
    if delay is not None and not re.match(r"^\d+(\.\d+)?(us|ms|s)$", delay):
      raise ValueError(f"delay must look like 5ms, 200us or 1s, got {delay!r}")
    self.rate, self.delay = rate, delay
    self.burst = burst or burst_bytes(rate)
    self.queue_latency_ms = queue_latency_ms
    tag = f"{PREFIX}{os.getpid()}-"
    self.hosts = [Host(f"{tag}h{i}", f"{SUBNET}.{i + 1}", INTERFACE) for i in range(hosts)]
    self.bridge = f"{tag}br" if hosts > 2 else None
    self.created: list[str] = []

  @property
  def shaping(self) -> str:
    """The tc settings, as reported beside the results."""
    delay = f" after netem delay {self.delay}" if self.delay else ""
    return (f"tbf rate {self.rate} burst {self.burst} bytes latency {self.queue_latency_ms}ms"
            f"{delay} on every host egress" + (" and bridge port" if self.bridge else ""))

  def __enter__(self) -> "Network":
    try:
      self._build()
    except BaseException:
      self.close()
      raise
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def _add_namespace(self, name: str) -> None:
    _run(["ip", "netns", "add", name])
    self.created.append(name)
    _run(["ip", "-n", name, "link", "set", "lo", "up"])
    # IPv6 autoconfiguration would put its own packets on the counted links.
    _run(["ip", "netns", "exec", name, "sysctl", "-q", "-w", "net.ipv6.conf.all.disable_ipv6=1",
          "net.ipv6.conf.default.disable_ipv6=1"])

  def _shape(self, namespace: str, interface: str) -> None:
    tbf = ["tbf", "rate", self.rate, "burst", str(self.burst), "latency",
           f"{self.queue_latency_ms}ms"]
    if self.delay:
      _run(["tc", "-n", namespace, "qdisc", "add", "dev", interface, "root", "handle", "1:",
            "netem", "delay", self.delay])
      _run(["tc", "-n", namespace, "qdisc", "add", "dev", interface, "parent", "1:1",
            "handle", "10:", *tbf])
    else:
      _run(["tc", "-n", namespace, "qdisc", "add", "dev", interface, "root", *tbf])

  def _build(self) -> None:
    for host in self.hosts:
      self._add_namespace(host.namespace)
    if self.bridge is None:
      a, b = self.hosts
      _run(["ip", "link", "add", a.interface, "netns", a.namespace, "type", "veth", "peer",
            "name", b.interface, "netns", b.namespace])
    else:
      self._add_namespace(self.bridge)
      _run(["ip", "-n", self.bridge, "link", "add", "br0", "type", "bridge"])
      _run(["ip", "-n", self.bridge, "link", "set", "br0", "up"])
      for i, host in enumerate(self.hosts):
        port = f"p{i}"
        _run(["ip", "link", "add", host.interface, "netns", host.namespace, "type", "veth",
              "peer", "name", port, "netns", self.bridge])
        _run(["ip", "-n", self.bridge, "link", "set", port, "master", "br0"])
        _run(["ip", "-n", self.bridge, "link", "set", port, "up"])
        self._shape(self.bridge, port)
    for host in self.hosts:
      _run(["ip", "-n", host.namespace, "addr", "add", f"{host.address}/24", "dev",
            host.interface])
      _run(["ip", "-n", host.namespace, "link", "set", host.interface, "up"])
      self._shape(host.namespace, host.interface)

  def exec_prefix(self, i: int) -> list[str]:
    """The command prefix that runs a program on host `i`."""
    return ["ip", "netns", "exec", self.hosts[i].namespace]

  def tx_bytes(self, i: int) -> int:
    """Bytes host `i` has sent on its link (the interface counter inside its namespace)."""
    host = self.hosts[i]
    return int(_run([*self.exec_prefix(i), "cat",
                     f"/sys/class/net/{host.interface}/statistics/tx_bytes"]))

  def close(self) -> None:
    for name in reversed(self.created):
      remove_namespace(name)
    self.created.clear()
