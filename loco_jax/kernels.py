"""Fused LoCo compress step (compensate, quantize, pack, error update) and the receive-side mean."""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from loco_jax import quant, reference

try:
  from jax.experimental import pallas as pl
except ImportError:  # pragma: no cover - a jax without Pallas runs the jnp path only
  pl = None

IMPLEMENTATIONS = ("auto", "jnp", "pallas")
# Pallas tiles: scale blocks per program instance (each tile row is one whole scale block, so
# the absmax never crosses program instances) and Triton warps per instance.
# On an H200 one block of 2048 with 4 warps ran fastest (2**28 values: 0.75 ms; 2 blocks 0.79;
# 4 blocks with 8 warps 3.8 ms on 2**30 against 3.3 for one block; docs/PERFORMANCE.md).
TILE_BLOCKS = {"gpu": 1, "tpu": 32, "cpu": 8}
NUM_WARPS = 4
# On GPU, buckets of shorter blocks (a small leaf's remainder) take the jnp path.
GPU_MIN_BLOCK = 128
# The jnp path on CPU works through this many blocks of 2048 at a time (see `_compress_jnp`):
# on 2**24 values (2 shared EPYC cores, 2026-12-01) the step took 1.24x adamw's time untiled
# and 0.56x by tiles of 64 or 256 blocks (the materialized h and residual stay in cache).
CPU_TILE_BLOCKS = 64


class Compressed(NamedTuple):
  """One LoCo step on a flat float32 vector of `blocks * block_size` values."""
  packed: jax.Array               # uint8 [blocks, block_size * bits / 8], quant.pack's layout
  scales: jax.Array               # float32 [blocks], sent with the payload
  error: jax.Array                # int8 [size], the new stored error
  error_scale: jax.Array          # float32 [blocks]
  finite: jax.Array               # bool []: every gradient value was finite
  decompressed: jax.Array | None  # float32 [size], loco's local-mode output (if asked for)


# --- The arithmetic, written once for the jnp path and the Pallas kernels ---------------------
#
# Plain float32 arithmetic: each implementation is held to the float64 reference
# (`reference.check_step`) within float32 rounding, not to the others bit for bit, so compilers
# may contract products into FMAs. A given program is deterministic run to run.


def _absmax_scale(absmax: jax.Array, bits: int) -> jax.Array:
  """quant.absmax_scale from a precomputed max|x|: qmax / absmax, 0 if vanishing or not finite."""
  usable = (absmax > quant.VANISHING) & jnp.isfinite(absmax)
  scale = np.float32(max(quant.int_range(bits)[1], 1)) / jnp.where(usable, absmax, 1.0)
  return jnp.where(usable, jnp.maximum(scale, quant.TINY), 0.0)


def _reciprocal(scale: jax.Array) -> jax.Array:
  """1 / scale where scale > 0 (else 1): q / s is computed as q * (1 / s), one division a block."""
  return 1.0 / jnp.where(scale > 0, scale, 1.0)


def _quantize(x: jax.Array, scale: jax.Array, bits: int) -> jax.Array:
  """Eq. (1), integer-valued float32: clip(round_half_even(scale * x), qmin, qmax)."""
  qmin, qmax = quant.int_range(bits)
  return jnp.clip(jnp.round(scale * x), qmin, qmax)


def _max_abs(planes: list[jax.Array]) -> jax.Array:
  """max |x| over the last axis of every plane (the planes of one scale block): [rows, 1]."""
  return functools.reduce(jnp.maximum, [jnp.max(jnp.abs(x), axis=-1, keepdims=True)
                                        for x in planes])


def _fixed_or_absmax(fixed, absmax: jax.Array, bits: int) -> jax.Array:
  if fixed is None:
    return _absmax_scale(absmax, bits)
  return jnp.full_like(absmax, fixed)


