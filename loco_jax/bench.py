"""`loco-jax bench`: LoCo's step against adamw and a device copy, wire bits, codecs, cost model."""

import argparse
import functools
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from loco_jax import comm, files, kernels, loco
from loco_jax.loco import _reference_step

# Bytes an element that each step has to move (read + write), the basis of "bandwidth".
COMPRESS_BYTES = 4 + 1 + 0.5 + 1      # g, error in; 4-bit payload, error out
LOCO_UPDATE_BYTES = 4 + 1 + 4 + 1     # g, error in; float32 update, error out (local mode)
ADAMW_BYTES = 4 * 7                   # g, params, mu, nu in; mu, nu, update out
MEAN_BYTES = 0.5 + 4 / 8              # 8 peers' 4-bit shards in, their float32 mean out
WIRE_DEVICES = 8
WIRE_PARAMS = {"w": (1024, 1024), "b": (1024,)}
COST_DEVICES = (8, 64, 512, 4096)
COST_GBPS = (25, 100, 400)
BASELINES = ("uncompressed", "bf16", "int_quantized", "error_feedback", "ef21", "sign_ef",
             "topk_ef")
# Pallas tile configurations (scale blocks per program, warps) tried on GPU; the best is kept.
GPU_SWEEP = ((1, 2), (1, 4), (1, 8), (2, 4))


class Record(NamedTuple):
  name: str
  value: float
  unit: str


# --- Cost model: the LoCo paper's Table I ---------------------------------------------------


def comm_seconds(bits_g: float, bits_w: float, psi: float, devices: int, gbps: float,
                 topology: str = "ring") -> float:
  """Seconds a step spends communicating, LoCo paper Table I, B = gbps * 1e9 / 8 bytes/s.

  ring: (b_g + b_w) * Psi * (N - 1) / (8 N B); master-server: (b_g + b_w) * Psi * N / (8 B).
  Example:
    >>> comm_seconds(16, 16, 7e9, 8, 100)   # bf16 ring all-reduce of 7B params: 1.96 s
  """
  bytes_per_s = gbps * 1e9 / 8
  if topology == "ring":
    return (bits_g + bits_w) * psi * (devices - 1) / (8 * devices * bytes_per_s)
  if topology == "master-server":
    return (bits_g + bits_w) * psi * devices / (8 * bytes_per_s)
  raise ValueError(f"topology must be 'ring' or 'master-server', got {topology!r}")


def cost_model(psi: float, adamw_s_per_param: float, loco_s_per_param: float,
               devices: Sequence[int] = COST_DEVICES, gbps: Sequence[float] = COST_GBPS
               ) -> list[dict]:
  """Predicted optimizer-plus-communication time of a step, bf16 against LoCo (no overlap).

  bf16: adamw compute + Table I with b_g = b_w = 16. LoCo: adamw + LoCo's update compute +
  Table I with b_g = 4, b_w = 16. Compute scales linearly with Psi from the measured seconds
  per parameter; forward and backward passes are left out (they add the same to both).
  Example:
    >>> rows = cost_model(7e9, 7.7e-3 / 2**30, 3.3e-3 / 2**30)
  """
  rows = []
  for n in devices:
    for b in gbps:
      row = {"devices": n, "gbps": b}
      for topology in ("ring", "master-server"):
        bf16_s = adamw_s_per_param * psi + comm_seconds(16, 16, psi, n, b, topology)
        loco_s = ((adamw_s_per_param + loco_s_per_param) * psi
                  + comm_seconds(4, 16, psi, n, b, topology))
        row[topology] = {"bf16_s": bf16_s, "loco_s": loco_s, "speedup": bf16_s / loco_s}
      rows.append(row)
  return rows


# --- Timing -----------------------------------------------------------------------------------


class _Candidate:
  """A jitted step whose donated state is carried from call to call."""

  def __init__(self, name: str, step: Callable, state: Any, fixed: tuple = (),
               keep: Callable = lambda out: out):
    self.name, self.step, self.state, self.fixed, self.keep = name, step, state, fixed, keep
    self.inner = 1

  def run(self) -> float:
    """Seconds a call, averaged over `inner` back-to-back calls."""
    start = time.perf_counter()
    for _ in range(self.inner):
      out = self.step(*self.fixed, self.state)
      self.state = self.keep(out)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / self.inner


