"""What each XLA:CPU workaround of loco_jax/core/workarounds.py buys: compile seconds, step
median and temporaries of `loco`'s update with the workarounds on (the default), all off
(`LOCO_JAX_WORKAROUNDS=0`) and each one off alone, timed interleaved in one process
(docs/results/backend_workarounds.md).

  python experiments/workarounds_ab.py local [--repeats 25]   # no axis: the tree and a flat leaf
  python experiments/workarounds_ab.py mesh [--repeats 25]    # loco(axis_name="data"), 8 devices
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from loco_jax import loco  # noqa: E402
from loco_jax.apps import bench  # noqa: E402
from loco_jax.core import workarounds  # noqa: E402
from loco_jax.train import parallel  # noqa: E402

DEFAULT = {"opaque_offsets": workarounds.opaque_offsets, "finite_first": workarounds.finite_first}
WITHOUT = {"opaque_offsets": lambda offsets, count: list(offsets),
           "finite_first": lambda *args, **kwargs: None}
VARIANTS = ("on", "off", "no opaque_offsets", "no finite_first")


def set_variant(variant: str) -> None:
  """Switches the module's workarounds: all, none (the environment switch), or all but one."""
  if variant == "off":
    os.environ["LOCO_JAX_WORKAROUNDS"] = "0"
  else:
    os.environ.pop("LOCO_JAX_WORKAROUNDS", None)
  for name, function in DEFAULT.items():
    setattr(workarounds, name, WITHOUT[name] if variant == f"no {name}" else function)


def local_step(params):
  opt = loco()
  return jax.jit(lambda g, s: opt.update(g, s)), (params, opt.init(params))


def mesh_step(params):
  mesh = parallel.data_mesh(8)
  opt = loco(axis_name="data")
  state, specs = parallel.init_opt_state(opt, params, mesh)
  update = lambda g, s: opt.update(jax.tree.map(lambda x: x[0], g), s)
  step = jax.jit(jax.shard_map(update, mesh=mesh,
                               in_specs=(jax.tree.map(lambda _: P("data"), params), specs),
                               out_specs=(jax.tree.map(lambda _: P(), params), specs)))
  grads = jax.tree.map(lambda x: jax.device_put(jnp.full((8, *x.shape), 0.01, x.dtype),
                                                NamedSharding(mesh, P("data"))), params)
  return step, (grads, state)


def compiled_variant(variant: str, build, params):
  """(the compiled step, its arguments, compile seconds, MiB of temporaries)."""
  set_variant(variant)
  step, args = build(params)
  start = time.perf_counter()
  compiled = step.lower(*args).compile()
  seconds = time.perf_counter() - start
  return compiled, args, seconds, compiled.memory_analysis().temp_size_in_bytes / 2**20


def compare(label: str, build, params, variants, repeats: int) -> None:
  compiled_variant(variants[0], build, params)  # the first compile of a process warms caches
  built = {v: compiled_variant(v, build, params) for v in variants}
  times = {v: [] for v in variants}
  for compiled, args, *_ in built.values():
    jax.block_until_ready(compiled(*args))
  for r in range(repeats):  # every repeat runs each variant, in a rotated order
    for v in variants[r % len(variants):] + variants[:r % len(variants)]:
      compiled, args, *_ = built[v]
      start = time.perf_counter()
      jax.block_until_ready(compiled(*args))
      times[v].append(time.perf_counter() - start)
  for v, (_, _, seconds, temps) in built.items():
    print(f"| {label} | {v} | {seconds:.2f} | {statistics.median(times[v]) * 1e3:.1f} | "
          f"{temps:.1f} |", flush=True)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("where", choices=("local", "mesh"))
  parser.add_argument("--repeats", type=int, default=25)
  options = parser.parse_args()
  tree = jax.tree.map(lambda s: jnp.full(s, 0.01, jnp.float32), bench.gpt2_shapes(),
                      is_leaf=lambda s: isinstance(s, tuple))
  print("| step | workarounds | compile s | step ms (median) | temporaries MiB |")
  print("|---|---|---|---|---|")
  if options.where == "local":
    compare("local, 148-leaf tree", local_step, tree, VARIANTS, options.repeats)
    compare("local, one leaf of 2**24", local_step, {"w": jnp.full(2**24, 0.01)}, VARIANTS,
            options.repeats)
  else:  # finite_first applies only without an axis
    compare("mesh of 8, 148-leaf tree", mesh_step, tree, VARIANTS[:3], options.repeats)


if __name__ == "__main__":
  main()
