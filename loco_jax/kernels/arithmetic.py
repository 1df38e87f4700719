"""LoCo's compress step and receive-side mean as block arithmetic, written once for both
paths, and the jnp path (every backend)."""


import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from loco_jax.core import leaves, quant

IMPLEMENTATIONS = ("auto", "jnp", "pallas")  #: the choices of `compress_step`'s `implementation`
# Pallas tiles: scale blocks per program instance (each tile row is one whole scale block, so
# the absmax never crosses program instances) and Triton warps per instance.
# On an H200 one block of 2048 with 4 warps ran fastest (2**28 values: 0.75 ms; 2 blocks 0.79;
# 4 blocks with 8 warps 3.8 ms on 2**30 against 3.3 for one block; docs/results/performance.md).
TILE_BLOCKS = {"gpu": 1, "tpu": 32, "cpu": 8}  #: scale blocks a Pallas tile holds, by backend
NUM_WARPS = 4  #: Triton warps a Pallas program instance runs
# On GPU, buckets of shorter blocks (a small leaf's remainder) take the jnp path.
GPU_MIN_BLOCK = 128  #: on GPU, shorter blocks take the jnp path
# The jnp path on CPU works through this many blocks of 2048 at a time (see `compress_jnp`):
# on 2**24 values (2 shared EPYC cores, 2026-12-01) the step took 2.2x as long untiled as by
# tiles of 64 or 256 blocks (the materialized h and residual stay in cache).
CPU_TILE_BLOCKS = 64  #: blocks the jnp path on CPU works through at a time


class Compressed(NamedTuple):
  """One LoCo step on a flat float32 vector of `blocks * block_size` values."""
  packed: jax.Array               # uint8 [blocks, block_size * bits / 8], quant.pack's layout
  scales: jax.Array               # float32 [blocks], sent with the payload
  error: jax.Array                # int8 [size], the new stored error
  error_scale: jax.Array          # float32 [blocks]
  finite: jax.Array               # bool []: every gradient value was finite
  decompressed: jax.Array | None  # float32 [size], loco's local-mode output (if asked for)


# Plain float32 arithmetic, held to the float64 reference (`reference.check_step`) within
# float32 rounding, not to the other path bit for bit: compilers may contract products to FMAs.


def _quantize(x: jax.Array, scale: jax.Array, bits: int) -> jax.Array:
  """Eq. (1), integer-valued float32: clip(round_half_even(scale * x), qmin, qmax)."""
  qmin, qmax = quant.int_range(bits)
  return jnp.clip(jnp.round(quant.times_scale(x, scale, bits)), qmin, qmax)


def _max_abs(planes: list[jax.Array]) -> jax.Array:
  """max |x| over the last axis of every plane (the planes of one scale block): [rows, 1]."""
  return functools.reduce(jnp.maximum, [jnp.max(jnp.abs(x), axis=-1, keepdims=True)
                                        for x in planes])


def _fixed_or_absmax(fixed, absmax: jax.Array, bits: int) -> jax.Array:
  if fixed is None:
    return quant.scale_from_absmax(absmax, bits)
  return jnp.full_like(absmax, fixed)


def _payload_scale(fixed, planes: list[jax.Array], absmax: jax.Array, bits: int,
                   scale_method: str, clip_rms) -> jax.Array:
  """The payload's scales [rows, 1]: fixed, absmax, or quant.rms_scale's qmax / min(clip_rms x
  rms, absmax) (the mean square taken of x / absmax: no overflow)."""
  if fixed is not None or scale_method == "absmax":
    return _fixed_or_absmax(fixed, absmax, bits)
  length = sum(x.shape[-1] for x in planes)

  def mean_square(f, r):
    return functools.reduce(jnp.add, [jnp.sum(jnp.square((x * f) * r), axis=-1, keepdims=True)
                                      for x in planes]) * np.float32(1.0 / length)
  return quant.scale_from_rms(absmax, mean_square, bits, clip_rms)


