"""Two facts about XLA:CPU behind docs/PERFORMANCE.md's "A fair adamw baseline": what the order
of a donated step's outputs costs adamw, and what YNNPACK's row reductions cost when they
compute their input (milliseconds and page faults a call, medians).

  python experiments/cpu_probe.py [--repeats 11]
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import optax

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


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--repeats", type=int, default=11)
  args = parser.parse_args()
  output_order(args.repeats)
  reductions(args.repeats)
  print(f"\n(jax {jax.__version__}, {jax.default_backend()})")


if __name__ == "__main__":
  main()
