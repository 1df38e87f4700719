"""Low-bit LoCo (issue 15): prototype compressors at 2 and 3 bits, and the sweeps that chose
the library's defaults by bit width.

  python experiments/lowbit.py explore --variants none,p2-mid-rms1.5-B256-b0-e32 --seeds 0
  python experiments/lowbit.py explore --report --out runs/lowbit-explore

A prototype variant is named p<bits>-<grid>-<scale>-B<block>-b<beta>-e<error bits>:
  grid   int: today's signed integers {-2**(p-1) .. 2**(p-1) - 1} (value q / s);
         mid: all 2**p levels, midrise {-1.5, -0.5, 0.5, 1.5} at 2 bits (value (q + 0.5) / s)
  scale  absmax: top level at the block's max |h| (today);
         rms<c>: top level at c x the block's rms, values beyond clipped (fed back as error);
         mse: per block the least squared error of c x rms for c in MSE_CLIPS, or absmax
  B      block size; b: beta (0 is classic EF's update); e: 8 = int8 error with absmax block
         scales (LoCo's storage), 32 = float32 error.
The prototype compresses each device's gradient locally in plain jnp, averages the decompressed
values with a float32 pmean rounded to bfloat16 (what the library's all-to-all mean and bf16
gather give, up to the order of the sum) and never resets the error (400 steps < 1024).
Any other name (none, ef2, loco3, ...) is experiments/common.py's variant.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

import common

MSE_CLIPS = (1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0)
_PROTO = re.compile(r"p(\d)-(int|mid)-(absmax|mse|rms[\d.]+)-B(\d+)-b([\d.]+)-e(8|32)$")


class Proto(NamedTuple):
  bits: int
  grid: str
  scale: str
  clip: float | None
  block_size: int
  beta: float
  error_bits: int

  @property
  def payload_bits(self) -> float:
    """Codes plus one float32 scale per block, bits per parameter (near-equal blocks)."""
    return self.bits + 32 / self.block_size


def parse(name: str) -> Proto | None:
  m = _PROTO.fullmatch(name)
  if not m:
    return None
  scale = m[3]
  clip = float(scale[3:]) if scale.startswith("rms") else None
  return Proto(int(m[1]), m[2], "rms" if clip else scale, clip, int(m[4]), float(m[5]),
               int(m[6]))


# --- The prototype's arithmetic (plain jnp) ---------------------------------------------------

def top_level(bits: int, grid: str) -> float:
  """The largest level's magnitude in steps: qmax for the integer grid, 2**(p-1) - 1/2 midrise."""
  return float(max(2 ** (bits - 1) - 1, 1)) if grid == "int" else 2 ** (bits - 1) - 0.5


def qdq(x, s, bits: int, grid: str):
  """Quantize-dequantize x [B, L] with scales s [B, 1] (0: the block decodes to 0)."""
  import jax.numpy as jnp
  qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
  safe = jnp.where(s > 0, s, 1.0)
  if grid == "int":
    v = jnp.clip(jnp.round(s * x), qmin, qmax)
  else:
    v = jnp.clip(jnp.floor(s * x), qmin, qmax) + 0.5
  return jnp.where(s > 0, v / safe, 0.0)


def choose_scale(x, p: Proto):
  """[B, 1] scales: the top level at the clip range r (absmax, c x rms, or the least-MSE one)."""
  import jax.numpy as jnp
  top = top_level(p.bits, p.grid)
  absmax = jnp.max(jnp.abs(x), axis=1, keepdims=True)
  rms = jnp.sqrt(jnp.mean(x * x, axis=1, keepdims=True))
  to_scale = lambda r: jnp.where(r > 1e-30, top / jnp.where(r > 1e-30, r, 1.0), 0.0)
  if p.scale == "absmax":
    return to_scale(absmax)
  if p.scale == "rms":
    return to_scale(p.clip * rms)
  ranges = [absmax] + [c * rms for c in MSE_CLIPS]
  errs = jnp.stack([jnp.sum((x - qdq(x, to_scale(r), p.bits, p.grid)) ** 2, axis=1,
                            keepdims=True) for r in ranges])
  best = jnp.argmin(errs, axis=0)
  return to_scale(jnp.take_along_axis(jnp.stack(ranges), best[None], axis=0)[0])


class ProtoState(NamedTuple):
  error: Any          # float32 (e32) or int8 (e8) [blocks, block_len] per leaf
  error_scale: Any    # float32 [blocks, 1] per leaf (e8), else size-0



