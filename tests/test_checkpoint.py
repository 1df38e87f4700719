"""Checkpoint / resume of the whole TrainState: SIGKILL and resume, atomic saves, mismatches."""

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from processes import free_port
import train_worker
from loco_jax.train import checkpoint, parallel

WORKER = Path(__file__).with_name("train_worker.py")
TIMEOUT_S = 150
STEPS, EVERY = 20, 5


def _env(cache: Path) -> dict[str, str]:
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env.update(JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=str(cache),
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
             JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  return env


def _start(argv: list[str], log: Path, cache: Path) -> subprocess.Popen:
  with open(log, "w") as out:
    return subprocess.Popen([sys.executable, *argv], env=_env(cache), stdout=out,
                            stderr=subprocess.STDOUT)


def _logs(logs: list[Path]) -> str:
  return "\n".join(f"--- {p.name}:\n{p.read_text()[-3000:]}" for p in logs)


def _finish(procs: list[subprocess.Popen], logs: list[Path], timeout: float = TIMEOUT_S) -> None:
  """Waits for every process; kills them all and fails with their logs on a hang or an error."""
  deadline = time.monotonic() + timeout
  try:
    for p in procs:
      p.communicate(timeout=max(deadline - time.monotonic(), 0.1))
  except subprocess.TimeoutExpired:
    for p in procs:
      p.kill()
      p.wait()
    pytest.fail(f"a process hung for more than {timeout} s\n{_logs(logs)}")
  if any(p.returncode for p in procs):
    pytest.fail(f"return codes {[p.returncode for p in procs]}\n{_logs(logs)}")


def _kill_when(proc: subprocess.Popen, ready, what: str, log: Path) -> None:
  """SIGKILLs `proc` as soon as `ready()` holds; fails if it ends or hangs before."""
  deadline = time.monotonic() + TIMEOUT_S
  try:
    while not ready():
      if proc.poll() is not None or time.monotonic() > deadline:
        pytest.fail(f"the process ended or hung before {what}\n{_logs([log])}")
      time.sleep(0.01)
  finally:
    proc.send_signal(signal.SIGKILL)
    proc.wait()
  assert proc.returncode == -signal.SIGKILL


def _train(tmp: Path, name: str, cache: Path, *extra: str, processes: int = 1) -> Path:
  """Runs train_worker to completion (`processes` x 8/processes devices); returns its losses."""
  losses, port = tmp / f"{name}.txt", str(free_port())
  logs = [tmp / f"{name}.{i}.log" for i in range(processes)]
  procs = [_start([str(WORKER), "--losses", str(losses), "--steps", str(STEPS), *extra,
                   "--num-processes", str(processes), "--process-id", str(i), "--port", port,
                   "--devices-per-process", str(8 // processes)], log, cache)
           for i, log in enumerate(logs)]
  _finish(procs, logs)
  return losses


def _read_losses(path: Path) -> dict[int, str]:
  """{step: printed repr of its loss}; a later line for a step replaces an earlier one."""
  return {int(k): v for k, v in (line.split() for line in path.read_text().splitlines())}


def _listing(directory: Path) -> dict[str, tuple[int, int]]:
  """Every file and folder under `directory` with its size and mtime, to prove nothing changed."""
  out = {}
  for root, dirs, files in os.walk(directory):
    for name in dirs + files:
      st = os.stat(os.path.join(root, name))
      out[os.path.relpath(os.path.join(root, name), directory)] = (st.st_size, st.st_mtime_ns)
  return out


def _state_on_8(mode: str = "zero2", hidden: int = 64, devices: int = 8):
  state, _, config = train_worker.build(mode, hidden, parallel.data_mesh(devices))
  return state, config


def _assert_states_equal(a, b) -> None:
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(a)]
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for path, x, y in zip(paths, jax.tree.leaves(a), jax.tree.leaves(b)):
    assert x.sharding == y.sharding, path
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=path)


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
  """A jax compilation cache shared by the workers of this module (halves their start-up)."""
  return tmp_path_factory.mktemp("jax_cache")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, cache) -> tuple[dict[int, str], Path]:
  """1 process x 8 devices, zero2 + LoCo, 20 steps, a checkpoint every 5: (losses, ckpt dir)."""
  tmp = tmp_path_factory.mktemp("uninterrupted")
  losses = _train(tmp, "a", cache, "--ckpt-dir", str(tmp / "ckpt"), "--ckpt-every", str(EVERY))
  return _read_losses(losses), tmp / "ckpt"


@pytest.mark.slow
def test_sigkill_then_resume_continues_bit_for_bit(uninterrupted, tmp_path, cache):
  a, a_dir = uninterrupted
  assert sorted(a) == list(range(1, STEPS + 1))
  ckpt = tmp_path / "ckpt"
  argv = [str(WORKER), "--losses", str(tmp_path / "killed.txt"), "--steps", str(STEPS),
          "--ckpt-dir", str(ckpt), "--ckpt-every", str(EVERY)]
  log = tmp_path / "killed.log"
  proc = _start([*argv, "--step-delay", "0.25"], log, cache)
  losses = tmp_path / "killed.txt"
  _kill_when(proc, lambda: losses.exists() and "\n12 " in "\n" + losses.read_text(),
             "logging step 12", log)
  killed = _read_losses(tmp_path / "killed.txt")
  assert max(killed) < 15 and checkpoint.latest_step(ckpt) == 10, (killed, _listing(ckpt))
  assert all(killed[k] == a[k] for k in killed)

  resumed_log = tmp_path / "resumed.log"
  _finish([_start([*argv[:2], str(tmp_path / "resumed.txt"), *argv[3:]], resumed_log, cache)],
          [resumed_log])
  assert "resumed from step 10" in resumed_log.read_text()
  resumed = _read_losses(tmp_path / "resumed.txt")
  assert sorted(resumed) == list(range(11, STEPS + 1))
  assert resumed == {k: a[k] for k in resumed}  # the printed reprs: bit-for-bit equal

  state, config = _state_on_8()
  final_a, _ = checkpoint.restore(a_dir, state, config)
  final_resumed, step = checkpoint.restore(ckpt, state, config)
  assert step == STEPS
  _assert_states_equal(final_resumed, final_a)


_SAVER = """
import os, sys
os.environ.pop("XLA_FLAGS", None)
import jax
jax.config.update("jax_num_cpu_devices", 8)
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from loco_jax.train import checkpoint, parallel
sharding = NamedSharding(parallel.data_mesh(8), P("data"))
n = int(sys.argv[2])
zeros = jax.jit(lambda: {f"x{i}": jnp.zeros((n,)) for i in range(4)}, out_shardings=sharding)
noise = jax.jit(lambda: {f"x{i}": jax.random.normal(jax.random.key(i), (n,)) for i in range(4)},
                out_shardings=sharding)
checkpoint.save(sys.argv[1], 1, zeros(), {"what": "big"})
state = jax.block_until_ready(noise())
print("saving step 2", flush=True)
checkpoint.save(sys.argv[1], 2, state, {"what": "big"})
print("saved step 2", flush=True)
"""


def _bytes_under(path: Path) -> int:
  return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


@pytest.mark.slow
def test_kill_during_save_leaves_previous_checkpoint(tmp_path, cache):
  """SIGKILL while 128 MiB of random floats are being written: step 1 stays the checkpoint."""
  ckpt, log, n = tmp_path / "ckpt", tmp_path / "saver.log", 2**23  # 4 leaves x 32 MiB
  proc = _start(["-c", _SAVER, str(ckpt), str(n)], log, cache)
  unfinished = lambda: list(ckpt.glob("2.orbax-checkpoint-tmp*"))
  _kill_when(proc, lambda: any(_bytes_under(d) > 8 * 2**20 for d in unfinished()),
             "writing step 2", log)
  partial = unfinished()
  assert not (ckpt / "2").exists(), "step 2 was committed before the kill; use a bigger state"
  assert partial[0].exists()  # the half-written step is still on disk, and ignored:
  assert checkpoint.latest_step(ckpt) == 1
  sharding = NamedSharding(parallel.data_mesh(8), P("data"))
  like = {f"x{i}": jax.ShapeDtypeStruct((n,), jnp.float32, sharding=sharding) for i in range(4)}
  state, step = checkpoint.restore(ckpt, like, {"what": "big"})
  assert step == 1 and all(not np.asarray(x).any() for x in state.values())
  # A new save of step 2 replaces the half-written one.
  ones = jax.tree.map(lambda x: jnp.ones(x.shape, x.dtype, device=x.sharding), like)
  checkpoint.save(ckpt, 2, ones, {"what": "big"})
  assert not partial[0].exists()
  state, step = checkpoint.restore(ckpt, like, {"what": "big"})
  assert step == 2 and all(np.asarray(x).min() == 1 for x in state.values())


@pytest.mark.slow
def test_round_trip_ddp_and_zero2_and_keep(tmp_path):
  for mode in ("ddp", "zero2"):
    state, step_fn, config = train_worker.build(mode, 32, parallel.data_mesh(8))
    like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                        state)
    state, _ = step_fn(state, train_worker.batch(0, parallel.data_mesh(8)))
    assert any(np.asarray(e).any() for e in jax.tree.leaves(
        [g.error for g in state.compressor_state.groups.values()]))
    checkpoint.save(tmp_path / mode, 1, state, config)
    restored, step = checkpoint.restore(tmp_path / mode, like, config)
    assert step == 1 and isinstance(restored, parallel.TrainState)
    _assert_states_equal(restored, state)
  for step in (2, 3, 4):
    checkpoint.save(tmp_path / "zero2", step, restored, config, keep=2)
  assert sorted(int(p.name) for p in (tmp_path / "zero2").iterdir()) == [3, 4]
  meta = checkpoint.metadata(tmp_path / "zero2")
  assert meta["step"] == 4 and meta["device count"] == 8 and meta["config"] == config
  assert meta["mesh"] == [["data", 8]]
  assert meta["tree"][".params['w1']"] == [[16 * 32 // 8 * 8], "float32", ["data"]]


@pytest.mark.slow
def test_mismatches_raise_and_touch_nothing(tmp_path):
  ckpt = tmp_path / "ckpt"
  state, config = _state_on_8()
  checkpoint.save(ckpt, 5, state, config)
  before = _listing(ckpt)
  time.sleep(0.01)  # so that a rewrite would show in the mtimes
  cases = [
      (_state_on_8(hidden=32), r"shape: checkpoint \[16, 64, 4\], now \[16, 32, 4\]"),
      (_state_on_8(mode="ddp"), r"mode: checkpoint 'zero2', now 'ddp'"),
      ((state, {**config, "devices": 4}), r"devices: checkpoint 8, now 4"),
      (_state_on_8(devices=4), r"device count: checkpoint 8, now 4"),
      ((_state_on_8(hidden=32)[0], config), r"tree: .params\['w1'\] shape checkpoint \[1024\], "
                                            r"now \[512\]"),
      ((state, {**config, "model": "gpt"}), r"model: checkpoint 'mlp-regression', now 'gpt'"),
  ]
  for (like, cfg), match in cases:
    with pytest.raises(ValueError, match=match):
      checkpoint.restore(ckpt, like, cfg)
  with pytest.raises(ValueError, match="not after the newest checkpoint 5"):
    checkpoint.save(ckpt, 5, state, config)
  assert _listing(ckpt) == before


def test_bad_directories(tmp_path):
  state, config = _state_on_8()
  with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'missing'} does not exist")):
    checkpoint.restore(tmp_path / "missing", state, config)
  (tmp_path / "empty").mkdir()
  with pytest.raises(ValueError, match=re.escape(f"no checkpoint in {tmp_path / 'empty'}")):
    checkpoint.restore(tmp_path / "empty", state, config)
  assert checkpoint.latest_step(tmp_path / "missing") is None
  assert checkpoint.latest_step(tmp_path / "empty") is None
  checkpoint.save(tmp_path / "one", 3, state, config)
  with pytest.raises(ValueError, match=r"no checkpoint of step 7 .* steps present: \[3\]"):
    checkpoint.restore(tmp_path / "one", state, config, step=7)
  for step in (-1, 1.5, True):
    with pytest.raises(ValueError, match="step must be an int >= 0"):
      checkpoint.save(tmp_path / "one", step, state, config)
  with pytest.raises(ValueError, match="JSON"):
    checkpoint.save(tmp_path / "one", 9, state, {"mesh": parallel.data_mesh(8)})


@pytest.mark.slow
def test_two_processes_match_one_and_resume_its_checkpoint(uninterrupted, tmp_path, cache):
  """2 processes x 4 devices (gloo) train, save and restore like 1 x 8; the states are equal."""
  a, a_dir = uninterrupted
  two = _read_losses(_train(tmp_path, "two", cache, "--ckpt-dir", str(tmp_path / "two"),
                            "--ckpt-every", str(EVERY), processes=2))
  assert sorted(two) == sorted(a)
  # The logged loss is a pmean: gloo sums the 8 devices' losses in another order than the
  # in-process all-reduce, so it may differ in the last bit; the trained state does not.
  np.testing.assert_allclose([float(two[k]) for k in a], [float(a[k]) for k in a], rtol=1e-6)
  state, config = _state_on_8()
  final_two, _ = checkpoint.restore(tmp_path / "two", state, config)
  final_one, _ = checkpoint.restore(a_dir, state, config)
  _assert_states_equal(final_two, final_one)
  assert checkpoint.metadata(tmp_path / "two")["process count"] == 2

  # 2 x 4 resume the 1 x 8 checkpoint of step 10 and retrace the 2 x 4 run exactly.
  shutil.copytree(a_dir / "10", tmp_path / "from_one" / "10")
  resumed = _read_losses(_train(tmp_path, "resumed", cache, "--ckpt-dir",
                                str(tmp_path / "from_one"), "--ckpt-every", str(EVERY),
                                processes=2))
  assert resumed == {k: two[k] for k in range(11, STEPS + 1)}
  final, step = checkpoint.restore(tmp_path / "from_one", state, config)
  assert step == STEPS
  _assert_states_equal(final, final_one)
