"""Hosts on a real wire for netbench: network namespaces, veth / bridge links, tbf shaping.

One level (`nodes=1`): every host on one shaped link, a veth pair for 2 hosts, a bridge for
more. Two levels (`nodes>1`): the hosts are split into nodes of consecutive hosts; each node
is a bridge its hosts reach on links of `rate`, and every node bridge reaches a core bridge on
one uplink of `inter_rate`, whose interface counters are the bytes between nodes.

Every name this module creates starts with PREFIX and carries the creating process's pid
("lj-<pid>-h0", "lj-<pid>-br", "lj-<pid>-n0", "lj-<pid>-core"), so a set whose creator died is
recognised and removed before the next run, and two runs never touch each other's hosts.
Needs root and iproute2 (`ip`, `tc`; netbench's hosts read their connections with `ss`).
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from typing import NamedTuple, Sequence

PREFIX = "lj-"
SUBNET = "10.213.0"          # private; these addresses exist only inside our namespaces
INTERFACE = "eth0"           # every host's link, inside its namespace
UPLINK = "uplink"           # a node bridge's link toward the core, inside the node's namespace
MAX_HOSTS = 64
COMMAND_TIMEOUT_S = 20
_NAME = re.compile(rf"^{re.escape(PREFIX)}(\d+)-(h\d+|br|n\d+|core)$")
_RATE = re.compile(r"^(\d+(?:\.\d+)?)(kbit|mbit|gbit)$")
_RATE_UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
_DELAY = re.compile(r"^\d+(\.\d+)?(us|ms|s)$")
# The shaper's bucket holds this much of the rate: ~1 MB at 1 Gb/s, which let a plain fp32
# all-reduce reach ~95% of the rate here; a 64 KB bucket lost half the rate to TCP drops.
# At least 128 KB: tbf splits a 64 KB GSO packet that does not fit its bucket into MTU
# segments, each with its own headers, which put 6% more bytes on the counters at 20 Mb/s.
BURST_S = 0.008
MIN_BURST_BYTES = 128 * 1024
MIN_BURST_ARG = 1514         # --burst: at least one full Ethernet frame, or tbf never sends it
QUEUE_LATENCY_MS = 100
TCP_PORT = 29417
# A receiver of one TCP stream: prints the bytes it read, those it timed, and the seconds from
# its first `skip` bytes (the shapers' full buckets pass at line rate) to the sender's close.
_RECEIVER = """
import socket, sys, time
server = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("ready", flush=True)
connection, _ = server.accept()
total, skip = 0, int(sys.argv[3])
while total < skip and (chunk := connection.recv(1 << 20)):
  total += len(chunk)
start, untimed = time.perf_counter(), total
while chunk := connection.recv(1 << 20):
  total += len(chunk)
print(total, total - untimed, time.perf_counter() - start, flush=True)
"""
_SENDER = """
import socket, sys
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=60) as c:
  block = bytes(1 << 20)
  for _ in range(int(sys.argv[3]) >> 20):
    c.sendall(block)
