"""`loco-jax bench`: LoCo's step against adamw and a device copy, wire bits, codecs.

What an exchange step costs on a cluster's links is `loco-jax probe` and `loco-jax advise`'s
(apps/step_model.py), calibrated by measurement there.
"""

import argparse
import functools
import json
import math
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from loco_jax import comm, kernels, loco
from loco_jax.core import layout

# Bytes an element that each step has to move (read + write), the basis of "bandwidth".

from loco_jax.train import files
COMPRESS_BYTES = 4 + 1 + 0.5 + 1      # g, error in; 4-bit payload, error out
LOCO_UPDATE_BYTES = 4 + 1 + 4 + 1     # g, error in; float32 update, error out (local mode)
ADAMW_BYTES = 4 * 7                   # g, params, mu, nu in; mu, nu, update out
MEAN_BYTES = 0.5 + 4 / 8              # 8 peers' 4-bit shards in, their float32 mean out
WIRE_DEVICES = 8
WIRE_PARAMS = {"w": (1024, 1024), "b": (1024,)}
# The GPT-2-shaped tree of the step and compile comparisons (148 leaves, 9,575,936 params).
TREE = {"d_model": 256, "layers": 12}
TREE_QUICK = {"d_model": 64, "layers": 2}
BASELINES = ("uncompressed", "bf16", "int_quantized", "error_feedback", "ef21", "sign_ef",
             "topk_ef")
# Pallas tile configurations (scale blocks per program, warps) tried on GPU; the best is kept.
GPU_SWEEP = ((1, 2), (1, 4), (1, 8), (2, 4))


class Record(NamedTuple):
  name: str
  value: float
  unit: str


# --- A GPT-2-shaped parameter tree ----------------------------------------------------------


def gpt2_shapes(d_model: int = 256, layers: int = 12, vocab: int = 256,
                seq: int = 128) -> dict:
  """Leaf shapes of a GPT-2-style model (tied embedding, pre-LN blocks, 4x MLP), as tuples.

  The defaults give the issue's tree: 148 leaves, 9,575,936 parameters.
  Example:
    >>> shapes = gpt2_shapes()
    >>> leaves = jax.tree.leaves(shapes, is_leaf=lambda s: isinstance(s, tuple))
    >>> len(leaves), sum(math.prod(s) for s in leaves)
    (148, 9575936)
  """
  d = d_model
  layer = {"ln1": {"scale": (d,), "bias": (d,)},
           "attn": {"qkv": {"kernel": (d, 3 * d), "bias": (3 * d,)},
                    "out": {"kernel": (d, d), "bias": (d,)}},
           "ln2": {"scale": (d,), "bias": (d,)},
           "mlp": {"fc": {"kernel": (d, 4 * d), "bias": (4 * d,)},
                   "proj": {"kernel": (4 * d, d), "bias": (d,)}}}
  return {"wte": (vocab, d), "wpe": (seq, d), "ln_f": {"scale": (d,), "bias": (d,)},
          **{f"h{i}": layer for i in range(layers)}}


def gpt2_params(**shape_options) -> dict:
  """`gpt2_shapes(**shape_options)` as float32 standard-normal leaves (the values the timed and
  compiled steps run on).

  Example:
    >>> gpt2_params(d_model=64, layers=2)["h0"]["mlp"]["fc"]["kernel"].shape
    (64, 256)
  """
  return jax.tree.map(lambda s: jax.random.normal(jax.random.key(len(s)), s, jnp.float32),
                      gpt2_shapes(**shape_options), is_leaf=lambda s: isinstance(s, tuple))


# --- Timing -----------------------------------------------------------------------------------


class _Candidate:
  """A jitted step whose donated state is carried from call to call."""

  def __init__(self, name: str, step: Callable, state: Any, fixed: tuple = (),
               keep: Callable = lambda out: out):
    self.name, self.step, self.state, self.fixed, self.keep = name, step, state, fixed, keep
    self.inner, self.faults = 1, []

  def run(self) -> float:
    """Seconds a call, averaged over `inner` back-to-back calls; the process's page faults a
    call go to `faults`."""
    faults, start = minor_faults(), time.perf_counter()
    for _ in range(self.inner):
      out = self.step(*self.fixed, self.state)
      self.state = self.keep(out)
    jax.block_until_ready(out)
    seconds = (time.perf_counter() - start) / self.inner
    self.faults.append((minor_faults() - faults) / self.inner)
    return seconds


