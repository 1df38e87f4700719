"""Why co3-fp4 with the coded gather trains worse than with the bf16 gather: the demo's run with
variants of the exchange, and what the conversion loses.

  python experiments/co3_gather_gap.py --variants bf16,coded,bf16-agreed --seeds 0,1

Every variant is the demo's co3-fp4 (8 simulated devices, adamw, gamma 0.7 or --gammas):
- bf16: the bf16 gather, each device at its own scales (the reference);
- coded: the library's coded gather (the exact sums of the levels; the devices' scales agreed,
  `co3_exchange.agree_scales`: the largest, at most 4x the smallest);
- bf16-agreed: the bf16 gather with the scales agreed as the coded gather agrees them;
- coded-<rule>: the coded gather with the scales agreed otherwise (min: the smallest, the
  library's rule before 2026-12-05; geomean: the geometric mean; max: the largest, unbounded);
- bf16-pow2: the bf16 gather at scales a finer exact sum could use (`POW2_OCTAVES` below).
The script wraps co3's functions for the run (a hook of this experiment, not an option of the
library). The variants of the gather that converted the averaged shard to fp4 again (the
shard's gamma, its refit) ran with this script at commit 338554f, against that library.

Per step it records the conversion's relative error ||Q(a) - a|| / ||a|| and the fraction of
non-zero values of a that round to 0 (fp4's dead zone), averaged over devices and steps.
Prints one JSON record per (variant, seed).
"""

import argparse
import collections
import importlib
import json
from pathlib import Path
import sys
import threading

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled


def _stats(fmt, compensated, symbols, scales):
  """float32 [2]: ||Q(a) - a||^2 and ||a||^2 summed over leaves, and [2]: dead, non-zero."""
  import jax.numpy as jnp
  from loco_jax.codecs import fp
  err = sum(jnp.sum((fp.decode(q, fmt, s) - a) ** 2) for a, q, s in zip(compensated, symbols,
                                                                         scales))
  norm = sum(jnp.sum(a ** 2) for a in compensated)
  dead = sum(jnp.sum((a != 0) & (fp.decode(q, fmt, s) == 0)) for a, q, s in
             zip(compensated, symbols, scales))
  nonzero = sum(jnp.sum(a != 0) for a in compensated)
  return jnp.stack([err, norm, dead.astype(jnp.float32), nonzero.astype(jnp.float32)])


class Recorder:
  """Host side: per conversion, the sums of `_stats` over the devices' calls."""

  def __init__(self):
    self.lock = threading.Lock()
    self.sums = collections.defaultdict(list)

  def hook(self, stage):
    import numpy as np

    def record(stats):
      with self.lock:
        self.sums[stage].append(np.asarray(stats, np.float64).copy())
      return np.float32(0)
    return record

  def summary(self):
    import numpy as np
    out = {}
    for stage, rows in sorted(self.sums.items()):
      rows = np.array(rows)
      out[f"stage{stage}_rel_err"] = round(float(np.mean(np.sqrt(rows[:, 0] / rows[:, 1]))), 4)
      out[f"stage{stage}_dead_frac"] = round(float(np.mean(rows[:, 2] / rows[:, 3])), 4)
    return out


def _observed(recorder, stage, stats, like):
  """`like` plus 0 x the host's receipt of `stats` (so the call is not dropped)."""
  import jax
  import jax.numpy as jnp
  from loco_jax.comm import coded
  from loco_jax.core import leaves
  receipt = coded.host_call(recorder.hook(stage), jax.ShapeDtypeStruct((), jnp.float32), stats)
  return like + 0 * leaves.vary_like(receipt, like)


