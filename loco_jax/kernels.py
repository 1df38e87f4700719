"""Fused LoCo compress step (compensate, quantize, pack, error update) and the receive-side mean."""

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from loco_jax import quant

try:
  from jax.experimental import pallas as pl
except ImportError:  # pragma: no cover - jax without Pallas: the jnp path only
  pl = None

IMPLEMENTATIONS = ("auto", "jnp", "pallas")
# Pallas tile defaults per backend: scale blocks per program instance and Triton warps. Each row
# of a tile is one scale block, so the absmax never crosses a program instance.
TILE_BLOCKS = {"gpu": 4, "tpu": 32, "cpu": 8}
NUM_WARPS = 8


class Compressed(NamedTuple):
  """One LoCo step on a flat vector of `blocks * block_size` float32 values."""
  packed: jax.Array             # uint8 [blocks, block_size * bits / 8], quant.pack's layout
  scales: jax.Array             # float32 [blocks], sent with the payload
  error: jax.Array              # int8 [size], the new stored error
  error_scale: jax.Array        # float32 [blocks]
  finite: jax.Array             # bool []: every gradient value was finite
  decompressed: jax.Array | None  # float32 [size] (loco's local-mode output) if asked for


def _check(size: int, error, error_scale, bits: int, error_bits: int, block_size: int) -> int:
  quant.check_bits(bits)
  quant.check_bits(error_bits, "error_bits")
  if block_size <= 0 or block_size % quant.PACK_UNIT:
    raise ValueError(f"block_size must be a positive multiple of {quant.PACK_UNIT}, got "
                     f"{block_size}")
  if size == 0 or size % block_size:
    raise ValueError(f"compress_step needs a size that is a positive multiple of block_size="
                     f"{block_size}, got {size} (use loco() for ragged leaves)")
  blocks = size // block_size
  if error.shape != (size,) or error.dtype != jnp.int8:
    raise ValueError(f"error must be int8 [{size}], got {error.dtype} {error.shape}")
  if error_scale.shape != (blocks,):
    raise ValueError(f"error_scale must be float32 [{blocks}], got {error_scale.shape}")
  return blocks


# --- The reference formulation: loco.py's _feedback_step through quant.py, as XLA fuses it ------


def _compress_jnp(g, error, error_scale_B, reset, bits, error_bits, beta, with_decompressed):
  """loco.py's update for one aligned leaf, op for op and in its shapes.

  Op for op matters: XLA's CPU backend contracts multiply-add pairs into FMAs (LLVM
  AllowFPOpFusion=Fast) where it vectorizes, and that depends on the fusions around an op, so an
  algebraically equal but restructured formulation can differ from loco() in the last bit.
  """
  blocks = error_scale_B.shape[0]
  rows = lambda x: x.reshape(1, blocks, -1)
  finite = jnp.all(jnp.isfinite(g))
  flag = jnp.where(finite, 0.0, jnp.nan).astype(jnp.float32)
  e = jnp.where(reset, 0.0, quant.decompress(rows(error), error_scale_B[None][..., None])
                ).reshape(-1)
  h = g + e
  scales = quant.absmax_scale(rows(h), bits)
  q = quant.compress(rows(h), scales[..., None], bits)
  d = quant.decompress(q, scales[..., None]).reshape(-1)
  residual = beta * e + (1.0 - beta) * (h - d)
  new_scale = quant.absmax_scale(rows(residual), error_bits)
  new_error = quant.compress(rows(residual), new_scale[..., None], error_bits)
  new_error = jnp.where(finite, new_error.reshape(-1), error)
  new_scale = jnp.where(finite, new_scale[0], error_scale_B)
  return (quant.pack(q[0], bits), scales[0], new_error, new_scale, finite,
          d + flag if with_decompressed else None)


def _mean_jnp(packed_NxBxP, scales_NxB, bits):
  codes = quant.unpack(packed_NxBxP, bits)
  return quant.decompress(codes, scales_NxB[..., None]).mean(axis=0).reshape(-1)


# --- Pallas: one program instance = one tile of whole scale blocks, one pass over memory -------


class _Ops(NamedTuple):
  """IEEE division and round-half-to-even; Triton's own `/` is div.full.f32 (not IEEE)."""
  div: Callable
  round: Callable


