"""Gathers at the width they claim: the axis size, 16-bit gathers and means, and the
gathers of averaged shards (bfloat16 or packed codes), each framed once (`comm.framing`)."""

import math
from typing import Sequence

import jax
import jax.numpy as jnp

from loco_jax.comm import framing, wire
from loco_jax.core import quant
from loco_jax.core.layout import AxisName


def axis_size(axis_name: AxisName, caller: str = "loco") -> int:
  """Device count along `axis_name`; a ValueError naming the axis if it is not bound."""
  try:
    return jax.lax.axis_size(axis_name)
  except NameError as e:
    raise ValueError(
        f"{caller}: axis_name={axis_name!r} is not bound here. Call the update inside "
        f"jax.shard_map over a mesh that has that axis (or pass axis_name=None for local "
        f"compression). JAX said: {e}") from None


# XLA:CPU's collectives carry 16-bit floats as 32 bits on the wire (its compiled program
# converts them to f32 around the collective); their bit patterns as uint16 cross at 16 bits.
# GPU (NCCL) and TPU (ICI) collectives move bf16 as it is.
WIDENING_BACKENDS = ("cpu",)  #: backends whose collectives send 16-bit floats as 32 bits
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

  One `pmean` where the backend carries bf16 collectives as they are. Where it widens them
  (`WIDENING_BACKENDS`), an all-to-all of uint16 rows, a float32 sum rounded once, and a uint16
  all-gather: the bytes of a ring all-reduce at 16 bits.
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


def gather_bf16(shards: Sequence[jax.Array], side: jax.Array,
                axis_name: AxisName) -> tuple[list[jax.Array], jax.Array]:
  """ONE all-gather of float32 shards in bfloat16 (saturating; 16 bits a value on every
  backend) with float32 `side` numbers (a flag, a status): [k] each -> [n, k] float32, row j
  device j's, and every device's side numbers, `[n, *side.shape]`."""
  parts = [quant.saturate(s.reshape(1, -1), jnp.bfloat16).astype(jnp.bfloat16) for s in shards]
  buffer, parts = framing.frame(parts + [side.astype(jnp.float32)[None]], jnp.uint16)
  *values, sides = framing.unframe(wire.all_gather(buffer, axis_name), parts)
  return [v.astype(jnp.float32) for v in values], sides


def gather_packed(packed: Sequence[jax.Array], scales: Sequence[jax.Array] | None, fixed_scale,
                  bits: int, side: jax.Array,
                  axis_name: AxisName) -> tuple[list[jax.Array], jax.Array]:
  """ONE all-gather of quantized shards: packed codes (uint8 [blocks, len * bits / 8]) and
  block scales ([blocks]; None: `fixed_scale`) -> [n, blocks, len] float32 each, and every
  device's `side` numbers, as `gather_bf16`'s."""
  parts = [x[None] for x in packed] + [x[None] for x in scales or ()]
  buffer, parts = framing.frame(parts + [side.astype(jnp.float32)[None]])
  *got, sides = framing.unframe(wire.all_gather(buffer, axis_name), parts)
  codes, peer_scales = got[:len(packed)], got[len(packed):]
  return [quant.decompress(quant.unpack(q, bits),
                           fixed_scale if scales is None else peer_scales[c][..., None])
          for c, q in enumerate(codes)], sides
