"""Fused LoCo compress step (compensate, quantize, pack, error update) and the receive-side mean."""

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from loco_jax import quant

try:
  from jax.experimental import pallas as pl
except ImportError:  # pragma: no cover - a jax without Pallas runs the jnp path only
  pl = None

IMPLEMENTATIONS = ("auto", "jnp", "pallas")
# Pallas tiles: scale blocks per program instance (each tile row is one whole scale block, so
# the absmax never crosses program instances) and Triton warps per instance.
# On an H200 one block of 2048 with 4 warps ran fastest (2**28 values: 0.75 ms; 2 blocks 0.79;
# 4 blocks with 8 warps 3.8 ms on 2**30 against 3.3 for one block; experiments/gpu_kernel_probe).
TILE_BLOCKS = {"gpu": 1, "tpu": 32, "cpu": 8}
NUM_WARPS = 4
# The jnp path on CPU works through this many scale blocks at a time (see `_compress_jnp`):
# 2**24 values on 2 EPYC cores took 0.74x adamw's time untiled, 0.50x by 32 blocks, 0.31-0.37x
# by 256-512 blocks (per-tile overheads fall; 7-14 MiB of temporaries still sit in L3).
CPU_TILE_BLOCKS = 256


class Compressed(NamedTuple):
  """One LoCo step on a flat float32 vector of `blocks * block_size` values."""
  packed: jax.Array               # uint8 [blocks, block_size * bits / 8], quant.pack's layout
  scales: jax.Array               # float32 [blocks], sent with the payload
  error: jax.Array                # int8 [size], the new stored error
  error_scale: jax.Array          # float32 [blocks]
  finite: jax.Array               # bool []: every gradient value was finite
  decompressed: jax.Array | None  # float32 [size], loco's local-mode output (if asked for)


# --- The arithmetic, written once for every implementation ----------------------------------
#
# Every operation rounds once. Compilers contract a product that feeds an add into one FMA (one
# rounding instead of two): XLA:CPU does (its objects for loco().update hold vfmadd where the
# loop was vectorized), LLVM's GPU backends and Triton do by default. Whether it happens depends
# on how a fusion's loops are emitted (on CPU, unswitching the loop on the per-block `scale > 0`
# test exposes the product to the add), so two programs with the same math differ in the last
# bit. `_sealed` puts a per-element select between such a product and its add: no rewrite that
# keeps IEEE semantics (no nsz/nnan flags) can fuse them, so the result is the exactly rounded
# one whatever the program around it. On Triton every operation is explicit PTX: `.rn`
# multiplies and adds, and XLA:GPU's own (not correctly rounded) division and reciprocal.


class _Ops(NamedTuple):
  """Elementwise float32 arithmetic, never contracted, rounded as XLA rounds on the backend."""
  mul: Callable
  add: Callable
  div: Callable
  reciprocal: Callable
  round: Callable   # round half to even, to an integer-valued float


_XLA_OPS = _Ops(jnp.multiply, jnp.add, jnp.divide, lambda x: 1.0 / x, jnp.round)


def _triton_ops() -> _Ops:
  """PTX that rounds as XLA:GPU does. Its division is not IEEE: measured on an H200 (jax 0.11.2,
  experiments/gpu_kernel_probe.py), a / b matched div.full.f32 and 1 / x rcp.approx.f32, 29%
  and 14% of random quotients differing from the correctly rounded ones; its multiplies and
  adds were `.rn` and never contracted. `.rn` arithmetic is never contracted by ptxas."""
  from jax.experimental.pallas import triton as pltriton

  def asm(code: str, *args):
    args = jnp.broadcast_arrays(*[jnp.asarray(a, jnp.float32) for a in args])
    return pltriton.elementwise_inline_asm(
        code, args=list(args), constraints="=r" + ",r" * len(args), pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(args[0].shape, jnp.float32)])[0]

  return _Ops(mul=lambda a, b: asm("mul.rn.f32 $0, $1, $2;", a, b),
              add=lambda a, b: asm("add.rn.f32 $0, $1, $2;", a, b),
              div=lambda a, b: asm("div.full.f32 $0, $1, $2;", a, b),
              reciprocal=lambda x: asm("rcp.approx.f32 $0, $1;", x),
              round=lambda a: asm("cvt.rni.f32.f32 $0, $1;", a))


