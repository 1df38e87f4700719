"""Two processes x 4 CPU devices (jax.distributed on 127.0.0.1, gloo) match one process x 8."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

WORKER = Path(__file__).with_name("mp_worker.py")
TIMEOUT_S = 180


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _run(script: Path, num_processes: int, out: Path, extra: tuple[str, ...] = ()) -> None:
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["JAX_PLATFORMS"] = "cpu"
  port = str(_free_port())
  procs = [subprocess.Popen([sys.executable, str(script), str(pid), str(num_processes), port,
                             str(out), *extra], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
           for pid in range(num_processes)]
  try:
    logs = [p.communicate(timeout=TIMEOUT_S)[0] for p in procs]
  except subprocess.TimeoutExpired:
    for p in procs:
      p.kill()
    pytest.fail(f"{script.name}: a process hung for more than {TIMEOUT_S} s")
  for p, log in zip(procs, logs):
    assert p.returncode == 0, log[-3000:]


@pytest.mark.slow
def test_two_processes_match_one(tmp_path):
  _run(WORKER, 1, tmp_path / "one.npz")
  _run(WORKER, 2, tmp_path / "two.npz")
  one, two = np.load(tmp_path / "one.npz"), np.load(tmp_path / "two.npz")
  assert sorted(one.files) == sorted(two.files) and one.files
  for k in one.files:
    assert np.abs(one[k]).max() > 0, k
    np.testing.assert_array_equal(one[k], two[k], err_msg=k)
