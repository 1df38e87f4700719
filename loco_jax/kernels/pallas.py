"""The Pallas kernels (GPU, TPU): one program instance per tile of whole scale blocks, one
pass over memory, the arithmetic of `kernels.arithmetic`."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from loco_jax.core import quant
from loco_jax.kernels.arithmetic import NUM_WARPS, TILE_BLOCKS, dequantize_planes, step_planes

try:
  from jax.experimental import pallas as pl
except ImportError:  # pragma: no cover - a jax without Pallas runs the jnp path only
  pl = None


def _compress_kernel(g_ref, e_ref, es_ref, packed_ref, scale_ref, new_e_ref, new_es_ref,
                     finite_ref, *d_ref, bits, error_bits, beta, fixed_scale, fixed_error_scale,
                     scale_method="absmax", clip_rms=None):
  """Planes are the `8 // bits` column ranges that share a byte (quant.pack's layout)."""
  width = g_ref.shape[1] * bits // 8
  planes = [pl.ds(t * width, width) for t in range(8 // bits)]
  q, scale, new_error, new_scale, finite, d = step_planes(
      [g_ref[:, p] for p in planes], [e_ref[:, p] for p in planes], es_ref[...], bits,
      error_bits, beta, fixed_scale, fixed_error_scale, bool(d_ref), scale_method, clip_rms)
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
    planes = dequantize_planes(packed_ref[j].astype(jnp.int32), scales_ref[j], bits, down)
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


def compress_pallas(g_BxL, error_BxL, error_scale_B, bits, error_bits, beta, fixed_scale,
                     fixed_error_scale, with_decompressed, backend, interpret, tile_blocks,
                     num_warps, scale_method="absmax", clip_rms=None):
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
                             fixed_scale=fixed_scale, fixed_error_scale=fixed_error_scale,
                             scale_method=scale_method, clip_rms=clip_rms)
  outs = pl.pallas_call(
      kernel, out_shape=[_out_shape(s, t, g_BxL) for s, t in shapes], grid=(blocks // tile,),
      in_specs=[rows(block_size), rows(block_size), rows(1)],
      out_specs=[rows(s[1]) for s, _ in shapes],
      interpret=interpret, compiler_params=params, name="loco_compress_step",
  )(g_BxL, error_BxL, error_scale_B[:, None])
  packed, scales, new_error, new_scale, finite = outs[:5]
  return (packed, scales[:, 0], new_error.reshape(-1), new_scale[:, 0], jnp.all(finite != 0),
          outs[5].reshape(-1) if with_decompressed else None)


def mean_pallas(packed_NxBxP, scales_NxB, bits, backend, interpret, tile_blocks, num_warps):
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
