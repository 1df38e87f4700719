"""Coded rates on real gradients: CO3's fp4 streams and LoCo's 4-bit codes, per shard.

  python experiments/co3_wire_rates.py [--steps 60] [--devices 8]

For the demo's GPT (gradients at a few points of an uncompressed adamw run) and the GPT-2-shaped
tree of `bench.gpt2_params` (random normal leaves), prints one JSON record per gradient:
- co3: the fp4 symbols at CO3's fitted scales, laid out in per-device rows as the coded
  all-to-all sends them: their entropy, what `huffman_deflate` codes each row to (bits a
  symbol), the ideal sent-table pair Huffman of each row (`huffman.encode_pairs`), and the
  model-table alternative (per leaf, code lengths derived from the fitted GenNorm (beta,
  alpha): only two numbers would cross).
- loco: `kernels.compress_step`'s packed nibbles (4 bits, blocks of 2048, first step: no
  stored error), per-device rows: the codes' entropy and `huffman_deflate`'s bits a code.
"""

import argparse
import json
from pathlib import Path
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled


def _rows(flat_leaves, n):
  """Per-device rows of every leaf's shard, concatenated (layout.shard_rows), as numpy."""
  from loco_jax.core import layout
  return np.concatenate([np.asarray(layout.shard_rows(
      jnp.asarray(x), layout.leaf_layout(x.size, n, None))) for x in flat_leaves], axis=1)


def _stream_bits(rows_NxB, symbols_per_byte):
  from loco_jax.apps import huffman
  from loco_jax.codecs import huffman_deflate
  symbols = rows_NxB.size * symbols_per_byte
  deflate = sum(len(huffman_deflate.encode(r)) for r in rows_NxB)
  return {"entropy": round(float(np.mean([huffman.entropy_bits(r) for r in rows_NxB])
                                 / symbols_per_byte), 4),
          "deflate": round(8 * deflate / symbols, 4)}


def co3_rates(grads: list[np.ndarray], n: int) -> dict:
  from loco_jax.apps import huffman
  from loco_jax.codecs import fp, gennorm
  from loco_jax.transforms import co3_host
  symbols, model_bytes, nonzero = [], 0, []
  for g in grads:
    x = g[g != 0]
    fit = gennorm.fit(x[:: max(1, x.size // 65536)])
    scale = np.float32(min(co3_host.fitted_scale(fp.FP4, fit.beta, fit.alpha),
                           fp.max_value(fp.FP4) / np.quantile(np.abs(x), 0.99)))
    s = np.asarray(fp.encode(g, fp.FP4, scale)).astype(np.uint8)
    symbols.append(s)
    p = gennorm.symbol_probabilities(fp.FP4, fit.beta, fit.alpha, float(scale))
    model_bytes += len(huffman.encode_pairs(s, probabilities=p))
    nonzero.append(x.size)
  rows = _rows(symbols, n)
  pairs = (rows[:, 0::2] << 4 | rows[:, 1::2]).astype(np.uint8)
  out = _stream_bits(pairs, 2)
  out["sent_table_pairs"] = round(8 * sum(len(huffman.encode_pairs(r)) for r in rows)
                                  / rows.size, 4)
  out["model_table_per_leaf"] = round(8 * model_bytes / sum(s.size for s in symbols), 4)
  return out


def loco_rates(grads: list[np.ndarray], n: int) -> dict:
  from loco_jax import kernels
  packed = []
  for g in grads:
    flat = np.pad(g, (0, -g.size % 2048))
    out = kernels.compress_step(jnp.asarray(flat), jnp.zeros(flat.size, jnp.int8),
                                jnp.zeros(flat.size // 2048), bits=4, block_size=2048,
                                implementation="jnp")
    packed.append(np.asarray(out.packed).reshape(-1)[:(g.size + 1) // 2])
  return _stream_bits(_rows(packed, n), 2)


def demo_gradients(steps: int, every: int) -> list[tuple[int, list[np.ndarray]]]:
  import optax
  from loco_jax.apps import demo
  config = demo.DemoConfig(steps=steps, devices=1)
  _, params, loss_fn = demo.make_model(config)
  corpus = demo.load_corpus(config)
  opt = demo.make_optimizer(config)
  state = opt.init(params)
  grad_fn = jax.jit(jax.grad(loss_fn))
  taken = []
  for i, batch in enumerate(corpus.train_SxBxL):
    g = grad_fn(params, jnp.asarray(batch))
    if i % every == 0:
      taken.append((i, [np.asarray(x, np.float32).reshape(-1) for x in jax.tree.leaves(g)]))
    updates, state = opt.update(g, state, params)
    params = optax.apply_updates(params, updates)
  return taken


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--steps", type=int, default=61)
  p.add_argument("--every", type=int, default=30)
  p.add_argument("--devices", type=int, default=8)
  args = p.parse_args(argv)
  for step, grads in demo_gradients(args.steps, args.every):
    print(json.dumps({"tree": "demo", "step": step, "co3": co3_rates(grads, args.devices),
                      "loco": loco_rates(grads, args.devices)}), flush=True)
  from loco_jax.apps import bench
  tree = [np.asarray(x).reshape(-1) for x in jax.tree.leaves(bench.gpt2_params())]
  print(json.dumps({"tree": "gpt2_params", "co3": co3_rates(tree, args.devices),
                    "loco": loco_rates(tree, args.devices)}), flush=True)


if __name__ == "__main__":
  main()