def install(recorder, agree_rule):
  """Wraps co3's conversion to record its losses; sets how (and whether) scales are agreed."""
  import jax
  import jax.numpy as jnp
  co3_module = importlib.import_module("loco_jax.transforms.co3")
  from loco_jax.transforms import co3_exchange
  convert = co3_module.convert

  def recorded_convert(settings, grads, errors, scales, refit, agree=False):
    out = convert(settings, grads, errors, scales, refit, agree)
    stats = _stats(settings.fmt, out.compensated, out.symbols, out.scales)
    return out._replace(scales=_observed(recorder, 1, stats, out.scales))

  co3_module.convert = recorded_convert
  if agree_rule == "always":  # the bf16 gather too
    co3_exchange.sums_levels = lambda settings, n: n > 1
  elif agree_rule == "geomean":
    co3_exchange.agree_scales = lambda settings, scales: jnp.exp(
        jax.lax.pmean(jnp.log(scales), settings.axis_name))
  elif agree_rule == "pow2":  # the bf16 gather, as a sum of levels in a finer unit would be
    co3_exchange.sums_levels = lambda settings, n: n > 1

    def finer(settings, scales):
      smallest = jax.lax.pmin(scales, settings.axis_name)
      octaves = jnp.clip(jnp.floor(jnp.log2(scales / smallest)), 0, POW2_OCTAVES)
      return smallest * 2.0 ** octaves
    co3_exchange.agree_scales = finer
  elif agree_rule == "max":
    co3_exchange.agree_scales = lambda settings, scales: jax.lax.pmax(scales,
                                                                      settings.axis_name)
  elif agree_rule == "min":  # the library's rule until 2026-12-05
    co3_exchange.agree_scales = lambda settings, scales: jax.lax.pmin(scales,
                                                                      settings.axis_name)


VARIANTS = {  # name -> (gather, how scales are agreed: None as the library does)
    "bf16": ("bf16", None),
    "coded": ("coded", None),
    "bf16-agreed": ("bf16", "always"),
    "coded-geomean": ("coded", "geomean"),
    "coded-max": ("coded", "max"),
    "coded-min": ("coded", "min"),
    "bf16-pow2": ("bf16", "pow2"),
}
# bf16-pow2: each device at the smallest scale times 2**k, k = floor(log2(own / smallest)) in
# [0, POW2_OCTAVES]: no device saturates more than at its own scale (as with the smallest), the
# smaller gradients keep up to 2**POW2_OCTAVES finer levels, and the levels still add exactly
# in units of the finest one (n * 6 * 2**POW2_OCTAVES + 1 values: a byte up to n = 10 at 1).
POW2_OCTAVES = 1


def run(variant: str, seed: int, steps: int, gamma: float = 0.7) -> dict:
  from loco_jax.apps import demo
  from loco_jax.transforms.co3 import co3
  gather, agree_rule = VARIANTS[variant]
  recorder = Recorder()
  install(recorder, agree_rule)
  config = demo.DemoConfig(steps=steps, seed=seed)
  name = "co3-fp4" if gather == "bf16" else "co3-fp4-coded"
  result = demo.run_method(name, co3("fp4", gamma=gamma, axis_name=demo.AXIS, gather=gather),
                           config, demo.load_corpus(config))
  return {"variant": variant, "seed": seed, "steps": steps, "gamma": gamma,
          "eval_loss": round(result.eval_loss, 4), "final_loss": round(result.final_loss, 4),
          "wire_bits": result.wire_bits_per_param, "coded_bits": result.co3["coded_bits"],
          "overflow_steps": result.co3["overflow_steps"], **recorder.summary()}


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--variants", default="bf16,coded,bf16-agreed")
  p.add_argument("--seeds", default="0")
  p.add_argument("--steps", type=int, default=300)
  p.add_argument("--gammas", default="0.7", help="co3's gamma, one run each")
  args = p.parse_args(argv)
  variants = args.variants.split(",")
  unknown = [v for v in variants if v not in VARIANTS]
  if unknown:
    p.error(f"unknown variants {unknown}; accepted: {', '.join(VARIANTS)}")
  from loco_jax.apps import demo
  demo.setup_devices(demo.DemoConfig().devices)
  from loco_jax.transforms import co3_exchange
  co3_module = importlib.import_module("loco_jax.transforms.co3")
  originals = co3_module.convert, co3_exchange.sums_levels, co3_exchange.agree_scales
  for seed in [int(s) for s in args.seeds.split(",")]:
    for variant in variants:
      for gamma in [float(g) for g in args.gammas.split(",")]:
        print(json.dumps(run(variant, seed, args.steps, gamma)), flush=True)
        co3_module.convert, co3_exchange.sums_levels, co3_exchange.agree_scales = originals


if __name__ == "__main__":
  main()