def _sealed(x: jax.Array) -> jax.Array:
  """x, with NaN read as 0, through a per-element select that no compiler fuses into an add."""
  return jnp.where(jnp.isnan(x), 0.0, x)


def _absmax_scale(absmax: jax.Array, bits: int, ops: _Ops) -> jax.Array:
  """quant.absmax_scale from a precomputed max|x|: qmax / absmax, 0 if vanishing or not finite."""
  usable = (absmax > quant.VANISHING) & jnp.isfinite(absmax)
  safe = jnp.where(usable, absmax, 1.0)
  return jnp.where(usable, ops.div(jnp.full_like(safe, max(quant.int_range(bits)[1], 1)), safe),
                   0.0)


def _reciprocal(scale: jax.Array, ops: _Ops) -> jax.Array:
  """1 / scale where scale > 0: quant.decompress's q / s is computed (by XLA) as q * (1 / s)."""
  return ops.reciprocal(jnp.where(scale > 0, scale, 1.0))


def _quantize(x: jax.Array, scale: jax.Array, bits: int, ops: _Ops) -> jax.Array:
  """Eq. (1), integer-valued float32: clip(round_half_even(scale * x), qmin, qmax)."""
  qmin, qmax = quant.int_range(bits)
  return jnp.clip(ops.round(ops.mul(scale, x)), qmin, qmax)


def _max_abs(planes: list[jax.Array]) -> jax.Array:
  """max |x| over the last axis of every plane (the planes of one scale block): [rows, 1]."""
  return functools.reduce(jnp.maximum, [jnp.max(jnp.abs(x), axis=-1, keepdims=True)
                                        for x in planes])


def _step(g: list[jax.Array], error: list[jax.Array], error_scale: jax.Array, bits: int,
          error_bits: int, beta: float, ops: _Ops, with_decompressed: bool):
  """LoCo's step on the planes of whole scale blocks ([rows, width] each; scales [rows, 1]).

  Returns the codes q (integer-valued float32 planes), the scales, the new error codes (planes),
  the new error scales and, if asked for, the decompressed planes.
  """
  has_error = error_scale > 0
  error_step = _reciprocal(error_scale, ops)
  e = [jnp.where(has_error, ops.mul(c.astype(jnp.float32), error_step), 0.0) for c in error]
  h = [ops.add(gi, _sealed(ei)) for gi, ei in zip(g, e)]
  scale = _absmax_scale(_max_abs(h), bits, ops)
  sent, step = scale > 0, _reciprocal(scale, ops)
  q = [_quantize(x, scale, bits, ops) for x in h]
  # h - d as h + (-q / s): an add, so that the select in `_sealed` cannot be folded away.
  h_minus_d = [ops.add(hi, _sealed(jnp.where(sent, ops.mul(-qi, step), 0.0)))
               for hi, qi in zip(h, q)]
  beta_f32, rest_f32 = np.float32(beta), np.float32(1.0 - beta)  # loco's beta, (1.0 - beta)
  residual = [ops.add(_sealed(ops.mul(beta_f32, ei)), _sealed(ops.mul(rest_f32, hd)))
              for ei, hd in zip(e, h_minus_d)]
  new_scale = _absmax_scale(_max_abs(residual), error_bits, ops)
  new_error = [_quantize(r, new_scale, error_bits, ops) for r in residual]
  d = ([jnp.where(sent, ops.mul(qi, step), 0.0) for qi in q] if with_decompressed else None)
  return q, scale, new_error, new_scale, d


