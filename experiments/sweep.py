"""Sensitivity of the demo's ordering: learning rate, bits, LoCo's beta, error precision, seeds.

  python experiments/sweep.py --groups lr,bits,beta,error --seeds 0,1,2 --out runs/sweep
  python experiments/sweep.py --report --out runs/sweep      # the markdown tables only

Every run is the demo's training (loco_jax.apps.demo.run_method) with one change; results append to
<out>/runs.jsonl as they finish (a rerun skips what is there) and <out>/sweep.md holds, per
group, each variant's final train and eval loss relative to `none` at the same seed and
learning rate (mean ± std over seeds, in %), and how many seeds diverged.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import numpy as np

import common

# group -> [(config overrides, variants)]; `none` at the same overrides is the reference.
# At 2 and 3 bits these groups study the paper's recipe (absmax blocks of 2048): `-paper`, what
# loco2 and loco3 meant before loco's low-bit defaults (experiments/lowbit.py compares both).
GROUPS = {
    "defaults": [({}, ["none", "noef4", "ef4", "loco4"])],
    "lr": [({"lr": lr}, ["none", "noef4", "ef4", "loco4"]) for lr in (1e-3, 2e-3, 4e-3)],
    "bits": [({}, ["none"] + [f"{v}{b}" for b in (2, 3, 4) for v in ("noef", "ef", "loco")
                              ] + ["loco2-paper", "loco3-paper"])],
    "beta": [({}, ["none", "loco4-b0", "loco4-b0.5", "loco4", "loco4-b0.9", "loco2-paper-b0",
                   "loco2-paper"])],
    "error": [({}, ["none", "ef4", "loco4-b0", "loco4-efp32", "loco4", "loco4-e4", "ef2",
                    "loco2-paper-b0", "loco2-paper-efp32", "loco2-paper"])],
    "steps": [({"steps": s}, ["none", "noef4", "ef4", "loco4"]) for s in (200, 400, 800)],
}


def _changes(overrides: dict, base) -> dict:
  """The overrides that change `base` (lr 2e-3 on a 2e-3 base is the base run)."""
  return {k: v for k, v in overrides.items() if getattr(base, k) != v}


def _key(variant: str, overrides: dict, seed: int) -> str:
  return f"{variant}|{sorted(overrides.items())}|{seed}"


def same_base(record: dict, base) -> bool:
  """Whether a record was run from `base` (up to its seed and its group's overrides)."""
  want = dataclasses.asdict(base)
  got = {**record["config"], **{k: want[k] for k in record["overrides"]}, "seed": want["seed"]}
  return got == want


def run(groups: list[str], seeds: list[int], base, out: Path) -> None:
  from loco_jax.apps import demo
  path = out / "runs.jsonl"
  records = common.read_jsonl(path)
  if any(not same_base(r, base) for r in records):
    raise SystemExit(f"{path} holds runs of another base config; use another --out")
  done = {r["key"] for r in records}
  todo = []
  for group in groups:
    for overrides, variants in GROUPS[group]:
      overrides = _changes(overrides, base)
      for seed in seeds:
        for variant in variants:
          key = _key(variant, overrides, seed)
          if key not in done and key not in {t[0] for t in todo}:
            todo.append((key, variant, overrides, seed))
  print(f"sweep: {len(todo)} runs to do ({len(done)} done) in {path}", file=sys.stderr)
  corpora = {}
  for i, (key, variant, overrides, seed) in enumerate(todo):
    config = dataclasses.replace(base, seed=seed, **overrides)
    corpus_key = (seed, config.steps)
    if corpus_key not in corpora:
      corpora = {corpus_key: demo.load_corpus(config)}
    start = time.perf_counter()
    result = demo.run_method(variant, common.make_variant(variant, config), config,
                             corpora[corpus_key])
    record = common.result_record(result, config, key=key, variant=variant, seed=seed,
                                  overrides=overrides)
    common.append_jsonl(path, record)
    print(f"[{i + 1}/{len(todo)}] {variant:<14} {overrides} seed {seed}: train "
          f"{result.final_loss:.4f} eval {result.eval_loss:.4f} "
          f"({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)


def report(records: list[dict], groups: list[str], base) -> str:
  """Markdown tables: loss change against `none` (same seed, same overrides) per variant."""
  by_key = {r["key"]: r for r in records}
  lines = []
  for group in groups:
    lines += [f"### {group}", "",
              "| variant | setting | seeds | train loss vs none, % | eval loss vs none, % | "
              "diverged | wire bits |", "|---|---|---|---|---|---|---|"]
    for overrides, variants in GROUPS[group]:
      shown = overrides
      overrides = _changes(overrides, base)
      for variant in variants:
        if variant == "none":
          continue
        train, held_out, diverged, seeds, wire = [], [], 0, 0, None
        for seed in sorted({r["seed"] for r in records}):
          r = by_key.get(_key(variant, overrides, seed))
          ref = by_key.get(_key("none", overrides, seed))
          if r is None or ref is None:
            continue
          seeds += 1
          wire = r["wire_bits_per_param"]
          if r["diverged"]:
            diverged += 1
            continue
          train.append(100 * (r["final_loss"] / ref["final_loss"] - 1))
          held_out.append(100 * (r["eval_loss"] / ref["eval_loss"] - 1))
        if seeds:
          setting = ", ".join(f"{k} {v:g}" for k, v in shown.items()) or "default"
          lines.append(f"| {variant} | {setting} | {seeds} | {common.mean_std(train)} | "
                       f"{common.mean_std(held_out)} | {diverged} | {wire:.2f} |")
    lines.append("")
  refs = [r for r in records if r["variant"] == "none"]
  if refs:
    losses = [r["eval_loss"] for r in refs if not r["overrides"]]
    if len(losses) > 1:
      lines.append(f"Reference (`none`, default setting) eval loss over {len(losses)} seeds: "
                   f"{np.mean(losses):.4f} ± {np.std(losses, ddof=1):.4f} "
                   f"({100 * np.std(losses, ddof=1) / np.mean(losses):.2f}% seed noise).")
  return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--groups", default="lr,bits,beta,error", help=f"of {','.join(GROUPS)}")
  p.add_argument("--seeds", default="0,1,2")
  p.add_argument("--steps", type=int, default=None)
  p.add_argument("--d-model", type=int, default=None)
  p.add_argument("--layers", type=int, default=None)
  p.add_argument("--batch", type=int, default=None, help="sequences per device")
  p.add_argument("--lr", type=float, default=None)
  p.add_argument("--devices", type=int, default=8)
  p.add_argument("--platform", default="cpu")
  p.add_argument("--out", default="runs/sweep")
  p.add_argument("--report", action="store_true", help="only rewrite <out>/sweep.md")
  args = p.parse_args(argv)
  groups = args.groups.split(",")
  unknown = [g for g in groups if g not in GROUPS]
  if unknown:
    p.error(f"unknown group(s) {unknown}; accepted: {','.join(GROUPS)}")
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  from loco_jax.apps import demo
  changes = {k: v for k, v in (("steps", args.steps), ("d_model", args.d_model),
                               ("n_layers", args.layers), ("batch_per_device", args.batch),
                               ("lr", args.lr)) if v is not None}
  if "d_model" in changes:
    changes["d_ff"] = 4 * changes["d_model"]
  base = dataclasses.replace(demo.DemoConfig(devices=args.devices), **changes)
  if not args.report:
    common.setup(args.devices, args.platform, cache_dir=str(out / "xla-cache"))
    print(f"sweep base: {common.describe(base)}", file=sys.stderr)
    run(groups, [int(s) for s in args.seeds.split(",")], base, out)
  records = [r for r in common.read_jsonl(out / "runs.jsonl") if same_base(r, base)]
  text = f"Base: {common.describe(base)}.\n\n" + report(records, groups, base)
  common.write_text_atomic(out / "sweep.md", text)
  print(text)
  return 0

if __name__ == "__main__":
  sys.exit(main())
