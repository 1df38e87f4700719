"""Why co3-fp4 with the coded gather trains worse than with the bf16 gather: the demo's run with
variants of the averaged shard's second conversion, and what each conversion loses.

  python experiments/co3_gather_gap.py --variants base,shard-ef1 --seeds 0,1 [--steps 300]

Every variant is the demo's co3-fp4 (8 simulated devices, adamw, gamma 0.7) with the coded
gather, except:
- bf16: the bf16 gather (no second conversion), the reference;
- base: the library's coded gather as it is;
- shard-ef<g>: the shard's error fed back with gamma g (e.g. shard-ef1: classic error feedback);
- shard-refit: the shard's scale refitted every step (gamma as the library's);
- shard-ef1-refit: both;
- ef1: gamma 1 in both conversions.
The script wraps co3's two conversion functions for the run (a hook of this experiment, not an
option of the library).

Per step and conversion (1: each device's gradient, 2: the averaged shard), it records the
relative error ||Q(a) - a|| / ||a|| and the fraction of non-zero values of a that round to 0
(fp4's dead zone, |a| below a quarter of the smallest level), averaged over devices and steps.
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


def install(recorder, shard_gamma, shard_refit):
  """Wraps co3's two conversions to record their losses; sets the shard's gamma and refit."""
  import jax.numpy as jnp
  co3_module = importlib.import_module("loco_jax.transforms.co3")
  from loco_jax.transforms import co3_exchange
  convert, coded_shard = co3_module.convert, co3_exchange._coded_shard

  def recorded_convert(settings, grads, errors, scales, refit):
    out = convert(settings, grads, errors, scales, refit)
    stats = _stats(settings.fmt, out.compensated, out.symbols, out.scales)
    return out._replace(scales=_observed(recorder, 1, stats, out.scales))

  def recorded_shard(settings, shards, shard, refit):
    if shard_gamma is not None:
      settings = settings._replace(gamma=shard_gamma)
    if shard_refit:
      refit = jnp.bool_(True)
    symbols, scales, new = coded_shard(settings, shards, shard, refit)
    compensated = [e + co3_exchange.fp.decode(q, settings.fmt, s)
                   for e, q, s in zip(new.errors, symbols, scales)]
    stats = _stats(settings.fmt, compensated, symbols, scales)
    return symbols, _observed(recorder, 2, stats, scales), new

  co3_module.convert = recorded_convert
  co3_exchange._coded_shard = recorded_shard


VARIANTS = {  # name -> (gather, first gamma, shard gamma, shard refit every step)
    "bf16": ("bf16", 0.7, None, False),
    "base": ("coded", 0.7, None, False),
    "shard-ef1": ("coded", 0.7, 1.0, False),
    "shard-ef0.9": ("coded", 0.7, 0.9, False),
    "shard-ef0": ("coded", 0.7, 0.0, False),
    "shard-refit": ("coded", 0.7, None, True),
    "shard-ef1-refit": ("coded", 0.7, 1.0, True),
    "ef1": ("coded", 1.0, 1.0, False),
    "ef1-bf16": ("bf16", 1.0, None, False),
}


def run(variant: str, seed: int, steps: int) -> dict:
  from loco_jax.apps import demo
  from loco_jax.transforms.co3 import co3
  gather, gamma, shard_gamma, shard_refit = VARIANTS[variant]
  recorder = Recorder()
  install(recorder, shard_gamma, shard_refit)
  config = demo.DemoConfig(steps=steps, seed=seed)
  name = "co3-fp4" if gather == "bf16" else "co3-fp4-coded"
  result = demo.run_method(name, co3("fp4", gamma=gamma, axis_name=demo.AXIS, gather=gather),
                           config, demo.load_corpus(config))
  return {"variant": variant, "seed": seed, "steps": steps,
          "eval_loss": round(result.eval_loss, 4), "final_loss": round(result.final_loss, 4),
          "wire_bits": result.wire_bits_per_param, "coded_bits": result.co3["coded_bits"],
          "overflow_steps": result.co3["overflow_steps"], **recorder.summary()}


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--variants", default="bf16,base,shard-ef1")
  p.add_argument("--seeds", default="0")
  p.add_argument("--steps", type=int, default=300)
  args = p.parse_args(argv)
  variants = args.variants.split(",")
  unknown = [v for v in variants if v not in VARIANTS]
  if unknown:
    p.error(f"unknown variants {unknown}; accepted: {', '.join(VARIANTS)}")
  from loco_jax.apps import demo
  demo.setup_devices(demo.DemoConfig().devices)
  co3_module = importlib.import_module("loco_jax.transforms.co3")
  from loco_jax.transforms import co3_exchange
  originals = co3_module.convert, co3_exchange._coded_shard
  for seed in [int(s) for s in args.seeds.split(",")]:
    for variant in variants:
      print(json.dumps(run(variant, seed, args.steps)), flush=True)
      co3_module.convert, co3_exchange._coded_shard = originals


if __name__ == "__main__":
  main()
