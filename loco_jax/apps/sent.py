"""What a netbench host has sent: its interface's counters, and the TCP payload inside them.

The interface counts every byte on the link: the program's payload, the TCP/IP and Ethernet
headers of every packet (ACKs included) and the resends of what the shaper dropped. Only the
payload is what the compiled program sends, so netbench compares the payload with the
program's prediction and checks that headers and resends explain the rest. The payload is
what the peers acknowledged (tcp_info's bytes_acked: each byte once, however often it went),
on the host process's own connections, read with `ss` inside the host's namespace.
bytes_sent would not do: a segment the host's own shaper drops is counted there, then sent
again as new data (+16% at 20 Mb/s).
"""

import os
import re
import subprocess
import time
from typing import NamedTuple

# The longest headers a packet of ours can carry: Ethernet, then IPv4 and TCP with options.
MAX_HEADER_BYTES = 14 + 60 + 60
DRAIN_S = 5.0
_COUNT = {name: re.compile(rf"\b{name}:(\d+)") for name in ("bytes_acked", "bytes_retrans")}


class Sent(NamedTuple):
  """Counts since a start (`Sent.since`): the interface's bytes and packets, the payload the
  other hosts acknowledged, and the bytes TCP sent again."""
  interface_bytes: int
  packets: int
  payload_bytes: int
  retransmitted_bytes: int

  def since(self, start: "Sent") -> "Sent":
    return Sent(*(a - b for a, b in zip(self, start)))

  def unexplained(self) -> str | None:
    """Why the interface's bytes are not the payload plus at most MAX_HEADER_BYTES a packet
    and the resends (None when they are): a connection or a counter was missed."""
    extra = self.interface_bytes - self.payload_bytes
    most = MAX_HEADER_BYTES * self.packets + self.retransmitted_bytes
    if 0 <= extra <= most:
      return None
    return (f"the interface sent {self.interface_bytes} bytes in {self.packets} packets, the "
            f"peers acknowledged {self.payload_bytes} bytes of payload (+"
            f"{self.retransmitted_bytes} resent): {extra} bytes more, where 0 to {most} are "
            f"headers and resends")


def tcp_counts(ss_output: str, pid: int) -> tuple[int, int, int]:
  """(bytes acknowledged, bytes retransmitted, bytes in the send queues) over the connections
  of process `pid` that `ss -tinpH` lists whose peer is another address (a connection to
  itself stays off the link).

    >>> tcp_counts('''ESTAB 0 52 10.213.0.1:46367 10.213.0.2:37666 users:(("python",pid=7,fd=9))
    ...      bbr bytes_sent:79887 bytes_retrans:1448 bytes_acked:78387 unacked:1
    ... ESTAB 0 0 10.213.0.1:12355 10.213.0.1:50972 users:(("python",pid=7,fd=5))
    ...      bbr bytes_sent:1764 bytes_acked:1764
    ... ESTAB 0 0 10.213.0.1:22 10.213.0.3:50972 users:(("sshd",pid=70,fd=3))
    ...      cubic bytes_sent:5000 bytes_acked:5000''', pid=7)
    (78387, 1448, 52)
  """
  acked = retransmitted = queued = 0
  lines = ss_output.splitlines()
  for socket, info in zip(lines, lines[1:]):
    if socket[:1].isspace() or not info[:1].isspace():
      continue   # not a socket line followed by its info line
    fields = socket.split()
    local, peer = (address.rsplit(":", 1)[0].strip("[]") for address in fields[3:5])
    if local != peer and f"pid={pid}," in socket:
      counts = {name: int(m.group(1)) if (m := pattern.search(info)) else 0   # 0: unprinted
                for name, pattern in _COUNT.items()}
      acked += counts["bytes_acked"]
      retransmitted += counts["bytes_retrans"]
      queued += int(fields[2])
  return acked, retransmitted, queued


def read(interface: str, drain_s: float = DRAIN_S) -> Sent:
  """The counts so far of `interface` and of this process's TCP connections, once their send
  queues are empty (all they sent acknowledged): a RuntimeError after `drain_s` seconds of
  bytes still queued."""
  def counter(name: str) -> int:
    with open(f"/sys/class/net/{interface}/statistics/{name}") as f:
      return int(f.read())
  deadline = time.monotonic() + drain_s
  while True:
    done = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True, timeout=20)
    if done.returncode:
      raise RuntimeError(f"`ss -tinpH` failed ({done.returncode}): {done.stderr.strip()}")
    acked, retransmitted, queued = tcp_counts(done.stdout, os.getpid())
    if not queued:
      return Sent(counter("tx_bytes"), counter("tx_packets"), acked, retransmitted)
    if time.monotonic() > deadline:
      raise RuntimeError(f"{queued} bytes still unacknowledged on this host's connections "
                         f"after {drain_s} s")
    time.sleep(0.005)
