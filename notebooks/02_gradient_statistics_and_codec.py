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
# # Gradient statistics and the CO3 codec
#
# CO3 (seed paper 003) models each layer's gradient as a generalized normal (GenNorm) with shape
# beta and scale alpha, picks an fp4 scale from the fit, and Huffman-codes the small-float symbols.
# This notebook takes real gradients of a small byte-level GPT on Python source text and checks
# each step: `loco_jax.codecs.gennorm` (fit, validate), `loco_jax.codecs.fp` (fp4/fp8 small floats),
# `loco_jax.apps.huffman` (the lossless code, from the codec benchmark).

# %%
import jax
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
      f"{sum(g.size for g in jax.tree.leaves(grads)):,} gradient values")

# %% [markdown]
# ## GenNorm, normal or Laplace?
#
# `gennorm.validate` fits every leaf and reports the 1-D Wasserstein-2 distance between the
# gradient values and each fitted model (smaller is better).

# %%
report = gennorm.validate(grads)
print(f"{'leaf':<38} {'beta':>6} {'W2 normal':>10} {'W2 Laplace':>11} {'W2 GenNorm':>11}")
for leaf, r in report.items():
  print(f"{leaf[:38]:<38} {r['beta']:>6.2f} {r['w2_normal']:>10.2e} {r['w2_laplace']:>11.2e} "
        f"{r['w2_gennorm']:>11.2e}")
wins = sum(r["w2_gennorm"] <= min(r["w2_normal"], r["w2_laplace"]) * 1.0001
           for r in report.values())
print(f"GenNorm fits best (or ties) on {wins} of {len(report)} leaves; "
      f"median beta {np.median([r['beta'] for r in report.values()]):.2f}")

# %% [markdown]
# Weight matrices sit between Laplace (beta 1) and normal (beta 2), as CO3 reports.
# Three kinds of leaf do not fit at all: the qkv bias (its key third has exactly zero gradient:
# a bias on every key shifts all scores of a query equally, which softmax ignores) and the token
# embedding (bytes absent from the batch get no gradient) are a point mass at zero plus a spread,
# which drives the fitted beta to its floor 0.05; LayerNorm and bias leaves are too small to say
# much. A fitted
# scale is only as good as the fit, so CO3's scale rule is meant for the big matrices.

# %%
leaf = np.asarray(grads["blocks"][0]["fc1"]["kernel"]).ravel()
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
plt.legend(fontsize=8); plt.title("one layer's gradient, log density"); plt.show()

# %% [markdown]
# ## Small floats: fp4 [1,2,1] at the fitted scale
#
# fp4 has levels {0, ±0.5, ±1, ±1.5, ±2, ±3}. CO3 scales x by s = p(beta) / alpha before
# rounding; p is a polynomial fit of the MSE-optimal scale for unit GenNorm data. Check it
# against a scan of scales on this leaf.

# %%
print("fp4 levels:", fp.levels(fp.FP4))
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
      f"the best scanned")

# %% [markdown]
# ## Huffman coding of the symbols
#
# The fp4 symbols are far from uniform (most values round to 0 or ±0.5), so a Huffman code needs
# fewer than 4 bits a value. `huffman.encode` codes symbols one at a time; `encode_pairs` codes pairs
# of fp4 symbols, which closes most of the gap to the entropy. The GenNorm model predicts the
# entropy from (beta, alpha, scale) alone.

# %%
symbols = np.asarray(fp.encode(leaf, fp.FP4, fitted))
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
  print(f"{name:>34}: {bits:.3f} bits / value")

# %%
# Across every leaf: coded size against the model's prediction.
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
plt.title("fp4 symbols per leaf"); plt.show()
