"""Two processes x 4 CPU devices (jax.distributed on 127.0.0.1, gloo) match one process x 8."""

import sys
from pathlib import Path

import numpy as np
import pytest

import processes

WORKER = Path(__file__).with_name("mp_worker.py")
TIMEOUT_S = 180


def _run(script: Path, num_processes: int, out: Path, extra: tuple[str, ...] = ()) -> None:
  port = str(processes.free_port())
  processes.run_all([[sys.executable, str(script), str(pid), str(num_processes), port, str(out),
                      *extra] for pid in range(num_processes)], TIMEOUT_S, script.name)


@pytest.mark.slow
def test_two_processes_match_one(tmp_path):
  _run(WORKER, 1, tmp_path / "one.npz")
  _run(WORKER, 2, tmp_path / "two.npz")
  one, two = np.load(tmp_path / "one.npz"), np.load(tmp_path / "two.npz")
  assert sorted(one.files) == sorted(two.files) and one.files
  for k in one.files:
    assert np.abs(one[k]).max() > 0, k
    np.testing.assert_array_equal(one[k], two[k], err_msg=k)