def _time_interleaved(candidates: list[_Candidate], repeats: int,
                      min_sample_s: float = 0.01) -> dict[str, float]:
  """Median seconds a call per candidate; every repeat runs all of them, in a rotated order."""
  for c in candidates:  # compile, then size `inner` so that one sample lasts >= min_sample_s
    c.run()
    c.inner = int(min(20, max(1, math.ceil(min_sample_s / max(c.run(), 1e-7)))))
  samples = {c.name: [] for c in candidates}
  for r in range(repeats):
    for c in candidates[r % len(candidates):] + candidates[:r % len(candidates)]:
      samples[c.name].append(c.run())
  return {name: statistics.median(s) for name, s in samples.items()}


def _count_fusions(jitted: Callable, *args) -> int:
  """Fusion instructions in the compiled HLO (entry and loop bodies)."""
  text = jitted.lower(*args).compile().as_text()
  return len(re.findall(r"=\s*\S+\s+fusion\(", text))


def _step_candidates(n: int, backend: str, sweep: bool) -> tuple[list[_Candidate], dict, dict]:
  """The timed candidates, their fusion counts, and facts about the kernels (records)."""
  g = jax.random.normal(jax.random.key(0), (n,), jnp.float32)
  facts, fusions = {}, {}
  adamw = optax.adamw(1e-3)
  adamw_step = jax.jit(lambda grads, params, state: adamw.update(grads, state, params),
                       donate_argnums=2)
  cands = [_Candidate("adamw", adamw_step, adamw.init(g), (g, g), keep=lambda out: out[1])]
  fusions["adamw"] = _count_fusions(adamw_step, g, g, jax.eval_shape(adamw.init, g))
  opt = loco()
  loco_step = jax.jit(lambda grads, state: opt.update(grads, state), donate_argnums=1)
  cands.append(_Candidate("loco_update", loco_step, opt.init(g), (g,),
                          keep=lambda out: out[1]))
  fusions["loco_update"] = _count_fusions(loco_step, g, jax.eval_shape(opt.init, g))
  copy_words = math.ceil(n * COMPRESS_BYTES / 2 / 4)  # reads and writes 6.5 B an element
  copy = jax.jit(lambda x: x + jnp.uint32(1), donate_argnums=0)
  cands.append(_Candidate("copy", copy, jnp.zeros(copy_words, jnp.uint32)))

  block = 2048
  if n % block:
    print(f"bench: kernels not timed: n_params={n} is not a multiple of {block}",
          file=sys.stderr)
    return cands, fusions, facts
  blocks = n // block

  def compress_candidate(name: str, **options) -> _Candidate:
    def step(grads, state):  # every output is returned, so that XLA computes all of them
      out = kernels.compress_step(grads, *state, **options)
      return out.packed, out.scales, out.finite, (out.error, out.error_scale)
    state = (jnp.zeros(n, jnp.int8), jnp.zeros(blocks, jnp.float32))
    return _Candidate(name, jax.jit(step, donate_argnums=1), state, (g,),
                      keep=lambda out: out[3])

  jnp_step = compress_candidate("compress_step_jnp", implementation="jnp")
  cands.append(jnp_step)
  fusions["compress_step_jnp"] = _count_fusions(jnp_step.step, g, jnp_step.state)
  peers = 8
  shard = comm.leaf_layout(n // peers, 1, block)
  received = jnp.zeros((peers, shard.row_len // 2), jnp.uint8)
  peer_scales = jnp.ones((peers, shard.blocks), jnp.float32)
  mean = jax.jit(functools.partial(kernels.dequantize_mean, implementation="auto"))
  cands.append(_Candidate("dequantize_mean_8_peers", lambda r, s, _: mean(r, s), None,
                          (received, peer_scales)))
  facts["compress_step_auto"] = kernels.chosen_implementation(blocks)
  if backend in ("gpu", "tpu"):
    configs = GPU_SWEEP if backend == "gpu" and sweep else ((None, None),)
    for tile_blocks, num_warps in configs:
      label = "" if tile_blocks is None else f"_tile{tile_blocks}_warps{num_warps}"
      report = kernels.pallas_report(backend, tile_blocks=tile_blocks, num_warps=num_warps)
      facts[f"pallas_report/compress_step_pallas{label}"] = report
      if not report.startswith("error"):  # a mismatch still runs: time it, and say so
        cands.append(compress_candidate(f"compress_step_pallas{label}",
                                        implementation="pallas", tile_blocks=tile_blocks,
                                        num_warps=num_warps))
  return cands, fusions, facts


def _timing_records(n: int, repeats: int, backend: str, sweep: bool) -> list[Record]:
  cands, fusions, facts = _step_candidates(n, backend, sweep)
  seconds = _time_interleaved(cands, repeats)
  records = [Record(f"step_ms/{name}", s * 1e3, "ms") for name, s in seconds.items()]
  records += [Record(f"hlo_fusions/{name}", k, "count") for name, k in fusions.items()]
  adamw_s, copy_s = seconds["adamw"], seconds["copy"]
  copy_gbps = n * COMPRESS_BYTES / copy_s / 1e9
  records.append(Record("bandwidth_GBps/copy", copy_gbps, "GB/s"))
  records.append(Record("loco_over_adamw", seconds["loco_update"] / adamw_s, "x"))
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
    if key.startswith("pallas_report/"):  # 1 match, 0 mismatch (timed anyway), -1 error
      records.append(Record(key, 1.0 if value == "match" else
                            -1.0 if value.startswith("error") else 0.0, "status"))
      if value != "match":
        print(f"bench: {key}: {value}", file=sys.stderr)
  return records


# --- Wire bits from the lowered HLO ----------------------------------------------------------


def _wire_methods() -> dict[str, Callable[[], optax.GradientTransformation]]:
  methods = {"loco_bf16_gather": lambda: loco(axis_name="data"),
             "loco_quantized_gather": lambda: loco(axis_name="data", gather="quantized")}
  try:
    from loco_jax import baselines
  except ImportError:
    return methods
  for name in BASELINES:
    factory = getattr(baselines, name, None)
    if factory is not None:
      methods[name] = functools.partial(factory, axis_name="data")
  return methods


def wire_bits_in_process() -> list[Record]:
  """Bits each device sends a parameter per step, from each method's lowered HLO, 8 devices.

  Example:
    >>> wire_bits_in_process()   # needs 8 devices (XLA_FLAGS=--xla_force_host_platform_...)
  """
  from jax.sharding import PartitionSpec as P

  from loco_jax import parallel
  mesh = parallel.data_mesh(WIRE_DEVICES)
  params = {k: jnp.zeros(shape, jnp.float32) for k, shape in WIRE_PARAMS.items()}
  n_params = sum(math.prod(s) for s in WIRE_PARAMS.values())
  grads = {k: jax.ShapeDtypeStruct((WIRE_DEVICES, *s), jnp.float32)
           for k, s in WIRE_PARAMS.items()}
  records = []
  for name, make in _wire_methods().items():
    try:
      opt = make()
      state, specs = parallel.init_opt_state(opt, params, mesh)
      update = lambda g, s, opt=opt: opt.update(jax.tree.map(lambda x: x[0], g), s)
      step = jax.jit(jax.shard_map(update, mesh=mesh,
                                   in_specs=(jax.tree.map(lambda _: P("data"), params), specs),
                                   out_specs=(jax.tree.map(lambda _: P(), params), specs)))
      found = comm.lowered_collectives(step, grads, state, num_devices=WIRE_DEVICES)
      records.append(Record(f"wire_bits_per_param/{name}",
                            comm.wire_bits_per_param(found, n_params), "bits/param/device"))
    except Exception as e:  # noqa: BLE001 - one method failing must not hide the others
      print(f"bench: wire bits of {name} failed: {type(e).__name__}: {e}", file=sys.stderr)
  return records


def wire_bits() -> list[Record]:
  """`wire_bits_in_process` here if 8 devices exist, else in a subprocess on 8 host CPUs.

  The lowered HLO (before backend compilation) is the same on every backend, so the
  subprocess forces JAX_PLATFORMS=cpu and --xla_force_host_platform_device_count=8 and leaves
  this process's devices alone.
  """
  if jax.device_count() >= WIRE_DEVICES:
    return wire_bits_in_process()
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                      f" --xla_force_host_platform_device_count={WIRE_DEVICES}").strip()
  code = ("import json; from loco_jax import bench; "
          "print(json.dumps([r._asdict() for r in bench.wire_bits_in_process()]))")
  done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                        timeout=600)
  if done.returncode:
    raise RuntimeError(f"wire-bits subprocess failed:\n{done.stderr[-2000:]}")
  sys.stderr.write(done.stderr)
  return [Record(**r) for r in json.loads(done.stdout.strip().splitlines()[-1])]


# --- Codecs ----------------------------------------------------------------------------------


def codec_records(n_symbols: int, repeats: int) -> list[Record]:
  """loco_jax.codec_bench.run's records (prefixed "codec/"), plus bits per symbol and
  throughput for each codec and beta; none if codec_bench is not there.

  Example:
    >>> codec_records(4096, 1)
  """
  try:
    from loco_jax import codec_bench
  except ImportError:
    print("bench: loco_jax.codec_bench is not available: codecs skipped", file=sys.stderr)
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


def _exact_product_gradients(seed: int, blocks: int, block: int = 2048) -> np.ndarray:
  """Blocks whose max |g| is 7 * 2**k: q / s is exact, so no FMA can change the step."""
  rng = np.random.default_rng(seed)
  top = (7 * 2.0 ** rng.integers(-12, 12, (blocks, 1))).astype(np.float32)
  g = np.clip(rng.standard_normal((blocks, block)) * top / 3, -0.99 * top, 0.99 * top)
  g[:, 0] = top[:, 0] * rng.choice([-1, 1], blocks)
  return g.astype(np.float32).reshape(-1)


def _general_gradients(seed: int, blocks: int, block: int = 2048) -> np.ndarray:
  """Normal values whose blocks differ in magnitude by about e**12."""
  rng = np.random.default_rng(seed)
  magnitude = np.exp(3 * rng.standard_normal((blocks, 1)))
  return (rng.standard_normal((blocks, block)) * magnitude).astype(np.float32).reshape(-1)


def check_kernels(backend: str) -> list[tuple[str, bool, str]]:
  """(check, passed, detail) for the kernels on this backend: Pallas against jnp bit for bit,
  jnp against loco() (bit for bit where no FMA can differ, bounded elsewhere), and
  dequantize_mean against numpy's mean.

  Example:
    >>> all(ok for _, ok, _ in check_kernels(jax.default_backend()))
  """
  checks = []
  interpret = None if backend in ("gpu", "tpu") else True
  for bits, error_bits, beta in ((4, 8, 0.8), (2, 8, 0.5), (8, 6, 0.9)):
    report = kernels.pallas_report(backend, bits, error_bits, beta, interpret=interpret)
    checks.append((f"pallas_equals_jnp/bits={bits},error_bits={error_bits},beta={beta}",
                   report == "match", report))
  blocks, n = 40, 40 * 2048
  step = jax.jit(lambda g, e, s, r: kernels.compress_step(g, e, s, reset=r, decompressed=True,
                                                          implementation="jnp"))
  reference = jax.jit(_reference_step)
  for name, reset_interval, data in (
      ("jnp_equals_loco_exact_products", 1, _exact_product_gradients),
      ("jnp_tracks_loco_general_data", 3, _general_gradients)):
    error, error_scale = jnp.zeros(n, jnp.int8), jnp.zeros(blocks, jnp.float32)
    worst = {"update": 0, "codes": 0, "scales": 0.0}
    for k in range(4):
      g = jnp.asarray(data(k, blocks))
      reset = jnp.bool_(k > 0 and k % reset_interval == 0)
      out = step(g, error, error_scale, reset)
      want = reference(g, error, error_scale, reset)
      error, error_scale = want.error, want.error_scale
      worst["update"] = max(worst["update"], int(np.sum(np.asarray(out.decompressed) !=
                                                        np.asarray(want.decompressed))))
      worst["codes"] = max(worst["codes"], int(np.sum(np.asarray(out.error) !=
                                                      np.asarray(want.error))))
      got_scale, want_scale = np.asarray(out.error_scale), np.asarray(want.error_scale)
      worst["scales"] = max(worst["scales"], float(np.max(
          np.abs(got_scale - want_scale) / np.maximum(np.abs(want_scale), 1e-30))))
    exact = worst["update"] == worst["codes"] == 0 and worst["scales"] == 0
    bounded = worst["codes"] <= n * 1e-4 and worst["scales"] <= 2e-6
    checks.append((name, exact if reset_interval == 1 else bounded,
                   f"elements differing (worst step): update {worst['update']}/{n}, error "
                   f"codes {worst['codes']}/{n}; error scales max rel diff {worst['scales']:.2g}"))
  peers, rng = 8, np.random.default_rng(7)
  received = rng.integers(0, 256, (peers, blocks * 1024), dtype=np.uint8)
  scales = np.exp(3 * rng.standard_normal((peers, blocks))).astype(np.float32)
  scales[0, 3] = 0.0
  low, high = (received & 15).astype(np.int32) - 8, (received >> 4).astype(np.int32) - 8
  codes = np.concatenate([low.reshape(peers, blocks, -1), high.reshape(peers, blocks, -1)], -1)
  step_size = (np.float32(1) / np.where(scales > 0, scales, np.float32(1))).astype(np.float32)
  values = np.where(scales[..., None] > 0, codes.astype(np.float32) * step_size[..., None],
                    np.float32(0)).astype(np.float32)
  want = values.mean(axis=0).reshape(-1)
  # XLA:GPU's 1 / s is rcp.approx.f32 (see kernels._triton_ops): there the mean is checked to
  # a few ulp of the mean of |values| (the sum may cancel); elsewhere bit for bit.
  tolerance = 4 * np.finfo(np.float32).eps if backend == "gpu" else 0.0
  for implementation in ("jnp", "auto"):
    got = np.asarray(jax.jit(functools.partial(kernels.dequantize_mean,
                                               implementation=implementation))(received, scales))
    magnitude = np.maximum(np.abs(values).mean(axis=0).reshape(-1), 1e-30)
    worst = float(np.max(np.abs(got - want) / magnitude))
    checks.append((f"dequantize_mean_matches_numpy/{implementation}", worst <= tolerance,
                   f"{int(np.sum(got != want))}/{want.size} elements differ, max diff "
                   f"{worst:.2g} of mean |value| (allowed {tolerance:.2g})"))
  return checks


# --- Output ----------------------------------------------------------------------------------


def _value(records: list[Record], name: str) -> float | None:
  return next((r.value for r in records if r.name == name), None)


def format_tables(records: list[Record], backend: str, n: int, repeats: int, psi: float,
                  cost_rows: list[dict], codec_symbols: int) -> str:
  """The markdown printed by `loco-jax bench`."""
  lines = [f"## Step times: backend {backend}, n_params = {n}, median of {repeats} "
           "(interleaved)", "",
           "| step | ms | GB/s (nominal bytes) | vs adamw | bandwidth vs copy | HLO fusions |",
           "|---|---|---|---|---|---|"]
  adamw_ms = _value(records, "step_ms/adamw")
  copy_gbps = _value(records, "bandwidth_GBps/copy")
  for r in records:
    if not r.name.startswith("step_ms/"):
      continue
    name = r.name.split("/", 1)[1]
    gbps = _value(records, f"bandwidth_GBps/{name}")
    fusions = _value(records, f"hlo_fusions/{name}")
    lines.append(f"| {name} | {r.value:.3f} | {'' if gbps is None else f'{gbps:.1f}'} | "
                 f"{r.value / adamw_ms:.3f} | "
                 f"{'' if gbps is None else f'{gbps / copy_gbps:.3f}'} | "
                 f"{'' if fusions is None else int(fusions)} |")
  lines += ["", "| ratio | value |", "|---|---|"]
  for name in ("loco_over_adamw", "compress_step_over_adamw", "loco_bandwidth_fraction_of_copy",
               "loco_update_bandwidth_fraction_of_copy", "compress_step_auto_is_pallas"):
    value = _value(records, name)
    if value is not None:
      lines.append(f"| {name} | {value:.3f} |")
  lines += [f"| {r.name} (1 match, 0 mismatch, -1 error) | {r.value:.0f} |" for r in records
            if r.name.startswith("pallas_report/")]
  wire = [r for r in records if r.name.startswith("wire_bits_per_param/")]
  if wire:
    lines += ["", f"## Wire bits per parameter per device ({WIRE_DEVICES} devices, lowered HLO)",
              "", "| method | bits |", "|---|---|"]
    lines += [f"| {r.name.split('/', 1)[1]} | {r.value:.3f} |" for r in wire]
  codec_lines = _codec_table(records)
  if codec_lines:
    lines += ["", f"## Codecs on the host CPU: bits per symbol, encode + decode throughput "
              f"({codec_symbols} fp4 GenNorm symbols per beta)", ""] + codec_lines
  if cost_rows:
    lines += ["", f"## Cost model: Psi = {psi:.3g} params, LoCo paper Table I, compute from "
              f"this run's adamw and loco_update ({backend}), no overlap", "",
              "| devices | Gb/s | ring bf16 s | ring LoCo s | ring speedup | "
              "master-server speedup |", "|---|---|---|---|---|---|"]
    for row in cost_rows:
      ring = row["ring"]
      lines.append(f"| {row['devices']} | {row['gbps']} | {ring['bf16_s']:.3f} | "
                   f"{ring['loco_s']:.3f} | {ring['speedup']:.2f} | "
                   f"{row['master-server']['speedup']:.2f} |")
  return "\n".join(lines) + "\n"


# --- Command line ----------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog="loco-jax bench",
      description="LoCo's step against adamw and a device copy (medians, interleaved), wire "
                  "bits from the HLO, the Huffman codec against zlib/zstd, and a cost model.")
  p.add_argument("--n-params", type=int, default=None,
                 help="parameters of the timed flat leaf (default 2**24 on CPU, 2**30 on "
                      "GPU/TPU, 2**16 with --quick)")
  p.add_argument("--repeats", type=int, default=None,
                 help="timed repeats (default 10, 3 with --quick)")
  p.add_argument("--json", default=None, help="write the records here (atomically)")
  p.add_argument("--quick", action="store_true",
                 help="tiny sizes: a smoke test of every part")
  p.add_argument("--psi", type=float, default=7e9, help="model size for the cost model")
  p.add_argument("--codec-symbols", type=int, default=None,
                 help="symbols per codec run (default 2**20, 2**12 with --quick)")
  p.add_argument("--skip", default="", help="comma-separated parts to skip: wire,codec")
  p.add_argument("--check-kernels", action="store_true",
                 help="only check the kernels on this backend (Pallas == jnp bit for bit, jnp "
                      "against loco(), dequantize_mean against numpy); exit 1 on a failure")
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
    if not (math.isfinite(args.psi) and args.psi > 0):
      parser.error(f"--psi must be a positive number of parameters, got {args.psi}")
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
  records = _timing_records(n, repeats, backend, sweep=not args.quick)

  adamw_s = _value(records, "step_ms/adamw") / 1e3
  loco_s = _value(records, "step_ms/loco_update") / 1e3
  cost_rows = cost_model(args.psi, adamw_s / n, loco_s / n)
  for row in cost_rows:
    for topology in ("ring", "master-server"):
      records.append(Record(f"cost_model_speedup/{topology}/devices={row['devices']}/"
                            f"gbps={row['gbps']}", row[topology]["speedup"], "x"))
  if "wire" not in skip:
    records += wire_bits()
  codec_symbols = args.codec_symbols or (2**12 if args.quick else 2**20)
  if "codec" not in skip:
    records += codec_records(codec_symbols, 1 if args.quick else 3)
  print(format_tables(records, backend, n, repeats, args.psi, cost_rows, codec_symbols), end="")
  print(f"\n({time.perf_counter() - started:.1f} s, jax {jax.__version__}, "
        f"{jax.devices()[0].device_kind})")
  if args.json:
    out = [dict(r._asdict(), backend=backend,
                n_params=(codec_symbols if r.name.startswith("codec") else
                          sum(math.prod(s) for s in WIRE_PARAMS.values())
                          if r.name.startswith("wire_bits") else
                          args.psi if r.name.startswith("cost_model") else n))
           for r in records]
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    files.write_json_atomic(args.json, out, indent=1)
  return 0