def _step(g: list[jax.Array], error: list[jax.Array], error_scale: jax.Array, bits: int,
          error_bits: int, beta, fixed_scale, fixed_error_scale, with_decompressed: bool):
  """LoCo's step on the planes of whole scale blocks ([rows, width] each; scales [rows, 1]).

  Returns the codes q (integer-valued float32 planes), the scales, the new error codes (planes),
  the new error scales, [rows, 1] bool "every g of the block was finite" and, if asked for,
  the decompressed planes. Saturating where loco's unfused step does (quant.saturate): e,
  h = g + e, q / s and the residual stay finite for finite g near the float32 maximum.
  """
  sat = quant.saturate
  has_error, error_step = error_scale > 0, _reciprocal(error_scale)
  e = [jnp.where(has_error, sat(c.astype(jnp.float32) * error_step), 0.0) for c in error]
  # A non-finite g marks its block with inf: the block's max keeps it (XLA:CPU's max drops NaN).
  h = [jnp.where(jnp.isfinite(gi), sat(gi + ei), jnp.inf) for gi, ei in zip(g, e)]
  absmax = _max_abs(h)
  scale = _fixed_or_absmax(fixed_scale, absmax, bits)
  sent, step = scale > 0, _reciprocal(scale)
  q = [_quantize(x, scale, bits) for x in h]
  d = [jnp.where(sent, sat(qi * step), 0.0) for qi in q]
  keep, mix = (np.float32(beta), np.float32(1.0 - beta)) if _is_constant(beta) else (
      beta, 1.0 - beta)
  residual = [sat(keep * ei + mix * (hi - di)) for ei, hi, di in zip(e, h, d)]
  new_scale = _fixed_or_absmax(fixed_error_scale, _max_abs(residual), error_bits)
  new_error = [_quantize(r, new_scale, error_bits) for r in residual]
  return q, scale, new_error, new_scale, jnp.isfinite(absmax), d if with_decompressed else None


def _is_constant(x) -> bool:
  return not isinstance(x, jax.core.Tracer)


# --- jnp: the XLA formulation -------------------------------------------------------------


def _compress_whole(g_BxL, error_BxL, error_scale_B, bits, error_bits, beta, fixed_scale,
                    fixed_error_scale, with_decompressed):
  q, scale, new_error, new_scale, finite, d = _step(
      [g_BxL], [error_BxL], error_scale_B[:, None], bits, error_bits, beta, fixed_scale,
      fixed_error_scale, with_decompressed)
  return (quant.pack(q[0].astype(jnp.int8), bits), scale[:, 0], new_error[0].astype(jnp.int8),
          new_scale[:, 0], jnp.all(finite), d[0] if with_decompressed else None)


