"""Elastic resume end to end: a job of two processes (4 CPU devices each, jax.distributed on
127.0.0.1 with gloo) loses one mid-run; the survivor restarts alone from the last complete
checkpoint on its four devices and finishes. Every wait is bounded: a hung peer fails the test
instead of hanging it."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import processes
import train_worker
from loco_jax.train import checkpoint, parallel

WORKER = Path(__file__).with_name("train_worker.py")
STEPS, EVERY, KILL_AFTER = 25, 5, 12
START_S, DEATH_S, FINISH_S = 150, 60, 150  # to reach the kill; for the survivor to stop; to end


def _env() -> dict[str, str]:
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["JAX_PLATFORMS"] = "cpu"
  return env


def _start(args: list[str], log: Path) -> subprocess.Popen:
  with open(log, "w") as out:
    return subprocess.Popen([sys.executable, str(WORKER), *args], env=_env(), stdout=out,
                            stderr=subprocess.STDOUT)


def _logs(*logs: Path) -> str:
  return "\n".join(f"--- {p.name}:\n{p.read_text()[-3000:]}" for p in logs if p.exists())


def _losses(path: Path) -> dict[int, float]:
  lines = path.read_text().splitlines() if path.exists() else []
  return {int(k): float(v) for k, v in (line.split() for line in lines if len(line.split()) == 2)}


def _stop(*procs: subprocess.Popen) -> None:
  for p in procs:
    if p.poll() is None:
      p.kill()
    p.wait()


@pytest.mark.slow
def test_a_job_that_loses_a_process_finishes_on_the_survivors_devices(tmp_path):
  ckpt, losses, port = tmp_path / "ckpt", tmp_path / "losses.txt", str(processes.free_port())
  logs = [tmp_path / f"process{i}.log" for i in range(2)]
  common = ["--mode", "zero2", "--steps", str(STEPS), "--losses", str(losses), "--ckpt-dir",
            str(ckpt), "--ckpt-every", str(EVERY), "--hidden", "64"]
  job = [_start([*common, "--num-processes", "2", "--process-id", str(i), "--port", port,
                 "--devices-per-process", "4", "--step-delay", "0.3",
                 "--heartbeat-timeout", "5"], log) for i, log in enumerate(logs)]
  try:
    deadline = time.monotonic() + START_S
    while max(_losses(losses), default=0) < KILL_AFTER:
      if any(p.poll() is not None for p in job) or time.monotonic() > deadline:
        pytest.fail(f"the job ended or hung before step {KILL_AFTER}\n{_logs(*logs)}")
      time.sleep(0.05)
    job[1].send_signal(signal.SIGKILL)  # a host is lost
    try:  # the survivor learns it from jax.distributed's heartbeats, or hangs in a collective
      job[0].wait(timeout=DEATH_S)
      ended = "exited"
    except subprocess.TimeoutExpired:
      ended = "hung, killed by the test"
  finally:
    _stop(*job)
  before = _losses(losses)
  last = checkpoint.latest_step(ckpt)
  assert last is not None and KILL_AFTER - EVERY <= last < STEPS, (last, before, ended)

  # The survivor, restarted alone: 1 process of 4 devices from the last complete checkpoint.
  log = tmp_path / "survivor.log"
  survivor = _start([*common, "--elastic", "--devices-per-process", "4"], log)
  try:
    survivor.wait(timeout=FINISH_S)
  except subprocess.TimeoutExpired:
    _stop(survivor)
    pytest.fail(f"the survivor hung for more than {FINISH_S} s\n{_logs(log)}")
  assert survivor.returncode == 0, _logs(log, *logs)
  text = log.read_text()
  assert f"resumed from step {last}" in text and "resharded from (data=8) to (data=4)" in text
  assert checkpoint.latest_step(ckpt) == STEPS
  meta = checkpoint.metadata(ckpt)
  assert meta["mesh"] == [["data", 4]] and meta["process count"] == 1
  after = _losses(losses)  # the survivor's lines follow the job's: steps last+1 .. STEPS
  assert sorted(k for k in after if k > last) == list(range(last + 1, STEPS + 1))

  # Against the uninterrupted run on 8 devices: the job's steps alike, the resumed curve within
  # the uninterrupted one's step-to-step noise.
  state, step, _ = train_worker.build("zero2", 64, parallel.data_mesh(8))
  uninterrupted = []
  for k in range(STEPS):
    state, loss = step(state, train_worker.batch(k, parallel.data_mesh(8)))
    uninterrupted.append(float(loss))
  np.testing.assert_allclose([before[k] for k in range(1, last + 1)], uninterrupted[:last],
                             rtol=1e-6)
  noise = np.mean(np.abs(np.diff(uninterrupted)))
  gap = max(abs(after[k] - uninterrupted[k - 1]) for k in range(last + 1, STEPS + 1))
  assert gap <= noise, (gap, noise, ended)


@pytest.mark.slow
def test_two_processes_continue_a_checkpoint_of_another_model_shape(tmp_path):
  """One process of 8 devices on (data=4, model=2) checkpoints at step 4; a job of two
  processes of 4 devices each continues it on (data=8): every process reads the checkpoint and
  re-lays it for the mesh over both. The job's curve stays within the uninterrupted run's
  step-to-step noise."""
  ckpt, losses, port = tmp_path / "ckpt", tmp_path / "losses.txt", str(processes.free_port())
  logs = [tmp_path / f"{name}.log" for name in ("first", "process0", "process1")]
  common = ["--mode", "zero2", "--losses", str(losses), "--ckpt-dir", str(ckpt),
            "--ckpt-every", "4", "--hidden", "64"]
  first = _start([*common, "--steps", "4", "--model", "2"], logs[0])
  try:
    first.wait(timeout=START_S)
  finally:
    _stop(first)
  assert first.returncode == 0 and checkpoint.latest_step(ckpt) == 4, _logs(logs[0])
  job = [_start([*common, "--steps", "8", "--elastic", "--num-processes", "2", "--process-id",
                 str(i), "--port", port, "--devices-per-process", "4"], log)
         for i, log in enumerate(logs[1:])]
  try:
    for p in job:
      p.wait(timeout=FINISH_S)
  except subprocess.TimeoutExpired:
    pytest.fail(f"the two processes hung for more than {FINISH_S} s\n{_logs(*logs)}")
  finally:
    _stop(*job)
  assert all(p.returncode == 0 for p in job), _logs(*logs)
  for log in logs[1:]:
    text = log.read_text()
    assert "resumed from step 4" in text and "resharded from (data=4, model=2) to (data=8)" in text
  meta = checkpoint.metadata(ckpt)
  assert meta["step"] == 8 and meta["mesh"] == [["data", 8]] and meta["process count"] == 2
  state, step, _ = train_worker.build("zero2", 64, train_worker.mesh_of(2))
  uninterrupted = []
  for k in range(8):
    state, loss = step(state, train_worker.batch(k, train_worker.mesh_of(2)))
    uninterrupted.append(float(loss))
  resumed = _losses(losses)
  assert sorted(resumed) == list(range(1, 9)), resumed
  np.testing.assert_allclose([resumed[k] for k in range(1, 5)], uninterrupted[:4], rtol=1e-6)
  noise = np.mean(np.abs(np.diff(uninterrupted)))
  gap = max(abs(resumed[k] - uninterrupted[k - 1]) for k in range(5, 9))
  assert gap <= noise, (gap, noise, resumed, uninterrupted)
