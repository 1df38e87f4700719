"""Compressed collectives: the all-to-all mean of packed payloads and the gathers."""

import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from loco_jax.comm import wire
from loco_jax.core import quant
from loco_jax.core.layout import AxisName, LeafLayout, Payload, from_rows


def axis_size(axis_name: AxisName, caller: str = "loco") -> int:
  """Device count along `axis_name`; a ValueError naming the axis if it is not bound."""
  try:
    return jax.lax.axis_size(axis_name)
  except NameError as e:
    raise ValueError(
        f"{caller}: axis_name={axis_name!r} is not bound here. Call the update inside "
        f"jax.shard_map over a mesh that has that axis (or pass axis_name=None for local "
        f"compression). JAX said: {e}") from None


def _bytes(x: jax.Array) -> jax.Array:
  """[rows, ...] of any dtype -> [rows, nbytes] uint8 (a bitcast, no conversion)."""
  rows = x.shape[0]
  if x.dtype.itemsize > 1:
    x = jax.lax.bitcast_convert_type(x, jnp.uint8)
  return x.reshape(rows, -1).astype(jnp.uint8)


def _from_bytes(b: jax.Array, dtype, shape: tuple[int, ...]) -> jax.Array:
  itemsize = np.dtype(dtype).itemsize
  if itemsize == 1:
    return b.reshape(shape).astype(dtype)
  return jax.lax.bitcast_convert_type(b.reshape(*shape, itemsize), dtype)


def _frame(parts: Sequence[jax.Array]) -> tuple[jax.Array, list[tuple[int, int]]]:
  """Concatenates [rows, nbytes_i] byte arrays; returns the buffer and (start, stop) of each."""
  offsets, start = [], 0
  for p in parts:
    offsets.append((start, start + p.shape[1]))
    start += p.shape[1]
  return jnp.concatenate(parts, axis=1), offsets


def encode_rows(payloads: Sequence[Payload], bits: int, flag: jax.Array) -> tuple[jax.Array, list]:
  """Packs every leaf's codes (and scales) plus a float32 flag into one [rows, nbytes] uint8 buffer."""
  parts = []
  for p in payloads:
    parts.append(_bytes(p.codes if p.packed else quant.pack(p.codes, bits)))
    if p.scales is not None:
      parts.append(_bytes(p.scales))
  rows = parts[0].shape[0] if parts else 1
  parts.append(_bytes(jnp.broadcast_to(flag.astype(jnp.float32), (rows,))))
  return _frame(parts)


def decode_rows(buffer: jax.Array, offsets: list, payloads: Sequence[Payload], bits: int,
                fixed_scale: float | jax.Array | None) -> tuple[list[jax.Array], jax.Array]:
  """Inverse of `encode_rows` on a received buffer: each leaf's dequantized rows, and the flags."""
  rows = buffer.shape[0]
  values, i = [], 0
  for p in payloads:
    start, stop = offsets[i]
    codes = quant.unpack(buffer[:, start:stop].reshape(rows, p.codes.shape[1], -1), bits)
    i += 1
    if p.scales is not None:
      start, stop = offsets[i]
      scales = _from_bytes(buffer[:, start:stop], jnp.float32, (rows, p.scales.shape[1]))
      i += 1
      values.append(quant.decompress(codes, scales[..., None]))
    else:
      values.append(quant.decompress(codes, fixed_scale))
  start, stop = offsets[i]
  flags = _from_bytes(buffer[:, start:stop], jnp.float32, (rows,))
  return values, flags


def all_to_all_mean(payloads: Sequence[Payload], bits: int, fixed_scale, flag: jax.Array,
                    axis_name: AxisName) -> tuple[list[jax.Array], jax.Array]:
  """ONE all-to-all of every leaf's packed rows; returns this device's averaged shards.

  Device j receives row j of every peer's payload (never re-quantized on the way), dequantizes
  and averages them in float32: a list of [blocks, block_len] shards, and the sum of the peers'
  flags (0, or NaN when some peer saw a non-finite gradient).
  """
  buffer, offsets = encode_rows(payloads, bits, flag)
  received = wire.all_to_all(buffer, axis_name)   # chunked where gloo needs it (wire.py)
  values, flags = decode_rows(received, offsets, payloads, bits, fixed_scale)
  return [quant.mean_over_peers(v) for v in values], flags.sum()  # never overflows


# XLA:CPU's collectives carry 16-bit floats as 32 bits on the wire (its compiled program
# converts them to f32 around the collective); their bit patterns as uint16 cross at 16 bits.
# GPU (NCCL) and TPU (ICI) collectives move bf16 as it is.
WIDENING_BACKENDS = ("cpu",)
_FLOAT16 = (jnp.bfloat16, jnp.float16)