def _compress_jnp(g_BxL, error_BxL, error_scale_B, bits, error_bits, beta, fixed_scale,
                  fixed_error_scale, with_decompressed, backend):
  """The XLA formulation. XLA:CPU materializes every reduction's input (h, then the residual),
  so on CPU the step runs tile by tile (about `CPU_TILE_BLOCKS` blocks of 2048) and those
  passes stay in cache; elsewhere XLA fuses the reductions into their producers and takes the
  whole vector."""
  blocks, block_size = g_BxL.shape
  tile = min(blocks, max(1, CPU_TILE_BLOCKS * 2048 // block_size))
  step = functools.partial(_compress_whole, bits=bits, error_bits=error_bits, beta=beta,
                           fixed_scale=fixed_scale, fixed_error_scale=fixed_error_scale,
                           with_decompressed=with_decompressed)
  if backend != "cpu" or tile == blocks:
    out = step(g_BxL, error_BxL, error_scale_B)
  else:
    out = _tiled(step, (g_BxL, error_BxL, error_scale_B), blocks, tile)
  packed, scale, new_error, new_scale, finite, d = out
  return (packed, scale, new_error.reshape(-1), new_scale, finite,
          None if d is None else d.reshape(-1))


def _tiled(step, inputs, blocks: int, tile: int):
  """`step` over tiles of `tile` blocks, in a loop. The last tile ends at the last block (it may
  overlap the one before: blocks are independent, so they are computed again, identically)."""
  at = lambda i: jnp.minimum(i * tile, blocks - tile)
  take = lambda x, i: jax.lax.dynamic_slice_in_dim(x, at(i), tile)
  shapes = jax.eval_shape(step, *[take(x, 0) for x in inputs])
  outs = [None if s is None else jnp.zeros((blocks, *s.shape[1:]), s.dtype) if s.ndim else
          jnp.bool_(True) for s in shapes]
  # Under jax.shard_map the loop's carry varies over the axes that the inputs vary over.
  axes = tuple(jax.typeof(inputs[0]).manual_axis_type.varying)
  if axes:
    outs = [None if o is None else jax.lax.pcast(o, axes, to="varying") for o in outs]

  def body(i, outs):
    got = step(*[take(x, i) for x in inputs])
    return [None if o is None else o & r if o.ndim == 0 else
            jax.lax.dynamic_update_slice_in_dim(o, r, at(i), 0) for o, r in zip(outs, got)]

  return jax.lax.fori_loop(0, -(-blocks // tile), body, outs)


def _dequantize(word: jax.Array, scale: jax.Array, bits: int, down: float = 1.0) -> list[jax.Array]:
  """uint8 words (as int32) [rows, width] -> the `8 // bits` decompressed planes (q / s
  saturated as quant.decompress does), each times `down` (a power of two: exact)."""
  qmin, mask = quant.int_range(bits)[0], (1 << bits) - 1
  step, sent = _reciprocal(scale), scale > 0
  return [jnp.where(sent, quant.saturate(
      (((word >> (t * bits)) & mask) + qmin).astype(jnp.float32) * step) * np.float32(down), 0.0)
          for t in range(8 // bits)]


# Up to this many peers the jnp mean is one unrolled fusion; beyond, a loop over the peers.
UNROLLED_PEERS = 64


def _mean_jnp(packed_NxBxP, scales_NxB, bits):
  """sum_j q_j / s_j, added in peer order from 0, * 1/N, without overflow: as
  quant.mean_over_peers, sum_j (q_j / s_j) 2**-k, times 2**k / N."""
  shards = packed_NxBxP.shape[0]
  down, up = quant.mean_factors(shards)
  if 8 % bits:
    codes = quant.unpack(packed_NxBxP, bits).astype(jnp.float32)
    step = _reciprocal(scales_NxB[..., None])
    peer = lambda j: jnp.where(scales_NxB[j][..., None] > 0,
                               quant.saturate(codes[j] * step[j]) * np.float32(down), 0.0)
  else:
    peer = lambda j: jnp.concatenate(_dequantize(
        packed_NxBxP[j].astype(jnp.int32), scales_NxB[j][..., None], bits, down), -1)
  total = jnp.zeros(packed_NxBxP.shape[1:2] + (packed_NxBxP.shape[2] * 8 // bits,), jnp.float32)
  if shards <= UNROLLED_PEERS:
    for j in range(shards):
      total = total + peer(j)
  else:
    total = jax.lax.fori_loop(0, shards, lambda j, acc: acc + peer(j), total)
  return quant.saturate(total * np.float32(up)).reshape(-1)


# --- Pallas: one program instance per tile of whole scale blocks, one pass over memory -------


def _compress_kernel(g_ref, e_ref, es_ref, packed_ref, scale_ref, new_e_ref, new_es_ref,
                     finite_ref, *d_ref, bits, error_bits, beta, fixed_scale, fixed_error_scale):
  """Planes are the `8 // bits` column ranges that share a byte (quant.pack's layout)."""
  width = g_ref.shape[1] * bits // 8
  planes = [pl.ds(t * width, width) for t in range(8 // bits)]
  q, scale, new_error, new_scale, finite, d = _step(
      [g_ref[:, p] for p in planes], [e_ref[:, p] for p in planes], es_ref[...], bits,
      error_bits, beta, fixed_scale, fixed_error_scale, bool(d_ref))
  qmin = quant.int_range(bits)[0]
  word = None
  for t, p in enumerate(planes):
    new_e_ref[:, p] = new_error[t].astype(jnp.int8)
    unsigned = (q[t] - qmin).astype(jnp.int32) << (t * bits)
    word = unsigned if word is None else word | unsigned
    if d_ref:
      d_ref[0][:, p] = d[t]
  packed_ref[...] = word.astype(jnp.uint8)
  scale_ref[...] = scale
  new_es_ref[...] = new_scale
  finite_ref[...] = finite.astype(jnp.int32)


def _mean_kernel(packed_ref, scales_ref, out_ref, *, shards, bits):
  width = packed_ref.shape[2]
  down, up = quant.mean_factors(shards)

  def add_shard(j, sums):
    planes = _dequantize(packed_ref[j].astype(jnp.int32), scales_ref[j], bits, down)
    return tuple(s + v for s, v in zip(sums, planes))

  zeros = tuple(jnp.zeros((out_ref.shape[0], width), jnp.float32) for _ in range(8 // bits))
  sums = jax.lax.fori_loop(0, shards, add_shard, zeros)
  for t, s in enumerate(sums):
    out_ref[:, pl.ds(t * width, width)] = quant.saturate(s * np.float32(up))


def _pallas_settings(backend: str, interpret: bool | None, tile_blocks: int | None,
                     num_warps: int | None, block_len: int):
  """(interpret, compiler_params, tile_blocks) for a Pallas call on `backend`. Blocks shorter
  than 2048 are taken several to a program (a program of a few values is all overhead)."""
  interpret = backend == "cpu" if interpret is None else interpret
  short = max(1, 2048 // block_len)
  if interpret:
    return True, None, tile_blocks or TILE_BLOCKS["cpu"] * short
  tile_blocks = tile_blocks or TILE_BLOCKS.get(backend, 1) * short
  if backend == "gpu":
    from jax.experimental.pallas import triton as pltriton
    return False, pltriton.CompilerParams(num_warps=num_warps or NUM_WARPS,
                                          num_stages=1), tile_blocks
  if backend == "tpu":
    from jax.experimental.pallas import tpu as pltpu
    return False, pltpu.CompilerParams(dimension_semantics=("parallel",)), tile_blocks
  raise ValueError(f"no compiled Pallas path on backend {backend!r}; pass interpret=True")


def _tile(blocks: int, tile_blocks: int) -> int:
  """The largest power of two that divides `blocks` and is at most `tile_blocks`."""
  tile = 1
  while tile * 2 <= tile_blocks and blocks % (tile * 2) == 0:
    tile *= 2
  return tile


def _same_varying_axes(*inputs: jax.Array) -> list[jax.Array]:
  """The inputs, each cast to vary over every jax.shard_map axis that any of them varies over:
  a pallas_call under shard_map takes inputs and outputs of one kind (none outside shard_map)."""
  axes = frozenset().union(*[jax.typeof(x).manual_axis_type.varying for x in inputs])
  return [x if jax.typeof(x).manual_axis_type.varying == axes else
          jax.lax.pcast(x, tuple(axes - jax.typeof(x).manual_axis_type.varying), to="varying")
          for x in inputs]


def _out_shape(shape: tuple, dtype, like: jax.Array) -> jax.ShapeDtypeStruct:
  """A Pallas output that varies over the same jax.shard_map axes as `like` (an input)."""
  return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.typeof(like).manual_axis_type)


def _compress_pallas(g_BxL, error_BxL, error_scale_B, bits, error_bits, beta, fixed_scale,
                     fixed_error_scale, with_decompressed, backend, interpret, tile_blocks,
                     num_warps):
  blocks, block_size = g_BxL.shape
  interpret, params, tile_blocks = _pallas_settings(backend, interpret, tile_blocks, num_warps,
                                                    block_size)
  tile = _tile(blocks, tile_blocks)
  nbytes = block_size * bits // 8
  g_BxL, error_BxL, error_scale_B = _same_varying_axes(g_BxL, error_BxL, error_scale_B)
  rows = lambda width: pl.BlockSpec((tile, width), lambda i: (i, 0))
  shapes = [((blocks, nbytes), jnp.uint8), ((blocks, 1), jnp.float32),
            ((blocks, block_size), jnp.int8), ((blocks, 1), jnp.float32),
            ((blocks, 1), jnp.int32)] + ([((blocks, block_size), jnp.float32)]
                                         if with_decompressed else [])
  kernel = functools.partial(_compress_kernel, bits=bits, error_bits=error_bits, beta=beta,
                             fixed_scale=fixed_scale, fixed_error_scale=fixed_error_scale)
  outs = pl.pallas_call(
      kernel, out_shape=[_out_shape(s, t, g_BxL) for s, t in shapes], grid=(blocks // tile,),
      in_specs=[rows(block_size), rows(block_size), rows(1)],
      out_specs=[rows(s[1]) for s, _ in shapes],
      interpret=interpret, compiler_params=params, name="loco_compress_step",
  )(g_BxL, error_BxL, error_scale_B[:, None])
  packed, scales, new_error, new_scale, finite = outs[:5]
  return (packed, scales[:, 0], new_error.reshape(-1), new_scale[:, 0], jnp.all(finite != 0),
          outs[5].reshape(-1) if with_decompressed else None)


def _mean_pallas(packed_NxBxP, scales_NxB, bits, backend, interpret, tile_blocks, num_warps):
  shards, blocks, nbytes = packed_NxBxP.shape
  block_len = nbytes * 8 // bits
  interpret, params, tile_blocks = _pallas_settings(backend, interpret, tile_blocks, num_warps,
                                                    block_len)
  tile = _tile(blocks, tile_blocks)
  packed_NxBxP, scales_NxB = _same_varying_axes(packed_NxBxP, scales_NxB)
  out = pl.pallas_call(
      functools.partial(_mean_kernel, shards=shards, bits=bits),
      out_shape=_out_shape((blocks, block_len), jnp.float32, packed_NxBxP),
      grid=(blocks // tile,),
      in_specs=[pl.BlockSpec((shards, tile, nbytes), lambda i: (0, i, 0)),
                pl.BlockSpec((shards, tile, 1), lambda i: (0, i, 0))],
      out_specs=pl.BlockSpec((tile, block_len), lambda i: (i, 0)),
      interpret=interpret, compiler_params=params, name="loco_dequantize_mean",
  )(packed_NxBxP, scales_NxB[..., None])
  return out.reshape(-1)


# --- Choosing the implementation: each is checked against the float64 reference -------------


def _pallas_unsupported(bits: int, block_size: int, beta, backend: str, peers: int = 1,
                        fixed=(None, None)) -> str | None:
  """Why the Pallas path cannot run these settings (None when it can)."""
  if pl is None:
    return "jax.experimental.pallas does not import here"
  if 8 % bits:
    return f"bits={bits} does not divide 8 (bit-plane packing is jnp only)"
  if not all(_is_constant(x) for x in (beta, *fixed)):
    return "beta or a fixed scale is traced (the kernel bakes them in as constants)"
  if backend == "gpu" and block_size & (block_size - 1):
    return f"Triton tiles need a power-of-two block_size, got {block_size}"
  if backend == "gpu" and peers & (peers - 1):
    return f"Triton tiles need a power-of-two number of peers, got {peers}"
  if backend == "gpu" and block_size < GPU_MIN_BLOCK:
    return f"blocks of {block_size} < {GPU_MIN_BLOCK} values run on jnp (Triton tiles that small)"
  return None


def _check_data(blocks: int, block_size: int, seed: int) -> np.ndarray:
  """Normal values whose blocks differ in magnitude by about e**12, one all-zero block."""
  rng = np.random.default_rng(seed)
  magnitude = np.exp(3 * rng.standard_normal((blocks, 1)))
  g = rng.standard_normal((blocks, block_size)) * magnitude
  g[blocks // 2] = 0.0
  return g.astype(np.float32)


@functools.cache
def implementation_report(implementation: str, backend: str, bits: int = 4,
                          error_bits: int = 8, beta: float = 0.8, block_size: int = 2048,
                          tile_blocks: int | None = None, num_warps: int | None = None,
                          interpret: bool | None = None) -> str:
  """"pass" if `implementation` runs here and its steps and receive-side mean agree with the
  float64 reference (`reference.check_step`, `reference.mean_off`) within float32 rounding,
  else "fail: ..." (what was off) or "error: ..." (why it did not run).

  Three compress steps (each from the previous one's error, the third after a reset) and a
  dequantize_mean of their payloads; cached per configuration.
  Example:
    >>> implementation_report("jnp", "cpu")
    'pass'
  """
  def run(fn, *args):  # compiled and called directly: safe while an outer jit is tracing
    return jax.jit(fn).lower(*args).compile()(*args)

  if backend != jax.default_backend():
    return f"error: asked about {backend!r}, but this process runs on {jax.default_backend()!r}"
  blocks = 4 * (tile_blocks or TILE_BLOCKS.get(backend, 1))
  options = dict(bits=bits, implementation=implementation, tile_blocks=tile_blocks,
                 num_warps=num_warps, interpret=interpret)
  problems = []
  try:
    error, error_scale = np.zeros(blocks * block_size, np.int8), np.zeros(blocks, np.float32)
    payloads = []
    for k in range(3):
      g = _check_data(blocks, block_size, k)
      step = functools.partial(compress_step, error_bits=error_bits, beta=beta, reset=k == 2,
                               block_size=block_size, decompressed=True, **options)
      out = Compressed(*[np.asarray(x) for x in run(step, g.reshape(-1), error, error_scale)])
      codes = np.asarray(quant.unpack(out.packed, bits))
      found = reference.check_step(
          g, error.reshape(blocks, -1), error_scale, codes, out.scales,
          out.error.reshape(blocks, -1), out.error_scale, out.decompressed.reshape(blocks, -1),
          bits=bits, error_bits=error_bits, beta=beta, reset=k == 2)
      problems += [f"step {k}: {found}"] if not found.passed else []
      problems += [f"step {k}: finite=False on finite data"] if not out.finite else []
      payloads.append((out.packed.reshape(-1), out.scales, codes))
      error, error_scale = out.error, out.error_scale
    received, scales, codes = [np.stack(x) for x in zip(*payloads)]
    mean = run(functools.partial(dequantize_mean, **options), received, scales)
  except Exception as e:  # noqa: BLE001 - any lowering or runtime failure means "do not use it"
    return f"error: {implementation}: {type(e).__name__}: {str(e).splitlines()[0][:300]}"
  off = reference.mean_off(np.asarray(mean), codes, scales)
  problems += [f"dequantize_mean: {off} elements off"] if off else []
  return "pass" if not problems else "fail: " + "; ".join(problems)


def pallas_report(backend: str, bits: int = 4, error_bits: int = 8, beta: float = 0.8,
                  block_size: int = 2048, tile_blocks: int | None = None,
                  num_warps: int | None = None, interpret: bool | None = None) -> str:
  """`implementation_report` of the Pallas kernels: "pass" where `auto` may pick them.

  Example:
    >>> pallas_report("gpu", tile_blocks=8, num_warps=8)   # "pass" on a GPU
    "error: asked about 'gpu', but this process runs on 'cpu'"
  """
  return implementation_report("pallas", backend, bits, error_bits, beta, block_size,
                               tile_blocks, num_warps, interpret)


def _resolve(implementation: str, bits: int, error_bits: int, beta, block_size: int,
             tile_blocks, num_warps, interpret, peers: int = 1,
             fixed=(None, None)) -> tuple[str, str]:
  """("jnp" | "pallas", backend) for a call with these settings (`peers` shards)."""
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
  backend = jax.default_backend()
  if implementation == "jnp":
    return "jnp", backend
  why_not = _pallas_unsupported(bits, block_size, beta, backend, peers, fixed)
  if implementation == "pallas":
    if why_not:
      raise ValueError(f"implementation='pallas' cannot run here: {why_not}")
    return "pallas", backend
  if why_not or backend not in ("gpu", "tpu") or interpret:
    return "jnp", backend  # on CPU Pallas only interprets: slower than XLA
  # One check per (bits, error_bits, beta): it runs with absmax scales and blocks of 2048 (a
  # fixed scale only replaces a computed value by a constant; the tests cover other blocks).
  passed = pallas_report(backend, bits, error_bits, float(beta), 2048, tile_blocks,
                         num_warps) == "pass"
  return ("pallas" if passed else "jnp"), backend


def chosen_implementation(bits: int = 4, error_bits: int = 8, beta: float = 0.8,
                          block_size: int = 2048, tile_blocks: int | None = None,
                          num_warps: int | None = None) -> str:
  """What `implementation="auto"` runs on the current backend: "pallas" or "jnp".

  Example:
    >>> chosen_implementation()   # on CPU
    'jnp'
  """
  return _resolve("auto", bits, error_bits, beta, block_size, tile_blocks, num_warps, None)[0]


# --- Public API ----------------------------------------------------------------------------


def _check_compress(size: int, error, error_scale, fixed_error_scale, bits: int,
                    error_bits: int, block_size: int) -> int:
  quant.check_bits(bits)
  quant.check_bits(error_bits, "error_bits")
  if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)) or (
      block_size <= 0 or block_size % quant.PACK_UNIT):
    raise ValueError(f"block_size must be a positive multiple of {quant.PACK_UNIT}, got "
                     f"{block_size!r}")
  if size == 0 or size % block_size:
    raise ValueError(f"compress_step needs a size that is a positive multiple of block_size="
                     f"{block_size}, got {size} (loco() handles ragged leaves)")
  blocks = size // block_size
  if error.shape != (size,) or error.dtype != jnp.int8:
    raise ValueError(f"error must be int8 [{size}], got {error.dtype} {tuple(error.shape)}")
  if (error_scale is None) == (fixed_error_scale is None):
    raise ValueError("pass the stored error's block scales (error_scale) or a fixed_error_scale, "
                     "exactly one of them")
  if error_scale is not None and error_scale.shape != (blocks,):
    raise ValueError(f"error_scale must be float32 [{blocks}] (one per block), got "
                     f"{tuple(error_scale.shape)}")
  return blocks


def compress_step(g: jax.Array, error: jax.Array, error_scale: jax.Array | None, *,
                  bits: int = 4, error_bits: int = 8, beta: float = 0.8,
                  reset: jax.Array | bool = False, block_size: int = 2048,
                  decompressed: bool = False, fixed_scale: float | None = None,
                  fixed_error_scale: float | None = None, implementation: str = "auto",
                  tile_blocks: int | None = None, num_warps: int | None = None,
                  interpret: bool | None = None) -> Compressed:
  """LoCo's step on a flat vector whose size is a multiple of block_size.

  What `loco()` runs on each bucket: e = error / error_scale (0 if `reset`), h = g + e,
  q = compress(h; s) with s = qmax / max|h| per block (or `fixed_scale`), d = q / s,
  error' = compress(beta e + (1 - beta)(h - d); per-block absmax (or `fixed_error_scale`),
  error_bits). The Pallas kernel reads g (4 B) and the error (1 B) once and writes the payload
  (bits / 8 B) and the new error (1 B): 6.5 B an element at 4 bits (plus 4 B with
  `decompressed`).
  `implementation`: "pallas" is one kernel, one program instance per `tile_blocks` scale blocks
  (Triton on GPU, Mosaic on TPU, the interpreter on CPU); "jnp" is the XLA formulation; "auto"
  takes Pallas on GPU/TPU where `pallas_report` passes (the float64 reference check), else jnp.
  Every implementation agrees with `reference.check_step` within float32 rounding and is
  deterministic run to run. A non-finite g gives finite=False and unspecified other outputs
  (loco then keeps its previous state); a finite g gives finite outputs: e, g + e, q / s and
  the residual saturate at the float32 maximum, and scales stay at least `quant.TINY`.
  With a fixed scale, `scales` (or `error_scale`) holds that value for every block.
  Example:
    >>> g = jnp.linspace(-1.0, 1.0, 2 * 2048)
    >>> out = compress_step(g, jnp.zeros(g.size, jnp.int8), jnp.zeros(g.size // 2048))
    >>> out.packed.shape, out.error.dtype
    ((2, 1024), dtype('int8'))
  """
  blocks = _check_compress(g.size, error, error_scale, fixed_error_scale, bits, error_bits,
                           block_size)
  name, backend = _resolve(implementation, bits, error_bits, beta, block_size, tile_blocks,
                           num_warps, interpret, fixed=(fixed_scale, fixed_error_scale))
  g_BxL = g.reshape(blocks, block_size).astype(jnp.float32)
  error_BxL = error.reshape(blocks, block_size)
  stored = (jnp.full((blocks,), fixed_error_scale, jnp.float32) if error_scale is None
            else error_scale.astype(jnp.float32))
  # A reset zeroes the error: a zero scale decompresses to exactly 0, as loco's where() does.
  stored = jnp.where(reset, 0.0, stored)
  args = (g_BxL, error_BxL, stored, bits, error_bits, beta, fixed_scale, fixed_error_scale,
          decompressed, backend)
  if name == "jnp":
    out = _compress_jnp(*args)
  else:
    out = _compress_pallas(*args, interpret, tile_blocks, num_warps)
  return Compressed(*out)


def dequantize_mean(received: jax.Array, scales: jax.Array, *, bits: int = 4,
                    implementation: str = "auto", tile_blocks: int | None = None,
                    num_warps: int | None = None, interpret: bool | None = None) -> jax.Array:
  """The float32 mean of N peers' packed shards: a device's work after the all-to-all.

  `received` is uint8 [N, blocks * block_len * bits / 8] (row j from peer j, quant.pack's
  layout within each block) and `scales` float32 [N, blocks]; returns float32
  [blocks * block_len]: the mean over j of q_j / s_j (0 where s_j is 0) in one pass over the N
  shards, within float32 rounding of the float64 mean (`reference.mean_off`). It never
  overflows: each q_j / s_j saturates at the float32 maximum and is added times 2**-k
  (2**k >= N, exact), the sum then times 2**k / N (`quant.mean_factors`).
  Example:
    >>> g = jnp.linspace(-1.0, 1.0, 2048)
    >>> a = compress_step(g, jnp.zeros(g.size, jnp.int8), jnp.zeros(1))
    >>> b = compress_step(-g, jnp.zeros(g.size, jnp.int8), jnp.zeros(1))
    >>> mean = dequantize_mean(jnp.stack([a.packed.reshape(-1), b.packed.reshape(-1)]),
    ...                        jnp.stack([a.scales, b.scales]))
    >>> float(jnp.abs(mean).max())   # the two peers' gradients cancel
    0.0
  """
  quant.check_bits(bits)
  if received.ndim != 2 or scales.ndim != 2 or received.shape[0] != scales.shape[0]:
    raise ValueError(f"received must be [N, bytes] and scales [N, blocks] with the same N, got "
                     f"{tuple(received.shape)} and {tuple(scales.shape)}")
  shards, nbytes = received.shape
  blocks = scales.shape[1]
  if shards == 0 or blocks == 0 or nbytes % blocks or (nbytes // blocks) % bits:
    raise ValueError(f"{nbytes} bytes a shard do not split into {blocks} blocks of whole "
                     f"{bits}-bit packing units")
  block_len = nbytes // blocks * 8 // bits
  name, backend = _resolve(implementation, bits, 8, 0.8, block_len, tile_blocks, num_warps,
                           interpret, peers=shards)
  packed_NxBxP = received.reshape(shards, blocks, nbytes // blocks)
  if name == "jnp":
    return _mean_jnp(packed_NxBxP, scales.astype(jnp.float32), bits)
  return _mean_pallas(packed_NxBxP, scales.astype(jnp.float32), bits, backend, interpret,
                      tile_blocks, num_warps)
