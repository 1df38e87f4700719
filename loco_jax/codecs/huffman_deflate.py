"""Fast Huffman coding of byte rows: zlib's Huffman-only deflate behind a checked header.

The wire format of CO3's coded exchange: `Z_HUFFMAN_ONLY` deflate, one code table per block of
about 32K bytes and no LZ77 match. zlib-ng writes the streams and libdeflate reads them
(docs/results/co3.md); Python's zlib reads ours and we read its. fp4 symbols travel in
pairs, one byte each pair, which closes most of Huffman's gap to the entropy.

Stream: "LD", version 1, the byte count (LEB128 varint), the CRC32 of the bytes (4 bytes,
little-endian), then raw deflate. `decode` trusts nothing: whatever does not decode to exactly
the expected bytes raises ValueError, and it never produces more than the expected count.

Example:
  >>> data = np.array([0, 0, 1, 9], np.uint8)
  >>> decode(encode(data), 4)
  array([0, 0, 1, 9], dtype=uint8)
"""

import deflate
import numpy as np
from zlib_ng import zlib_ng as zlib

MAGIC = b"LD"
VERSION = 1
# Deflate blocks: zlib ends one every 2**(MEM_LEVEL + 6) - 1 bytes; a dynamic block's header
# (its code lengths, themselves Huffman-coded) takes about BLOCK_HEADER_BYTES for 257 letters
# (docs/results/co3.md). `overhead` is what a slot reserves, not a bound: a stream that
# does not fit is sent raw (comm.coded), so nothing is lost where it is short.
MEM_LEVEL = 9
BLOCK_BYTES = (1 << (MEM_LEVEL + 6)) - 1
BLOCK_HEADER_BYTES = 128
#: magic, version, a varint of up to 2**35, the CRC32, deflate's final empty block
HEADER_BYTES = 2 + 1 + 5 + 4 + 8


def encode(data: np.ndarray) -> bytes:
  """The stream of uint8 `data` (any shape, read flat): the header, then the deflate."""
  data = np.ascontiguousarray(data)
  if data.dtype != np.uint8:
    raise ValueError(f"huffman_deflate.encode takes uint8 data, got {data.dtype}")
  packer = zlib.compressobj(1, zlib.DEFLATED, -15, MEM_LEVEL, zlib.Z_HUFFMAN_ONLY)
  header = MAGIC + bytes([VERSION]) + varint_bytes(data.size) + zlib.crc32(data).to_bytes(4, "little")
  return header + packer.compress(data) + packer.flush()


def overhead(size: int) -> int:
  """The most bytes a stream of `size` bytes spends beyond its Huffman payload."""
  return HEADER_BYTES + BLOCK_HEADER_BYTES * max(1, -(-size // BLOCK_BYTES))


def decode(stream, size: int) -> np.ndarray:
  """uint8 [size], the bytes of a bytes-like stream made by `encode`; ValueError for anything
  else, a stream of another count included."""
  try:
    view = memoryview(stream).cast("B")
  except TypeError as e:
    raise TypeError(f"huffman_deflate.decode takes bytes, got {type(stream).__name__}") from e
  if bytes(view[:3]) != MAGIC + bytes([VERSION]):
    raise ValueError(f"not a version-{VERSION} {MAGIC!r} stream: it starts {bytes(view[:3])!r}")
  count, at = _read_varint(view, 3)
  if count != size:
    raise ValueError(f"the stream holds {count} bytes, {size} were expected")
  if len(view) < at + 4:
    raise ValueError("truncated stream: the CRC32 is cut off")
  crc = int.from_bytes(view[at:at + 4], "little")
  try:  # into at most `size` bytes: a longer stream fails without growing further
    out = deflate.deflate_decompress(view[at + 4:], size)
  except deflate.DeflateError:
    raise ValueError(f"corrupt or truncated stream: it does not inflate to at most {size} "
                     f"bytes") from None
  if len(out) != size:
    raise ValueError(f"corrupt or truncated stream: it decodes to {len(out)} bytes, {size} "
                     f"were expected")
  if zlib.crc32(out) != crc:
    raise ValueError("corrupt stream: the CRC32 of the decoded bytes does not match")
  return np.frombuffer(out, np.uint8)


def varint_bytes(value: int) -> bytes:
  """LEB128: seven bits a byte, low first, the top bit set on all but the last."""
  out = bytearray()
  while True:
    byte, value = value & 0x7F, value >> 7
    out.append(byte | (0x80 if value else 0))
    if not value:
      return bytes(out)


def _read_varint(view: memoryview, at: int) -> tuple[int, int]:
  value = 0
  for i in range(5):
    if at + i >= len(view):
      raise ValueError("truncated stream: the byte count is cut off")
    byte = view[at + i]
    value |= (byte & 0x7F) << (7 * i)
    if not byte & 0x80:
      if i and not byte:
        raise ValueError("corrupt stream: the byte count is a non-minimal varint")
      return value, at + i + 1
  raise ValueError("corrupt stream: the byte count is longer than 5 bytes")