def _triton_ops() -> _Ops:
  from jax.experimental.pallas import triton as pltriton

  def asm(code, *args):
    return pltriton.elementwise_inline_asm(
        code, args=list(args), constraints="=r" + ",r" * len(args), pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(args[0].shape, jnp.float32)])[0]

  def div(x, y):
    x, y = jnp.broadcast_arrays(x.astype(jnp.float32), y.astype(jnp.float32))
    return asm("div.rn.f32 $0, $1, $2;", x, y)

  return _Ops(div, lambda x: asm("cvt.rni.f32.f32 $0, $1;", x))


_PLAIN_OPS = _Ops(lambda x, y: x / y, jnp.round)


def _k_decompress(q_f32, scale, ops: _Ops):
  positive = scale > 0
  return jnp.where(positive, ops.div(q_f32, jnp.where(positive, scale, 1.0)), 0.0)


def _k_absmax_scale(absmax, bits: int, ops: _Ops):
  qmax = max(quant.int_range(bits)[1], 1)
  usable = (absmax > quant.VANISHING) & jnp.isfinite(absmax)
  safe = jnp.where(usable, absmax, 1.0)
  return jnp.where(usable, ops.div(jnp.full_like(safe, qmax), safe), 0.0)


def _k_compress(x, scale, bits: int, ops: _Ops):
  """Eq. (1) as integer-valued float32 (the cast happens at the store)."""
  qmin, qmax = quant.int_range(bits)
  return jnp.clip(ops.round(scale * x), qmin, qmax)


def _row_absmax(planes):
  out = None
  for x in planes:
    m = jnp.max(jnp.abs(x), axis=1, keepdims=True)
    out = m if out is None else jnp.maximum(out, m)
  return out


def _compress_kernel(g_ref, e_ref, es_ref, packed_ref, scale_ref, new_e_ref, new_es_ref,
                     finite_ref, *d_ref, bits, error_bits, beta, one_minus_beta, ops):
  per_byte = 8 // bits
  width = g_ref.shape[1] // per_byte
  planes = [pl.ds(t * width, width) for t in range(per_byte)]
  error_scale = es_ref[...]
  g = [g_ref[:, p] for p in planes]
  e = [_k_decompress(e_ref[:, p].astype(jnp.float32), error_scale, ops) for p in planes]
  h = [a + b for a, b in zip(g, e)]
  scale = _k_absmax_scale(_row_absmax(h), bits, ops)
  q = [_k_compress(x, scale, bits, ops) for x in h]
  d = [_k_decompress(x, scale, ops) for x in q]
  residual = [beta * ei + one_minus_beta * (hi - di) for ei, hi, di in zip(e, h, d)]
  new_scale = _k_absmax_scale(_row_absmax(residual), error_bits, ops)
  qmin = quant.int_range(bits)[0]
  word = None
  for t, (p, qt, rt) in enumerate(zip(planes, q, residual)):
    new_e_ref[:, p] = _k_compress(rt, new_scale, error_bits, ops).astype(jnp.int8)
    unsigned = (qt - qmin).astype(jnp.int32)
    word = unsigned if word is None else word | (unsigned << (t * bits))
    if d_ref:
      d_ref[0][:, p] = d[t]
  packed_ref[...] = word.astype(jnp.uint8)
  scale_ref[...] = scale
  new_es_ref[...] = new_scale
  finite = None
  for x in g:  # a min over int32: Triton has no boolean reduction
    f = jnp.min(jnp.isfinite(x).astype(jnp.int32), axis=1, keepdims=True)
    finite = f if finite is None else jnp.minimum(finite, f)
  finite_ref[...] = finite


def _mean_kernel(packed_ref, scales_ref, out_ref, *, shards, bits, ops):
  per_byte = 8 // bits
  width = packed_ref.shape[2]
  qmin, mask = quant.int_range(bits)[0], (1 << bits) - 1

  def add_shard(j, sums):
    word = packed_ref[j].astype(jnp.int32)
    scale = scales_ref[j]
    return tuple(
        s + _k_decompress((((word >> (t * bits)) & mask) + qmin).astype(jnp.float32), scale, ops)
        for t, s in enumerate(sums))

  zeros = tuple(jnp.zeros((out_ref.shape[0], width), jnp.float32) for _ in range(per_byte))
  sums = jax.lax.fori_loop(0, shards, add_shard, zeros)
  for t, s in enumerate(sums):
    out_ref[:, pl.ds(t * width, width)] = ops.div(s, jnp.full_like(s, shards))


