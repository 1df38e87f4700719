"""What fp8 symbols of real gradients code to, stream by stream: the capacity co3-fp8 needs.

  python experiments/co3_fp8_capacity.py [--steps 300] [--seed 0] [--skip-demo]

1. The demo's co3-fp8 run (8 simulated devices, the bf16 gather): the length of every stream
   each device codes for the all-to-all, step by step (read where the coded exchange fills
   its slots: `stream_lengths`). A coded stream is lossless whatever its slot, so one run
   at any capacity gives the lengths of all of them. For each stream: the capacity (bits a
   symbol) its slot would need, (length - huffman_deflate.overhead(row bytes)) * 8 / symbols;
   per step the largest over the 56 streams, since one stream that does not fit sends the step
   raw.
2. The GPT-2-shaped tree (`bench.gpt2_params`: standard normal leaves), converted to fp8 at the
   scales co3 fits (`co3_host.fit_scales`), laid out in 8 rows as the all-to-all sends them:
   the same per-stream capacity.

Prints JSON: the quantiles of the per-step largest need, the share of steps that would overflow
at the default capacity (`default_capacity_bits`: the default slot with its extension) and at a
few others, and the mean coded bits.
"""

import argparse
import json
from pathlib import Path
import sys
import threading

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled
sys.path.insert(0, str(Path(__file__).resolve().parent))  # common.py beside it

from common import stream_lengths  # noqa: E402

CANDIDATES = (6.86, 7.0, 7.1, 7.2, 7.25, 7.3, 7.4, 7.5)


def needed_bits(lengths: np.ndarray, row_bytes: int) -> np.ndarray:
  """Bits a symbol (fp8: one a byte) a slot must reserve for streams of `lengths`."""
  from loco_jax.codecs import huffman_deflate
  from loco_jax.comm import coded
  return coded.needed_bits_per_byte(lengths, row_bytes, huffman_deflate)


def summary(need_SxK: np.ndarray, coded_bits: float) -> dict:
  """need_SxK: per step, every stream's need. The quantiles and overflow shares."""
  worst = need_SxK.max(axis=1)
  from loco_jax.codecs import fp
  from loco_jax.transforms import co3_host
  default = co3_host.default_capacity_bits(fp.FP8)
  return {"steps": int(worst.size), "streams_a_step": int(need_SxK.shape[1]),
          "coded_bits_mean": round(coded_bits, 4),
          "stream_need_median": round(float(np.median(need_SxK)), 4),
          "step_worst_need": {q: round(float(np.quantile(worst, float(q))), 4)
                              for q in ("0.5", "0.9", "0.99", "1.0")},
          "default_capacity": round(default, 4),
          "overflow_share": {str(c): round(float(np.mean(worst > c)), 4)
                             for c in (round(default, 4), *CANDIDATES)}}


def demo_streams(steps: int, seed: int) -> dict:
  from loco_jax.apps import demo
  from loco_jax.core import layout
  from loco_jax.apps.models import num_params
  config = demo.DemoConfig(steps=steps, seed=seed)
  demo.setup_devices(config.devices)
  import jax
  _, params, _ = demo.make_model(config)
  row_bytes = sum(layout.shard_len(x.size, config.devices) for x in jax.tree.leaves(params))
  lock, current, per_step = threading.Lock(), [], []

  def record(length):
    with lock:
      current.append(length)

  def observe(state, step):
    del state, step
    with lock:
      per_step.append(list(current))
      current.clear()

  with stream_lengths(lambda _, length: record(length)):
    result = demo.run_method("co3-fp8", demo.make_compressor("co3-fp8", config), config,
                             demo.load_corpus(config), observe=observe)
  need = np.array([needed_bits(np.array(s), row_bytes) for s in per_step])
  return {"tree": "demo", "params": num_params(params), "row_bytes": row_bytes,
          "eval_loss": round(result.eval_loss, 4), "overflow_steps_run": result.co3[
              "overflow_steps"], **summary(need, result.co3["coded_bits"])}


def gpt2_streams(devices: int) -> dict:
  import jax
  from loco_jax.apps import bench
  from loco_jax.codecs import fp, huffman_deflate
  from loco_jax.core import layout
  from loco_jax.transforms import co3_host
  flat = [np.asarray(x, np.float32).reshape(-1) for x in jax.tree.leaves(bench.gpt2_params())]
  samples = [x[:: max(1, x.size // co3_host.FIT_SAMPLES)][:co3_host.FIT_SAMPLES] for x in flat]
  scales = co3_host.fit_scales(fp.FP8, tuple(s.size for s in samples),
                               np.ones(len(flat), np.float32),
                               np.array([np.abs(x).max() for x in flat]),
                               np.concatenate(samples))
  rows = np.concatenate([np.asarray(layout.shard_rows(
      fp.encode(x, fp.FP8, s), layout.leaf_layout(x.size, devices, None)), np.uint8)
      for x, s in zip(flat, scales)], axis=1)
  lengths = np.array([len(huffman_deflate.encode(r)) for r in rows])
  coded = 8.0 * lengths.sum() / rows.size
  return {"tree": "gpt2_params", "params": int(sum(x.size for x in flat)),
          "row_bytes": int(rows.shape[1]),
          **summary(needed_bits(lengths, rows.shape[1])[None], coded)}


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--steps", type=int, default=300)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--skip-demo", action="store_true")
  args = p.parse_args(argv)
  if not args.skip_demo:
    print(json.dumps(demo_streams(args.steps, args.seed)), flush=True)
  print(json.dumps(gpt2_streams(8)), flush=True)


if __name__ == "__main__":
  main()
