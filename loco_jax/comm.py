"""Compressed collectives: wire layout, all-to-all mean of packed payloads, gathers, HLO bytes."""

import math
import re
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from loco_jax import quant, wire

AxisName = str | tuple[str, ...]


class LeafLayout(NamedTuple):
  """How one flattened leaf of `size` elements lies on the wire: rows x blocks x block_len.

  Row j (one per device on the axis) is the shard device j averages: `row_len` elements of the
  zero-padded leaf (`shard_len`, the same whatever the block size, so that sharded parameters
  and gradient shards line up). Each row is cut into `blocks` blocks of `block_len` elements (a
  multiple of 8, for packing) with one scale each, zero-padded too: every size is compressed,
  none falls back to full precision.
  """
  size: int
  rows: int
  row_len: int
  blocks: int
  block_len: int

  @property
  def padded(self) -> int:
    return self.rows * self.blocks * self.block_len


def shard_len(size: int, rows: int) -> int:
  """Elements of each device's shard of a leaf of `size` elements: ceil(size / rows), to 8."""
  return quant.PACK_UNIT * max(math.ceil(size / rows / quant.PACK_UNIT), 1)


def leaf_layout(size: int, rows: int, block_size: int | None) -> LeafLayout:
  """Near-equal blocks of at most about `block_size` elements (None: one block per row)."""
  row_len = shard_len(size, rows)
  blocks = 1 if block_size is None else math.ceil(row_len / block_size)
  block_len = quant.PACK_UNIT * math.ceil(row_len / blocks / quant.PACK_UNIT)
  return LeafLayout(size, rows, row_len, blocks, block_len)


def shard_rows(flat: jax.Array, layout: LeafLayout) -> jax.Array:
  """[size] -> [rows, row_len], zero-padded: row j is device j's shard."""
  return jnp.pad(flat, (0, layout.rows * layout.row_len - layout.size)).reshape(layout.rows, -1)


def to_rows(flat: jax.Array, layout: LeafLayout) -> jax.Array:
  """[size] -> [rows, blocks, block_len], zero-padded."""
  rows = jnp.pad(shard_rows(flat, layout),
                 ((0, 0), (0, layout.blocks * layout.block_len - layout.row_len)))
  return rows.reshape(layout.rows, layout.blocks, layout.block_len)


def from_rows(rows: jax.Array, layout: LeafLayout) -> jax.Array:
  """[rows, blocks, block_len] -> [size]; also [rows, row_len] -> [size]."""
  rows = rows.reshape(layout.rows, -1)[:, : layout.row_len]
  return rows.reshape(-1)[: layout.size]


def axis_size(axis_name: AxisName, who: str = "loco") -> int:
  """Device count along `axis_name`; a ValueError naming the axis if it is not bound."""
  try:
    return jax.lax.axis_size(axis_name)
  except NameError as e:
    raise ValueError(
        f"{who}: axis_name={axis_name!r} is not bound here. Call the update inside "
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


class Payload(NamedTuple):
  """One leaf's compressed rows: int codes [rows, blocks, block_len] (or, with `packed`, their
  uint8 `quant.pack` bytes [rows, blocks, block_len * bits / 8]), scales [rows, blocks] or None."""
  codes: jax.Array
  scales: jax.Array | None
  packed: bool = False


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


# --- Wire accounting from the lowered HLO -----------------------------------------------------

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
                "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "s4": 0.5, "u4": 0.5}
_COLLECTIVES = ("all-to-all", "all-gather", "all-reduce", "reduce-scatter", "collective-permute")
_INSTRUCTION = re.compile(
    r"=\s*(?P<result>\(.*?\)|\w+\[[\d,]*\](?:\{[^}]*\})?)\s+"
    r"(?P<op>" + "|".join(_COLLECTIVES) + r")(?P<start>-start)?\((?P<attrs>.*)$")
_SHAPE = re.compile(r"(\w+)\[([\d,]*)\]")


class Collective(NamedTuple):
  """One collective of a lowered step: `nbytes` is the full buffer (gathered or pre-scatter).

  `conditional` marks one inside a branch of a conditional (a rare path such as CO3's
  overflow), which a step does not always run.
  """
  op: str
  dtype: str
  nbytes: float
  group_size: int
  conditional: bool = False

  @property
  def sent_bytes(self) -> float:
    """Bytes each device sends: ring all-reduce 2(n-1)/n b; the others (n-1)/n b."""
    n = self.group_size
    factor = 2 * (n - 1) / n if self.op == "all-reduce" else (n - 1) / n
    return factor * self.nbytes


_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_BRANCHES = re.compile(r"(?:branch_computations=\{([^}]*)\}|"
                       r"(?:true|false)_computation=%?([\w.\-]+))")


def _shape_bytes(text: str) -> tuple[str, float]:
  dtypes, total = [], 0.0
  for dtype, dims in _SHAPE.findall(text):
    count = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
    total += count * _DTYPE_BYTES.get(dtype, 4)
    dtypes.append(dtype)
  return ",".join(sorted(set(dtypes))), total


def _group_size(attrs: str, default: int) -> int:
  groups = re.search(r"replica_groups=\{\{([\d,]*)\}", attrs)
  if groups:
    return len(groups.group(1).split(","))
  iota = re.search(r"replica_groups=\[(\d+),(\d+)\]", attrs)
  if iota:
    return int(iota.group(2))
  return default


def collectives(hlo_text: str, num_devices: int) -> list[Collective]:
  """Every collective in HLO text (`jax.jit(f).lower(...).as_text(dialect="hlo")`)."""
  lines = hlo_text.splitlines()
  branches = set()
  for line in lines:
    for listed, single in _BRANCHES.findall(line):
      branches.update(name.strip().lstrip("%") for name in (listed or single).split(","))
  found, computation = [], ""
  for line in lines:
    header = _COMPUTATION.match(line)
    if header:
      computation = header.group(1)
      continue
    m = _INSTRUCTION.search(line)
    if not m:
      continue
    op, result = m.group("op"), m.group("result")
    if m.group("start") and result.startswith("("):
      result = result[1:].split("]")[0] + "]"  # async start: (operand, result, ...); same size
    dtype, nbytes = _shape_bytes(result)
    n = _group_size(m.group("attrs"), num_devices)
    # The full buffer: what a gather returns, what a scatter takes (n times what it returns).
    found.append(Collective(op, dtype, nbytes * n if op == "reduce-scatter" else nbytes, n,
                            computation in branches))
  return found


def lowered_collectives(fn, *args, num_devices: int | None = None) -> list[Collective]:
  """Lowers `fn` (jitted or not) on `args` and lists its collectives."""
  jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
  text = jitted.lower(*args).as_text(dialect="hlo")
  return collectives(text, num_devices or jax.device_count())


def compiled_collectives(fn, *args, num_devices: int | None = None) -> list[Collective]:
  """Compiles `fn` on `args` for this backend and lists the collectives the program runs.

  What crosses the wire: the backend's compiler may rewrite collectives after lowering (XLA:CPU
  widens 16-bit float ones to float32), so where the lowered and compiled HLO differ, this one
  is right.
  """
  jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
  text = jitted.lower(*args).compile().as_text()
  return collectives(text, num_devices or jax.device_count())


def wire_bits_per_param(found: Sequence[Collective], n_params: int,
                        include_conditional: bool = False) -> float:
  """Bits each device sends per parameter per step, summed over every collective that every
  step runs (and over the conditional ones too with `include_conditional`)."""
  return 8.0 * sum(c.sent_bytes for c in found
                   if include_conditional or not c.conditional) / n_params