def _pallas_settings(backend: str, interpret: bool | None, tile_blocks: int | None,
                     num_warps: int | None):
  interpret = backend == "cpu" if interpret is None else interpret
  if interpret:
    return True, _PLAIN_OPS, None, tile_blocks or TILE_BLOCKS["cpu"]
  tile_blocks = tile_blocks or TILE_BLOCKS.get(backend, 1)
  if backend == "gpu":
    from jax.experimental.pallas import triton as pltriton
    return False, _triton_ops(), pltriton.CompilerParams(num_warps=num_warps or NUM_WARPS,
                                                          num_stages=1), tile_blocks
  if backend == "tpu":
    from jax.experimental.pallas import tpu as pltpu
    return False, _PLAIN_OPS, pltpu.CompilerParams(dimension_semantics=("parallel",)), \
        tile_blocks
  raise ValueError(f"no compiled Pallas path on backend {backend!r}; pass interpret=True")


def _tile(blocks: int, tile_blocks: int) -> int:
  """The largest power of two that divides `blocks` and is at most `tile_blocks`."""
  tile = 1
  while tile * 2 <= tile_blocks and blocks % (tile * 2) == 0:
    tile *= 2
  return tile


def _compress_pallas(g_BxL, error_BxL, error_scale_B, bits, error_bits, beta, with_decompressed,
                     backend, interpret, tile_blocks, num_warps):
  blocks, block_size = g_BxL.shape
  interpret, ops, params, tile_blocks = _pallas_settings(backend, interpret, tile_blocks,
                                                         num_warps)
  tile = _tile(blocks, tile_blocks)
  nbytes = block_size * bits // 8
  rows = lambda width: pl.BlockSpec((tile, width), lambda i: (i, 0))
  out_shape = [jax.ShapeDtypeStruct((blocks, nbytes), jnp.uint8),
               jax.ShapeDtypeStruct((blocks, 1), jnp.float32),
               jax.ShapeDtypeStruct((blocks, block_size), jnp.int8),
               jax.ShapeDtypeStruct((blocks, 1), jnp.float32),
               jax.ShapeDtypeStruct((blocks, 1), jnp.int32)]
  out_specs = [rows(nbytes), rows(1), rows(block_size), rows(1), rows(1)]
  if with_decompressed:
    out_shape.append(jax.ShapeDtypeStruct((blocks, block_size), jnp.float32))
    out_specs.append(rows(block_size))
  kernel = functools.partial(_compress_kernel, bits=bits, error_bits=error_bits,
                             beta=np.float32(beta), one_minus_beta=np.float32(1.0 - beta),
                             ops=ops)
  outs = pl.pallas_call(
      kernel, out_shape=out_shape, grid=(blocks // tile,),
      in_specs=[rows(block_size), rows(block_size), rows(1)], out_specs=out_specs,
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
  out = pl.pallas_call(
      functools.partial(_mean_kernel, shards=shards, bits=bits, ops=ops),
      out_shape=jax.ShapeDtypeStruct((blocks, block_len), jnp.float32), grid=(blocks // tile,),
      in_specs=[pl.BlockSpec((shards, tile, nbytes), lambda i: (0, i, 0)),
                pl.BlockSpec((shards, tile, 1), lambda i: (0, i, 0))],
      out_specs=pl.BlockSpec((tile, block_len), lambda i: (i, 0)),
      interpret=interpret, compiler_params=params, name="loco_dequantize_mean",
  )(packed_NxBxP, scales_NxB[..., None])
  return out.reshape(-1)


# --- Choosing the implementation -----------------------------------------------------------


def _pallas_unsupported(bits: int, block_size: int, beta, backend: str) -> str | None:
  """Why the Pallas path cannot run these settings (None when it can)."""
  if pl is None:
    return "jax.experimental.pallas does not import here"
  if 8 % bits:
    return f"bits={bits} does not divide 8 (bit-plane packing is jnp only)"
  if isinstance(beta, jax.core.Tracer):
    return "beta is traced (the kernel bakes it in as a constant)"
  if backend == "gpu" and block_size & (block_size - 1):
    return f"Triton tiles need a power-of-two block_size, got {block_size}"
  return None


@functools.cache
def pallas_matches_jnp(backend: str, bits: int, error_bits: int, beta: float, block_size: int,
                       tile_blocks: int | None = None, num_warps: int | None = None,
                       interpret: bool | None = None) -> bool:
  """Whether the Pallas kernels compile here and agree with the jnp path bit for bit.

  Runs two compress steps (the second with the first's error) and one dequantize_mean of
  their payloads on random data with blocks of very different magnitudes; cached per
  configuration. `implementation="auto"` uses Pallas only where this holds.
  Example:
    >>> pallas_matches_jnp("gpu", 4, 8, 0.8, 2048)
  """
  try:
    with jax.ensure_compile_time_eval():
      blocks = 4 * (tile_blocks or TILE_BLOCKS.get(backend, 1))
      size = blocks * block_size
      magnitude = jnp.exp(3 * jax.random.normal(jax.random.key(1), (1, blocks, 1)))
      g = (jax.random.normal(jax.random.key(0), (2, blocks, block_size)) * magnitude)
      g = g.reshape(2, size).astype(jnp.float32)
      run = {}
      for name in ("jnp", "pallas"):
        options = dict(bits=bits, implementation=name, tile_blocks=tile_blocks,
                       num_warps=num_warps, interpret=interpret)
        step = jax.jit(functools.partial(compress_step, error_bits=error_bits, beta=beta,
                                         block_size=block_size, decompressed=True, **options))
        error, error_scale = jnp.zeros(size, jnp.int8), jnp.zeros(blocks, jnp.float32)
        outs = []
        for k in range(2):
          out = step(g[k], error, error_scale)
          error, error_scale = out.error, out.error_scale
          outs.append(out)
        received = jnp.stack([o.packed.reshape(-1) for o in outs])
        scales = jnp.stack([o.scales for o in outs])
        mean = jax.jit(functools.partial(dequantize_mean, **options))(received, scales)
        run[name] = jax.tree.leaves((outs, mean))
      return all(np.array_equal(np.asarray(a), np.asarray(b))
                 for a, b in zip(run["jnp"], run["pallas"]))
  except Exception:  # noqa: BLE001 - any lowering or runtime failure means "use jnp"
    import traceback; traceback.print_exc()
    return False


def _resolve(implementation: str, blocks: int, bits: int, error_bits: int, beta,
             block_size: int, tile_blocks, num_warps, interpret) -> tuple[str, str]:
  """("jnp" | "pallas", backend) for a call on `blocks` scale blocks."""
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
  backend = jax.default_backend()
  if implementation == "jnp":
    return "jnp", backend
  why_not = _pallas_unsupported(bits, block_size, beta, backend)
  if implementation == "pallas":
    if why_not:
      raise ValueError(f"implementation='pallas' cannot run here: {why_not}")
    return "pallas", backend
  tile = tile_blocks or TILE_BLOCKS.get(backend, 1)
  if why_not or backend not in ("gpu", "tpu") or interpret or blocks % tile:
    return "jnp", backend  # the probe below is only representative of whole tiles
  ok = pallas_matches_jnp(backend, bits, error_bits, float(beta), block_size, tile_blocks,
                          num_warps)
  return ("pallas" if ok else "jnp"), backend


def chosen_implementation(blocks: int = 1 << 20, bits: int = 4, error_bits: int = 8,
                          beta: float = 0.8, block_size: int = 2048,
                          tile_blocks: int | None = None, num_warps: int | None = None) -> str:
  """What `implementation="auto"` runs on the current backend: "pallas" or "jnp".

  Example:
    >>> chosen_implementation()   # "jnp" on CPU
  """
  return _resolve("auto", blocks, bits, error_bits, beta, block_size, tile_blocks, num_warps,
                  None)[0]


# --- Public API ----------------------------------------------------------------------------


def compress_step(g: jax.Array, error: jax.Array, error_scale: jax.Array, *, bits: int = 4,
                  error_bits: int = 8, beta: float = 0.8, reset: jax.Array | bool = False,
                  block_size: int = 2048, decompressed: bool = False,
                  implementation: str = "auto", tile_blocks: int | None = None,
                  num_warps: int | None = None, interpret: bool | None = None) -> Compressed:
  """LoCo's step on a flat float32 vector whose size is a multiple of `block_size`, fused.

  Same numbers as `loco(bits, error_bits=..., beta=..., block_size=...)` (absmax block scales):
  e = error / error_scale (0 if `reset`), h = g + e, q = compress(h; qmax / max|h|_block),
  d = q / s, error' = compress(beta e + (1 - beta)(h - d); per-block absmax, error_bits).
  Reads g (4 B) and the error (1 B) once and writes the packed payload (bits / 8 B), the new
  error (1 B) and the scales: 6.5 B an element at 4 bits. `implementation="pallas"` is one
  kernel (one program instance per `tile_blocks` scale blocks; Triton on GPU, Mosaic on TPU,
  the interpreter on CPU); "jnp" is the XLA formulation; "auto" picks Pallas on GPU/TPU when
  `pallas_matches_jnp` holds, else jnp. Non-finite input: `finite` is False and the other
  outputs are unspecified (loco keeps its old state then).
  Example:
    >>> out = compress_step(g, jnp.zeros(g.size, jnp.int8), jnp.zeros(g.size // 2048))
    >>> out.packed.shape, out.error.dtype   # ((g.size // 2048, 1024), int8)
  """
  size = g.size
  blocks = _check(size, error, error_scale, bits, error_bits, block_size)
  name, backend = _resolve(implementation, blocks, bits, error_bits, beta, block_size,
                           tile_blocks, num_warps, interpret)
  g = g.reshape(-1).astype(jnp.float32)
  error_scale = error_scale.astype(jnp.float32)
  if name == "jnp":
    out = _compress_jnp(g, error, error_scale, reset, bits, error_bits, beta, decompressed)
  else:
    # A reset zeroes the stored error: a zero scale decompresses to exactly 0, as where() does.
    out = _compress_pallas(g.reshape(blocks, block_size), error.reshape(blocks, block_size),
                           jnp.where(reset, 0.0, error_scale), bits, error_bits, beta,
                           decompressed, backend, interpret, tile_blocks, num_warps)
  return Compressed(*out)


def dequantize_mean(received: jax.Array, scales: jax.Array, *, bits: int = 4,
                    implementation: str = "auto", tile_blocks: int | None = None,
                    num_warps: int | None = None, interpret: bool | None = None) -> jax.Array:
  """The float32 mean of N peers' packed shards: what each device does after the all-to-all.

  `received` is uint8 [N, blocks * block_len * bits / 8] (row j from peer j, quant.pack layout
  per block) and `scales` float32 [N, blocks]; returns float32 [blocks * block_len], the same
  numbers as comm.all_to_all_mean's decode and mean, in one pass over the N shards.
  Example:
    >>> dequantize_mean(jnp.stack([a.packed.reshape(-1), b.packed.reshape(-1)]),
    ...                 jnp.stack([a.scales, b.scales]))
  """
  quant.check_bits(bits)
  if received.ndim != 2 or scales.ndim != 2 or received.shape[0] != scales.shape[0]:
    raise ValueError(f"received must be [N, bytes] and scales [N, blocks], got "
                     f"{received.shape} and {scales.shape}")
  shards, nbytes = received.shape
  blocks = scales.shape[1]
  if blocks == 0 or nbytes % blocks or (nbytes // blocks) % bits:
    raise ValueError(f"{nbytes} bytes a shard do not split into {blocks} blocks of whole "
                     f"packing units of {bits} bits")
  block_len = nbytes // blocks * 8 // bits
  name, backend = _resolve(implementation, blocks, bits, 8, 0.8, block_len, tile_blocks,
                           num_warps, interpret)
  packed_NxBxP = received.reshape(shards, blocks, nbytes // blocks)
  if name == "jnp":
    return _mean_jnp(packed_NxBxP, scales.astype(jnp.float32), bits)
  return _mean_pallas(packed_NxBxP, scales.astype(jnp.float32), bits, backend, interpret,
                      tile_blocks, num_warps)