def _as_uint16(x: jax.Array) -> jax.Array:
  return jax.lax.bitcast_convert_type(x, jnp.uint16) if x.dtype in _FLOAT16 else x


def all_gather(x: jax.Array, axis_name: AxisName, axis: int = 0) -> jax.Array:
  """`jax.lax.all_gather(tiled=True, to="invarying")` at `x`'s nominal width: 16-bit floats
  cross as their uint16 bit patterns (a bitcast each side, no rounding); in pieces where the
  backend needs it (`wire.chunk_bytes`)."""
  moved = jnp.moveaxis(_as_uint16(x), axis, 0)
  gathered = jnp.moveaxis(wire.all_gather(moved, axis_name), 0, axis)
  return jax.lax.bitcast_convert_type(gathered, x.dtype) if x.dtype in _FLOAT16 else gathered


def mean_16bit(values: Sequence[jax.Array], axis_name: AxisName,
               backend: str | None = None) -> list[jax.Array]:
  """The mean over the axis of 16-bit float arrays, crossing the wire at 16 bits a value.

  Where the backend carries bf16 collectives as they are, one `pmean`. Where it widens them
  (`WIDENING_BACKENDS`, default: `jax.default_backend()`), a sum cannot run on bit patterns,
  so: a reduce-scatter by all-to-all of uint16 rows, a local float32 sum of the received
  shard, rounded once to the 16-bit dtype, and a uint16 all-gather; the same bytes a ring
  all-reduce sends, 2 (n-1)/n x 16 bits a value. The HLO shows which one ran.
  """
  if not values:
    return []
  if (backend or jax.default_backend()) not in WIDENING_BACKENDS:
    return list(jax.lax.pmean(list(values), axis_name))
  dtype = values[0].dtype
  if any(v.dtype != dtype or dtype not in _FLOAT16 for v in values):
    raise ValueError(f"mean_16bit takes bfloat16 or float16 arrays of one dtype, got "
                     f"{sorted({str(v.dtype) for v in values})}")
  n = axis_size(axis_name, "mean_16bit")
  flat = jnp.concatenate([v.reshape(-1) for v in values])
  row_len = math.ceil(flat.size / n)
  rows_NxR = jnp.pad(flat, (0, n * row_len - flat.size)).reshape(n, row_len)
  received_NxR = wire.all_to_all(_as_uint16(rows_NxR), axis_name)
  peers_NxR = jax.lax.bitcast_convert_type(received_NxR, dtype).astype(jnp.float32)
  shard_R = quant.sum_rows(peers_NxR) / n
  full = all_gather(shard_R.astype(dtype), axis_name)[: flat.size]
  out, start = [], 0
  for v in values:
    out.append(full[start: start + v.size].reshape(v.shape))
    start += v.size
  return out


def gather_bf16(shards: Sequence[jax.Array], layouts: Sequence[LeafLayout], flag: jax.Array,
                axis_name: AxisName) -> tuple[list[jax.Array], jax.Array]:
  """All-gathers averaged shards in bfloat16 (as uint16, 16 bits on every backend):
  [blocks, block_len] each -> [size] float32.

  `flag` (the summed peers' flags) rides along so that it comes back replicated over the axis.
  """
  flat = [_as_uint16(s.reshape(1, -1)[:, : lay.row_len].astype(jnp.bfloat16))
          for s, lay in zip(shards, layouts)]
  flat.append(jax.lax.bitcast_convert_type(flag.astype(jnp.float32), jnp.uint16).reshape(1, 2))
  buffer, offsets = _frame(flat)
  gathered = wire.all_gather(buffer, axis_name)
  values = [from_rows(jax.lax.bitcast_convert_type(gathered[:, a:b], jnp.bfloat16)
                      .astype(jnp.float32), lay)
            for (a, b), lay in zip(offsets, layouts)]
  a, b = offsets[-1]
  return values, jax.lax.bitcast_convert_type(gathered[0, a:b], jnp.float32)


def gather_packed(payloads: Sequence[Payload], layouts: Sequence[LeafLayout], bits: int,
                  fixed_scale, flag: jax.Array,
                  axis_name: AxisName) -> tuple[list[jax.Array], jax.Array]:
  """All-gathers re-quantized shards (one row each) packed to `bits`; -> [size] float32 each."""
  buffer, offsets = encode_rows(payloads, bits, flag)
  gathered = wire.all_gather(buffer, axis_name)
  values, flags = decode_rows(gathered, offsets, payloads, bits, fixed_scale)
  return [from_rows(v, lay) for v, lay in zip(values, layouts)], flags[0]