"""


def rate_bits(rate: str) -> float:
  """'100mbit' -> 1e8 bits per second (units kbit, mbit, gbit, as tc writes them)."""
  m = _RATE.match(rate.strip().lower())
  if not m or float(m.group(1)) <= 0:
    raise ValueError(f"rate must be a positive number followed by kbit, mbit or gbit (e.g. "
                     f"100mbit, 1gbit), got {rate!r}")
  return float(m.group(1)) * _RATE_UNITS[m.group(2)]


def burst_bytes(rate: str) -> int:
  """The token bucket for `rate`: BURST_S of traffic, at least MIN_BURST_BYTES."""
  return max(int(rate_bits(rate) * BURST_S / 8), MIN_BURST_BYTES)


def check_topology(hosts: int, nodes: int = 1, delay: str | None = None,
                   burst: int | None = None) -> None:
  """ValueError unless `hosts` hosts split into `nodes` nodes, `delay` and `burst` are ones
  Network can build (checked before anything is created)."""
  if not 2 <= hosts <= MAX_HOSTS:
    raise ValueError(f"hosts must be in 2..{MAX_HOSTS}, got {hosts}")
  if not 1 <= nodes <= hosts or hosts % nodes:
    raise ValueError(f"nodes must divide the hosts into nodes of equal size (1..{hosts}), got "
                     f"{nodes} nodes for {hosts} hosts")
  if delay is not None and not _DELAY.match(delay):
    raise ValueError(f"delay must be a number followed by us, ms or s (e.g. 5ms, 200us), got "
                     f"{delay!r}")
  if burst is not None and burst < MIN_BURST_ARG:
    raise ValueError(f"burst must be at least {MIN_BURST_ARG} bytes (one Ethernet frame), got "
                     f"{burst}")


def missing_requirements() -> list[str]:
  """What netbench lacks here to build and read hosts: root, `ip`, `tc`, `ss` (empty when all
  is present)."""
  missing = []
  if os.geteuid() != 0:
    missing.append("root (network namespaces and tc need it; run as root)")
  for tool in ("ip", "tc", "ss"):
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


def link_bytes(namespace: str, interface: str) -> tuple[int, int]:
  """(bytes sent, bytes received) by `interface` in `namespace`, from any namespace (root)."""
  stats = json.loads(_run(["ip", "-n", namespace, "-j", "-s", "link", "show", "dev",
                           interface]))[0]["stats64"]
  return int(stats["tx"]["bytes"]), int(stats["rx"]["bytes"])


class Host(NamedTuple):
  namespace: str
  address: str
  interface: str


class Link(NamedTuple):
  """An interface whose counters netbench reads: `namespace`, `interface`."""
  namespace: str
  interface: str


class Network:
  """`hosts` namespaces on shaped links: one level, or `nodes` nodes joined by slower links.

  One level: a veth pair for 2 hosts, a bridge for more. Two levels (`nodes` > 1, with
  `inter_rate`): the hosts, `hosts // nodes` consecutive ones a node, each on a bridge of its
  own node; every node bridge reaches a core bridge through one link (`uplinks`). Every host's
  egress and every bridge port toward a host is shaped to `rate` by tbf (and delayed by netem
  when `delay`, e.g. "5ms"), as a switch port would be; both ends of every inter-node link to
  `inter_rate`. Use as a context manager: the namespaces (and the links in them, and whatever
  still runs there) are removed on leaving it, however it is left.
  """

  def __init__(self, hosts: int, rate: str, delay: str | None = None,
               burst: int | None = None, nodes: int = 1, inter_rate: str | None = None,
               queue_latency_ms: int = QUEUE_LATENCY_MS):
    check_topology(hosts, nodes, delay, burst)
    rate_bits(rate)
    if (nodes > 1) != (inter_rate is not None):
      raise ValueError(f"inter_rate is the rate between nodes: give it exactly when nodes > 1 "
                       f"(nodes={nodes}, inter_rate={inter_rate!r})")
    if inter_rate is not None:
      rate_bits(inter_rate)
    self.rate, self.inter_rate, self.delay, self.burst = rate, inter_rate, delay, burst
    self.queue_latency_ms = queue_latency_ms
    tag = f"{PREFIX}{os.getpid()}-"
    self.hosts = [Host(f"{tag}h{i}", f"{SUBNET}.{i + 1}", INTERFACE) for i in range(hosts)]
    self.hosts_per_node = hosts // nodes
    self.switches = [f"{tag}n{k}" for k in range(nodes)] if nodes > 1 else []
    self.core = f"{tag}core" if nodes > 1 else None
    self.bridge = f"{tag}br" if nodes == 1 and hosts > 2 else None
    self.created: list[str] = []

  @property
  def uplinks(self) -> list[Link]:
    """Per node, its link toward the other nodes: `tx` is all it sends them (empty: one level)."""
    return [Link(switch, UPLINK) for switch in self.switches]

  def _tbf(self, rate: str) -> str:
    return f"tbf rate {rate} burst {self.burst or burst_bytes(rate)} bytes"

  @property
  def shaping(self) -> str:
    """The tc settings, as reported beside the results."""
    delay = f" after netem delay {self.delay}" if self.delay else ""
    latency = f" latency {self.queue_latency_ms}ms{delay}"
    ports = " and bridge port" if self.bridge or self.switches else ""
    text = f"{self._tbf(self.rate)}{latency} on every host egress{ports}"
    if self.switches:
      text += (f"; {len(self.switches)} nodes of {self.hosts_per_node} hosts, "
               f"{self._tbf(self.inter_rate)}{latency} on both ends of every inter-node link")
    return text

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

  def _add_bridge(self, namespace: str) -> None:
    self._add_namespace(namespace)
    _run(["ip", "-n", namespace, "link", "add", "br0", "type", "bridge"])
    _run(["ip", "-n", namespace, "link", "set", "br0", "up"])

  def _shape(self, namespace: str, interface: str, rate: str) -> None:
    tbf = ["tbf", "rate", rate, "burst", str(self.burst or burst_bytes(rate)), "latency",
           f"{self.queue_latency_ms}ms"]
    if self.delay:
      _run(["tc", "-n", namespace, "qdisc", "add", "dev", interface, "root", "handle", "1:",
            "netem", "delay", self.delay])
      _run(["tc", "-n", namespace, "qdisc", "add", "dev", interface, "parent", "1:1",
            "handle", "10:", *tbf])
    else:
      _run(["tc", "-n", namespace, "qdisc", "add", "dev", interface, "root", *tbf])

  def _port(self, a: str, a_if: str, bridge: str, port: str, rate: str) -> None:
    """A veth from `a_if` in namespace `a` to `port` on the bridge in `bridge`, the port's
    egress shaped to `rate`."""
    _run(["ip", "link", "add", a_if, "netns", a, "type", "veth", "peer", "name", port, "netns",
          bridge])
    _run(["ip", "-n", bridge, "link", "set", port, "master", "br0"])
    _run(["ip", "-n", bridge, "link", "set", port, "up"])
    self._shape(bridge, port, rate)

  def _build(self) -> None:
    for host in self.hosts:
      self._add_namespace(host.namespace)
    if self.core:
      self._add_bridge(self.core)
      for k, switch in enumerate(self.switches):
        self._add_bridge(switch)
        self._port(switch, UPLINK, self.core, f"n{k}", self.inter_rate)
        _run(["ip", "-n", switch, "link", "set", UPLINK, "master", "br0"])
        _run(["ip", "-n", switch, "link", "set", UPLINK, "up"])
        self._shape(switch, UPLINK, self.inter_rate)
      for i, host in enumerate(self.hosts):
        self._port(host.namespace, host.interface, self.switches[i // self.hosts_per_node],
                   f"p{i}", self.rate)
    elif self.bridge:
      self._add_bridge(self.bridge)
      for i, host in enumerate(self.hosts):
        self._port(host.namespace, host.interface, self.bridge, f"p{i}", self.rate)
    else:
      a, b = self.hosts
      _run(["ip", "link", "add", a.interface, "netns", a.namespace, "type", "veth", "peer",
            "name", b.interface, "netns", b.namespace])
    for host in self.hosts:
      _run(["ip", "-n", host.namespace, "addr", "add", f"{host.address}/24", "dev",
            host.interface])
      _run(["ip", "-n", host.namespace, "link", "set", host.interface, "up"])
      self._shape(host.namespace, host.interface, self.rate)

  def exec_prefix(self, i: int) -> list[str]:
    """The command prefix that runs a program on host `i`."""
    return ["ip", "netns", "exec", self.hosts[i].namespace]

  def tcp_goodput(self, src: int, dst: int, seconds: float = 2.0) -> float:
    """Bits a second one plain TCP stream carries from host `src` to host `dst` (payload only),
    sending about `seconds` of the nominal rate between them: what the shaped path delivers,
    against which netbench calibrates (RuntimeError if the transfer fails or hangs)."""
    rate = self.inter_rate if dst // self.hosts_per_node != src // self.hosts_per_node else (
        self.rate)
    skip = 2 * (self.burst or burst_bytes(rate))   # a bucket on each side of a bridge
    size = max(int(rate_bits(rate) * seconds / 8), 16 * skip) >> 20 << 20
    address, timeout = self.hosts[dst].address, 30 + 4 * seconds
    receiver = subprocess.Popen([*self.exec_prefix(dst), sys.executable, "-c", _RECEIVER,
                                 address, str(TCP_PORT), str(skip)], stdout=subprocess.PIPE,
                                text=True)
    try:
      if receiver.stdout.readline().strip() != "ready":
        raise RuntimeError(f"tcp_goodput: the receiver on host {dst} did not start")
      subprocess.run([*self.exec_prefix(src), sys.executable, "-c", _SENDER, address,
                      str(TCP_PORT), str(size)], check=True, timeout=timeout,
                     capture_output=True)
      out, _ = receiver.communicate(timeout=timeout)
      received, timed, elapsed = out.split()
    except (subprocess.SubprocessError, ValueError) as e:
      raise RuntimeError(f"tcp_goodput: {size} bytes from host {src} to host {dst} failed: "
                         f"{e}") from e
    finally:
      receiver.kill()
      receiver.wait()
    if int(received) != size:
      raise RuntimeError(f"tcp_goodput: host {dst} received {received} of {size} bytes")
    return int(timed) * 8 / float(elapsed)

  def tx_bytes(self, i: int) -> int:
    """Bytes host `i` has sent on its link (the interface counter inside its namespace)."""
    host = self.hosts[i]
    return link_bytes(host.namespace, host.interface)[0]

  def close(self) -> None:
    for name in reversed(self.created):
      remove_namespace(name)
    self.created.clear()
