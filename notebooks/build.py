"""Writes the notebooks of this folder from the cell sources below (outputs cleared).

  .venv/bin/python notebooks/build.py        # then open them in Jupyter, or let the tests run them
"""

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent

QUICKSTART = [
    ("md", """# LoCo quickstart: 4-bit gradients on a mesh

`loco_jax.loco` is an optax transformation. Without an axis it compresses locally (one device, or
a simulation); with `axis_name` it runs inside `jax.shard_map` and averages the 4-bit gradients over
the mesh with one all-to-all of packed codes and an all-gather of the averaged shards.

This notebook runs on a laptop CPU: jax simulates 8 devices. It shows
1. the one-line change on one device,
2. why error feedback matters (the drift of uncorrected rounding),
3. a data-parallel train step on an 8-device mesh,
4. the bytes each method puts on the wire, read from the compiled step's HLO."""),
    ("code", """import jax
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
print(jax.devices())"""),
    ("md", """## 1. One device: chain it in front of any optimizer

A small MLP learns a random tanh teacher. The same seed, data and Adam settings; only the
gradient transformation in front of Adam changes. This easy problem does not mind 4-bit
gradients at all; at 2 bits the rounding without feedback costs a lot more than LoCo's."""),
    ("code", """x, y = mlp.teacher_student_data(jax.random.key(0), 2048, 16, 4, 32)
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
  print(f"{name:>20}: final loss {losses[-20:].mean():.4f}")"""),
    ("md", """## 2. What error feedback buys: bounded drift

Rounding each step's gradient to 4 bits throws away a little of it. Without feedback the lost
parts add up like a random walk; LoCo keeps an (8-bit, averaged) record of them and adds it back,
so the total of what was lost, sum_k (g_k - d_k), stays bounded (it equals
(e_K - e_0) / (1 - beta) up to the int8 rounding). Below, gradients drawn at random each step
with a small mean, compressed locally."""),
    ("code", """def drift(front, steps=200, size=4096):
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
plt.title("accumulated compression error"); plt.show()"""),
    ("md", """## 3. Data parallel on a mesh of 8 devices

`parallel.init_train_state` places the parameters and the states (each device keeps its own LoCo
error, so that part is split over the `data` axis); `parallel.make_train_step` splits each batch
over the devices, and the compressor averages the gradients."""),
    ("code", """mesh = parallel.data_mesh(8)
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
print("LoCo error of one leaf, global shape (8 devices x size):", error.shape, error.dtype,
      "| devices 0 and 1 differ:", bool(jnp.any(per_device[0] != per_device[1])))"""),
    ("code", """plt.figure(figsize=(6, 3.5))
for name, (_, _, losses) in runs.items():
  plt.plot(np.convolve(losses, np.ones(10) / 10, "valid"), label=name)
plt.yscale("log"); plt.xlabel("step"); plt.ylabel("train loss (10-step mean)")
plt.legend(); plt.grid(alpha=.3); plt.show()"""),
    ("md", """## 4. Bytes on the wire, from the compiled step

`comm.lowered_collectives` lowers the real train step and lists its collectives; 
`comm.wire_bits_per_param` counts what each device sends per parameter and step (a ring
all-reduce sends 2(n-1)/n of its buffer, the other collectives (n-1)/n). LoCo's all-to-all
carries 4-bit codes plus a float32 scale per block of 2048 values; the all-gather of the averaged
shards is bfloat16 (or, with `gather="quantized"`, 4-bit again)."""),
    ("code", """n_params = sum(p.size for p in jax.tree.leaves(params0))
batch = (x[:256], y[:256])
rows = dict((name, runs[name][:2]) for name in runs)
rows["LoCo 4-bit, quantized gather"] = train_mesh(
    loco_jax.loco(bits=4, axis_name="data", gather="quantized"), steps=1)[:2]
print(f"{'method':>30} | collectives (op dtype bits/param of buffer) | wire bits/param")
for name, (state, step) in rows.items():
  found = comm.lowered_collectives(step.jitted, state, batch)
  big = [f"{c.op} {c.dtype} {8 * c.nbytes / n_params:.2f}" for c in found if c.nbytes > 64]
  print(f"{name:>30} | {'; '.join(big[:3])}{' ...' if len(big) > 3 else ''} | "
        f"{comm.wire_bits_per_param(found, n_params):.2f}")"""),
    ("md", """The float32 all-reduce sends 2 x 7/8 x 32 = 56 bits a parameter; LoCo sends
7/8 x (4.02 + 16) = 17.5 plus padding: every leaf is cut into 8 shards of a multiple of 8
values, which weighs on this 1,348-parameter MLP (5.1 instead of 4.02 gradient bits) and
vanishes on real models (the demo's GPT: 4.06). The quantized gather brings the total to about
7/8 x 8.
Next: `python -m loco_jax demo` trains a small GPT this way with every method, and
`02_gradient_statistics_and_codec.ipynb` looks at CO3's small floats and Huffman coding."""),
]

