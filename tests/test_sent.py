"""sent: a host's interface counts and the TCP payload among them, read from `ss`."""

import os
import shutil
import socket
import subprocess
import time

import pytest

from loco_jax.apps import sent

pytestmark = pytest.mark.skipif(shutil.which("ss") is None, reason="needs `ss` (iproute2)")


def _connection(source: str, destination: str):
  listener = socket.create_server((destination, 0))
  port = listener.getsockname()[1]
  client = socket.create_connection((destination, port), source_address=(source, 0))
  server, _ = listener.accept()
  listener.close()
  return client, server, port


def _send(client, server, n: int) -> None:
  client.sendall(b"x" * n)
  got = 0
  while got < n:
    got += len(server.recv(1 << 20))


def _client_side(port: int) -> str:
  """`ss -tinH` of the connection to `port` once its send queue is empty."""
  for _ in range(1000):
    out = subprocess.run(["ss", "-tinpH", "dport", "=", f":{port}"], capture_output=True,
                         text=True, check=True, timeout=20).stdout
    if sent.tcp_counts(out, os.getpid())[2] == 0 and "bytes_acked" in out:
      return out
    time.sleep(0.005)
  raise AssertionError(f"the connection to port {port} did not drain:\n{out}")


def test_the_payload_of_a_connection_to_another_address_is_what_the_peer_acknowledged():
  client, server, port = _connection("127.0.0.1", "127.0.0.2")
  with client, server:
    _send(client, server, 300_000)
    # The acknowledged sequence starts with the SYN's one number: netbench takes differences.
    assert sent.tcp_counts(_client_side(port), os.getpid()) == (1 + 300_000, 0, 0)
    assert sent.tcp_counts(_client_side(port), os.getpid() + 1) == (0, 0, 0)  # not its own


def test_a_connection_to_its_own_address_is_off_the_link():
  client, server, port = _connection("127.0.0.1", "127.0.0.1")
  with client, server:
    _send(client, server, 300_000)
    assert "bytes_acked:300001" in _client_side(port)
    assert sent.tcp_counts(_client_side(port), os.getpid()) == (0, 0, 0)


def test_counts_since_a_start_and_what_explains_the_interface():
  start = sent.Sent(1000, 10, 500, 0)
  now = sent.Sent(1000 + 66 * 5 + 4000 + 1448, 10 + 5, 500 + 4000, 1448)
  delta = now.since(start)
  assert delta == sent.Sent(66 * 5 + 5448, 5, 4000, 1448) and delta.unexplained() is None
  assert "0 to 2118" in delta._replace(interface_bytes=10_000).unexplained()
  assert "-1 bytes more" in delta._replace(interface_bytes=3999).unexplained()


def test_read_waits_for_the_acknowledgements_and_counts_the_interface():
  client, server, port = _connection("127.0.0.1", "127.0.0.2")
  with client, server:
    start = sent.read("lo")
    _send(client, server, 300_000)
    delta = sent.read("lo").since(start)
  # Other connections of this machine may send too: at least ours, headers included.
  assert delta.payload_bytes >= 300_000 and delta.packets > 0
  assert delta.interface_bytes >= 300_000 + delta.packets * 40


def test_read_gives_up_on_a_queue_that_does_not_drain(monkeypatch):
  stuck = (f'ESTAB 0 1448 10.213.0.1:1 10.213.0.2:2 users:(("python",pid={os.getpid()},fd=3))'
           "\n\t bbr bytes_acked:10 unacked:1\n")
  monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(
      a, 0, stdout=stuck, stderr=""))
  with pytest.raises(RuntimeError, match="1448 bytes still unacknowledged"):
    sent.read("lo", drain_s=0.05)
