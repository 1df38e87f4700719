"""CO3's rate-accuracy curve: Huffman-coded bits per parameter against the loss, with LoCo and
plain quantization at 2..8 bits as reference points.

  python experiments/co3_rate.py [--steps 400 --seeds 0] [--out runs/co3_rate]

The hook for loco_jax.co3: while that module is missing the CO3 points are skipped (and said
so); the reference points still run. A CO3 point's rate is the mean over steps and devices of
`state.compressor_state.coded_bits` (what the Huffman code needed); its wire, read from the HLO,
is the collective's fixed capacity. A reference point's rate is its HLO gradient bits.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import numpy as np

import common

CO3_POINTS = [("fp4", 0.0), ("fp4", 0.7), ("fp4", 1.0), ("fp8", 0.7)]
REFERENCES = ["none", "noef2", "noef3", "noef4", "noef8", "loco2", "loco3", "loco4", "loco8"]


def co3_point(fmt: str, gamma: float, config, corpus) -> dict:
  """Trains with co3(fmt, gamma) and records the coded rate along the way."""
  import importlib
  import jax
  from loco_jax.apps import demo
  co3 = importlib.import_module("loco_jax.transforms.co3")
  rates = []

  def observe(state, step):
    if step % 10 == 0 or step == config.steps:
      rates.append(float(jax.device_get(state.compressor_state.coded_bits).mean()))

  name = f"co3-{fmt}-g{gamma:g}"
  result = demo.run_method(name, co3.co3(fmt=fmt, gamma=gamma, axis_name="data"), config,
                           corpus, observe=observe)
  return common.result_record(result, config, variant=name, rate=float(np.mean(rates)),
                              rate_last=rates[-1])


def reference_point(variant: str, config, corpus) -> dict:
  from loco_jax.apps import demo
  result = demo.run_method(variant, common.make_variant(variant, config), config, corpus)
  return common.result_record(result, config, variant=variant,
                              rate=result.gradient_bits_per_param)


def report(records: list[dict]) -> str:
  ref = {r["seed"]: r["eval_loss"] for r in records if r["variant"] == "none"}
  lines = ["| point | rate, bits/param | wire (HLO) bits/param | eval loss | vs none, % |",
           "|---|---|---|---|---|"]
  for r in sorted(records, key=lambda r: r["rate"]):
    rel = (f"{100 * (r['eval_loss'] / ref[r['seed']] - 1):+.2f}"
           if r["seed"] in ref and r["eval_loss"] is not None else "n/a")
    lines.append(f"| {r['variant']} (seed {r['seed']}) | {r['rate']:.2f} | "
                 f"{r['wire_bits_per_param']:.2f} | {r['eval_loss'] or float('nan'):.4f} | {rel} |")
  return "\n".join(lines) + "\n"


def plot(records: list[dict], path: Path) -> None:
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return
  fig, ax = plt.subplots(figsize=(6, 4), dpi=110)
  for family, marker in (("noef", "s"), ("loco", "o"), ("co3", "^")):
    pts = sorted((r["rate"], r["eval_loss"]) for r in records
                 if r["variant"].startswith(family) and r["eval_loss"] is not None)
    if pts:
      ax.plot(*zip(*pts), marker=marker, label=family)
  for r in records:
    if r["variant"] == "none":
      ax.axhline(r["eval_loss"], color="k", ls="--", lw=0.8, label="none (32 bits)")
      break
  ax.set_xlabel("gradient rate, bits / parameter"); ax.set_ylabel("eval loss")
  ax.grid(alpha=0.3); ax.legend(fontsize=8); fig.tight_layout(); fig.savefig(path)
  plt.close(fig)


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--steps", type=int, default=400)
  p.add_argument("--d-model", type=int, default=96)
  p.add_argument("--layers", type=int, default=2)
  p.add_argument("--seeds", default="0")
  p.add_argument("--devices", type=int, default=8)
  p.add_argument("--platform", default="cpu")
  p.add_argument("--references", default=",".join(REFERENCES))
  p.add_argument("--out", default="runs/co3_rate")
  args = p.parse_args(argv)
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  common.setup(args.devices, args.platform, cache_dir=str(out / "xla-cache"))
  from loco_jax.apps import demo
  base = demo.DemoConfig(steps=args.steps, d_model=args.d_model, d_ff=4 * args.d_model,
                         n_layers=args.layers, devices=args.devices)
  path = out / "runs.jsonl"
  done = {(r["variant"], r["seed"]) for r in common.read_jsonl(path)}
  have_co3 = common.co3_available()
  if not have_co3:
    print(f"CO3 points skipped: {demo.co3_status()}", file=sys.stderr)
  for seed in [int(s) for s in args.seeds.split(",")]:
    config = dataclasses.replace(base, seed=seed)
    corpus = demo.load_corpus(config)
    jobs = [(v, lambda v=v: reference_point(v, config, corpus))
            for v in args.references.split(",") if v]
    if have_co3:
      jobs += [(f"co3-{f}-g{g:g}", lambda f=f, g=g: co3_point(f, g, config, corpus))
               for f, g in CO3_POINTS]
    for name, job in jobs:
      if (name, seed) in done:
        continue
      record = job()
      record["seed"] = seed
      common.append_jsonl(path, record)
      print(f"{name:<14} seed {seed}: rate {record['rate']:.2f} eval {record['eval_loss']}",
            file=sys.stderr, flush=True)
  records = common.read_jsonl(path)
  text = f"{common.describe(base)}\n\n" + report(records)
  common.write_text_atomic(out / "co3_rate.md", text)
  plot(records, out / "co3_rate.png")
  print(text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
