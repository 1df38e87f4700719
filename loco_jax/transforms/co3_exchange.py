"""CO3 on a mesh: every device serves 1/n of every leaf, as LoCo's exchange does.

Per-shard exchange (`all_to_all`): each device codes row j of its symbols (device j's shard of
every leaf) into a slot of ONE all-to-all (`comm.coded`), decodes the rows it receives,
averages them in float32 with each sender's scales and all-gathers its averaged shard: in bf16,
or (`gather="coded"`, fp4) as the exact sum of the n senders' levels, one byte an element, coded
again. The sum is exact because the devices agree on each leaf's scale (`agree_scales`).
A device sends (n-1)/n (C + 16) or (n-1)/n (C + C_sum) bits a parameter for a coded rate C.

Whole-gradient exchange (`all_gather`): every device decodes and averages every device's coded
gradient, (n-1) C bits. `collective="auto"` picks whichever `predicted_bits` says sends less.

Status, replicated: `flag` is 0, +inf where some receiver found a stream corrupt, NaN where some
gradient was not finite; `extended` is 1 where some slot took its extension (`comm.coded`);
`overflowed` is 1 where some stream did not fit even so: the exchange then runs again raw,
inside a lax.cond that every device takes alike.
"""

import functools
import itertools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from loco_jax.codecs import fp, huffman_deflate
from loco_jax import comm
from loco_jax.comm import coded
from loco_jax.core import layout, leaves, quant
from loco_jax.transforms import co3_host
from loco_jax.transforms.co3_settings import Co3Settings

CODER = huffman_deflate  #: the wire coder, a comm.coded.ByteCoder


class Exchanged(NamedTuple):
  """One group of leaves after the exchange (see the module doc for `flag`, `overflowed`)."""
  values: list             # float32 [size] per leaf: the mean over the axis
  flag: jax.Array          # float32
  overflowed: jax.Array    # float32 0 or 1
  coded_bytes: jax.Array   # int32: bytes this device's coder produced (its uplink streams)
  extended: jax.Array      # int32 0 or 1: some slot took its extension (`comm.coded`)


def symbols_per_byte(fmt: fp.FloatFormat) -> int:
  """fp4 symbols travel in pairs, one byte `first << 4 | second`; fp8 one a byte."""
  return 2 if fmt.bits <= 4 else 1


def predicted_bits(n: int, symbol_bits: float, gather_bits: float, per_shard: bool) -> float:
  """Bits a device sends per parameter a step, scales aside: `symbol_bits` a symbol in the
  all-to-all (or whole gradients' all-gather), `gather_bits` an element in the shards' gather."""
  if per_shard:
    return (n - 1) / n * (symbol_bits + gather_bits)
  return (n - 1) * symbol_bits


def gather_bits(settings: Co3Settings, n: int) -> float:
  """Bits an element of the averaged shards' gather: 16 (bf16), or a sum slot's capacity."""
  if settings.gather == "bf16":
    return 16.0
  if not settings.entropy_code:
    return 8.0
  if settings.gather_capacity_bits is not None:
    return settings.gather_capacity_bits
  return co3_host.usual_sum_capacity_bits(n)


def gather_reach_bits(settings: Co3Settings, n: int) -> float | None:
  """Bits an element of a coded gather's slot with its extension (None: a given size, none)."""
  if settings.gather_capacity_bits is not None:
    return None
  return co3_host.default_sum_capacity_bits(n)


def is_per_shard(settings: Co3Settings, n: int) -> bool:
  """Whether this axis of `n` devices runs the per-shard exchange (see the module doc)."""
  if settings.collective != "auto":
    return settings.collective == "all_to_all"
  bits = settings.capacity_bits if settings.entropy_code else settings.fmt.bits
  gathered = gather_bits(settings, n)
  return predicted_bits(n, bits, gathered, True) < predicted_bits(n, bits, gathered, False)


def sums_levels(settings: Co3Settings, n: int) -> bool:
  """Whether the devices agree on their scales and gather the exact sums of their levels
  (ValueError where they would, but the sums do not fit a byte: `check_sum_gather`)."""
  if settings.gather == "coded" and n > 1 and is_per_shard(settings, n):
    check_sum_gather(settings.fmt, n)
    return True
  return False


def level_unit(fmt: fp.FloatFormat) -> float:
  """The levels of `fmt` are integer multiples of 1 / level_unit (fp4: halves)."""
  return 2.0 ** (fmt.bias - 1 + fmt.mantissa_bits)