def minor_faults() -> int:
  """Minor page faults of this process so far (every thread): each first touch of a page that
  the allocator has just mapped (tests/test_bench.py checks it counts them)."""
  return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _time_interleaved(candidates: list[_Candidate], repeats: int,
                      min_sample_s: float = 0.01) -> dict[str, list[float]]:
  """Seconds a call per candidate and repeat; every repeat runs all of them, in a rotated
  order (so that a ratio of two candidates can be taken repeat by repeat)."""
  for c in candidates:  # compile, then size `inner` so that one sample lasts >= min_sample_s
    c.run()
    c.inner = int(min(20, max(1, math.ceil(min_sample_s / max(c.run(), 1e-7)))))
  samples = {c.name: [] for c in candidates}
  for c in candidates:
    c.faults.clear()
  for r in range(repeats):
    for c in candidates[r % len(candidates):] + candidates[:r % len(candidates)]:
      samples[c.name].append(c.run())
  return samples


def _compile_seconds(jitted: Callable, *args) -> float:
  """Seconds to lower and compile `jitted` on `args` (a fresh trace: no cache is hit)."""
  start = time.perf_counter()
  jitted.lower(*args).compile()
  return time.perf_counter() - start


def _ratio_records(name: str, samples: dict, over: str, under: str) -> list[Record]:
  """`name`: the ratio of the medians; `name`/min and /max: the spread of the per-repeat
  ratios (both candidates ran in every repeat)."""
  ratios = [a / b for a, b in zip(samples[over], samples[under])]
  return [Record(name, statistics.median(samples[over]) / statistics.median(samples[under]), "x"),
          Record(f"{name}/min", min(ratios), "x"), Record(f"{name}/max", max(ratios), "x")]


def _compiled_facts(jitted: Callable, *args) -> tuple[int, float]:
  """(fusion instructions in the compiled HLO (entry and loop bodies), MiB of temporaries)."""
  compiled = jitted.lower(*args).compile()
  fusions = len(re.findall(r"=\s*\S+\s+fusion\(", compiled.as_text()))
  return fusions, compiled.memory_analysis().temp_size_in_bytes / 2**20


