"""The byte format of a Huffman stream's tables: code lengths, lane sizes, varints, and a
bounds-checked reader whose every shortfall is a ValueError (streams come from peers)."""

import numpy as np

from loco_jax.apps.huffman_codes import LANE_LETTERS, MAX_CODE_LENGTH, ONE_LANE_LETTERS
from loco_jax.codecs.huffman_deflate import varint_bytes


def lane_letters_for(n_letters: int) -> int:
  """Letters per lane, as encode picks them (decode accepts nothing else)."""
  return n_letters if n_letters <= ONE_LANE_LETTERS else LANE_LETTERS


def pack_lengths(lengths: np.ndarray) -> bytes:
  """Largest used letter, a presence bitmap up to it, then (length - 1) nibbles of those used."""
  used = np.flatnonzero(lengths)
  top = int(used[-1])
  bitmap = np.packbits(lengths[:top + 1] > 0).tobytes()
  nibbles = lengths[used] - 1
  if nibbles.size % 2:
    nibbles = np.append(nibbles, np.uint8(0))
  return bytes([top]) + bitmap + ((nibbles[0::2] << 4) | nibbles[1::2]).astype(np.uint8).tobytes()


def pack_lanes(lane_letters: int, lane_bits: np.ndarray) -> bytes:
  """Letters per lane, then every lane's bit length as `base + width-bit offset`."""
  base = int(lane_bits.min())
  width = int(lane_bits.max() - base).bit_length()
  offsets = (lane_bits - base).astype(np.uint64)
  shifts = np.arange(width - 1, -1, -1, dtype=np.uint64)
  bits = ((offsets[:, None] >> shifts[None, :]) & np.uint64(1)).astype(np.uint8)
  return (varint_bytes(lane_letters) + varint_bytes(base) + bytes([width])
          + np.packbits(bits.reshape(-1)).tobytes())


class Reader:
  """Bounds-checked cursor over the stream; every shortfall is a ValueError."""

  def __init__(self, data: bytes):
    self.data = data
    self.pos = 0

  def take(self, n: int, what: str) -> bytes:
    if n > len(self.data) - self.pos:
      raise ValueError(f"truncated Huffman stream: {what} needs {n} bytes at offset "
                       f"{self.pos}, only {len(self.data) - self.pos} left.")
    chunk = self.data[self.pos:self.pos + n]
    self.pos += n
    return chunk

  def byte(self, what: str) -> int:
    return self.take(1, what)[0]

  def varint(self, what: str) -> int:
    value = 0
    for i in range(10):
      byte = self.byte(what)
      value |= (byte & 0x7F) << (7 * i)
      if not byte & 0x80:
        if i and not byte:
          raise ValueError(f"corrupt Huffman stream: {what} is a non-minimal varint.")
        return value
    raise ValueError(f"corrupt Huffman stream: {what} is a varint longer than 10 bytes.")

  def remaining(self) -> int:
    return len(self.data) - self.pos


def expect_end(reader: Reader) -> None:
  if reader.remaining():
    raise ValueError(f"corrupt Huffman stream: {reader.remaining()} unexpected trailing bytes.")


def unpack_lengths(reader: Reader) -> np.ndarray:
  top = reader.byte("largest letter")
  bitmap = np.frombuffer(reader.take(top // 8 + 1, "letter bitmap"), np.uint8)
  present = np.unpackbits(bitmap)[:top + 1].astype(bool)
  if not present[top] or np.any(np.unpackbits(bitmap)[top + 1:]):
    raise ValueError("corrupt Huffman stream: the letter bitmap disagrees with its size.")
  n_used = int(present.sum())
  packed = np.frombuffer(reader.take((n_used + 1) // 2, "code lengths"), np.uint8)
  nibbles = np.stack([packed >> 4, packed & 15], axis=1).reshape(-1)
  if n_used % 2 and nibbles[-1]:
    raise ValueError("corrupt Huffman stream: the pad nibble of the code lengths is not 0.")
  lengths = np.zeros(256, np.uint8)
  lengths[:top + 1][present] = nibbles[:n_used] + 1
  # Kraft: more than one letter must form a complete code (no over- or under-subscription);
  # a lone letter has the 1-bit code.
  if n_used == 1:
    if lengths[top] != 1:
      raise ValueError("corrupt Huffman stream: a lone letter must have a 1-bit code.")
  elif int(np.sum(np.left_shift(1, MAX_CODE_LENGTH - lengths[lengths > 0].astype(np.int64)))) != (
      1 << MAX_CODE_LENGTH):
    raise ValueError("corrupt Huffman stream: the code lengths violate Kraft's equality "
                     "(the code must be complete).")
  lengths.setflags(write=False)
  return lengths


def unpack_lanes(reader: Reader, n_lanes: int) -> np.ndarray:
  base = reader.varint("lane base length")
  width = reader.byte("lane length width")
  if width > 40:
    raise ValueError(f"corrupt Huffman stream: lane length width {width} > 40 bits.")
  n_bytes = (n_lanes * width + 7) // 8
  if n_bytes > reader.remaining():
    raise ValueError("truncated Huffman stream: lane table runs past the end.")
  packed = np.frombuffer(reader.take(n_bytes, "lane table"), np.uint8)
  bits = np.unpackbits(packed)
  if np.any(bits[n_lanes * width:]):
    raise ValueError("corrupt Huffman stream: the lane table's pad bits are not zero.")
  weights = np.left_shift(1, np.arange(width - 1, -1, -1, dtype=np.int64))
  offsets = bits[:n_lanes * width].reshape(n_lanes, width).astype(np.int64) @ weights
  if base > (1 << 40):
    raise ValueError(f"corrupt Huffman stream: lane base length {base} is absurd.")
  # encode writes base = the shortest lane and width = the bits of the largest offset.
  if int(offsets.min()) != 0 or int(offsets.max()).bit_length() != width:
    raise ValueError(f"corrupt Huffman stream: lane table base {base} and width {width} are not "
                     f"the shortest lane and the width of the largest offset.")
  return base + offsets