def max_sum(fmt: fp.FloatFormat, n: int) -> int:
  """The largest `|sum|` of n devices' levels, in units of 1 / level_unit."""
  return int(n * fp.max_value(fmt) * level_unit(fmt))


def check_sum_gather(fmt: fp.FloatFormat, n: int) -> None:
  """ValueError unless the sums of n devices' levels fit one byte, offset to be non-negative."""
  if 2 * max_sum(fmt, n) > 255:
    raise ValueError(
        f"gather='coded' sends the exact sum of the devices' levels in one byte an element: "
        f"{fmt} on {n} devices sums up to +-{max_sum(fmt, n)}, which does not fit (fp4 fits up "
        f"to 21 devices); use gather='bf16'")


# The devices agree on the finest of their scales, at most this many times the coarsest. At the
# coarsest, the devices with the smaller gradients lose more of their values to fp4's dead zone
# (which error feedback with gamma < 1 returns only in part) than the larger ones lose to
# saturation at the finest: the demo's eval loss over 8 seeds, 2.138 against 2.030 (own scales
# with the bf16 gather: 2.059; docs/results/co3.md). The bound keeps a device whose leaf is
# nearly zero (a huge scale) from saturating every other device's.
AGREED_SCALE_SPAN = 4.0


def agree_scales(settings: Co3Settings, scales: jax.Array) -> jax.Array:
  """Leaf by leaf, the largest of every device's scale, at most AGREED_SCALE_SPAN times the
  smallest: shared so that the levels sum exactly (a NaN of a skipped step stays)."""
  extremes = jax.lax.pmax(jnp.concatenate([scales, -scales]), settings.axis_name)  # one collective
  finest, coarsest = extremes[:scales.size], -extremes[scales.size:]
  return jnp.minimum(finest, AGREED_SCALE_SPAN * coarsest)


def _to_bytes(symbols_NxK: jax.Array, fmt: fp.FloatFormat) -> jax.Array:
  if symbols_per_byte(fmt) == 1:
    return symbols_NxK
  pairs = symbols_NxK.reshape(*symbols_NxK.shape[:-1], -1, 2)
  return (pairs[..., 0] << 4) | pairs[..., 1]


def _from_bytes(bytes_NxB: jax.Array, fmt: fp.FloatFormat) -> jax.Array:
  if symbols_per_byte(fmt) == 1:
    return bytes_NxB
  return jnp.stack([bytes_NxB >> 4, bytes_NxB & 15], axis=-1).reshape(bytes_NxB.shape[0], -1)


def symbol_rows(symbols: list, layouts: list, fmt: fp.FloatFormat) -> jax.Array:
  """Per leaf uint8 [size] -> uint8 [rows, B]: row j holds device j's shard of every leaf."""
  return jnp.concatenate([_to_bytes(layout.shard_rows(s, lay), fmt)
                          for s, lay in zip(symbols, layouts)], axis=1)


def row_values(rows_NxB: jax.Array, scales_NxL: jax.Array, layouts: list,
               fmt: fp.FloatFormat) -> list:
  """Inverse of `symbol_rows` for every sender: per leaf float32 [N, row_len], each row with
  its own sender's scale."""
  symbols_NxR, values, start = _from_bytes(rows_NxB, fmt), [], 0
  for i, lay in enumerate(layouts):
    values.append(fp.decode(symbols_NxR[:, start:start + lay.row_len], fmt,
                            scales_NxL[:, i:i + 1]))
    start += lay.row_len
  return values


def _corrupt(missing: jax.Array) -> jax.Array:
  """+inf where some slot received here did not decode, else 0 (added to the flag)."""
  return jnp.where(missing[1] > 0, jnp.inf, 0.0).astype(jnp.float32)


def _symbol_slots(settings: Co3Settings) -> tuple[float, float | None]:
  """(bits a byte of a symbols' slot, the same with its extension or None)."""
  per_byte, reach = symbols_per_byte(settings.fmt), settings.capacity_reach_bits
  return settings.capacity_bits * per_byte, None if reach is None else reach * per_byte