def _layout(size: int, block_size: int) -> tuple[int, int]:
  blocks = max(1, math.ceil(size / block_size))
  return blocks, 8 * math.ceil(size / blocks / 8)


def proto_compressor(p: Proto, axis_name: str | None = "data"):
  import jax
  import jax.numpy as jnp
  import optax
  from loco_jax.transforms.specs import register_per_device

  register_per_device(ProtoState, ("error", "error_scale"))

  def init_fn(params):
    def error(x):
      b, l = _layout(x.size, p.block_size)
      return jnp.zeros((b, l), jnp.float32 if p.error_bits == 32 else jnp.int8)

    def scale(x):
      b, _ = _layout(x.size, p.block_size)
      return jnp.zeros((b, 1) if p.error_bits == 8 else (0,), jnp.float32)

    return ProtoState(jax.tree.map(error, params), jax.tree.map(scale, params))

  def leaf(g, err, err_s):
    b, l = _layout(g.size, p.block_size)
    g_BxL = jnp.pad(g.reshape(-1).astype(jnp.float32), (0, b * l - g.size)).reshape(b, l)
    if p.error_bits == 8:
      e = jnp.where(err_s > 0, err.astype(jnp.float32) / jnp.where(err_s > 0, err_s, 1.0), 0.0)
    else:
      e = err
    h = g_BxL + e
    d = qdq(h, choose_scale(h, p), p.bits, p.grid)
    r = p.beta * e + (1 - p.beta) * (h - d)
    if p.error_bits == 8:
      amax = jnp.max(jnp.abs(r), axis=1, keepdims=True)
      s_e = jnp.where(amax > 1e-30, 127.0 / jnp.where(amax > 1e-30, amax, 1.0), 0.0)
      new_err, new_s = jnp.clip(jnp.round(r * s_e), -128, 127).astype(jnp.int8), s_e
    else:
      new_err, new_s = r, err_s
    mean = d if axis_name is None else jax.lax.pmean(d, axis_name)
    out = mean.astype(jnp.bfloat16).astype(jnp.float32).reshape(-1)[: g.size]
    return out.reshape(g.shape).astype(g.dtype), new_err, new_s

  def update_fn(updates, state, params=None):
    del params
    leaves, treedef = jax.tree.flatten(updates)
    outs = [leaf(g, e, s) for g, e, s in zip(leaves, treedef.flatten_up_to(state.error),
                                            treedef.flatten_up_to(state.error_scale))]
    out, err, err_s = zip(*outs)
    return treedef.unflatten(out), ProtoState(treedef.unflatten(err), treedef.unflatten(err_s))

  return optax.GradientTransformation(init_fn, update_fn)


def make(name: str, config, axis_name: str = "data"):
  p = parse(name)
  if p is None:
    return common.make_variant(name, config, axis_name)
  return proto_compressor(p, axis_name)


# --- Driver -----------------------------------------------------------------------------------

# The decision sweep: (overrides of the demo's config, variants, seeds), run in this order so
# that a sweep cut short has whole seeds of the most important cells (runs already in
# runs.jsonl are skipped by key, so a second pass only adds). Pruned to fit the time the shared
# 2-core machine gave (a demo run took 1-8 minutes beside other work, a larger-model run 2-16):
# 4 and 8 bits on the demo model at lr 2e-3 only, the larger model at 2 and 3 bits only.
LARGE = {"d_model": 128, "d_ff": 512, "n_layers": 4}
CORE = ["none", "loco2", "ef2", "loco3", "ef3"]
EXTRA = ["loco2-paper", "loco3-paper", "loco8", "ef8"]
DECIDE = {
    "demo": [({"lr": 2e-3}, CORE, (0, 1, 2)), ({"lr": 1e-3}, CORE, (0,)),
             ({"lr": 2e-3}, EXTRA, (0,)), ({"lr": 1e-3}, CORE, (1, 2)),
             ({"lr": 2e-3}, ["loco4", "ef4", "loco4-rms4-B256"], (0,)),
             ({"lr": 2e-3}, EXTRA + ["loco4", "ef4", "loco4-rms4-B256"], (1, 2)),
             ({"lr": 1e-3}, ["loco2-paper", "loco3-paper"], (0, 1, 2))],
    "large": [({**LARGE, "lr": 2e-3}, CORE + ["loco2-paper"], (0,)),
              ({**LARGE, "lr": 2e-3}, CORE + ["loco2-paper"], (1,)),
              ({**LARGE, "lr": 1e-3}, CORE, (0, 1, 2)),
              ({**LARGE, "lr": 1e-3}, ["loco2-paper", "loco3-paper"], (0, 1, 2)),
              ({**LARGE, "lr": 2e-3}, ["loco3-paper"], (0, 1, 2)),
              ({**LARGE, "lr": 2e-3}, ["loco2-paper"], (2,))],
}

