"""The LoCo paper's comparison (its Fig. 2 / Table V) at a configurable scale: loss per method.

  python experiments/compare.py                                   # CPU, 8 simulated devices
  python experiments/compare.py --d-model 256 --layers 4 --steps 2000 --seeds 0,1,2
  python experiments/compare.py --platform gpu --devices 1        # one GPU: no peers, but the
                                                                  # same compression per device
Each variant trains the demo's byte-level GPT (loco_jax.apps.demo.run_method) with the same seed and
data order; results append to <out>/runs.jsonl as they finish (a rerun skips what is there), and
<out>/compare.md and <out>/loss_curves.png are rewritten at the end. Variants: see --help.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from pathlib import Path

import numpy as np

import common

DEFAULT = ("none,bf16,noef4,ef4,ef21-4,sign,loco4,loco4-q,loco4-fixed,zero2-fp32,zero2-loco4,"
           "co3-fp4")


def _run(variant: str, config, corpus):
  from loco_jax import loco
  from loco_jax.apps import demo
  from loco_jax.train import parallel
  if variant == "zero2-fp32":
    return demo.run_method(variant, parallel.reduce_scatter("data"), config, corpus,
                           mode="zero2")
  if variant == "zero2-loco4":
    return demo.run_method(variant, loco(bits=4, block_size=config.block_size,
                                         axis_name="data", scatter=True),
                           config, corpus, mode="zero2")
  return demo.run_method(variant, common.make_variant(variant, config), config, corpus)


def report(records: list[dict]) -> str:
  """Markdown: per variant, mean over seeds of the losses and their change against `none`."""
  variants = list(dict.fromkeys(r["variant"] for r in records))
  ref = {r["seed"]: r for r in records if r["variant"] == "none"}
  lines = ["| variant | seeds | final train loss | eval loss | eval vs none, % | diverged | "
           "grad bits | wire bits | step s |", "|---|---|---|---|---|---|---|---|---|"]
  for v in variants:
    rs = [r for r in records if r["variant"] == v]
    ok = [r for r in rs if not r["diverged"]]
    rel = [100 * (r["eval_loss"] / ref[r["seed"]]["eval_loss"] - 1) for r in ok
           if r["seed"] in ref and not ref[r["seed"]]["diverged"]]
    mean = lambda k: f"{np.mean([r[k] for r in ok]):.4f}" if ok else "n/a"
    lines.append(f"| {v} | {len(rs)} | {mean('final_loss')} | {mean('eval_loss')} | "
                 f"{common.mean_std(rel)} | {len(rs) - len(ok)} | "
                 f"{rs[0]['gradient_bits_per_param']:.2f} | {rs[0]['wire_bits_per_param']:.2f} | "
                 f"{np.median([r['step_time_s'] for r in rs]):.3f} |")
  return "\n".join(lines) + "\n"


def plot(records: list[dict], path: Path, title: str) -> None:
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return
  fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
  for v in dict.fromkeys(r["variant"] for r in records):
    curves = [r["losses"] for r in records if r["variant"] == v and not r["diverged"]]
    if not curves:
      continue
    y = np.nanmean(np.array([[np.nan if x is None else x for x in c] for c in curves]), axis=0)
    k = max(len(y) // 20, 1)
    steps = np.linspace(1, records[0]["config"]["steps"], len(y))
    ax.plot(steps[k - 1:], np.convolve(y, np.ones(k) / k, "valid"), label=v, lw=1.4)
  ax.set_xlabel("step"); ax.set_ylabel("train loss (mean over seeds, smoothed)")
  ax.set_title(title, fontsize=9); ax.grid(alpha=0.3); ax.legend(fontsize=8)
  finite = [x for r in records for x in r["losses"][len(r["losses"]) // 5:]
            if x is not None and math.isfinite(x)]
  if finite:
    ax.set_ylim(min(finite) * 0.98, np.percentile(finite, 95) * 1.05)
  fig.tight_layout(); fig.savefig(path); plt.close(fig)


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__ + "\n" + common.VARIANT_HELP +
                              "\n  zero2-fp32 | zero2-loco4      ZeRO-2 train steps",
                              formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--variants", default=DEFAULT)
  p.add_argument("--seeds", default="0")
  p.add_argument("--steps", type=int, default=1000)
  p.add_argument("--d-model", type=int, default=128)
  p.add_argument("--layers", type=int, default=2)
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--seq-len", type=int, default=64)
  p.add_argument("--batch", type=int, default=8, help="sequences per device")
  p.add_argument("--lr", type=float, default=2e-3)
  p.add_argument("--devices", type=int, default=8)
  p.add_argument("--platform", default="cpu", help="cpu (simulated devices) or gpu")
  p.add_argument("--data", default=None, help="text file or folder (default: stdlib sources)")
  p.add_argument("--corpus-bytes", type=int, default=4_000_000)
  p.add_argument("--out", default="runs/compare")
  args = p.parse_args(argv)
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  common.setup(args.devices, args.platform, cache_dir=str(out / "xla-cache"))
  from loco_jax.apps import demo
  config = demo.DemoConfig(steps=args.steps, devices=args.devices, batch_per_device=args.batch,
                           seq_len=args.seq_len, d_model=args.d_model, n_layers=args.layers,
                           n_heads=args.heads, d_ff=4 * args.d_model, lr=args.lr,
                           corpus_bytes=args.corpus_bytes)
  variants = [v for v in args.variants.split(",") if v]
  if "co3-fp4" in variants and not common.co3_available():
    print(f"co3-fp4 skipped: {demo.co3_status()}", file=sys.stderr)
    variants.remove("co3-fp4")
  path = out / "runs.jsonl"
  unseeded = lambda c: {**c, "seed": 0}
  mine = lambda r: unseeded(r["config"]) == unseeded(dataclasses.asdict(config))
  done = {(r["variant"], r["seed"]) for r in common.read_jsonl(path) if mine(r)}
  print(f"compare: {common.describe(config)}", file=sys.stderr)
  for seed in [int(s) for s in args.seeds.split(",")]:
    seeded = dataclasses.replace(config, seed=seed)
    corpus = demo.load_corpus(seeded, args.data)
    for variant in variants:
      if (variant, seed) in done:
        continue
      result = _run(variant, seeded, corpus)
      common.append_jsonl(path, common.result_record(result, seeded, variant=variant, seed=seed))
      print(f"{variant:<14} seed {seed}: train {result.final_loss:.4f} eval "
            f"{result.eval_loss:.4f} wire {result.wire_bits_per_param:.2f} bits "
            f"({result.step_time_s:.3f} s/step, compile {result.compile_s:.0f} s)",
            file=sys.stderr, flush=True)
  records = [r for r in common.read_jsonl(path) if r["variant"] in variants and mine(r)]
  text = f"{common.describe(config)}\n\n" + report(records)
  common.write_text_atomic(out / "compare.md", text)
  plot(records, out / "loss_curves.png", common.describe(config))
  print(text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