def _step_candidates(n: int, backend: str, sweep: bool,
                     tree_size: dict) -> tuple[list[_Candidate], dict, dict]:
  """The timed candidates, (fusions, temporaries in MiB) of some compiled ones, and facts about
  the kernels (records)."""
  g = jax.random.normal(jax.random.key(0), (n,), jnp.float32)
  facts, compiled = {}, {}
  # Every timed step returns its new state first: jax gives each donated buffer to the first
  # output of its shape and dtype, so with the update first adamw's mu would be written as the
  # update and its new mu into a fresh buffer (2x adamw's time: docs/results/performance.md).
  adamw = optax.adamw(1e-3)
  adamw_step = jax.jit(lambda grads, params, state: adamw.update(grads, state, params)[::-1],
                       donate_argnums=2)
  cands = [_Candidate("adamw", adamw_step, adamw.init(g), (g, g), keep=lambda out: out[0])]
  compiled["adamw"] = _compiled_facts(adamw_step, g, g, jax.eval_shape(adamw.init, g))
  opt = loco()
  loco_step = jax.jit(lambda grads, state: opt.update(grads, state)[::-1], donate_argnums=1)
  cands.append(_Candidate("loco_update", loco_step, opt.init(g), (g,),
                          keep=lambda out: out[0]))
  compiled["loco_update"] = _compiled_facts(loco_step, g, jax.eval_shape(opt.init, g))
  facts["compile_s/adamw"] = _compile_seconds(jax.jit(lambda a, b, c: adamw.update(a, c, b)), g,
                                              g, adamw.init(g))
  facts["compile_s/loco_update"] = _compile_seconds(jax.jit(lambda a, b: opt.update(a, b)), g,
                                                    opt.init(g))
  tree = gpt2_params(**tree_size)
  cands.append(_Candidate("adamw_tree", adamw_step, adamw.init(tree), (tree, tree),
                          keep=lambda out: out[0]))
  cands.append(_Candidate("loco_update_tree", loco_step, opt.init(tree), (tree,),
                          keep=lambda out: out[0]))
  compiled["adamw_tree"] = _compiled_facts(adamw_step, tree, tree,
                                          jax.eval_shape(adamw.init, tree))
  compiled["loco_update_tree"] = _compiled_facts(loco_step, tree, jax.eval_shape(opt.init, tree))
  facts["compile_s/adamw_tree"] = _compile_seconds(
      jax.jit(lambda a, b, c: adamw.update(a, c, b)), tree, tree, adamw.init(tree))
  facts["compile_s/loco_update_tree"] = _compile_seconds(
      jax.jit(lambda a, b: opt.update(a, b)), tree, opt.init(tree))
  copy_words = math.ceil(n * COMPRESS_BYTES / 2 / 4)  # reads and writes 6.5 B an element
  copy = jax.jit(lambda x: x + jnp.uint32(1), donate_argnums=0)
  cands.append(_Candidate("copy", copy, jnp.zeros(copy_words, jnp.uint32)))
  # The same into a new buffer each call: what the allocator's fresh pages cost (every step
  # returns its update in one).
  fresh = jax.jit(lambda x: x + jnp.uint32(1))
  cands.append(_Candidate("copy_fresh", lambda x, _: fresh(x), None,
                          (jnp.zeros(copy_words, jnp.uint32),)))

  block = 2048
  if n % block:
    print(f"bench: kernels not timed: n_params={n} is not a multiple of {block}",
          file=sys.stderr)
    return cands, compiled, facts
  blocks = n // block

  def compress_candidate(name: str, **options) -> _Candidate:
    def step(grads, state):  # every output is returned, so that XLA computes all of them
      out = kernels.compress_step(grads, *state, **options)
      return (out.error, out.error_scale), out.packed, out.scales, out.finite
    state = (jnp.zeros(n, jnp.int8), jnp.zeros(blocks, jnp.float32))
    return _Candidate(name, jax.jit(step, donate_argnums=1), state, (g,),
                      keep=lambda out: out[0])

  jnp_step = compress_candidate("compress_step_jnp", implementation="jnp")
  cands.append(jnp_step)
  compiled["compress_step_jnp"] = _compiled_facts(jnp_step.step, g, jnp_step.state)
  peers = 8
  shard = layout.leaf_layout(n // peers, 1, block)
  received = jnp.zeros((peers, shard.row_len // 2), jnp.uint8)
  peer_scales = jnp.ones((peers, shard.blocks), jnp.float32)
  mean = jax.jit(functools.partial(kernels.dequantize_mean, implementation="auto"))
  cands.append(_Candidate("dequantize_mean_8_peers", lambda r, s, _: mean(r, s), None,
                          (received, peer_scales)))
  facts["compress_step_auto"] = kernels.chosen_implementation()
  if backend in ("gpu", "tpu"):
    configs = GPU_SWEEP if backend == "gpu" and sweep else ((None, None),)
    for tile_blocks, num_warps in configs:
      label = "" if tile_blocks is None else f"_tile{tile_blocks}_warps{num_warps}"
      report = kernels.pallas_report(backend, tile_blocks=tile_blocks, num_warps=num_warps)
      facts[f"pallas_report/compress_step_pallas{label}"] = report
      if not report.startswith("error"):  # a failed check still runs: time it, and say so
        cands.append(compress_candidate(f"compress_step_pallas{label}",
                                        implementation="pallas", tile_blocks=tile_blocks,
                                        num_warps=num_warps))
  return cands, compiled, facts


def _timing_records(n: int, repeats: int, backend: str, sweep: bool,
                    tree_size: dict) -> list[Record]:
  cands, compiled, facts = _step_candidates(n, backend, sweep, tree_size)
  samples = _time_interleaved(cands, repeats)
  seconds = {name: statistics.median(s) for name, s in samples.items()}
  records = [Record(f"step_ms/{name}", s * 1e3, "ms") for name, s in seconds.items()]
  records += [Record(f"page_faults/{c.name}", statistics.median(c.faults), "count")
              for c in cands]
  records += [Record(f"hlo_fusions/{name}", k, "count") for name, (k, _) in compiled.items()]
  records += [Record(f"temp_MiB/{name}", mib, "MiB") for name, (_, mib) in compiled.items()]
  records += [Record(key, value, "s") for key, value in facts.items()
              if key.startswith("compile_s/")]
  records.append(Record("compile_over_adamw", facts["compile_s/loco_update"] /
                        facts["compile_s/adamw"], "x"))
  records.append(Record("compile_over_adamw_tree", facts["compile_s/loco_update_tree"] /
                        facts["compile_s/adamw_tree"], "x"))
  adamw_s, copy_s = seconds["adamw"], seconds["copy"]
  copy_gbps = n * COMPRESS_BYTES / copy_s / 1e9
  records.append(Record("bandwidth_GBps/copy", copy_gbps, "GB/s"))
  records += _ratio_records("loco_over_adamw", samples, "loco_update", "adamw")
  records += _ratio_records("loco_over_adamw_tree", samples, "loco_update_tree", "adamw_tree")
  records.append(Record("bandwidth_GBps/adamw", n * ADAMW_BYTES / adamw_s / 1e9, "GB/s"))
  update_gbps = n * LOCO_UPDATE_BYTES / seconds["loco_update"] / 1e9
  records.append(Record("bandwidth_GBps/loco_update", update_gbps, "GB/s"))
  records.append(Record("loco_update_bandwidth_fraction_of_copy", update_gbps / copy_gbps, "x"))
  compress = {name: s for name, s in seconds.items() if name.startswith("compress_step")}
  for name, s in compress.items():
    records.append(Record(f"{name}_over_adamw", s / adamw_s, "x"))
    records.append(Record(f"bandwidth_GBps/{name}", n * COMPRESS_BYTES / s / 1e9, "GB/s"))
  if compress:
    best = min(compress, key=compress.get)
    best_gbps = n * COMPRESS_BYTES / compress[best] / 1e9
    records.append(Record("compress_step_over_adamw", compress[best] / adamw_s, "x"))
    records.append(Record("loco_bandwidth_fraction_of_copy", best_gbps / copy_gbps, "x"))
    records.append(Record(f"compress_step_best_is/{best}", 1.0, "bool"))
    records.append(Record("compress_step_auto_is_pallas",
                          float(facts["compress_step_auto"] == "pallas"), "bool"))
    mean_s = seconds["dequantize_mean_8_peers"]
    records.append(Record("bandwidth_GBps/dequantize_mean_8_peers", n * MEAN_BYTES / mean_s / 1e9,
                          "GB/s"))
  for key, value in facts.items():
    if key.startswith("pallas_report/"):  # 1 pass, 0 fail (timed anyway), -1 error
      records.append(Record(key, 1.0 if value == "pass" else
                            -1.0 if value.startswith("error") else 0.0, "status"))
      if value != "pass":
        print(f"bench: {key}: {value}", file=sys.stderr)
  return records


# --- Wire bits from the lowered HLO ----------------------------------------------------------


def _wire_methods() -> dict[str, Callable[[], optax.GradientTransformation]]:
  methods = {"loco_bf16_gather": lambda: loco(axis_name="data"),
             "loco_quantized_gather": lambda: loco(axis_name="data", gather="quantized")}
  try:
    from loco_jax.transforms import baselines
  except ImportError:
    return methods
  for name in BASELINES:
    factory = getattr(baselines, name, None)
    if factory is not None:
      methods[name] = functools.partial(factory, axis_name="data")
  return methods


def _mesh_step(opt, params, mesh):
  from jax.sharding import PartitionSpec as P

  from loco_jax.train import parallel
  state, specs = parallel.init_opt_state(opt, params, mesh)
  update = lambda g, s, opt=opt: opt.update(jax.tree.map(lambda x: x[0], g), s)
  step = jax.jit(jax.shard_map(update, mesh=mesh,
                               in_specs=(jax.tree.map(lambda _: P("data"), params), specs),
                               out_specs=(jax.tree.map(lambda _: P(), params), specs)))
  grads = jax.tree.map(lambda x: jax.ShapeDtypeStruct((WIRE_DEVICES, *x.shape), x.dtype), params)
  return step, grads, state


def mesh_tree_records(tree_size: dict) -> list[Record]:
  """The GPT-2-shaped tree on the 8-device mesh: compile seconds of the `loco(axis_name=...)`
  step and of an fp32 pmean step, and LoCo's wire bits from the compiled HLO.

  Example:
    >>> mesh_tree_records(dict(d_model=64, layers=2))   # needs 8 devices
  """
  from loco_jax.train import parallel
  mesh = parallel.data_mesh(WIRE_DEVICES)
  params = jax.tree.map(lambda s: jnp.zeros(s, jnp.float32), gpt2_shapes(**tree_size),
                        is_leaf=lambda s: isinstance(s, tuple))
  n_params = sum(x.size for x in jax.tree.leaves(params))
  pmean = optax.GradientTransformation(
      lambda p: optax.EmptyState(), lambda g, s, p=None: (jax.lax.pmean(g, "data"), s))
  records = []
  for name, opt in (("loco_mesh_step_tree", loco(axis_name="data")), ("pmean_mesh_step_tree",
                                                                      pmean)):
    step, grads, state = _mesh_step(opt, params, mesh)
    start = time.perf_counter()
    compiled = step.lower(grads, state).compile()
    records.append(Record(f"compile_s/{name}", time.perf_counter() - start, "s"))
    if name.startswith("loco"):
      found = comm.collectives(compiled.as_text(), WIRE_DEVICES)
      records.append(Record("wire_bits_per_param_tree/loco_bf16_gather",
                            comm.wire_bits_per_param(found, n_params), "bits/param/device"))
  return records


def wire_bits_in_process(tree_size: dict | None = None) -> list[Record]:
  """Bits each device sends a parameter per step, from each method's lowered HLO, 8 devices;
  with `tree_size`, also `mesh_tree_records(tree_size)`.

  Example:
    >>> wire_bits_in_process()   # needs 8 devices (XLA_FLAGS=--xla_force_host_platform_...)
  """
  from loco_jax.train import parallel
  mesh = parallel.data_mesh(WIRE_DEVICES)
  params = {k: jnp.zeros(shape, jnp.float32) for k, shape in WIRE_PARAMS.items()}
  n_params = sum(math.prod(s) for s in WIRE_PARAMS.values())
  records = []
  for name, make in _wire_methods().items():
    try:
      step, grads, state = _mesh_step(make(), params, mesh)
      found = comm.lowered_collectives(step, grads, state, num_devices=WIRE_DEVICES)
      records.append(Record(f"wire_bits_per_param/{name}",
                            comm.wire_bits_per_param(found, n_params), "bits/param/device"))
    except Exception as e:  # noqa: BLE001 - one method failing must not hide the others
      print(f"bench: wire bits of {name} failed: {type(e).__name__}: {e}", file=sys.stderr)
  return records + ([] if tree_size is None else mesh_tree_records(tree_size))


def wire_bits(tree_size: dict | None = None) -> list[Record]:
  """`wire_bits_in_process` here if 8 devices exist, else in a subprocess on 8 host CPUs.

  The lowered HLO (before backend compilation) is the same on every backend, so the
  subprocess forces JAX_PLATFORMS=cpu and --xla_force_host_platform_device_count=8 and leaves
  this process's devices alone.
  """
  if jax.device_count() >= WIRE_DEVICES:
    return wire_bits_in_process(tree_size)
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                      f" --xla_force_host_platform_device_count={WIRE_DEVICES}").strip()
  code = ("import json; from loco_jax.apps import bench; print(json.dumps([r._asdict() for r in "
          f"bench.wire_bits_in_process({tree_size!r})]))")
  done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                        timeout=600)
  if done.returncode:
    raise RuntimeError(f"wire-bits subprocess failed:\n{done.stderr[-2000:]}")
  sys.stderr.write(done.stderr)
  return [Record(**r) for r in json.loads(done.stdout.strip().splitlines()[-1])]


# --- Codecs ----------------------------------------------------------------------------------


def codec_records(n_symbols: int, repeats: int) -> list[Record]:
  """loco_jax.apps.codec_bench.run's records (prefixed "codec/"), plus bits per symbol and
  throughput for each codec and beta; none if codec_bench is not there.

  Example:
    >>> codec_records(4096, 1)
  """
  try:
    from loco_jax.apps import codec_bench
  except ImportError:
    print("bench: loco_jax.apps.codec_bench is not available: codecs skipped", file=sys.stderr)
    return []
  raw = codec_bench.run(n_symbols=n_symbols, betas=(0.5, 1.0, 2.0), seed=0, repeats=repeats)
  records = [Record("codec/" + r["name"], float(r["value"]), r["unit"]) for r in raw]
  values = {r["name"]: float(r["value"]) for r in raw}
  for name, ratio in values.items():
    metric, _, rest = name.partition("/")
    if metric != "size_vs_entropy":
      continue
    codec, _, beta = rest.partition("/")
    entropy = values.get(f"entropy/symbols/{beta}")
    total_ms = values.get(f"encode_decode_ms/{codec}/{beta}")
    if entropy is not None:
      records.append(Record(f"codec_bits_per_symbol/{codec}/{beta}", ratio * entropy,
                            "bits/symbol"))
    if total_ms:
      records.append(Record(f"codec_throughput/{codec}/{beta}", n_symbols / total_ms / 1e3,
                            "Msymbols/s (encode + decode)"))
  return records


def _codec_table(records: list[Record]) -> list[str]:
  """| codec | bits/symbol and Msymbols/s at each beta |, from `codec_records`."""
  table: dict[str, dict[str, str]] = {}
  betas = []
  for r in records:
    metric, _, rest = r.name.partition("/")
    if metric not in ("codec_bits_per_symbol", "codec_throughput"):
      continue
    codec, _, beta = rest.partition("/")
    betas += [beta] if beta not in betas else []
    cell = table.setdefault(codec, {}).setdefault(beta, "")
    text = f"{r.value:.3f} b" if metric == "codec_bits_per_symbol" else f"{r.value:.1f} M/s"
    table[codec][beta] = f"{cell}, {text}" if cell else text
  if not table:
    return []
  entropy = {r.name.rsplit("/", 1)[1]: r.value for r in records
             if r.name.startswith("codec/entropy/")}
  lines = ["| codec | " + " | ".join(betas) + " |", "|---|" + "---|" * len(betas),
           "| (entropy) | " + " | ".join(f"{entropy.get(b, float('nan')):.3f} b"
                                         for b in betas) + " |"]
  lines += [f"| {codec} | " + " | ".join(cells.get(b, "") for b in betas) + " |"
            for codec, cells in table.items()]
  return lines


# --- Kernel checks (run on the device: `loco-jax bench --check-kernels`) ---------------------


def check_kernels(backend: str) -> list[tuple[str, bool, str]]:
  """(check, passed, detail): every implementation of the compress step and dequantize_mean on
  this backend against the float64 reference (`kernels.implementation_report`), for a few
  settings, and which one `auto` picks.

  Example:
    >>> all(ok for _, ok, _ in check_kernels(jax.default_backend()))
  """
  checks = []
  interpret = None if backend in ("gpu", "tpu") else True
  implementations = ("jnp", "pallas") if kernels.pallas.pl is not None else ("jnp",)
  for bits, error_bits, beta in ((4, 8, 0.8), (2, 8, 0.5), (8, 6, 0.9)):
    for name in implementations:
      report = kernels.implementation_report(
          name, backend, bits, error_bits, beta,
          interpret=interpret if name == "pallas" else None)
      checks.append((f"{name}_matches_float64_reference/bits={bits},error_bits={error_bits},"
                     f"beta={beta}", report == "pass", report))
  auto = kernels.chosen_implementation()
  wanted = "pallas" if backend in ("gpu", "tpu") and kernels.pallas_report(backend) == "pass" \
      else "jnp"
  checks.append(("auto_picks_pallas_where_it_passes", auto == wanted, f"auto runs {auto}"))
  return checks


# --- Output ----------------------------------------------------------------------------------


def _value(records: list[Record], name: str) -> float | None:
  return next((r.value for r in records if r.name == name), None)


def format_tables(records: list[Record], backend: str, n: int, repeats: int,
                  codec_symbols: int) -> str:
  """The markdown printed by `loco-jax bench`."""
  lines = [f"## Step times: backend {backend}, n_params = {n}, median of {repeats} "
           "(interleaved)", "",
           "| step | ms | GB/s (nominal bytes) | vs adamw (on the tree: adamw_tree) | "
           "bandwidth vs copy | HLO fusions | temporaries MiB | page faults a call |",
           "|---|---|---|---|---|---|---|---|"]
  copy_gbps = _value(records, "bandwidth_GBps/copy")
  for r in records:
    if not r.name.startswith("step_ms/"):
      continue
    name = r.name.split("/", 1)[1]
    # The tree's steps against adamw on the tree, the others against adamw on the flat leaf.
    adamw_ms = _value(records, "step_ms/adamw_tree" if name.endswith("_tree") else "step_ms/adamw")
    gbps = _value(records, f"bandwidth_GBps/{name}")
    fusions, temp, faults = [_value(records, f"{kind}/{name}")
                             for kind in ("hlo_fusions", "temp_MiB", "page_faults")]
    lines.append(f"| {name} | {r.value:.3f} | {'' if gbps is None else f'{gbps:.1f}'} | "
                 f"{r.value / adamw_ms:.3f} | "
                 f"{'' if gbps is None else f'{gbps / copy_gbps:.3f}'} | "
                 f"{'' if fusions is None else int(fusions)} | "
                 f"{'' if temp is None else f'{temp:.1f}'} | "
                 f"{'' if faults is None else f'{faults:.0f}'} |")
  lines += ["", "| ratio | value |", "|---|---|"]
  for name in ("loco_over_adamw", "loco_over_adamw_tree", "compress_step_over_adamw",
               "loco_bandwidth_fraction_of_copy", "loco_update_bandwidth_fraction_of_copy",
               "compress_step_auto_is_pallas", "compile_over_adamw", "compile_over_adamw_tree"):
    value = _value(records, name)
    spread = (_value(records, f"{name}/min"), _value(records, f"{name}/max"))
    if value is not None:
      lines.append(f"| {name} | {value:.3f}" + ("" if spread[0] is None else
                   f" (per repeat {spread[0]:.3f}-{spread[1]:.3f})") + " |")
  lines += [f"| {r.name} (1 pass, 0 fail, -1 error) | {r.value:.0f} |" for r in records
            if r.name.startswith("pallas_report/")]
  compiled = [r for r in records if r.name.startswith("compile_s/")]
  if compiled:
    lines += ["", "## Compile seconds (lower + compile)", "", "| program | s |", "|---|---|"]
    lines += [f"| {r.name.split('/', 1)[1]} | {r.value:.2f} |" for r in compiled]
  wire = [r for r in records if r.name.startswith("wire_bits_per_param/")]
  if wire:
    lines += ["", f"## Wire bits per parameter per device ({WIRE_DEVICES} devices, lowered HLO)",
              "", "| method | bits |", "|---|---|"]
    lines += [f"| {r.name.split('/', 1)[1]} | {r.value:.3f} |" for r in wire]
    lines += [f"| {r.name.split('/', 1)[1]}, GPT-2-shaped tree (compiled HLO) | {r.value:.3f} |"
              for r in records if r.name.startswith("wire_bits_per_param_tree/")]
  codec_lines = _codec_table(records)
  if codec_lines:
    lines += ["", f"## Codecs on the host CPU: bits per symbol, encode + decode throughput "
              f"({codec_symbols} fp4 GenNorm symbols per beta)", ""] + codec_lines
  return "\n".join(lines) + "\n"


# --- Command line ----------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog="loco-jax bench",
      description="LoCo's step against adamw and a device copy (medians, interleaved), wire "
                  "bits from the HLO, the Huffman codec against zlib/zstd (a cluster's "
                  "exchange step: loco-jax probe and advise).")
  p.add_argument("--n-params", type=int, default=None,
                 help="parameters of the timed flat leaf (default 2**24 on CPU, 2**30 on "
                      "GPU/TPU, 2**16 with --quick)")
  p.add_argument("--repeats", type=int, default=None,
                 help="timed repeats (default 10, 3 with --quick)")
  p.add_argument("--json", default=None, help="write the records here (atomically)")
  p.add_argument("--quick", action="store_true",
                 help="tiny sizes: a smoke test of every part")
  p.add_argument("--codec-symbols", type=int, default=None,
                 help="symbols per codec run (default 2**20, 2**12 with --quick)")
  p.add_argument("--skip", default="", help="comma-separated parts to skip: wire,codec")
  p.add_argument("--check-kernels", action="store_true",
                 help="only check the kernels on this backend (each implementation against the "
                      "float64 reference, and what auto picks); exit 1 on a failure")
  return p