def step_planes(g: list[jax.Array], error: list[jax.Array], error_scale: jax.Array, bits: int,
          error_bits: int, beta, fixed_scale, fixed_error_scale, with_decompressed: bool,
          scale_method: str = "absmax", clip_rms: float | None = None):
  """LoCo's step on the planes of whole scale blocks ([rows, width] each; scales [rows, 1]).

  Returns the codes q (integer-valued float32 planes), the scales, the new error codes (planes),
  the new error scales, [rows, 1] bool "every g of the block was finite" and, if asked for,
  the decompressed planes. Saturating where loco's unfused step does (quant.saturate): e,
  h = g + e, q / s and the residual stay finite for finite g near the float32 maximum.
  """
  sat = quant.saturate
  has_error, error_step = quant.positive_scale(error_scale), quant.reciprocal(error_scale)
  e = [jnp.where(has_error, sat(c.astype(jnp.float32) * error_step), 0.0) for c in error]
  # A non-finite g marks its block with inf: the block's max keeps it (XLA:CPU's max drops NaN).
  h = [jnp.where(jnp.isfinite(gi), sat(gi + ei), jnp.inf) for gi, ei in zip(g, e)]
  absmax = _max_abs(h)
  scale = _payload_scale(fixed_scale, h, absmax, bits, scale_method, clip_rms)
  sent, step = quant.positive_scale(scale), quant.reciprocal(scale)
  q = [_quantize(x, scale, bits) for x in h]
  d = [jnp.where(sent, sat(qi * step), 0.0) for qi in q]
  keep, mix = (np.float32(beta), np.float32(1.0 - beta)) if is_constant(beta) else (
      beta, 1.0 - beta)
  residual = [sat(keep * ei + mix * (hi - di)) for ei, hi, di in zip(e, h, d)]
  new_scale = _fixed_or_absmax(fixed_error_scale, _max_abs(residual), error_bits)
  new_error = [_quantize(r, new_scale, error_bits) for r in residual]
  return q, scale, new_error, new_scale, jnp.isfinite(absmax), d if with_decompressed else None


def is_constant(x) -> bool:
  return not isinstance(x, jax.core.Tracer)


def _compress_whole(g_BxL, error_BxL, error_scale_B, bits, error_bits, beta, fixed_scale,
                    fixed_error_scale, with_decompressed, scale_method, clip_rms, skip):
  q, scale, new_error, new_scale, finite, d = step_planes(
      [g_BxL], [error_BxL], error_scale_B[:, None], bits, error_bits, beta, fixed_scale,
      fixed_error_scale, with_decompressed, scale_method, clip_rms)
  new_error = new_error[0].astype(jnp.int8)
  d = d[0] if with_decompressed else None
  if skip is not None:  # a step known to be skipped keeps its error codes and sends NaN
    new_error = jnp.where(skip, error_BxL, new_error)
    d = None if d is None else jnp.where(skip, jnp.nan, d)
  return (quant.pack(q[0].astype(jnp.int8), bits), scale[:, 0], new_error, new_scale[:, 0],
          jnp.all(finite), d)


