"""On one GPU: the bucketed `loco(axis_name=...)` step under jax.shard_map runs the Pallas
kernels inside the mesh program and gives the local step's numbers; the GPT-2-shaped tree's
mesh step, compile and step time against an fp32 pmean step.

  python experiments/gpu_mesh_check.py      # exit 1 if a check fails
"""

import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from loco_jax import kernels, loco
from loco_jax.apps import bench
from loco_jax.train import parallel


def _step(opt, params, mesh):
  state, specs = parallel.init_opt_state(opt, params, mesh)
  step = jax.jit(jax.shard_map(lambda g, s: opt.update(jax.tree.map(lambda x: x[0], g), s),
                               mesh=mesh, in_specs=(P("data"), specs), out_specs=(P(), specs)))
  return step, state


def _tree_times(mesh) -> list[tuple[str, bool]]:
  """Compile seconds and median step ms of the GPT-2-shaped tree's mesh step, loco and pmean."""
  params = bench.gpt2_params()
  grads = jax.tree.map(lambda x: x[None], params)
  pmean = optax.GradientTransformation(
      lambda p: optax.EmptyState(), lambda g, s, p=None: (jax.lax.pmean(g, "data"), s))
  rows, times = [], {}
  for name, opt in (("loco", loco(axis_name="data")), ("pmean", pmean)):
    step, state = _step(opt, params, mesh)
    start = time.perf_counter()
    compiled = step.lower(grads, state).compile()
    compile_s = time.perf_counter() - start
    samples = []
    for _ in range(20):
      start = time.perf_counter()
      out, state = compiled(grads, state)
      jax.block_until_ready(out)
      samples.append(time.perf_counter() - start)
    times[name] = statistics.median(samples[5:])
    rows.append((f"GPT-2 tree mesh step, {name}: compile {compile_s:.2f} s, step "
                 f"{times[name] * 1e3:.3f} ms", True))
  rows.append((f"loco mesh step / pmean mesh step (one GPU: no wire) = "
               f"{times['loco'] / times['pmean']:.2f}", True))
  return rows


def main() -> int:
  n = 1 << 22
  mesh = parallel.data_mesh(1)
  grads = [jax.random.normal(jax.random.key(k), (n,), jnp.float32) for k in range(3)]
  local = loco()
  step, state = _step(loco(axis_name="data"), jnp.zeros(n), mesh)
  hlo = step.lower(grads[0][None], state).compile().as_text()
  local_state, local_step = local.init(grads[0]), jax.jit(local.update)
  worst, codes_off, codes_far = 0.0, 0, 0
  for g in grads:
    out, state = step(g[None], state)
    want, local_state = local_step(g, local_state)
    want_bf16 = np.asarray(want.astype(jnp.bfloat16).astype(jnp.float32))
    gap = np.abs(np.asarray(out) - want_bf16) / np.maximum(np.abs(want_bf16), 1e-30)
    worst = max(worst, float(np.max(gap)))
    # One leaf in whole blocks: one bucket, the same layout on the 1-device mesh as locally.
    diff = np.abs(np.asarray(state.groups[""].error[0], np.int32) -
                  np.asarray(local_state.groups[""].error[0], np.int32))
    codes_off, codes_far = codes_off + int(np.sum(diff != 0)), codes_far + int(np.sum(diff > 1))
  checks = [
      ("auto picks the Pallas kernel", kernels.chosen_implementation() == "pallas"),
      (f"Pallas against the float64 reference: {kernels.pallas_report('gpu')}",
       kernels.pallas_report("gpu") == "pass"),
      ("the mesh step runs the Pallas compress kernel", "loco_compress_step" in hlo),
      ("the mesh step runs the Pallas receive-side mean", "loco_dequantize_mean" in hlo),
      (f"mesh output = bf16(local output): max rel diff {worst:.3g}", worst <= 2 ** -7),
      (f"mesh error within one code of the local one: {codes_off} codes differ, {codes_far} "
       f"by more than one", codes_far == 0 and codes_off <= 3 * n * 1e-3),
  ] + _tree_times(mesh)
  for name, ok in checks:
    print(f"| {name} | {'yes' if ok else 'NO'} |")
  return 0 if all(ok for _, ok in checks) else 1


if __name__ == "__main__":
  sys.exit(main())
