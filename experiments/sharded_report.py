"""Sharded training on 8 simulated CPU devices: losses, optimizer-state bytes and wire bits.

Trains a small MLP regression in ddp and zero2 modes with plain and LoCo gradient averaging
(and zero2 with an int8 parameter gather), then reads every step's collectives from its HLO.
  python experiments/sharded_report.py [--steps 200]
"""

import argparse

import jax

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from loco_jax import comm, loco  # noqa: E402
from loco_jax.train import parallel
from loco_jax.transforms import baselines
from loco_jax.transforms.two_hop import two_hop  # noqa: E402

N = 8


def params0():
  k1, k2 = jax.random.split(jax.random.key(0))
  return {"w1": jax.random.normal(k1, (64, 512)) * 0.1, "b1": jnp.zeros(512),
          "w2": jax.random.normal(k2, (512, 16)) * 0.05, "b2": jnp.zeros(16)}


def loss_fn(params, batch):
  h = jnp.tanh(batch[:, :64] @ params["w1"] + params["b1"])
  return jnp.mean((h @ params["w2"] + params["b2"] - batch[:, 64:]) ** 2)


def batches(steps, size=256, seed=0):
  rng = np.random.default_rng(seed)
  teacher = rng.standard_normal((64, 16)) / 8
  for _ in range(steps):
    x = rng.standard_normal((size, 64)).astype(np.float32)
    yield jnp.asarray(np.concatenate([x, np.tanh(x @ teacher)], 1).astype(np.float32))


def run(name, mode, compressor, steps, **kwargs):
  mesh = parallel.data_mesh(N)
  optimizer = optax.adamw(3e-3)
  state, specs = parallel.init_train_state(params0(), optimizer, mesh, compressor=compressor,
                                           mode=mode)
  step = parallel.make_train_step(loss_fn, optimizer, mesh, params0(),
                                  compressor=compressor, mode=mode, **kwargs)
  n_params = sum(x.size for x in jax.tree.leaves(params0()))
  found = comm.lowered_collectives(step.jitted, state, next(batches(1)))
  by_op = {}
  for c in found:
    by_op[c.op] = by_op.get(c.op, 0.0) + comm.wire_bits_per_param([c], n_params)
  opt_bytes = sum(x.nbytes for x in jax.tree.leaves(state.opt_state))
  opt_bytes_per_device = opt_bytes / (N if mode == "zero2" else 1)
  losses = []
  for b in batches(steps):
    state, loss = step(state, b)
    losses.append(float(loss))
  return dict(name=name, final_loss=np.mean(losses[-10:]), bits=by_op,
              opt_bytes_per_device=opt_bytes_per_device)


def two_hop_bits():
  """Wire bits per parameter of each hop on a (node=2, local=4) mesh."""
  from jax.sharding import PartitionSpec as P
  params = params0()
  n_params = sum(x.size for x in jax.tree.leaves(params))
  rows = {}
  mesh = parallel.node_mesh(2, 4)
  for intra in ("reduce_scatter", "loco"):
    opt = two_hop(intra=intra)
    state, specs = parallel.init_opt_state(opt, params, mesh, ("node", "local"))
    g = jax.tree.map(lambda x: jnp.ones((2, 4, *x.shape)), params)
    step = jax.jit(jax.shard_map(lambda g, s: opt.update(jax.tree.map(lambda x: x[0, 0], g), s),
                                 mesh=mesh, in_specs=(jax.tree.map(lambda _: P("node", "local"),
                                                                   params), specs),
                                 out_specs=(jax.tree.map(lambda _: P(), params), specs)))
    for c in comm.lowered_collectives(step, g, state):
      hop = "inside node" if c.group_size == 4 else "across nodes"
      key = (intra, hop, f"{c.op} {c.dtype}")
      rows[key] = rows.get(key, 0.0) + comm.wire_bits_per_param([c], n_params)
  return rows


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--steps", type=int, default=200)
  args = parser.parse_args()
  runs = [
      run("ddp, fp32 all-reduce", "ddp", baselines.uncompressed("data"), args.steps),
      run("ddp, LoCo", "ddp", loco(axis_name="data"), args.steps),
      run("zero2, fp32 reduce-scatter, fp32 gather", "zero2", parallel.reduce_scatter("data"),
          args.steps),
      run("zero2, fp32 reduce-scatter, bf16 gather", "zero2", parallel.reduce_scatter("data"),
          args.steps, compute_dtype=jnp.bfloat16),
      run("zero2, LoCo, bf16 gather", "zero2", loco(axis_name="data", scatter=True), args.steps,
          compute_dtype=jnp.bfloat16),
      run("zero2, LoCo, int8 gather", "zero2", loco(axis_name="data", scatter=True), args.steps,
          param_gather="int8"),
  ]
  print(f"| run ({N} CPU devices, {args.steps} steps) | final loss (mean of last 10) | "
        "optimizer state bytes / device | bits / param / device sent, by collective |")
  print("|---|---|---|---|")
  for r in runs:
    bits = ", ".join(f"{op} {b:.2f}" for op, b in sorted(r["bits"].items()))
    print(f"| {r['name']} | {r['final_loss']:.5f} | {r['opt_bytes_per_device']:.0f} | {bits} |")
  print("\n| two-hop mode | hop | collective | bits / param / device |\n|---|---|---|---|")
  for (intra, hop, op), bits in two_hop_bits().items():
    print(f"| {intra} | {hop} | {op} | {bits:.2f} |")


if __name__ == "__main__":
  main()
