"""One process of the multi-process test: LoCo steps on a global 8-device mesh, results to npz.

Usage: python mp_worker.py PROCESS_ID NUM_PROCESSES PORT OUT.npz
"""

import sys

import jax
import numpy as np

process_id, num_processes, port, out_path = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3],
                                             sys.argv[4])
jax.config.update("jax_num_cpu_devices", 8 // num_processes)
if num_processes > 1:
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(f"127.0.0.1:{port}", num_processes, process_id,
                             initialization_timeout=60)

import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from loco_jax import loco  # noqa: E402
from loco_jax.train import parallel

N = 8
PARAMS = {"w": jnp.zeros((64, 96)), "b": jnp.zeros(96)}
mesh = parallel.data_mesh(N)
opt = loco(axis_name="data")
state, specs = parallel.init_opt_state(opt, PARAMS, mesh)
grad_specs = jax.tree.map(lambda _: P("data"), PARAMS)
step = jax.jit(jax.shard_map(lambda g, s: opt.update(jax.tree.map(lambda x: x[0], g), s),
                             mesh=mesh, in_specs=(grad_specs, specs),
                             out_specs=(jax.tree.map(lambda _: P(), PARAMS), specs)))


def device_grads(seed):
  """Per-device gradients from numpy, identical whatever the process layout."""
  rng = np.random.default_rng(seed)
  full = {k: rng.standard_normal((N, *x.shape)).astype(np.float32) for k, x in
          sorted(PARAMS.items())}
  sharding = NamedSharding(mesh, P("data"))
  return {k: jax.make_array_from_callback(v.shape, sharding, lambda idx, v=v: v[idx])
          for k, v in full.items()}


outputs = {}
for seed in range(3):
  out, state = step(device_grads(seed), state)
  for k, v in out.items():
    outputs[f"{k}_{seed}"] = np.asarray(jax.device_get(v.addressable_data(0)))
if process_id == 0:
  np.savez(out_path, **outputs)
print("ok", process_id, flush=True)