def compress_jnp(g_BxL, error_BxL, error_scale_B, bits, error_bits, beta, fixed_scale,
                  fixed_error_scale, with_decompressed, backend, scale_method="absmax",
                  clip_rms=None, skip=None):
  """The XLA formulation. XLA:CPU materializes every reduction's input (h, then the residual),
  so on CPU the step runs tile by tile (about `CPU_TILE_BLOCKS` blocks of 2048) and those
  passes stay in cache; elsewhere XLA fuses the reductions into their producers and takes the
  whole vector."""
  blocks, block_size = g_BxL.shape
  tile = min(blocks, max(1, CPU_TILE_BLOCKS * 2048 // block_size))
  step = functools.partial(_compress_whole, bits=bits, error_bits=error_bits, beta=beta,
                           fixed_scale=fixed_scale, fixed_error_scale=fixed_error_scale,
                           with_decompressed=with_decompressed, scale_method=scale_method,
                           clip_rms=clip_rms, skip=skip)
  if backend != "cpu" or tile == blocks:
    out = step(g_BxL, error_BxL, error_scale_B)
  else:
    # The new error, its scales and the decompressed values overwrite the inputs they come from
    # (no zero-filled output buffers: a step's worth of fresh pages costs XLA:CPU a pass).
    out = _tiled(step, (g_BxL, error_BxL, error_scale_B), blocks, tile,
                 overwrite={2: 1, 3: 2, 5: 0})
  packed, scale, new_error, new_scale, finite, d = out
  return (packed, scale, new_error.reshape(-1), new_scale, finite,
          None if d is None else d.reshape(-1))


def _tiled(step, inputs, blocks: int, tile: int, overwrite: dict[int, int]):
  """`step` over tiles of `tile` blocks, in a loop; output k is written over input
  `overwrite[k]` (same shape and dtype) where the step returns it, the others into fresh
  buffers.

  The last tile ends at the last block, so it may overlap the one before; the blocks of it that
  are done already keep their outputs (their inputs may be overwritten by then: blocks are
  independent, so what the tile computes for them again is discarded)."""
  at = lambda i: jnp.minimum(i * tile, blocks - tile)
  take = lambda x, i: jax.lax.dynamic_slice_in_dim(x, at(i), tile, allow_negative_indices=False)
  shapes = jax.eval_shape(step, *[take(x, 0) for x in inputs])
  source = {overwrite[k]: k for k, s in enumerate(shapes) if k in overwrite and s is not None}
  outs = [None if s is None else inputs[overwrite[k]] if k in overwrite else
          jnp.zeros((blocks, *s.shape[1:]), s.dtype) if s.ndim else jnp.bool_(True)
          for k, s in enumerate(shapes)]
  # Under jax.shard_map the loop's carry varies over the axes that the inputs vary over.
  outs = [o if o is None else leaves.vary_like(o, inputs[0]) for o in outs]

  def body(i, outs):
    got = step(*[take(outs[source[j]] if j in source else x, i) for j, x in enumerate(inputs)])
    done = jnp.arange(tile) < i * tile - at(i)  # blocks that the tile before wrote
    keep = lambda o, r: r if blocks % tile == 0 else jnp.where(
        done.reshape(-1, *[1] * (r.ndim - 1)), take(o, i), r)
    return [None if o is None else o & r if o.ndim == 0 else
            jax.lax.dynamic_update_slice_in_dim(o, keep(o, r), at(i), 0,
                                                allow_negative_indices=False)
            for o, r in zip(outs, got)]

  return jax.lax.fori_loop(0, -(-blocks // tile), body, outs)


def dequantize_planes(word: jax.Array, scale: jax.Array, bits: int,
                      down: float = 1.0) -> list[jax.Array]:
  """uint8 words (as int32) [rows, width] -> the `8 // bits` decompressed planes (q / s
  saturated as quant.decompress does), each times `down` (a power of two: exact)."""
  qmin, mask = quant.int_range(bits)[0], (1 << bits) - 1
  step, sent = quant.reciprocal(scale), quant.positive_scale(scale)
  return [jnp.where(sent, quant.saturate(
      (((word >> (t * bits)) & mask) + qmin).astype(jnp.float32) * step) * np.float32(down), 0.0)
          for t in range(8 // bits)]


# Up to this many peers the jnp mean is one unrolled fusion on GPU and TPU; beyond, and always
# on CPU, a loop over the peers. XLA:CPU compiles the unrolled sum as kernels per peer (a slice
# at a constant peer index is a distinct kernel: 8 peers x 3 buckets of the GPT-2-shaped tree
# added ~1 s to the mesh step's compile) and ran it 2.5-3.5x slower than the loop (8 peers of
# 2**21 values, 33.5 ms against 9.7-13.3 ms; docs/results/performance.md).
UNROLLED_PEERS = 64  #: up to this many peers the jnp mean is unrolled (GPU, TPU)


def mean_jnp(packed_NxBxP, scales_NxB, bits, unroll: bool):
  """sum_j q_j / s_j, added in peer order from 0, * 1/N, without overflow: as
  quant.mean_over_peers, sum_j (q_j / s_j) 2**-k, times 2**k / N. `unroll`: one term per peer
  in the program, else a loop over the peers (the same sums, bit for bit)."""
  shards = packed_NxBxP.shape[0]
  down, up = quant.mean_factors(shards)
  if 8 % bits:
    codes = quant.unpack(packed_NxBxP, bits).astype(jnp.float32)
    step, sent = quant.reciprocal(scales_NxB[..., None]), quant.positive_scale(scales_NxB)
    peer = lambda j: jnp.where(sent[j][..., None],
                               quant.saturate(codes[j] * step[j]) * np.float32(down), 0.0)
  else:
    peer = lambda j: jnp.concatenate(dequantize_planes(
        packed_NxBxP[j].astype(jnp.int32), scales_NxB[j][..., None], bits, down), -1)
  total = jnp.zeros(packed_NxBxP.shape[1:2] + (packed_NxBxP.shape[2] * 8 // bits,), jnp.float32)
  if unroll:
    for j in range(shards):
      total = total + peer(j)
  else:
    total = jax.lax.fori_loop(0, shards, lambda j, acc: acc + peer(j),
                              leaves.vary_like(total, packed_NxBxP))
  return quant.saturate(total * np.float32(up)).reshape(-1)
