"""Three facts about XLA:CPU behind docs/results/performance.md's CPU
section: what the order of a donated step's outputs costs adamw, what YNNPACK's
row reductions cost when they compute their input, and the floors of LoCo's local step, its
memory traffic without arithmetic and its arithmetic on data in cache (milliseconds and page
faults a call, medians).

  python experiments/cpu_probe.py [--repeats 11]
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import optax

from loco_jax import kernels, loco
from loco_jax.apps import bench

N, BLOCK = 2**24, 2048


def measure(fn, args, carry=None, repeats: int = 11) -> tuple[float, float]:
  """(median ms, median page faults) a call of the compiled `fn`; `carry(out)` gives the next
  call's last argument (a donated state), else the arguments stay."""
  compiled = jax.jit(fn, donate_argnums=len(args) - 1 if carry else ()).lower(*args).compile()
  seconds, faults = [], []
  for _ in range(repeats):
    before, start = bench.minor_faults(), time.perf_counter()
    out = jax.block_until_ready(compiled(*args))
    seconds.append(time.perf_counter() - start)
    faults.append(bench.minor_faults() - before)
    if carry:
      args = (*args[:-1], carry(out))
  return statistics.median(seconds) * 1e3, statistics.median(faults)


def output_order(repeats: int) -> None:
  adamw = optax.adamw(1e-3)
  flat = jax.random.normal(jax.random.key(0), (N,), jnp.float32)
  tree = bench.gpt2_params()
  print("| adamw step, donated state | params | ms | page faults |\n|---|---|---|---|")
  for name, params in (("flat 2**24", flat), ("GPT-2-shaped tree", tree)):
    for order, step, state_at in (
        ("(updates, state)", lambda g, p, s: adamw.update(g, s, p), 1),
        ("(state, updates)", lambda g, p, s: adamw.update(g, s, p)[::-1], 0)):
      ms, faults = measure(step, (params, params, adamw.init(params)),
                           carry=lambda out, at=state_at: out[at], repeats=repeats)
      print(f"| returns {order} | {name} | {ms:.1f} | {faults:.0f} |")


def reductions(repeats: int) -> None:
  g = jax.random.normal(jax.random.key(0), (N,), jnp.float32)
  e = jnp.ones(N, jnp.int8)
  s = jnp.full(N // BLOCK, 0.01, jnp.float32)
  rows = lambda x: x.reshape(-1, BLOCK)
  cases = {
      "max(g)": (lambda g: jnp.max(rows(g), axis=1), (g,)),
      "max(|g|)": (lambda g: jnp.max(jnp.abs(rows(g)), axis=1), (g,)),
      "max(g * s)": (lambda g, s: jnp.max(rows(g) * s[:, None], axis=1), (g, s)),
      "max(g + e * s)": (lambda g, e, s: jnp.max(
          rows(g) + rows(e).astype(jnp.float32) * s[:, None], axis=1), (g, e, s)),
      "sum(|g|)": (lambda g: jnp.sum(jnp.abs(rows(g)), axis=1), (g,)),
  }
  print(f"\n| row reduction, blocks of {BLOCK}, 2**24 values | ms | page faults |\n|---|---|---|")
  for name, (fn, args) in cases.items():
    ms, faults = measure(fn, args, repeats=repeats)
    print(f"| {name} | {ms:.1f} | {faults:.0f} |")


def bare_step(g, error, error_scale):
  """LoCo's formula with none of the step's guards (saturation, non-finite marks, zero
  scales): arithmetic that every formulation of the step does, and a lower bound for them."""
  g = g.reshape(-1, BLOCK)
  e = error.reshape(-1, BLOCK).astype(jnp.float32) * error_scale[:, None]
  h = g + e
  scale = 7.0 / jnp.max(jnp.abs(h), axis=1, keepdims=True)
  q = jnp.clip(jnp.round(h * scale), -8, 7)
  d = q / scale
  residual = 0.8 * e + 0.2 * (h - d)
  new_scale = 127.0 / jnp.max(jnp.abs(residual), axis=1, keepdims=True)
  codes = (q.astype(jnp.int32) + 8).reshape(-1, BLOCK // 2, 2)
  return (jnp.round(residual * new_scale).astype(jnp.int8).reshape(-1), 1.0 / new_scale[:, 0],
          (codes[..., 0] | (codes[..., 1] << 4)).astype(jnp.uint8), d.reshape(-1))


def in_cache_ns(step, repeats: int, values: int = 2**17, loops: int = 32) -> float:
  """ns a value of `step(g, error, error_scale) -> (error, error_scale, payload,
  decompressed)` on `values` values that stay in cache, `loops` steps a call."""
  g = jax.random.normal(jax.random.key(1), (values,), jnp.float32)

  def steps(g, error, error_scale):
    return jax.lax.fori_loop(0, loops, lambda _, out: step(g, *out[:2]),
                             step(g, error, error_scale))

  ms, _ = measure(steps, (g, jnp.zeros(values, jnp.int8),
                          jnp.zeros(values // BLOCK, jnp.float32)), repeats=repeats)
  return ms * 1e6 / (values * (loops + 1))


def floors(repeats: int) -> None:
  """LoCo's local step against adamw, and lower bounds of it: the step's memory traffic with no
  arithmetic (read g and the int8 error, write the error in place and a float32 update), and
  the arithmetic of the jnp compress step (with the decompressed output, as the local step) and
  of `bare_step` on data in cache, scaled to the step's size."""
  def jnp_step(g, error, error_scale):
    out = kernels.compress_step(g, error, error_scale, decompressed=True, implementation="jnp")
    return out.error, out.error_scale, out.packed, out.decompressed

  arithmetic = {"compress arithmetic in cache": in_cache_ns(jnp_step, repeats),
                "bare formula in cache": in_cache_ns(bare_step, repeats)}
  adamw, opt, first = optax.adamw(1e-3), loco(), lambda out: out[0]
  print("\n| step | params | ms | page faults | over adamw |\n|---|---|---|---|---|")
  for name, params in (("flat 2**24", jax.random.normal(jax.random.key(0), (N,), jnp.float32)),
                       ("GPT-2-shaped tree", bench.gpt2_params())):
    adamw_ms, faults = measure(lambda g, p, s: adamw.update(g, s, p)[::-1],
                               (params, params, adamw.init(params)), carry=first,
                               repeats=repeats)
    rows = [("`adamw.update`", adamw_ms, faults)]
    rows.append(("`loco().update`", *measure(lambda g, s: opt.update(g, s)[::-1],
                                             (params, opt.init(params)), carry=first,
                                             repeats=repeats)))
    if name.startswith("flat"):
      rows.append(("LoCo's traffic, no arithmetic", *measure(
          lambda g, e: (e + 1, g * 2), (params, jnp.zeros(N, jnp.int8)), carry=first,
          repeats=repeats)))
    size = sum(x.size for x in jax.tree.leaves(params))
    rows += [(f"{label} ({ns:.2f} ns a value)", ns * size * 1e-6, None)
             for label, ns in arithmetic.items()]
    for label, ms, faults in rows:
      print(f"| {label} | {name} | {ms:.1f} | {'-' if faults is None else f'{faults:.0f}'} | "
            f"{ms / adamw_ms:.2f} |")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--repeats", type=int, default=11)
  args = parser.parse_args()
  output_order(args.repeats)
  reductions(args.repeats)
  floors(args.repeats)
  print(f"\n(jax {jax.__version__}, {jax.default_backend()})")


if __name__ == "__main__":
  main()