STATISTICS = [
    ("md", """# Gradient statistics and the CO3 codec

CO3 (seed paper 003) models each layer's gradient as a generalized normal (GenNorm) with shape
beta and scale alpha, picks an fp4 scale from the fit, and Huffman-codes the small-float symbols.
This notebook takes real gradients of a small byte-level GPT on Python source text and checks
each step: `loco_jax.codecs.gennorm` (fit, validate), `loco_jax.codecs.fp` (fp4/fp8 small floats),
`loco_jax.apps.huffman` (the lossless code, from the codec benchmark)."""),
    ("code", """import jax
jax.config.update("jax_platforms", "cpu")
import math
import zlib

import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
import optax

from loco_jax.apps import data, huffman
from loco_jax.codecs import fp, gennorm
from loco_jax.apps.models import GPT, GPTConfig, gpt

config = GPTConfig(d_model=64, n_layers=2, d_ff=256, seq_len=64)
graphdef, params = gpt.split_model(GPT(config))
corpus = data.stdlib_corpus(400_000)
batches = data.batches(corpus, batch_size=32, seq_len=64, seed=0)
loss_grad = jax.jit(jax.value_and_grad(lambda p, b: gpt.apply_loss(graphdef, p, b)))

# A few Adam steps first: gradients at initialization are not typical of training.
opt = optax.adam(2e-3)
opt_state = opt.init(params)
for _ in range(30):
  loss, grads = loss_grad(params, next(batches))
  updates, opt_state = opt.update(grads, opt_state, params)
  params = optax.apply_updates(params, updates)
loss, grads = loss_grad(params, next(batches))
print(f"loss after 30 steps {float(loss):.3f}; "
      f"{sum(g.size for g in jax.tree.leaves(grads)):,} gradient values")"""),
    ("md", """## GenNorm, normal or Laplace?

`gennorm.validate` fits every leaf and reports the 1-D Wasserstein-2 distance between the
gradient values and each fitted model (smaller is better)."""),
    ("code", """report = gennorm.validate(grads)
print(f"{'leaf':<38} {'beta':>6} {'W2 normal':>10} {'W2 Laplace':>11} {'W2 GenNorm':>11}")
for leaf, r in report.items():
  print(f"{leaf[:38]:<38} {r['beta']:>6.2f} {r['w2_normal']:>10.2e} {r['w2_laplace']:>11.2e} "
        f"{r['w2_gennorm']:>11.2e}")
wins = sum(r["w2_gennorm"] <= min(r["w2_normal"], r["w2_laplace"]) * 1.0001
           for r in report.values())
print(f"GenNorm fits best (or ties) on {wins} of {len(report)} leaves; "
      f"median beta {np.median([r['beta'] for r in report.values()]):.2f}")"""),
    ("md", """Weight matrices sit between Laplace (beta 1) and normal (beta 2), as CO3 reports.
Three kinds of leaf do not fit at all: the qkv bias (its key third has exactly zero gradient:
a bias on every key shifts all scores of a query equally, which softmax ignores) and the token
embedding (bytes absent from the batch get no gradient) are a point mass at zero plus a spread,
which drives the fitted beta to its floor 0.05; LayerNorm and bias leaves are too small to say
much. A fitted
scale is only as good as the fit, so CO3's scale rule is meant for the big matrices."""),
    ("code", """leaf = np.asarray(grads["blocks"][0]["fc1"]["kernel"]).ravel()
fit = gennorm.fit(leaf)

def pdf(x, beta, alpha):
  return beta / (2 * alpha * math.gamma(1 / beta)) * np.exp(-(np.abs(x) / alpha) ** beta)

edges = np.linspace(-6 * leaf.std(), 6 * leaf.std(), 121)
plt.figure(figsize=(6, 3.5))
plt.hist(leaf, bins=edges, density=True, alpha=.5, label="gradient values (fc1 of block 0)")
grid = 0.5 * (edges[1:] + edges[:-1])
plt.plot(grid, pdf(grid, fit.beta, fit.alpha), label=f"GenNorm beta={fit.beta:.2f}")
plt.plot(grid, pdf(grid, 2.0, gennorm.fit(leaf, beta=2.0).alpha), "--", label="normal fit")
plt.yscale("log"); plt.ylim(bottom=pdf(grid, fit.beta, fit.alpha).min() / 10)
plt.legend(fontsize=8); plt.title("one layer's gradient, log density"); plt.show()"""),
    ("md", """## Small floats: fp4 [1,2,1] at the fitted scale

fp4 has levels {0, ±0.5, ±1, ±1.5, ±2, ±3}. CO3 scales x by s = p(beta) / alpha before
rounding; p is a polynomial fit of the MSE-optimal scale for unit GenNorm data. Check it
against a scan of scales on this leaf."""),
    ("code", """print("fp4 levels:", fp.levels(fp.FP4))
fitted = gennorm.fp4_scale(fit.beta, fit.alpha)
scales = fitted * np.geomspace(0.1, 10, 41)
mse = [float(np.mean((fp.quantize(leaf, fp.FP4, s) - leaf) ** 2)) for s in scales]
plt.figure(figsize=(6, 3.5))
plt.loglog(scales, mse)
plt.axvline(fitted, color="k", ls="--", label=f"fitted scale p(beta)/alpha = {fitted:.3g}")
plt.xlabel("scale s"); plt.ylabel("MSE of fp4(x s) / s"); plt.legend(); plt.show()
best = scales[int(np.argmin(mse))]
at_fitted = float(np.mean((fp.quantize(leaf, fp.FP4, fitted) - leaf) ** 2))
print(f"best scanned scale {best:.3g}; the fitted scale's MSE is {at_fitted / min(mse):.2f}x "
      f"the best scanned")"""),
    ("md", """## Huffman coding of the symbols

The fp4 symbols are far from uniform (most values round to 0 or ±0.5), so a Huffman code needs
fewer than 4 bits a value. `huffman.encode` codes symbols one at a time; `encode_pairs` codes pairs
of fp4 symbols, which closes most of the gap to the entropy. The GenNorm model predicts the
entropy from (beta, alpha, scale) alone."""),
    ("code", """symbols = np.asarray(fp.encode(leaf, fp.FP4, fitted))
single, pairs = huffman.encode(symbols), huffman.encode_pairs(symbols)
assert np.array_equal(huffman.decode(single), symbols)
assert np.array_equal(huffman.decode(pairs), symbols)
n = symbols.size
rows = [("raw fp4 (packed nibbles)", 4.0),
        ("empirical entropy", huffman.entropy_bits(symbols)),
        ("GenNorm model entropy", gennorm.entropy_bits(fp.FP4, fit.beta, fit.alpha, fitted)),
        ("huffman.encode", 8 * len(single) / n),
        ("huffman.encode_pairs", 8 * len(pairs) / n),
        ("zlib level 9 (on packed nibbles)",
         8 * len(zlib.compress((symbols[0::2] << 4 | symbols[1::2]).tobytes(), 9)) / n)]
for name, bits in rows:
  print(f"{name:>34}: {bits:.3f} bits / value")"""),
    ("code", """# Across every leaf: coded size against the model's prediction.
leaves = {jax.tree_util.keystr(path): g for path, g in jax.tree_util.tree_leaves_with_path(grads)}
fitted_bits, coded_bits = [], []
for name, r in report.items():
  values = np.asarray(leaves[name]).ravel()
  # A leaf that barely gets gradient fits a tiny alpha: clip its scale into the range where
  # fp4's levels stay normal float32 numbers, as co3 does.
  s = float(np.clip(gennorm.fp4_scale(r["beta"], r["alpha"]), *fp.scale_range(fp.FP4)))
  fitted_bits.append(gennorm.entropy_bits(fp.FP4, r["beta"], r["alpha"], s))
  coded_bits.append(8 * len(huffman.encode(np.asarray(fp.encode(values, fp.FP4, s)))) /
                    values.size)
plt.figure(figsize=(4, 4))
plt.scatter(fitted_bits, coded_bits)
lim = [min(fitted_bits + coded_bits) - .1, max(fitted_bits + coded_bits) + .1]
plt.plot(lim, lim, "k--", lw=.8)
plt.xlabel("model entropy (bits)"); plt.ylabel("Huffman-coded (bits, with header)")
plt.title("fp4 symbols per leaf"); plt.show()"""),
]


def _notebook(cells) -> nbformat.NotebookNode:
  nb = new_notebook()
  nb.cells = [new_markdown_cell(src) if kind == "md" else new_code_cell(src)
              for kind, src in cells]
  nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
  nb.metadata["language_info"] = {"name": "python"}
  return nb


def main() -> None:
  for name, cells in (("01_quickstart.ipynb", QUICKSTART),
                      ("02_gradient_statistics_and_codec.ipynb", STATISTICS)):
    nbformat.write(_notebook(cells), HERE / name)
    print("wrote", HERE / name)


if __name__ == "__main__":
  main()