def main(argv: Sequence[str] | None = None) -> int:
  """Runs the benchmark; prints markdown tables; returns an exit status (2: bad arguments).

  Example:
    >>> main(["--quick", "--json", "/tmp/bench.json"])
  """
  parser = _parser()
  try:
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    for name in ("n_params", "repeats", "codec_symbols"):
      value = getattr(args, name)
      if value is not None and value <= 0:
        parser.error(f"--{name.replace('_', '-')} must be a positive integer, got {value}")
    skip = {s for s in args.skip.split(",") if s}
    if skip - {"wire", "codec"}:
      parser.error(f"--skip takes wire and/or codec, got {sorted(skip - {'wire', 'codec'})}")
  except SystemExit as e:
    return int(e.code or 0)

  backend = jax.default_backend()
  if args.check_kernels:
    checks = check_kernels(backend)
    print(f"## Kernel checks: backend {backend}, jax {jax.__version__}\n\n"
          "| check | passed | detail |\n|---|---|---|")
    for name, ok, detail in checks:
      print(f"| {name} | {'yes' if ok else 'NO'} | {detail} |")
    return 0 if all(ok for _, ok, _ in checks) else 1
  n = args.n_params or (2**16 if args.quick else 2**24 if backend == "cpu" else 2**30)
  repeats = args.repeats or (3 if args.quick else 10)
  started = time.perf_counter()
  tree_size = TREE_QUICK if args.quick else TREE
  records = _timing_records(n, repeats, backend, not args.quick, tree_size)
  if "wire" not in skip:
    records += wire_bits(tree_size)
  codec_symbols = args.codec_symbols or (2**12 if args.quick else 2**20)
  if "codec" not in skip:
    records += codec_records(codec_symbols, 1 if args.quick else 3)
  print(format_tables(records, backend, n, repeats, codec_symbols), end="")
  print(f"\n({time.perf_counter() - started:.1f} s, jax {jax.__version__}, "
        f"{jax.devices()[0].device_kind})")
  if args.json:
    tree_params = sum(math.prod(s) for s in jax.tree.leaves(
        gpt2_shapes(**tree_size), is_leaf=lambda s: isinstance(s, tuple)))
    out = [dict(r._asdict(), backend=backend,
                n_params=(tree_params if "tree" in r.name else
                          codec_symbols if r.name.startswith("codec") else
                          sum(math.prod(s) for s in WIRE_PARAMS.values())
                          if r.name.startswith("wire_bits") else n))
           for r in records]
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    files.write_json_atomic(args.json, out, indent=1)
  return 0
