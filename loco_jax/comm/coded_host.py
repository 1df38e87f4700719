"""The host side of the coded exchange: calls into numpy from a step, and the slots' coding.

Callbacks run once per device under shard_map, from several host threads at once: everything
here is a pure function of its arguments (the coder must be thread-safe too).
"""

import math
from typing import Callable, Protocol

import jax
import numpy as np
from jax.experimental.buffer_callback import buffer_callback


class ByteCoder(Protocol):
  """A lossless coder of byte rows, run on the host; every function must be thread-safe.

  The module `codecs.huffman_deflate` is one: the exchanges take it as their coder.
  """

  def encode(self, data: np.ndarray) -> bytes:
    """uint8 [size] -> its stream."""

  def decode(self, stream: memoryview, size: int) -> np.ndarray:
    """Exactly `size` bytes (uint8) from the stream, or ValueError: peers are untrusted."""

  def overhead(self, size: int) -> int:
    """The most bytes a stream of `size` bytes spends beyond its payload."""


def slot_bytes(size: int, bits_per_byte: float, coder: ByteCoder) -> int:
  """The capacity of a slot for `size` bytes coded at up to `bits_per_byte` bits a byte."""
  return math.ceil(bits_per_byte * size / 8) + coder.overhead(size)


def needed_bits_per_byte(lengths, size: int, coder: ByteCoder):
  """The inverse of `slot_bytes`: the bits a byte a slot must reserve to hold streams of
  `lengths` (an int or a numpy array) coding `size` bytes each."""
  return (lengths - coder.overhead(size)) * 8.0 / size


def host_call(fn: Callable, result, *args):
  """`fn(*numpy arrays)` on the host, once per device under shard_map; `result`: its shapes.

  On the CPU backend jax.pure_callback copies its arguments onto CPU device 0, which under
  shard_map may be blocked in a collective waiting for this very callback: a deadlock.
  buffer_callback hands over the buffers themselves instead (no copy either way).
  """
  if jax.default_backend() != "cpu":
    return jax.pure_callback(fn, result, *args)

  def run(ctx, out, *buffers):
    del ctx
    values = fn(*[np.asarray(b) for b in buffers])
    for buffer, value in zip(jax.tree.leaves(out), jax.tree.leaves(values)):
      np.asarray(buffer)[...] = value
  return buffer_callback(run, result)(*args)


def fill_slots(rows_NxB: np.ndarray, sender: np.ndarray, capacity: int, coder: ByteCoder,
               skip: int) -> tuple[np.ndarray, np.ndarray]:
  """Codes each row into its slot: (uint8 [N, capacity], int32 [N] stream lengths).

  A stream longer than the capacity keeps its true length (the receiver sees the overflow) and
  an empty slot; row `skip` (this device's own, which never crosses the wire; -1: none) is not
  coded and has length 0. Rows are coded in order. `sender` (this device) is not read here:
  it tells a wrapper of this function which device codes (tests tamper with streams that way).
  """
  del sender
  slots = np.zeros((rows_NxB.shape[0], capacity), np.uint8)
  lengths = np.zeros(rows_NxB.shape[0], np.int32)
  for j, row in enumerate(rows_NxB):
    if j == skip:
      continue
    stream = coder.encode(row)
    lengths[j] = len(stream)
    if len(stream) <= capacity:
      slots[j, :len(stream)] = np.frombuffer(stream, np.uint8)
  return slots, lengths


def read_slots(slots_NxC: np.ndarray, lengths: np.ndarray, own_B: np.ndarray, me: np.ndarray,
               coder: ByteCoder) -> tuple[np.ndarray, np.ndarray]:
  """Decodes every peer's slot: (uint8 [N, B] rows, int32 [2] slots [overflowed, corrupt]).

  Row `me` is this device's own row `own_B`. A peer's slot whose stream overflowed, or that
  does not decode to exactly B bytes, is left as zeros and counted: the caller must not use
  those rows.
  """
  me, size = int(me), own_B.size
  rows = np.zeros((slots_NxC.shape[0], size), np.uint8)
  missing = np.zeros(2, np.int32)
  for s, length in enumerate(lengths.tolist()):
    # This device's own slot counts too: in a gather every device sees the same lengths, and
    # all must count alike.
    overflowed = length > slots_NxC.shape[1]
    missing[0] += overflowed
    if s == me:
      rows[s] = own_B
    elif overflowed:
      continue
    elif length < 0:
      missing[1] += 1
    else:
      try:
        decoded = coder.decode(memoryview(slots_NxC[s, :length]), size)
      except ValueError:
        decoded = None
      if decoded is None or decoded.shape != (size,):  # numpy would broadcast a short row
        missing[1] += 1
      else:
        rows[s] = decoded
  return rows, missing
