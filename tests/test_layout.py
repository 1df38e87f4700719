"""The package layout: the library never imports the applications, every library module stays
small, and the module paths from before the subpackages still import."""

import importlib
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import loco_jax

LIBRARY = [m.name for m in pkgutil.walk_packages(loco_jax.__path__, "loco_jax.")
           if not m.name.startswith("loco_jax.apps") and m.name != "loco_jax.__main__"]


def test_the_library_never_imports_the_applications():
  # In a fresh interpreter: every library module imported, and nothing of loco_jax.apps.
  code = ("import sys, importlib\n"
          f"for name in {LIBRARY!r}: importlib.import_module(name)\n"
          "print(sorted(m for m in sys.modules if m.startswith('loco_jax.apps')))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"},
                       cwd=Path(__file__).resolve().parents[1])
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.strip() == "[]"


def test_no_library_module_is_much_over_400_lines():
  sizes = {name: len(Path(importlib.import_module(name).__file__).read_text().splitlines())
           for name in LIBRARY}
  assert max(sizes.values()) <= 420, {n: s for n, s in sizes.items() if s > 420}


@pytest.mark.parametrize("old", sorted(loco_jax.MOVED))
def test_old_module_paths_are_the_modules_at_their_new_homes(old):
  module = importlib.import_module(f"loco_jax.{old}")
  assert module is importlib.import_module(f"loco_jax.{loco_jax.MOVED[old]}")


def test_old_paths_keep_their_public_names():
  from loco_jax import baselines, checkpoint, co3, comm, fp, gennorm, huffman, kernels, parallel
  assert callable(parallel.make_train_step) and callable(parallel.initialize)
  assert callable(checkpoint.save) and callable(kernels.compress_step)
  assert callable(comm.compiled_collectives) and callable(comm.leaf_layout)
  assert callable(huffman.decode) and callable(huffman.entropy_bits) and callable(fp.levels)
  assert callable(gennorm.fit) and callable(baselines.error_feedback) and callable(co3)
  assert loco_jax.loco.__module__ == "loco_jax.transforms.loco"  # the function, not a module