def _exchange(settings: Co3Settings, gather: bool, rows, side, coded_path: bool,
              bits_per_byte: float, reach_bits_per_byte: float | None) -> coded.Received:
  """Rows through the all-to-all, or one row through the all-gather: raw, or coded into slots
  of `bits_per_byte` whose extension (`comm.coded`) reaches `reach_bits_per_byte` (None: none)."""
  if not coded_path:
    raw = coded.raw_all_gather if gather else coded.raw_all_to_all
    return raw(rows, side, settings.axis_name)
  size = rows.shape[-1]
  capacity = coded.slot_bytes(size, bits_per_byte, CODER)
  extension = (0 if reach_bits_per_byte is None else
               max(0, coded.slot_bytes(size, reach_bits_per_byte, CODER) - capacity))
  send = coded.all_gather if gather else coded.all_to_all
  return send(rows, side, capacity, CODER, settings.axis_name, extension)


def _whole(settings: Co3Settings, layouts: list, rows_1xB: jax.Array, scales: jax.Array,
           flag: jax.Array, coded_path: bool) -> Exchanged:
  """The all-gather of every device's whole symbols; each device averages all of them."""
  leaf_count = len(layouts)
  got = _exchange(settings, True, rows_1xB[0], jnp.concatenate([scales, flag[None]]),
                  coded_path, *_symbol_slots(settings))
  values = row_values(got.rows, got.side[:, :leaf_count], layouts, settings.fmt)
  flag = got.side[:, leaf_count].sum() + _corrupt(got.missing)
  if coded_path:  # its sender does not decode its own stream: agree on what receivers found
    flag = jax.lax.psum(flag, settings.axis_name)
  return Exchanged([quant.mean_over_peers(v)[:lay.size] for v, lay in zip(values, layouts)],
                   flag, (got.missing[0] > 0).astype(jnp.float32), got.coded_bytes,
                   got.extended)


def _bf16_gather(settings: Co3Settings, got: coded.Received, layouts: list,
                 status: jax.Array) -> tuple[list, coded.Received]:
  """The mean of this device's shard, all-gathered in bf16: per leaf float32 [n, row_len]."""
  leaf_count = len(layouts)
  shards = [quant.mean_over_peers(v)
            for v in row_values(got.rows, got.side[:, :leaf_count], layouts, settings.fmt)]
  values, statuses = comm.gather_bf16(shards, status, settings.axis_name)
  zero = jnp.int32(0)
  return values, coded.Received(jnp.zeros((len(values[0]), 0), jnp.uint8), statuses,
                                jnp.zeros(2, jnp.int32), zero, zero)


def _sum_gather(settings: Co3Settings, got: coded.Received, layouts: list, scales: jax.Array,
                status: jax.Array, coded_path: bool) -> tuple[list, coded.Received]:
  """The exact sum of the levels of this device's shard, all-gathered one byte an element
  (offset by max_sum) and coded; every device divides by n and by the agreed scales."""
  n, fmt = len(got.rows), settings.fmt
  unit, offset = level_unit(fmt), max_sum(fmt, n)
  levels = row_values(got.rows, jnp.ones((n, len(layouts)), jnp.float32), layouts, fmt)
  sum_R = jnp.concatenate([quant.sum_rows(v * unit) for v in levels])  # integers: exact
  # A symbol that is no level (a NaN gradient's, or a peer's forgery) makes the sum NaN: the
  # step is skipped, as for a stream that does not decode.
  valid = jnp.all(jnp.isfinite(sum_R))
  status = status + jnp.stack([jnp.where(valid, 0.0, jnp.inf), 0.0]).astype(jnp.float32)
  sums_B = jnp.where(jnp.isfinite(sum_R), sum_R + offset, 0).astype(jnp.uint8)
  gathered = _exchange(settings, True, sums_B, status, coded_path, gather_bits(settings, n),
                       gather_reach_bits(settings, n))
  # A byte above 2 * offset is no sum of n levels: a peer's forgery, counted as a stream that
  # does not decode (`_corrupt`).
  forged = jnp.any(gathered.rows > 2 * offset).astype(jnp.int32)
  gathered = gathered._replace(missing=gathered.missing.at[1].add(forged))
  sums_NxR = gathered.rows.astype(jnp.float32) - offset
  ends = itertools.accumulate(lay.row_len for lay in layouts)
  return [sums_NxR[:, end - lay.row_len:end] * (1.0 / (unit * n)) * (1.0 / scales[i])
          for i, (end, lay) in enumerate(zip(ends, layouts))], gathered