def _key(variant: str, overrides: dict, seed: int) -> str:
  return f"{variant}|{sorted(overrides.items())}|{seed}"


def _settings(variant: str) -> dict | None:
  """loco's resolved defaults for a demo loco<b> name (recorded with each run)."""
  from loco_jax.transforms import settings
  m = re.fullmatch(r"loco(\d)", variant)
  return settings.defaults_for(int(m[1])) if m else None


def run(variants: list[str], seeds: list[int], overrides: dict, base, out: Path) -> None:
  from loco_jax.apps import demo
  path = out / "runs.jsonl"
  done = {r["key"] for r in common.read_jsonl(path)}
  todo = [(s, v) for s in seeds for v in variants if _key(v, overrides, s) not in done]
  print(f"lowbit: {len(todo)} runs to do in {path}", file=sys.stderr)
  corpus, corpus_seed = None, None
  for i, (seed, variant) in enumerate(todo):
    config = dataclasses.replace(base, seed=seed, **overrides)
    if corpus_seed != seed:
      corpus, corpus_seed = demo.load_corpus(config), seed
    start = time.perf_counter()
    result = demo.run_method(variant, make(variant, config), config, corpus)
    p = parse(variant)
    record = common.result_record(result, config, key=_key(variant, overrides, seed),
                                  variant=variant, seed=seed, overrides=overrides,
                                  payload_bits=p.payload_bits if p else None,
                                  settings=_settings(variant))
    common.append_jsonl(path, record)
    print(f"[{i + 1}/{len(todo)}] {variant:<28} {overrides} seed {seed}: train "
          f"{result.final_loss:.4f} eval {result.eval_loss:.4f} "
          f"({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)


def report(records: list[dict]) -> str:
  """Markdown: eval loss vs `none` at the same seed and overrides, per variant and setting."""
  ref = {(r["seed"], str(sorted(r["overrides"].items()))): r for r in records
         if r["variant"] == "none"}
  rows: dict[tuple[str, str], list[float]] = {}
  for r in records:
    k = (r["seed"], str(sorted(r["overrides"].items())))
    if r["variant"] == "none" or k not in ref or r["diverged"]:
      continue
    rel = 100 * (r["eval_loss"] / ref[k]["eval_loss"] - 1)
    rows.setdefault((r["variant"], k[1]), []).append(rel)
  lines = ["| variant | setting | seeds | eval loss vs none, % |", "|---|---|---|---|"]
  for (variant, setting), rel in rows.items():
    lines.append(f"| {variant} | {setting} | {len(rel)} | {common.mean_std(rel)} |")
  return "\n".join(lines) + "\n"


def _setting(overrides: dict) -> str:
  model = "d_model 128, 4 layers" if overrides.get("d_model") == 128 else "demo model"
  return f"{model}, lr {overrides.get('lr', 2e-3):g}"


def _relative(records: list[dict]) -> dict[tuple[str, str], list[dict]]:
  """(variant, setting) -> that variant's runs, each with `rel`: eval loss vs `none` of the
  same seed and setting, in % (runs without their `none` are left out; one run per key)."""
  records = list({r["key"]: r for r in records}.values())
  key = lambda r: (r["seed"], _setting(r["overrides"]))
  ref = {key(r): r for r in records if r["variant"] == "none"}
  out: dict[tuple[str, str], list[dict]] = {}
  for r in records:
    if key(r) in ref:
      rel = None if r["diverged"] else 100 * (r["eval_loss"] / ref[key(r)]["eval_loss"] - 1)
      out.setdefault((r["variant"], _setting(r["overrides"])), []).append({**r, "rel": rel})
  return out


def decision_report(records: list[dict]) -> str:
  """Markdown: per setting and variant, seeds, gradient bits (codes + scales, from the HLO),
  bits sent in all, eval loss vs `none` (mean ± std over seeds) and the seeds' eval losses."""
  groups = _relative(records)
  lines = ["| setting | variant | seeds | gradient bits/param | sent bits/param | "
           "eval vs none, % | eval loss per seed |", "|---|---|---|---|---|---|---|"]
  for (variant, setting), runs in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0])):
    runs = sorted(runs, key=lambda r: r["seed"])
    lines.append(
        f"| {setting} | {variant} | {len(runs)} | {runs[0]['gradient_bits_per_param']:.3f} | "
        f"{runs[0]['wire_bits_per_param']:.2f} | {common.mean_std([r['rel'] for r in runs])} | "
        + ", ".join(f"{r['eval_loss']:.4f}" for r in runs) + " |")
  return "\n".join(lines) + "\n"


