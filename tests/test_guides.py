"""README.md's and the guides' python blocks run as written: each page's ```python blocks, in
order, in one namespace, in a fresh interpreter with 8 simulated CPU devices (as a reader who
pastes them one after the other). A block that raises fails the test, naming the page and the
block's line. Blocks that must not run here (shell commands, multi-host launches) are fenced as
```sh or `{code-block}` and are not collected.

Each page starts an interpreter that imports jax and compiles its steps (seconds): slow. The
fast checks: every block is valid Python, README.md stays short, and its test command is the
one CI runs.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
GUIDES = ROOT / "docs" / "guides"
PAGES = [README, *sorted(GUIDES.glob("*.md"))]
FENCE = re.compile(r"^```python\n(.*?)^```[ \t]*$", re.S | re.M)
DEVICES = 8
TIMEOUT_S = 600

# Runs a page's blocks in order in one namespace; each block compiled with its page's name and
# line numbers, so that a traceback points into the page. Then a page's checks, if it has any.
RUNNER = """
import json, sys
page, blocks, checks = json.load(sys.stdin)
scope = {"__name__": "__main__"}
for line, code in blocks:
  try:
    exec(compile("\\n" * (line - 1) + code, page, "exec"), scope)
  except BaseException:
    print(f"{page}: the python block at line {line} raised:", file=sys.stderr)
    raise
exec(checks, scope)
print("blocks ran:", len(blocks))
"""

# What a page's blocks must leave behind beyond not raising, run in the same namespace.
CHECKS = {
    "README.md": """
import jax, numpy as np
assert jax.device_count() == 8
assert jax.tree.map(np.shape, updates) == jax.tree.map(np.shape, params)
# adamw's first step moves every parameter by about its learning rate where LoCo delivers g.
assert np.allclose(np.abs(np.asarray(updates["w"])), 3e-4, rtol=0.05), updates["w"]
assert np.isfinite(float(loss)) and int(state.step) == 3
""",
    "mesh.md": """
import numpy as np
# Every device gave the same gradient: the mean is that gradient within 4-bit rounding.
assert np.allclose(np.abs(np.asarray(updates["w"])), 3e-4, rtol=0.05), updates["w"]
""",
    "model_parallel.md": """
import numpy as np
assert updates["w"].shape == (16, 8)
assert np.allclose(np.abs(np.asarray(updates["w"])), 3e-4, rtol=0.05), updates["w"]
""",
    "diloco.md": """
import jax, numpy as np
assert int(state.step) == 16
# Step 16 ended a round: every worker restarts from the global params, which moved.
for w, g in zip(jax.tree.leaves(state.workers), jax.tree.leaves(state.params)):
  assert all(np.array_equal(np.asarray(w)[i], np.asarray(g)) for i in range(8))
assert not np.array_equal(np.asarray(state.params["w"]), np.asarray(params["w"]))
# The overlapped run's global params live on the communication devices 4-7, its workers on 0-3.
assert {d.id for d in state4.params["w"].sharding.device_set} == {4, 5, 6, 7}
assert {d.id for d in state4.workers["w"].sharding.device_set} == {0, 1, 2, 3}
assert int(state4.step) == 16 and np.isfinite(float(loss))
""",
    "checkpoints.md": """
import jax, numpy as np
same = jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), restored, state)
assert all(jax.tree.leaves(same)), same
assert elastic.step == 1 and str(elastic.resharded).startswith(
    "resharded from (data=8) to (data=4)") and np.isfinite(float(loss))
assert str(elastic8.resharded).startswith("resharded from (data=4, model=2) to (data=8)")
whole = lambda state, like: np.asarray(parallel.unshard_params(state.params, like)["w"])
assert np.array_equal(whole(elastic8.state, params), whole(state42, placed(mesh42)))
""",
}


def _blocks(page: Path) -> list[tuple[int, str]]:
  """(line of the block's first code line, its code) for every ```python block of `page`."""
  text = page.read_text()
  return [(text.count("\n", 0, m.start(1)) + 1, m.group(1)) for m in FENCE.finditer(text)]


def _name(page: Path) -> str:
  return str(page.relative_to(ROOT))


RUNNABLE = [page for page in PAGES if _blocks(page)]


def test_the_pages_are_there_and_have_python_to_run():
  assert README in RUNNABLE, "README.md has no ```python block"
  assert len(RUNNABLE) >= 8, [_name(p) for p in RUNNABLE]
  unknown = set(CHECKS) - {p.name for p in RUNNABLE}
  assert not unknown, f"checks for pages without python blocks: {unknown}"


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_every_python_block_compiles(page):
  for line, code in _blocks(page):
    compile("\n" * (line - 1) + code, _name(page), "exec")  # a SyntaxError names the line


@pytest.mark.slow
@pytest.mark.parametrize("page", RUNNABLE, ids=_name)
def test_the_python_blocks_run_in_order(page, tmp_path):
  flags = os.environ.get("XLA_FLAGS", "")
  flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", flags)
  env = {**os.environ, "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count={DEVICES}".strip(),
         "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
  payload = json.dumps([_name(page), _blocks(page), CHECKS.get(page.name, "")])
  done = subprocess.run([sys.executable, "-c", RUNNER], input=payload, capture_output=True,
                        text=True, timeout=TIMEOUT_S, env=env, cwd=tmp_path)
  assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
  assert f"blocks ran: {len(_blocks(page))}" in done.stdout


def test_readme_is_short_and_its_test_command_is_what_ci_runs():
  text = README.read_text()
  assert len(text.splitlines()) <= 150, len(text.splitlines())
  shell = "".join(re.findall(r"^```sh\n(.*?)^```", text, re.S | re.M))
  commands = [line.split("#")[0].strip() for line in shell.splitlines()]
  assert "sh scripts/test" in commands, shell
  ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")]
  assert "sh scripts/test" in ci, ci


def test_the_fence_finds_blocks_and_leaves_other_languages_alone():
  # The pattern the runner depends on: python fences only, each block whole, its line right.
  page = "x\n```python\na = 1\n\nb = 2\n```\n```sh\nrm -rf /\n```\n```{code-block} python\nc\n```\n"
  found = [(page.count("\n", 0, m.start(1)) + 1, m.group(1)) for m in FENCE.finditer(page)]
  assert found == [(3, "a = 1\n\nb = 2\n")]
