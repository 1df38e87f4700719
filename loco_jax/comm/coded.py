"""A coded exchange: byte rows entropy-coded on the host into fixed-capacity slots of one
all-to-all (or all-gather), decoded on the host where they arrive; the raw exchange beside it.

Each slot crosses at its capacity (collectives have static shapes) with its stream's length
and a few float32 side numbers per row. A stream longer than its slot is not sent and counts
as overflowed; one that does not decode to exactly its row counts as corrupt
(`Received.missing`). The caller decides, through a later collective, whether to redo the
exchange raw or to skip the step. Nothing here knows what the bytes mean.

A slot may have an extension: `extension` more bytes that cross, in a second collective inside
a lax.cond, only on the steps where some stream is longer than `capacity`.

Example (inside jax.shard_map over "data", n devices):
  >>> coder = codecs.huffman_deflate                                     # doctest: +SKIP
  >>> capacity = slot_bytes(rows.shape[1], 4.0, coder)                   # doctest: +SKIP
  >>> got = all_to_all(rows, side, capacity, coder, "data")              # doctest: +SKIP
  >>> got.rows[s], got.side[s]  # what device s sent here, its side numbers  # doctest: +SKIP
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from loco_jax.comm import framing, wire
from loco_jax.comm.hlo import Collective
from loco_jax.comm.coded_host import (ByteCoder, fill_slots, host_call,  # noqa: F401
                                      needed_bits_per_byte, read_slots, slot_bytes)
from loco_jax.core import leaves
from loco_jax.core.layout import AxisName


class Received(NamedTuple):
  """What one device received: row s (and its side numbers) came from device s."""
  rows: jax.Array         # uint8 [n, B]; zeros where a slot is missing
  side: jax.Array         # float32 [n, S]
  missing: jax.Array      # int32 [2]: slots here that [overflowed, did not decode]; raw: zeros
  coded_bytes: jax.Array  # int32: bytes of the streams this device coded (raw: 0)
  extended: jax.Array     # int32 0 or 1, alike on every device: the slots' extension was sent


def _code(rows_NxB: jax.Array, capacity: int, coder: ByteCoder, sender: jax.Array,
          skip: int | jax.Array) -> tuple[jax.Array, jax.Array]:
  """One host call: every row coded into its slot -> (uint8 [N, capacity], int32 [N])."""
  n = rows_NxB.shape[0]
  shapes = (jax.ShapeDtypeStruct((n, capacity), jnp.uint8), jax.ShapeDtypeStruct((n,), jnp.int32))
  fill = lambda rows, sender, skip: fill_slots(rows, sender, capacity, coder, int(skip))
  out = host_call(fill, shapes, rows_NxB, sender, jnp.asarray(skip, jnp.int32))
  return leaves.vary_like(out, rows_NxB)


def _decode(slots_NxC: jax.Array, lengths: jax.Array, own_B: jax.Array, me: jax.Array,
            coder: ByteCoder) -> tuple[jax.Array, jax.Array]:
  """One host call: every peer's slot decoded -> (uint8 [N, B], int32 [2] missing)."""
  n, size = slots_NxC.shape[0], own_B.shape[0]
  shapes = (jax.ShapeDtypeStruct((n, size), jnp.uint8), jax.ShapeDtypeStruct((2,), jnp.int32))
  out = host_call(functools.partial(read_slots, coder=coder), shapes, slots_NxC, lengths,
                  own_B, me)
  return leaves.vary_like(out, slots_NxC)


#: The named scope of the extensions' collectives, which `is_extension` finds in the HLO.
EXTENSION_SCOPE = "coded_slot_extension"


def is_extension(collective: Collective) -> bool:
  """Whether a compiled step's collective sends slots' extensions (those steps' extra bytes)."""
  return EXTENSION_SCOPE in collective.op_name.split("/")


def _extend(got_NxC: jax.Array, got_lengths: jax.Array, tails_MxE: jax.Array,
            extended: jax.Array, send) -> tuple[jax.Array, jax.Array]:
  """The received slots with their extensions appended (`send(tails)` where `extended`, alike
  on every device, else zeros), and the received lengths, where one longer than the bytes that
  arrived reads as overflowed (only a peer outside the agreement sends one)."""
  capacity, extension = got_NxC.shape[1], tails_MxE.shape[1]
  zeros = lambda: leaves.vary_like(jnp.zeros((got_NxC.shape[0], extension), jnp.uint8), got_NxC)
  with jax.named_scope(EXTENSION_SCOPE):
    got_tails = jax.lax.cond(extended, lambda: send(tails_MxE), zeros)
  arrived = jnp.where(extended, capacity + extension, capacity)
  return (jnp.concatenate([got_NxC, got_tails], axis=1),
          jnp.where(got_lengths > arrived, capacity + extension + 1, got_lengths))


