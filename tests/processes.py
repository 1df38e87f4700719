"""Test helper: jobs of several processes on this machine, on CPU, bounded in time."""

import os
import socket
import subprocess

import pytest


def free_port() -> int:
  """A TCP port on 127.0.0.1 that nothing listens on now."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def cpu_env() -> dict[str, str]:
  """This environment for a child on CPU, without the test process's simulated device count."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["JAX_PLATFORMS"] = "cpu"
  return env


def run_all(argvs: list[list[str]], timeout_s: float, what: str,
            env: dict[str, str] | None = None) -> list[str]:
  """Starts one process per argv, waits for all of them, and returns their logs (stdout and
  stderr). Fails the test if one runs past `timeout_s` (all are killed) or exits non-zero."""
  procs = [subprocess.Popen(argv, env=cpu_env() if env is None else env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for argv in argvs]
  try:
    logs = [p.communicate(timeout=timeout_s)[0] for p in procs]
  except subprocess.TimeoutExpired:
    for p in procs:
      p.kill()
    pytest.fail(f"{what}: a process hung for more than {timeout_s} s")
  for p, log in zip(procs, logs):
    assert p.returncode == 0, log[-3000:]
  return logs
