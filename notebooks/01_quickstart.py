# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.7
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # LoCo quickstart: 4-bit gradients on a mesh
#
# `loco_jax.loco` is an optax transformation. Without an axis it compresses locally (one device, or
# a simulation); with `axis_name` it runs inside `jax.shard_map` and averages the 4-bit gradients over
# the mesh with one all-to-all of packed codes and an all-gather of the averaged shards.
#
# This notebook runs on a laptop CPU: jax simulates 8 devices. It shows
# 1. the one-line change on one device,
# 2. why error feedback matters (the drift of uncorrected rounding),
# 3. a data-parallel train step on an 8-device mesh,
# 4. the bytes each method puts on the wire, read from the compiled step's HLO.

# %%
import jax
jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)   # before anything starts jax's backend

import time
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
import optax

import loco_jax
from loco_jax import comm
from loco_jax.train import parallel
from loco_jax.transforms import baselines
from loco_jax.apps.models import mlp

STEPS = 120
print(jax.devices())

# %% [markdown]
# ## 1. One device: chain it in front of any optimizer
#
# A small MLP learns a random tanh teacher. The same seed, data and Adam settings; only the
# gradient transformation in front of Adam changes. This easy problem does not mind 4-bit
# gradients at all; at 2 bits the rounding without feedback costs a lot more than LoCo's.

# %%
x, y = mlp.teacher_student_data(jax.random.key(0), 2048, 16, 4, 32)
graphdef, params0 = mlp.split_model(mlp.MLP(16, 64, 4))
loss_fn = lambda p, batch: mlp.apply_loss(graphdef, p, batch)