FAMILIES = {  # the plot's lines: label -> variant at 2, 3, 4 and 8 bits
    "LoCo, defaults by width (loco<b>)": {2: "loco2", 3: "loco3", 4: "loco4", 8: "loco8"},
    "LoCo, paper's recipe (absmax, 2048)": {2: "loco2-paper", 3: "loco3-paper", 4: "loco4",
                                            8: "loco8"},
    "classic EF (absmax, 2048, fp32 error)": {2: "ef2", 3: "ef3", 4: "ef4", 8: "ef8"},
    "LoCo 4 bits, rms x4 blocks of 256": {4: "loco4-rms4-B256"},
}


def plot(records: list[dict], path: Path, setting: str = "demo model, lr 0.002") -> bool:
  """Eval loss vs `none` (%) against gradient bits per parameter, mean and the seeds' range."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return False
  groups = _relative(records)
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for (label, members), marker in zip(FAMILIES.items(), "osD^"):
    xs, ys, lo, hi = [], [], [], []
    for _, variant in sorted(members.items()):
      rel = [r["rel"] for r in groups.get((variant, setting), []) if r["rel"] is not None]
      if not rel:
        continue
      xs.append(groups[(variant, setting)][0]["gradient_bits_per_param"])
      ys.append(np.mean(rel))
      lo.append(np.mean(rel) - min(rel))
      hi.append(max(rel) - np.mean(rel))
    if xs:
      ax.errorbar(xs, ys, yerr=[lo, hi], marker=marker, capsize=3, label=label)
  ax.axhline(0.0, color="k", lw=0.8, label="none (float32 all-reduce, 32 bits)")
  ax.set_xscale("log", base=2)
  ax.set_xticks([2, 3, 4, 8])
  ax.set_xticklabels(["2", "3", "4", "8"])
  ax.set_xlabel("gradient bits per parameter on the wire (codes + block scales, from the HLO)")
  ax.set_ylabel("eval loss vs none, % (mean; bars: seeds' range)")
  ax.set_title(f"Low-bit LoCo: {setting}, 400 steps")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  return True


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("mode", choices=["explore", "decide"])
  ap.add_argument("--part", default="demo", help=f"decide: one of {','.join(DECIDE)}")
  ap.add_argument("--variants", default="none")
  ap.add_argument("--seeds", default="0")
  ap.add_argument("--steps", type=int, default=400)
  ap.add_argument("--lr", type=float, default=None)
  ap.add_argument("--d-model", type=int, default=None)
  ap.add_argument("--layers", type=int, default=None)
  ap.add_argument("--out", default="runs/lowbit-explore")
  ap.add_argument("--report", action="store_true")
  ap.add_argument("--plot", default=None, help="decide: write the plot here (a .png)")
  args = ap.parse_args(argv)
  out = Path(args.out)
  if not args.report:
    common.setup(8, "cpu", cache_dir=str(out / "xla-cache"))
    from loco_jax.apps import demo
    overrides = {k: v for k, v in (("lr", args.lr), ("d_model", args.d_model),
                                   ("n_layers", args.layers)) if v is not None}
    if "d_model" in overrides:
      overrides["d_ff"] = 4 * overrides["d_model"]
    base = demo.DemoConfig(steps=args.steps)
    if args.mode == "decide":
      for overrides, variants, seeds in DECIDE[args.part]:
        run(variants, list(seeds), overrides, base, out)
    else:
      run(args.variants.split(","), [int(s) for s in args.seeds.split(",")], overrides, base,
          out)
  records = common.read_jsonl(out / "runs.jsonl")
  text = decision_report(records) if args.mode == "decide" else report(records)
  print(text)
  if args.mode == "decide" and args.plot:
    print(f"plot: {args.plot}" if plot(records, Path(args.plot)) else "no plot: no matplotlib")
  return 0


if __name__ == "__main__":
  sys.exit(main())
