"""scripts/test compiles the behaviour tests with a faster-compiling XLA:CPU flag; their wire
assertions hold for a user's compile only if the flag leaves every collective as it was."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# The compiled collectives (op, dtype, bytes, group size) of the mesh steps the wire tests read.
PROGRAM = """
import json, os
os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
import jax, jax.numpy as jnp
from loco_jax import co3, comm, loco, two_hop
from loco_jax.train import parallel
from tests.conftest import shard_mapped_update

params = {"w": jnp.zeros((256, 64)), "b": jnp.zeros((64,)), "odd": jnp.zeros((33, 7))}
found = {}
for name, opt in [("loco", loco(axis_name="data")),
                  ("loco-quantized", loco(axis_name="data", gather="quantized")),
                  ("two_hop", two_hop()),
                  ("co3-fp4-coded", co3(axis_name="data", gather="coded"))]:
  mesh, lead = ((parallel.node_mesh(2, 4), (2, 4)) if name == "two_hop"
                else (parallel.data_mesh(8), (8,)))
  step, state = shard_mapped_update(opt, mesh, params, mesh.axis_names)
  grads = jax.tree.map(lambda x: jax.ShapeDtypeStruct((*lead, *x.shape), x.dtype), params)
  found[name] = sorted((c.op, c.dtype, c.nbytes, c.group_size)
                       for c in comm.compiled_collectives(step, grads, state))
print(json.dumps(found))
"""


def _fast_compile_flag() -> str:
  script = (ROOT / "scripts" / "test").read_text()
  (flag,) = re.findall(r'^FAST_COMPILE="([^"]+)"$', script, re.M)
  return flag


def _collectives(xla_flags: str) -> dict:
  env = {**os.environ, "XLA_FLAGS": xla_flags, "JAX_PLATFORMS": "cpu",
         "PYTHONPATH": str(ROOT)}
  out = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True,
                       timeout=300, env=env, cwd=ROOT)
  assert out.returncode == 0, out.stderr[-3000:]
  return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_the_fast_compile_flag_leaves_every_collective_as_a_users_compile_has_it():
  default = _collectives("")
  assert all(default.values()), default  # every step has collectives to compare
  assert _collectives(_fast_compile_flag()) == default
