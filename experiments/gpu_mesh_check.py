"""On one GPU: `loco(axis_name=...)` under jax.shard_map runs the fused Pallas step inside the
mesh program and gives the local step's numbers (its output through the bfloat16 gather).

  python experiments/gpu_mesh_check.py      # exit 1 if a check fails
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from loco_jax import kernels, loco, parallel


def main() -> int:
  n = 1 << 22
  mesh = parallel.data_mesh(1)
  grads = [jax.random.normal(jax.random.key(k), (n,), jnp.float32) for k in range(3)]
  local = loco()
  on_mesh = loco(axis_name="data")
  state, specs = parallel.init_opt_state(on_mesh, jnp.zeros(n), mesh)
  step = jax.jit(jax.shard_map(lambda g, s: on_mesh.update(g[0], s), mesh=mesh,
                               in_specs=(P("data"), specs), out_specs=(P(), specs)))
  hlo = step.lower(grads[0][None], state).compile().as_text()
  local_state, local_step = local.init(grads[0]), jax.jit(local.update)
  worst, codes = 0.0, 0
  for g in grads:
    out, state = step(g[None], state)
    want, local_state = local_step(g, local_state)
    want_bf16 = np.asarray(want.astype(jnp.bfloat16).astype(jnp.float32))
    gap = np.abs(np.asarray(out) - want_bf16) / np.maximum(np.abs(want_bf16), 1e-30)
    worst = max(worst, float(np.max(gap)))
    codes += int(np.sum(np.asarray(state.error).reshape(-1) != np.asarray(local_state.error)))
  checks = [
      ("auto picks the Pallas kernel", kernels.chosen_implementation(n // 2048) == "pallas"),
      (f"Pallas check: {kernels.pallas_report('gpu')}", True),
      ("the mesh step runs the Pallas kernel", "loco_compress_step" in hlo),
      (f"mesh output = bf16(local output): max rel diff {worst:.3g}", worst <= 2 ** -7),
      (f"mesh error = local error: {codes} codes differ", codes == 0),
  ]
  for name, ok in checks:
    print(f"| {name} | {'yes' if ok else 'NO'} |")
  return 0 if all(ok for _, ok in checks) else 1


if __name__ == "__main__":
  sys.exit(main())