def _all_finite_rows(planes: list[jax.Array]) -> jax.Array:
  """[rows, 1] int32, 1 where every value of the row is finite (a min: Triton has no `all`)."""
  return functools.reduce(jnp.minimum, [
      jnp.min(jnp.isfinite(x).astype(jnp.int32), axis=-1, keepdims=True) for x in planes])


# --- jnp: the XLA formulation -------------------------------------------------------------


def _compress_whole(g_BxL, error_BxL, error_scale_B, bits, error_bits, beta, with_decompressed):
  q, scale, new_error, new_scale, d = _step(
      [g_BxL], [error_BxL], error_scale_B[:, None], bits, error_bits, beta, _XLA_OPS,
      with_decompressed)
  return (quant.pack(q[0].astype(jnp.int8), bits), scale[:, 0], new_error[0].astype(jnp.int8),
          new_scale[:, 0], jnp.all(jnp.isfinite(g_BxL)), d[0] if with_decompressed else None)


def _compress_jnp(g_BxL, error_BxL, error_scale_B, bits, error_bits, beta, with_decompressed,
                  backend):
  """The XLA formulation. XLA:CPU materializes every reduction's input (h, then the residual),
  so on CPU the step runs tile by tile (`CPU_TILE_BLOCKS` blocks) and those passes stay in
  cache; elsewhere XLA fuses the reductions into their producers and takes the whole vector."""
  blocks, block_size = g_BxL.shape
  tile = _tile(blocks, CPU_TILE_BLOCKS)
  step = functools.partial(_compress_whole, bits=bits, error_bits=error_bits, beta=beta,
                           with_decompressed=with_decompressed)
  if backend != "cpu" or tile == blocks:
    out = step(g_BxL, error_BxL, error_scale_B)
  else:
    tiles = lambda x: x.reshape(blocks // tile, tile, *x.shape[1:])
    out = jax.lax.map(lambda t: step(*t), (tiles(g_BxL), tiles(error_BxL), tiles(error_scale_B)))
    out = [jnp.all(x) if i == 4 else None if x is None else x.reshape(blocks, *x.shape[2:])
           for i, x in enumerate(out)]
  packed, scale, new_error, new_scale, finite, d = out
  return (packed, scale, new_error.reshape(-1), new_scale, finite,
          None if d is None else d.reshape(-1))


def _dequantize(word: jax.Array, scale: jax.Array, bits: int, ops: _Ops) -> list[jax.Array]:
  """uint8 words (as int32) [rows, width] -> the `8 // bits` sealed decompressed planes."""
  qmin, mask = quant.int_range(bits)[0], (1 << bits) - 1
  step, sent = _reciprocal(scale, ops), scale > 0
  return [_sealed(jnp.where(
      sent, ops.mul((((word >> (t * bits)) & mask) + qmin).astype(jnp.float32), step), 0.0))
          for t in range(8 // bits)]


def _inverse_count(n: int) -> np.float32:
  """1 / n rounded once to float32: XLA turns a mean's division by n into this product."""
  return np.float32(1) / np.float32(n)


# Up to this many peers the jnp mean is one unrolled fusion; beyond, a loop over the peers.
UNROLLED_PEERS = 64


def _mean_jnp(packed_NxBxP, scales_NxB, bits):
  """sum_j q_j / s_j, added in peer order from 0 (numpy's order for a mean over axis 0), * 1/N."""
  shards = packed_NxBxP.shape[0]
  if 8 % bits:
    codes = quant.unpack(packed_NxBxP, bits).astype(jnp.float32)
    step = _reciprocal(scales_NxB[..., None], _XLA_OPS)
    peer = lambda j: _sealed(jnp.where(scales_NxB[j][..., None] > 0, codes[j] * step[j], 0.0))
  else:
    peer = lambda j: jnp.concatenate(_dequantize(
        packed_NxBxP[j].astype(jnp.int32), scales_NxB[j][..., None], bits, _XLA_OPS), -1)
  total = jnp.zeros(packed_NxBxP.shape[1:2] + (packed_NxBxP.shape[2] * 8 // bits,), jnp.float32)
  if shards <= UNROLLED_PEERS:
    for j in range(shards):
      total = total + peer(j)
  else:
    total = jax.lax.fori_loop(0, shards, lambda j, acc: acc + peer(j), total)
  return (total * _inverse_count(shards)).reshape(-1)


# --- Pallas: one program instance per tile of whole scale blocks, one pass over memory -------


def _compress_kernel(g_ref, e_ref, es_ref, packed_ref, scale_ref, new_e_ref, new_es_ref,
                     finite_ref, *d_ref, bits, error_bits, beta, ops):
  """Planes are the `8 // bits` column ranges that share a byte (quant.pack's layout)."""
  width = g_ref.shape[1] * bits // 8
  planes = [pl.ds(t * width, width) for t in range(8 // bits)]
  g = [g_ref[:, p] for p in planes]
  q, scale, new_error, new_scale, d = _step(
      g, [e_ref[:, p] for p in planes], es_ref[...], bits, error_bits, beta, ops, bool(d_ref))
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
  finite_ref[...] = _all_finite_rows(g)


def _mean_kernel(packed_ref, scales_ref, out_ref, *, shards, bits, ops):
  width = packed_ref.shape[2]

  def add_shard(j, sums):
    planes = _dequantize(packed_ref[j].astype(jnp.int32), scales_ref[j], bits, ops)
    return tuple(ops.add(s, v) for s, v in zip(sums, planes))  # peer order, from 0

  zeros = tuple(jnp.zeros((out_ref.shape[0], width), jnp.float32) for _ in range(8 // bits))
  sums = jax.lax.fori_loop(0, shards, add_shard, zeros)
  for t, s in enumerate(sums):
    out_ref[:, pl.ds(t * width, width)] = ops.mul(s, _inverse_count(shards))


def _pallas_settings(backend: str, interpret: bool | None, tile_blocks: int | None,
                     num_warps: int | None):
  """(interpret, ops, compiler_params, tile_blocks) for a Pallas call on `backend`."""
  interpret = backend == "cpu" if interpret is None else interpret
  if interpret:
    return True, _XLA_OPS, None, tile_blocks or TILE_BLOCKS["cpu"]
  tile_blocks = tile_blocks or TILE_BLOCKS.get(backend, 1)
  if backend == "gpu":
    from jax.experimental.pallas import triton as pltriton
    params = pltriton.CompilerParams(num_warps=num_warps or NUM_WARPS, num_stages=1)
    return False, _triton_ops(), params, tile_blocks
  if backend == "tpu":
    from jax.experimental.pallas import tpu as pltpu
    return False, _XLA_OPS, pltpu.CompilerParams(dimension_semantics=("parallel",)), tile_blocks
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


def _compress_pallas(g_BxL, error_BxL, error_scale_B, bits, error_bits, beta, with_decompressed,
                     backend, interpret, tile_blocks, num_warps):
  blocks, block_size = g_BxL.shape
  interpret, ops, params, tile_blocks = _pallas_settings(backend, interpret, tile_blocks,
                                                         num_warps)
  tile = _tile(blocks, tile_blocks)
  nbytes = block_size * bits // 8
  g_BxL, error_BxL, error_scale_B = _same_varying_axes(g_BxL, error_BxL, error_scale_B)
  rows = lambda width: pl.BlockSpec((tile, width), lambda i: (i, 0))
  shapes = [((blocks, nbytes), jnp.uint8), ((blocks, 1), jnp.float32),
            ((blocks, block_size), jnp.int8), ((blocks, 1), jnp.float32),
            ((blocks, 1), jnp.int32)] + ([((blocks, block_size), jnp.float32)]
                                         if with_decompressed else [])
  outs = pl.pallas_call(
      functools.partial(_compress_kernel, bits=bits, error_bits=error_bits, beta=beta, ops=ops),
      out_shape=[_out_shape(s, t, g_BxL) for s, t in shapes], grid=(blocks // tile,),
      in_specs=[rows(block_size), rows(block_size), rows(1)],
      out_specs=[rows(s[1]) for s, _ in shapes],
      interpret=interpret, compiler_params=params, name="loco_compress_step",
  )(g_BxL, error_BxL, error_scale_B[:, None])
  packed, scales, new_error, new_scale, finite = outs[:5]
  return (packed, scales[:, 0], new_error.reshape(-1), new_scale[:, 0], jnp.all(finite != 0),
          outs[5].reshape(-1) if with_decompressed else None)


def _mean_pallas(packed_NxBxP, scales_NxB, bits, backend, interpret, tile_blocks, num_warps):
  shards, blocks, nbytes = packed_NxBxP.shape
  interpret, ops, params, tile_blocks = _pallas_settings(backend, interpret, tile_blocks,
                                                         num_warps)
  tile = _tile(blocks, tile_blocks)
  block_len = nbytes * 8 // bits
  packed_NxBxP, scales_NxB = _same_varying_axes(packed_NxBxP, scales_NxB)
  out = pl.pallas_call(
      functools.partial(_mean_kernel, shards=shards, bits=bits, ops=ops),
      out_shape=_out_shape((blocks, block_len), jnp.float32, packed_NxBxP),
      grid=(blocks // tile,),
      in_specs=[pl.BlockSpec((shards, tile, nbytes), lambda i: (0, i, 0)),
                pl.BlockSpec((shards, tile, 1), lambda i: (0, i, 0))],
      out_specs=pl.BlockSpec((tile, block_len), lambda i: (i, 0)),
      interpret=interpret, compiler_params=params, name="loco_dequantize_mean",
  )(packed_NxBxP, scales_NxB[..., None])
  return out.reshape(-1)


# --- Choosing the implementation -----------------------------------------------------------


def _pallas_unsupported(bits: int, block_size: int, beta, backend: str,
                        peers: int = 1) -> str | None:
  """Why the Pallas path cannot run these settings (None when it can)."""
  if pl is None:
    return "jax.experimental.pallas does not import here"
  if 8 % bits:
    return f"bits={bits} does not divide 8 (bit-plane packing is jnp only)"
  if isinstance(beta, jax.core.Tracer):
    return "beta is traced (the kernel bakes it in as a constant)"
  if backend == "gpu" and block_size & (block_size - 1):
    return f"Triton tiles need a power-of-two block_size, got {block_size}"
  if backend == "gpu" and peers & (peers - 1):
    return f"Triton tiles need a power-of-two number of peers, got {peers}"
  return None


@functools.cache
def pallas_report(backend: str, bits: int = 4, error_bits: int = 8, beta: float = 0.8,
                  block_size: int = 2048, tile_blocks: int | None = None,
                  num_warps: int | None = None, interpret: bool | None = None) -> str:
  """"match" if the Pallas kernels run here and agree with the jnp path bit for bit, else
  "mismatch: ..." (which outputs, how many elements) or "error: ..." (why it did not run).

  Two compress steps (the second with the first's error) and a dequantize_mean of both
  payloads, on data whose blocks differ in magnitude by about e**12; cached per configuration.
  Example:
    >>> pallas_report("gpu", tile_blocks=8, num_warps=8)   # "match"
  """
  def run(fn, *args):  # compiled and called directly: safe while an outer jit is tracing
    return jax.jit(fn).lower(*args).compile()(*args)

  if backend != jax.default_backend():
    return f"error: asked about {backend!r}, but this process runs on {jax.default_backend()!r}"
  blocks = 4 * (tile_blocks or TILE_BLOCKS.get(backend, 1))
  size = blocks * block_size
  rng = np.random.default_rng(0)
  magnitude = np.exp(3 * rng.standard_normal((blocks, 1)))
  g = (rng.standard_normal((2, blocks, block_size)) * magnitude).astype(np.float32)
  results = {}
  for name in ("jnp", "pallas"):
    options = dict(bits=bits, implementation=name, tile_blocks=tile_blocks,
                   num_warps=num_warps, interpret=interpret)
    try:
      step = functools.partial(compress_step, error_bits=error_bits, beta=beta,
                               block_size=block_size, decompressed=True, **options)
      error, error_scale = np.zeros(size, np.int8), np.zeros(blocks, np.float32)
      outs = []
      for k in range(2):
        out = Compressed(*[np.asarray(x) for x in run(step, g[k].reshape(-1), error,
                                                      error_scale)])
        error, error_scale = out.error, out.error_scale
        outs.append(out)
      received = np.stack([o.packed.reshape(-1) for o in outs])
      scales = np.stack([o.scales for o in outs])
      mean = run(functools.partial(dequantize_mean, **options), received, scales)
    except Exception as e:  # noqa: BLE001 - any lowering or runtime failure means "use jnp"
      return f"error: {name}: {type(e).__name__}: {str(e).splitlines()[0][:300]}"
    results[name] = {f"{field}{k}": value for k, o in enumerate(outs)
                     for field, value in o._asdict().items()}
    results[name]["mean"] = np.asarray(mean)
  differing = [f"{key} {np.sum(a != results['pallas'][key])}/{a.size}"
               for key, a in results["jnp"].items()
               if not np.array_equal(a, results["pallas"][key])]
  return "match" if not differing else "mismatch: " + ", ".join(differing)


def pallas_matches_jnp(backend: str, bits: int = 4, error_bits: int = 8, beta: float = 0.8,
                       block_size: int = 2048, tile_blocks: int | None = None,
                       num_warps: int | None = None, interpret: bool | None = None) -> bool:
  """Whether `pallas_report` is "match": where `implementation="auto"` may pick Pallas.

  Example:
    >>> pallas_matches_jnp("gpu")
  """
  return pallas_report(backend, bits, error_bits, beta, block_size, tile_blocks, num_warps,
                       interpret) == "match"


def _resolve(implementation: str, blocks: int, bits: int, error_bits: int, beta,
             block_size: int, tile_blocks, num_warps, interpret,
             peers: int = 1) -> tuple[str, str]:
  """("jnp" | "pallas", backend) for a call on `blocks` scale blocks (of `peers` shards)."""
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
  backend = jax.default_backend()
  if implementation == "jnp":
    return "jnp", backend
  why_not = _pallas_unsupported(bits, block_size, beta, backend, peers)
  if implementation == "pallas":
    if why_not:
      raise ValueError(f"implementation='pallas' cannot run here: {why_not}")
    return "pallas", backend
  tile = tile_blocks or TILE_BLOCKS.get(backend, 1)
  if why_not or backend not in ("gpu", "tpu") or interpret or blocks % tile:
    return "jnp", backend  # the probe only vouches for whole tiles
  ok = pallas_matches_jnp(backend, bits, error_bits, float(beta), block_size, tile_blocks,
                          num_warps)
  return ("pallas" if ok else "jnp"), backend


def chosen_implementation(blocks: int = 1 << 19, bits: int = 4, error_bits: int = 8,
                          beta: float = 0.8, block_size: int = 2048,
                          tile_blocks: int | None = None, num_warps: int | None = None) -> str:
  """What `implementation="auto"` runs on the current backend: "pallas" or "jnp".

  Example:
    >>> chosen_implementation()   # "jnp" on CPU
  """
  return _resolve("auto", blocks, bits, error_bits, beta, block_size, tile_blocks, num_warps,
                  None)[0]


# --- Public API ----------------------------------------------------------------------------


def _check_compress(size: int, error, error_scale, bits: int, error_bits: int,
                    block_size: int) -> int:
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
  if error_scale.shape != (blocks,):
    raise ValueError(f"error_scale must be float32 [{blocks}] (one per block), got "
                     f"{tuple(error_scale.shape)}")
  return blocks


def compress_step(g: jax.Array, error: jax.Array, error_scale: jax.Array, *, bits: int = 4,
                  error_bits: int = 8, beta: float = 0.8, reset: jax.Array | bool = False,
                  block_size: int = 2048, decompressed: bool = False,
                  implementation: str = "auto", tile_blocks: int | None = None,
                  num_warps: int | None = None, interpret: bool | None = None) -> Compressed:
  """LoCo's step (absmax block scales) on a flat vector whose size is a multiple of block_size.

  The numbers of `loco(bits, error_bits=..., beta=..., block_size=...)` for one aligned leaf:
  e = error / error_scale (0 if `reset`), h = g + e, q = compress(h; s = qmax / max|h|) per
  block, d = q / s, error' = compress(beta e + (1 - beta)(h - d); per-block absmax,
  error_bits), every operation rounded once (see `_sealed`). The Pallas kernel reads g (4 B)
  and the error (1 B) once and writes the payload (bits / 8 B) and the new error (1 B): 6.5 B
  an element at 4 bits (plus 4 B with `decompressed`).
  `implementation`: "pallas" is one kernel, one program instance per `tile_blocks` scale blocks
  (Triton on GPU, Mosaic on TPU, the interpreter on CPU); "jnp" is the XLA formulation; "auto"
  takes Pallas on GPU/TPU where `pallas_matches_jnp` holds, else jnp. A non-finite g gives
  finite=False and unspecified other outputs (loco then keeps its previous state).
  Example:
    >>> out = compress_step(g, jnp.zeros(g.size, jnp.int8), jnp.zeros(g.size // 2048))
    >>> out.packed.shape, out.error.dtype    # ((g.size // 2048, 1024), int8)
  """
  blocks = _check_compress(g.size, error, error_scale, bits, error_bits, block_size)
  name, backend = _resolve(implementation, blocks, bits, error_bits, beta, block_size,
                           tile_blocks, num_warps, interpret)
  g_BxL = g.reshape(blocks, block_size).astype(jnp.float32)
  error_BxL = error.reshape(blocks, block_size)
  # A reset zeroes the error: a zero scale decompresses to exactly 0, as loco's where() does.
  error_scale = jnp.where(reset, 0.0, error_scale.astype(jnp.float32))
  if name == "jnp":
    out = _compress_jnp(g_BxL, error_BxL, error_scale, bits, error_bits, beta, decompressed,
                        backend)
  else:
    out = _compress_pallas(g_BxL, error_BxL, error_scale, bits, error_bits, beta, decompressed,
                           backend, interpret, tile_blocks, num_warps)
  return Compressed(*out)


def dequantize_mean(received: jax.Array, scales: jax.Array, *, bits: int = 4,
                    implementation: str = "auto", tile_blocks: int | None = None,
                    num_warps: int | None = None, interpret: bool | None = None) -> jax.Array:
  """The float32 mean of N peers' packed shards: a device's work after the all-to-all.

  `received` is uint8 [N, blocks * block_len * bits / 8] (row j from peer j, quant.pack's
  layout within each block) and `scales` float32 [N, blocks]; returns float32
  [blocks * block_len]: the sum over j of q_j / s_j in peer order, times 1/N (what
  comm.all_to_all_mean computes; XLA divides by N as a product with 1/N), in one pass over the
  N shards.
  Example:
    >>> mean = dequantize_mean(jnp.stack([a.packed.reshape(-1), b.packed.reshape(-1)]),
    ...                        jnp.stack([a.scales, b.scales]))
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
  name, backend = _resolve(implementation, blocks, bits, 8, 0.8, block_len, tile_blocks,
                           num_warps, interpret, peers=shards)
  packed_NxBxP = received.reshape(shards, blocks, nbytes // blocks)
  if name == "jnp":
    return _mean_jnp(packed_NxBxP, scales.astype(jnp.float32), bits)
  return _mean_pallas(packed_NxBxP, scales.astype(jnp.float32), bits, backend, interpret,
                      tile_blocks, num_warps)