def _per_shard(settings: Co3Settings, layouts: list, rows_NxB: jax.Array, scales: jax.Array,
               flag: jax.Array, coded_path: bool) -> Exchanged:
  """All-to-all of the rows, the mean of this device's shard, the gather of the shards."""
  n, leaf_count = layouts[0].rows, len(layouts)
  side_NxS = jnp.broadcast_to(jnp.concatenate([scales, flag[None]]), (n, leaf_count + 1))
  got = _exchange(settings, False, rows_NxB, side_NxS, coded_path, *_symbol_slots(settings))
  status = jnp.stack([got.side[:, leaf_count].sum() + _corrupt(got.missing),
                      (got.missing[0] > 0).astype(jnp.float32)])
  if settings.gather == "bf16":
    values, gathered = _bf16_gather(settings, got, layouts, status)
  else:
    values, gathered = _sum_gather(settings, got, layouts, scales, status, coded_path)
  flag = gathered.side[:, 0].sum()
  overflowed = (gathered.side[:, 1].sum() + gathered.missing[0]) > 0
  if settings.gather == "coded" and coded_path:  # as in _whole: the gathered streams' verdict
    flag = jax.lax.psum(flag + _corrupt(gathered.missing), settings.axis_name)
  return Exchanged([layout.from_rows(v, lay) for v, lay in zip(values, layouts)], flag,
                   overflowed.astype(jnp.float32), got.coded_bytes + gathered.coded_bytes,
                   jnp.maximum(got.extended, gathered.extended))


def mean_over_axis(settings: Co3Settings, symbols: list, scales: jax.Array,
                   flag: jax.Array) -> Exchanged:
  """The mean over `settings.axis_name` of every device's decoded symbols (uint8 [size] per
  leaf), at its `scales` (float32 [leaves]); `flag` is NaN where this gradient is not finite.
  Where the coded exchange overflowed and nothing else went wrong, it runs again raw."""
  n = comm.axis_size(settings.axis_name, "co3")
  per_shard = is_per_shard(settings, n)
  layouts = [layout.leaf_layout(s.size, n if per_shard else 1, None) for s in symbols]
  # Made once: a retry that converted again would have XLA convert every step, for the
  # conditional's operands, what the coded path has already converted.
  rows = symbol_rows(symbols, layouts, settings.fmt)
  run = functools.partial(_per_shard if per_shard else _whole, settings, layouts, rows, scales,
                          flag)
  first = run(settings.entropy_code)
  if not settings.entropy_code:
    return first
  retry = (first.overflowed > 0) & (first.flag == 0)
  return jax.lax.cond(retry, lambda: run(False)._replace(overflowed=first.overflowed,
                                                         coded_bytes=first.coded_bytes,
                                                         extended=first.extended),
                      lambda: first)


def local(settings: Co3Settings, symbols: list, scales: jax.Array, flag: jax.Array) -> Exchanged:
  """No peers: the symbols' round trip through the coder on the host (entropy_code), decoded."""
  layouts = [layout.leaf_layout(s.size, 1, None) for s in symbols]
  row_1xB, coded_bytes = symbol_rows(symbols, layouts, settings.fmt), jnp.int32(0)
  if settings.entropy_code:
    shapes = (jax.ShapeDtypeStruct(row_1xB.shape, jnp.uint8), jax.ShapeDtypeStruct((), jnp.int32))
    row_1xB, coded_bytes = leaves.vary_like(coded.host_call(_roundtrip, shapes, row_1xB), row_1xB)
  values = [v[0, :lay.size] for v, lay in zip(row_values(row_1xB, scales[None], layouts,
                                                     settings.fmt), layouts)]
  if settings.axis_name is not None:  # an axis of one device: the mean is typed replicated
    values, flag = jax.lax.all_gather((values, flag[None]), settings.axis_name, tiled=True,
                                      to="invarying")
    flag = flag[0]
  return Exchanged(values, flag, jnp.float32(0), coded_bytes, jnp.int32(0))


def _roundtrip(row_1xB: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  stream = CODER.encode(row_1xB)
  return CODER.decode(stream, row_1xB.size).reshape(row_1xB.shape), np.int32(len(stream))


def coded_symbols(settings: Co3Settings, n: int, symbols: list) -> int:
  """Symbols in the streams one device codes a step (what `Co3State.coded_bits` divides by)."""
  if n == 1 or not is_per_shard(settings, n):
    return sum(layout.shard_len(s.size, 1) for s in symbols)
  row = sum(layout.shard_len(s.size, n) for s in symbols)
  return (n - 1) * row + (row if settings.gather == "coded" else 0)
