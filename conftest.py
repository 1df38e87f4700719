"""Shared by the tests and the doctests: eight simulated CPU devices (set before jax is first
imported), the names the public API's docstring examples use, the `numerics` and `slow` markers, and
Python's SIGINT handler for the tests that send themselves Ctrl-C."""
import os
import shutil
import signal
import tempfile

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402

# Not test modules, and not collected as doctest modules either: scripts that run when imported
# (the multi-process workers, `python -m loco_jax`) and the benchmark applications, whose
# docstrings show command lines and the output of minutes-long runs rather than API examples.
collect_ignore = ["tests/mp_worker.py", "tests/train_worker.py", "loco_jax/__main__.py",
                  "loco_jax/apps/bench.py", "loco_jax/apps/codec_bench.py"]


def pytest_configure(config):
  # Tests build the same steps again and again (fresh closures over the same shapes, which
  # jax's in-memory cache does not match): a compilation cache of this session's own, keyed by
  # the programs' HLO, compiles each once. This process only: subprocesses compile their own.
  import jax
  config.loco_jax_compile_cache = tempfile.mkdtemp(prefix="loco_jax_xla_cache_")
  jax.config.update("jax_compilation_cache_dir", config.loco_jax_compile_cache)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  config.addinivalue_line(
      "markers", "numerics: asserts floating-point results of the library's arithmetic "
      "(kernels, codecs, the collectives' means) against references and thresholds near its "
      "rounding; scripts/test compiles these as a user's program is (the others with "
      "XLA:CPU's faster-compiling loop emitters) and runs them again under a lower CPU vector "
      "ISA, since XLA:CPU contracts multiply-adds into FMAs differently with AVX-512 and AVX2. "
      "Not marked: whole training paths compared with each other (fsdp and zero2, a "
      "model-sharded mesh and a data mesh, two processes and one), which run the same kernels "
      "at looser tolerances")
  config.addinivalue_line(
      "markers", "slow: takes more than a few seconds; `sh scripts/test --quick` leaves it out")


def pytest_unconfigure(config):
  shutil.rmtree(getattr(config, "loco_jax_compile_cache", ""), ignore_errors=True)


@pytest.fixture
def sigint_raises():
  """SIGINT raises KeyboardInterrupt during the test, however the runner was started: a
  command started in the background without job control (`cmd &` in a script) inherits
  SIGINT ignored, and Python then leaves it ignored."""
  previous = signal.signal(signal.SIGINT, signal.default_int_handler)
  yield
  signal.signal(signal.SIGINT, previous)


@pytest.fixture(autouse=True)
def _doctest_names(doctest_namespace):
  """`params` and `grads`: a small two-leaf tree, as in every optax example."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax

  import loco_jax

  params = {"w": jnp.ones((4, 8)), "b": jnp.zeros((8,))}
  doctest_namespace.update(
      jax=jax, jnp=jnp, np=np, optax=optax, loco_jax=loco_jax, params=params,
      grads=jax.tree.map(lambda x: jnp.full_like(x, 0.01), params))