def all_to_all(rows_NxB: jax.Array, side_NxS: jax.Array, capacity: int, coder: ByteCoder,
               axis_name: AxisName, extension: int = 0) -> Received:
  """Row j of `rows_NxB` (uint8) coded into a slot of `capacity` bytes, sent to device j with
  row j of `side_NxS` (float32) in ONE all-to-all; every slot received here decoded.

  `side_NxS`: float32 numbers sent uncoded beside each row. `extension`: bytes a slot may take
  beyond `capacity`, sent in a second all-to-all only where some device coded a longer stream.
  Returns `Received`: row s is what device s sent here; this device's own row is never coded.
  """
  me = jax.lax.axis_index(axis_name)
  slots, lengths = _code(rows_NxB, capacity + extension, coder, me, me)
  buffer, parts = framing.frame([slots[:, :capacity], lengths, side_NxS])
  got_slots, got_lengths, got_side = framing.unframe(wire.all_to_all(buffer, axis_name), parts)
  extended = jnp.bool_(False)
  if extension:
    extended = jax.lax.pmax(jnp.max(lengths), axis_name) > capacity
    got_slots, got_lengths = _extend(got_slots, got_lengths, slots[:, capacity:], extended,
                                     lambda tails: wire.all_to_all(tails, axis_name))
  own = jax.lax.dynamic_index_in_dim(rows_NxB, me, keepdims=False)
  rows, missing = _decode(got_slots, got_lengths, own, me, coder)
  return Received(rows, got_side, missing, jnp.sum(jnp.where(lengths > 0, lengths, 0)),
                  extended.astype(jnp.int32))


def all_gather(row_B: jax.Array, side_S: jax.Array, capacity: int, coder: ByteCoder,
               axis_name: AxisName, extension: int = 0) -> Received:
  """`row_B` (uint8) coded into a slot of `capacity` bytes and all-gathered with `side_S`
  (float32); every peer's slot decoded here. Every device receives the same slots, so the
  overflow counts (`Received.missing[0]`) agree; what fails to decode is found by each
  receiver of it, but not by its sender: agree on it through a later collective. `extension`
  as for `all_to_all`, agreed from the gathered lengths (which every device has alike)."""
  me = jax.lax.axis_index(axis_name)
  slot, length = _code(row_B[None], capacity + extension, coder, me, -1)
  buffer, parts = framing.frame([slot[:, :capacity], length, side_S[None]])
  got_slots, got_lengths, got_side = framing.unframe(wire.all_gather(buffer, axis_name), parts)
  extended = jnp.bool_(False)
  if extension:
    extended = jnp.max(got_lengths) > capacity
    got_slots, got_lengths = _extend(got_slots, got_lengths, slot[:, capacity:], extended,
                                     lambda tail: wire.all_gather(tail, axis_name))
  rows, missing = _decode(got_slots, got_lengths, row_B, me, coder)
  return Received(rows, got_side, missing, length[0],
                  extended.astype(jnp.int32))


def raw_all_to_all(rows_NxB: jax.Array, side_NxS: jax.Array, axis_name: AxisName) -> Received:
  """`all_to_all` without coding: the rows as they are."""
  buffer, parts = framing.frame([rows_NxB, side_NxS])
  return Received(*framing.unframe(wire.all_to_all(buffer, axis_name), parts),
                  jnp.zeros(2, jnp.int32), jnp.int32(0), jnp.int32(0))


def raw_all_gather(row_B: jax.Array, side_S: jax.Array, axis_name: AxisName) -> Received:
  """`all_gather` without coding: the row as it is."""
  buffer, parts = framing.frame([row_B[None], side_S[None]])
  return Received(*framing.unframe(wire.all_gather(buffer, axis_name), parts),
                  jnp.zeros(2, jnp.int32), jnp.int32(0), jnp.int32(0))
