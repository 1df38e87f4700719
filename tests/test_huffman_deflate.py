"""codecs.huffman_deflate: exact round trips, Huffman-only streams, and untrusted input
(every stream that does not decode to exactly the expected bytes raises ValueError, memory
bounded)."""

import tracemalloc
import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loco_jax.apps import huffman
from loco_jax.codecs import fp, gennorm, huffman_deflate


def _pairs(n: int, beta: float = 1.0, seed: int = 0) -> np.ndarray:
  """fp4 symbols of GenNorm data at CO3's scale, two a byte, as co3 sends them."""
  x = gennorm.sample(np.random.default_rng(seed), beta, 1.0, (2 * n,)).astype(np.float32)
  symbols = np.asarray(fp.encode(x, fp.FP4, np.float32(gennorm.fp4_scale(max(beta, 0.35), 1))))
  return (symbols[0::2] << 4 | symbols[1::2]).astype(np.uint8)


def _header_bytes(size: int) -> int:
  """Magic and version, the byte count's varint, the CRC32: what precedes the deflate."""
  return 3 + len(huffman_deflate.varint_bytes(size)) + 4


@pytest.mark.parametrize("n", [0, 1, 2, 1000, 32_767, 100_001])
def test_round_trip_is_exact(n):
  data = _pairs(n, seed=n)
  np.testing.assert_array_equal(huffman_deflate.decode(huffman_deflate.encode(data), n), data)


@pytest.mark.parametrize("beta", [0.5, 1.0, 2.0])
def test_size_is_within_two_percent_of_the_entropy(beta):
  data = _pairs(200_000, beta)
  stream = huffman_deflate.encode(data)
  entropy_bytes = huffman.entropy_bits(data) * data.size / 8
  assert entropy_bytes < len(stream) < 1.02 * entropy_bytes
  assert len(stream) <= entropy_bytes + huffman_deflate.overhead(data.size) + 0.02 * entropy_bytes


def test_the_payload_is_huffman_only_deflate():
  """Raw deflate in dynamic-Huffman blocks whose inflate never copies (no LZ77 match): a run
  of one byte costs a bit a byte, where any LZ77 coder would code it in a few bytes."""
  run = np.zeros(100_000, np.uint8)
  stream = huffman_deflate.encode(run)
  assert len(stream) > 100_000 / 8
  assert zlib.decompress(stream[_header_bytes(run.size):], -15) == run.tobytes()


def test_streams_of_pythons_own_zlib_decode():
  """The coder is zlib-ng; a peer whose stream came from Python's zlib (the same deflate
  format, another encoder) is read alike, and its zlib reads ours (the test above)."""
  data = _pairs(70_000, seed=3)
  packer = zlib.compressobj(1, zlib.DEFLATED, -15, huffman_deflate.MEM_LEVEL, zlib.Z_HUFFMAN_ONLY)
  ours = huffman_deflate.encode(data)
  theirs = ours[:_header_bytes(data.size)] + packer.compress(data.tobytes()) + packer.flush()
  np.testing.assert_array_equal(huffman_deflate.decode(theirs, data.size), data)


def test_wrong_dtype_and_non_bytes_are_refused():
  with pytest.raises(ValueError, match="uint8"):
    huffman_deflate.encode(np.zeros(4, np.int32))
  with pytest.raises(TypeError, match="bytes"):
    huffman_deflate.decode(12, 4)


def test_another_count_is_refused_before_decoding():
  stream = huffman_deflate.encode(_pairs(1000))
  for size in (0, 999, 1001, 10**9):
    with pytest.raises(ValueError, match="expected"):
      huffman_deflate.decode(stream, size)


def test_a_stream_claiming_few_bytes_does_not_grow_memory():
  """A peer claims 10 bytes but sends a deflate bomb: decode writes at most 10."""
  bomb = zlib.compressobj(9, zlib.DEFLATED, -15)
  payload = bomb.compress(bytes(50_000_000)) + bomb.flush()
  stream = b"LD\x01\x0a" + zlib.crc32(bytes(10)).to_bytes(4, "little") + payload
  tracemalloc.start()
  with pytest.raises(ValueError, match="does not inflate to at most 10"):
    huffman_deflate.decode(stream, 10)
  _, peak = tracemalloc.get_traced_memory()
  tracemalloc.stop()
  assert peak < 1 << 20


@pytest.mark.parametrize("cut", [0, 2, 3, 4, 7, 8, 20, -1, -5])
def test_every_truncation_is_refused(cut):
  data = _pairs(5000)
  stream = huffman_deflate.encode(data)
  with pytest.raises(ValueError):
    huffman_deflate.decode(stream[:cut], data.size)


def test_bytes_after_the_final_block_are_not_read():
  """libdeflate stops at the deflate's final block: what follows cannot change the bytes
  decoded (the count and the CRC32 still hold them)."""
  data = _pairs(5000)
  for junk in (b"\x00", b"\xff" * 300):
    np.testing.assert_array_equal(
        huffman_deflate.decode(huffman_deflate.encode(data) + junk, data.size), data)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 3000), st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 255)),
                                      min_size=1, max_size=4))
def test_fuzz_flipped_streams_decode_exactly_or_raise(n, flips):
  data = _pairs(n, seed=n)
  stream = bytearray(huffman_deflate.encode(data))
  for at, mask in flips:
    stream[at % len(stream)] ^= mask
  try:
    out = huffman_deflate.decode(bytes(stream), n)
  except ValueError:
    return
  np.testing.assert_array_equal(out, data)  # a flip that cancels out: the data, or nothing


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=400), st.integers(0, 5000))
def test_fuzz_random_bytes_after_a_valid_header(junk, size):
  stream = b"LD\x01" + huffman_deflate.varint_bytes(size) + bytes(4) + junk
  try:
    out = huffman_deflate.decode(stream, size)
  except ValueError:
    return
  assert out.shape == (size,) and zlib.crc32(out) == 0
