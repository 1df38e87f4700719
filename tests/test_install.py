"""A clean install, as a user makes one: `python -m venv`, then pip builds and installs the
package (a copy of this tree) without the dev extras, printing no deprecation; in that
environment README's first example runs an init and an update, and every module imports.

Slow (40-75 s on 2 busy cores): pip fetches the runtime dependencies (about 170 MB of wheels)
from the package index, as a new user's does (pip kept no cache of them here, so CI fetches them
too), and unpacks about 750 MB. It needs the index; it installs the versions of this environment
(a constraints file), not newer ones.
"""

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
UNPINNED = ("loco-jax", "pip", "setuptools", "wheel")  # the package; what builds it
DEV_ONLY = ("pytest", "hypothesis", "nbclient", "matplotlib", "jupytext",  # the dev extra's
            "sphinx", "myst_nb")  # and the docs extra's, not runtime


def _readme_first_example() -> str:
  return re.search(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)


def _run(args: list, cwd: Path, timeout: float) -> str:
  """Runs `args` with this environment's variables less those that would point Python at this
  tree or this virtual environment; the output, or a failure with its end."""
  env = {k: v for k, v in os.environ.items()
         if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP")}
  env["JAX_PLATFORMS"] = "cpu"
  done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
  output = done.stdout + done.stderr
  if done.returncode:
    pytest.fail(f"{args[0]} {args[1]} ... exited {done.returncode}:\n{output[-4000:]}")
  return output


@pytest.mark.slow
def test_a_fresh_environment_without_dev_extras_runs_the_readme_example(tmp_path):
  source = tmp_path / "source"  # a copy: setuptools builds in the tree it is given
  source.mkdir()
  for name in ("pyproject.toml", "README.md"):
    shutil.copy(ROOT / name, source)
  shutil.copytree(ROOT / "loco_jax", source / "loco_jax",
                  ignore=shutil.ignore_patterns("__pycache__"))
  pins = sorted({f"{d.metadata['Name']}=={d.version}" for d in importlib.metadata.distributions()
                 if d.metadata["Name"] and d.metadata["Name"].lower() not in UNPINNED})
  (tmp_path / "constraints.txt").write_text("\n".join(pins) + "\n")
  env_dir = tmp_path / "env"
  try:
    _check_fresh_environment(env_dir, source, tmp_path)
  finally:
    shutil.rmtree(env_dir, ignore_errors=True)  # 750 MB: pytest keeps its last runs' tmp_path


def _check_fresh_environment(env_dir: Path, source: Path, tmp_path: Path) -> None:
  _run([sys.executable, "-m", "venv", env_dir], tmp_path, 300)
  python = env_dir / "bin" / "python"
  # -v shows the build backend's output; --no-compile skips writing .pyc files (a minute here).
  log = _run([python, "-m", "pip", "install", "-v", "--no-compile", "-c", "constraints.txt",
              source], tmp_path, 1500)
  deprecations = [line for line in log.splitlines() if "deprecat" in line.lower()]
  assert not deprecations, "\n".join(deprecations[:10])
  script = _readme_first_example() + textwrap.dedent(f"""
      import importlib, importlib.util, pkgutil, jax, jax.numpy as jnp
      assert loco_jax.__file__.startswith({str(env_dir)!r}), loco_jax.__file__
      extras = [m for m in {DEV_ONLY!r} if importlib.util.find_spec(m)]
      assert not extras, f"dev extras installed: {{extras}}"
      params = {{"w": jnp.ones((4, 8)), "b": jnp.zeros(8)}}
      grads = jax.tree.map(lambda x: jnp.full_like(x, 0.5), params)
      state = opt.init(params)
      updates, state = opt.update(grads, state, params)
      # adamw's first step: -lr * sign(g) (and weight decay) wherever LoCo delivers g.
      assert all(bool(jnp.all(jnp.abs(u) > 1e-4)) for u in jax.tree.leaves(updates)), updates
      for module in pkgutil.walk_packages(loco_jax.__path__, "loco_jax."):
        if module.name != "loco_jax.__main__":  # the command line: runs on import
          importlib.import_module(module.name)
      print("example ran")
  """)
  assert "example ran" in _run([python, "-c", script], tmp_path, 600)