def train_local(front, steps=STEPS, batch=64):
  opt = optax.chain(front, optax.adam(3e-3))
  params, state = params0, opt.init(params0)

  @jax.jit
  def step(params, state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  rng, losses = np.random.default_rng(0), []
  for _ in range(steps):
    idx = rng.integers(0, len(x), batch)
    params, state, loss = step(params, state, (x[idx], y[idx]))
    losses.append(float(loss))
  return np.array(losses)

fronts = {"float32": optax.identity(),
          "4-bit, no feedback": baselines.int_quantized(bits=4),
          "LoCo 4-bit": loco_jax.loco(bits=4),
          "2-bit, no feedback": baselines.int_quantized(bits=2),
          "LoCo 2-bit": loco_jax.loco(bits=2)}
local = {name: train_local(front) for name, front in fronts.items()}
for name, losses in local.items():
  print(f"{name:>20}: final loss {losses[-20:].mean():.4f}")


# %% [markdown]
# ## 2. What error feedback buys: bounded drift
#
# Rounding each step's gradient to 4 bits throws away a little of it. Without feedback the lost
# parts add up like a random walk; LoCo keeps an (8-bit, averaged) record of them and adds it back,
# so the total of what was lost, sum_k (g_k - d_k), stays bounded (it equals
# (e_K - e_0) / (1 - beta) up to the int8 rounding). Below, gradients drawn at random each step
# with a small mean, compressed locally.

# %%
def drift(front, steps=200, size=4096):
  state = front.init(jnp.zeros(size))
  update = jax.jit(front.update)
  total, norms = jnp.zeros(size), []
  for k in range(steps):
    g = 0.05 + jax.random.normal(jax.random.key(k), (size,))
    d, state = update(g, state)
    total = total + (g - d)
    norms.append(float(jnp.linalg.norm(total) / np.sqrt(size)))
  return norms

plt.figure(figsize=(6, 3.5))
for name in ("4-bit, no feedback", "LoCo 4-bit"):
  plt.plot(drift(fronts[name]), label=name)
plt.plot(drift(baselines.error_feedback(bits=4)), label="classic EF (float32 error)", ls="--")
plt.xlabel("step"); plt.ylabel("rms of sum(g - d)"); plt.legend(); plt.grid(alpha=.3)
plt.title("accumulated compression error"); plt.show()

# %% [markdown]
# ## 3. Data parallel on a mesh of 8 devices
#
# `parallel.init_train_state` places the parameters and the states (each device keeps its own LoCo
# error, so that part is split over the `data` axis); `parallel.make_train_step` splits each batch
# over the devices, and the compressor averages the gradients.

# %%
mesh = parallel.data_mesh(8)
optimizer = optax.adam(3e-3)
compressors = {"float32 all-reduce": baselines.uncompressed(axis_name="data"),
               "4-bit, no feedback": baselines.int_quantized(bits=4, axis_name="data"),
               "LoCo 4-bit": loco_jax.loco(bits=4, axis_name="data")}

def train_mesh(compressor, steps=STEPS, batch=256):
  state, specs = parallel.init_train_state(params0, optimizer, mesh, compressor=compressor)
  step = parallel.make_train_step(loss_fn, optimizer, mesh, params0,
                                  compressor=compressor)
  rng, losses = np.random.default_rng(0), []
  for _ in range(steps):
    idx = rng.integers(0, len(x), batch)
    state, loss = step(state, (x[idx], y[idx]))
    losses.append(float(loss))
  return state, step, np.array(losses)

runs = {}
for name, compressor in compressors.items():
  start = time.perf_counter()
  runs[name] = train_mesh(compressor)
  print(f"{name:>20}: final loss {runs[name][2][-20:].mean():.4f} "
        f"({time.perf_counter() - start:.1f} s with compilation)")

state = runs["LoCo 4-bit"][0]
error = state.compressor_state.groups[""].error[0]  # one array per bucket (error_by_leaf: per leaf)
per_device = error.reshape(8, -1)
print("LoCo error of the first bucket, global shape (8 devices x size):", error.shape, error.dtype,
      "| devices 0 and 1 differ:", bool(jnp.any(per_device[0] != per_device[1])))

# %%
plt.figure(figsize=(6, 3.5))
for name, (_, _, losses) in runs.items():
  plt.plot(np.convolve(losses, np.ones(10) / 10, "valid"), label=name)
plt.yscale("log"); plt.xlabel("step"); plt.ylabel("train loss (10-step mean)")
plt.legend(); plt.grid(alpha=.3); plt.show()

# %% [markdown]
# ## 4. Bytes on the wire, from the compiled step
#
# `comm.lowered_collectives` lowers the real train step and lists its collectives; 
# `comm.wire_bits_per_param` counts what each device sends per parameter and step (a ring
# all-reduce sends 2(n-1)/n of its buffer, the other collectives (n-1)/n). LoCo's all-to-all
# carries 4-bit codes plus a float32 scale per block of 2048 values; the all-gather of the averaged
# shards is bfloat16 (or, with `gather="quantized"`, 4-bit again).

# %%
n_params = sum(p.size for p in jax.tree.leaves(params0))
batch = (x[:256], y[:256])
rows = dict((name, runs[name][:2]) for name in runs)
rows["LoCo 4-bit, quantized gather"] = train_mesh(
    loco_jax.loco(bits=4, axis_name="data", gather="quantized"), steps=1)[:2]
print(f"{'method':>30} | collectives (op dtype bits/param of buffer) | wire bits/param")
for name, (state, step) in rows.items():
  found = comm.lowered_collectives(step.jitted, state, batch)
  big = [f"{c.op} {c.dtype} {8 * c.nbytes / n_params:.2f}" for c in found if c.nbytes > 64]
  print(f"{name:>30} | {'; '.join(big[:3])}{' ...' if len(big) > 3 else ''} | "
        f"{comm.wire_bits_per_param(found, n_params):.2f}")

# %% [markdown]
# The float32 all-reduce sends 2 x 7/8 x 32 = 56 bits a parameter; LoCo sends
# 7/8 x (4.02 + 16) = 17.5 plus padding: every leaf is cut into 8 shards of a multiple of 8
# values, which weighs on this 1,348-parameter MLP (5.1 instead of 4.02 gradient bits) and
# vanishes on real models (the demo's GPT: 4.06). The quantized gather brings the total to about
# 7/8 x 8.
# Next: `python -m loco_jax demo` trains a small GPT this way with every method, and
# `02_gradient_statistics_and_codec.ipynb` looks at CO3's small floats and Huffman coding.
