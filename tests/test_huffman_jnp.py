"""Tests for loco_jax.apps.huffman_jnp: roundtrips under jit, the host coder's bit count, overflow."""

import functools

import jax
import numpy as np
import pytest

from loco_jax.apps import huffman
from loco_jax.apps import huffman_jnp as hj
from loco_jax.codecs import fp, gennorm


def _gennorm_fp4(n: int, beta: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """fp4 symbols of GenNorm(beta) data at CO3's scale, and the model's symbol probabilities."""
  scale = gennorm.fp4_scale(beta, 1.0)
  x = gennorm.sample(np.random.default_rng(seed), beta, 1.0, (n,))
  return fp.encode(x, fp.FP4, scale), gennorm.symbol_probabilities(fp.FP4, beta, 1.0, scale)


@functools.partial(jax.jit, static_argnames=("lane_symbols", "capacity_words", "packing",
                                             "max_code_length"))
def _roundtrip(symbols: jax.Array, lengths: jax.Array, codes: jax.Array, *, lane_symbols: int,
               capacity_words: int, packing: str = "segment_sum",
               max_code_length: int = hj.MAX_CODE_LENGTH) -> tuple[jax.Array, hj.Encoded]:
  """encode then decode in one jitted function, the table traced."""
  enc = hj.encode(symbols, lengths, codes, lane_symbols=lane_symbols,
                  capacity_words=capacity_words, packing=packing)
  decoded = hj.decode(enc.words, enc.lane_bit_offsets, symbols.shape[0], lengths, codes,
                      lane_symbols=lane_symbols, max_code_length=max_code_length)
  return decoded, enc


def _bits(symbols: np.ndarray, lengths: np.ndarray) -> int:
  return int(lengths.astype(np.int64)[symbols].sum())


def _payload_bytes(enc: hj.Encoded) -> bytes:
  total = int(enc.total_bits)
  return np.asarray(enc.words).astype(">u4").tobytes()[:(total + 7) // 8]


@pytest.mark.parametrize("beta", [0.5, 1.0, 2.0])
def test_roundtrip_gennorm_fp4_with_model_table(beta):
  symbols, probabilities = _gennorm_fp4(10_000, beta, seed=int(10 * beta))
  lengths, codes = hj.make_table(probabilities)
  decoded, enc = _roundtrip(symbols, lengths, codes, lane_symbols=2048, capacity_words=1500)
  np.testing.assert_array_equal(decoded, symbols)
  assert bool(enc.fits) and int(enc.total_bits) == _bits(symbols, lengths)
  starts = np.concatenate([[0], np.cumsum(lengths.astype(np.int64)[symbols])])
  np.testing.assert_array_equal(enc.lane_bit_offsets, starts[[0, 2048, 4096, 6144, 8192, 10_000]])


# Three tests share these shapes, so _roundtrip compiles once for them.
N, LANE, CAPACITY = 3001, 256, -(-3001 * hj.MAX_CODE_LENGTH // 32)


def test_roundtrip_all_256_letters():
  symbols = np.random.default_rng(1).integers(0, 256, N).astype(np.uint8)
  assert np.unique(symbols).size == 256
  lengths, codes = hj.make_table(np.bincount(symbols, minlength=256), every_letter=False)
  decoded, enc = _roundtrip(symbols, lengths, codes, lane_symbols=LANE, capacity_words=CAPACITY)
  np.testing.assert_array_equal(decoded, symbols)
  assert int(enc.total_bits) == _bits(symbols, lengths)


def test_roundtrip_16_bit_codes_across_word_boundaries():
  weights = 2.0 ** -np.minimum(np.arange(1, 18), 16)  # lengths 1..16, two letters at 16
  lengths, codes = hj.make_table(weights, 16, every_letter=False)
  assert lengths.max() == 16
  symbols = np.random.default_rng(2).integers(0, 17, N).astype(np.uint8)  # long codes a lot
  decoded, enc = _roundtrip(symbols, lengths, codes, lane_symbols=LANE, capacity_words=CAPACITY)
  np.testing.assert_array_equal(decoded, symbols)
  assert _payload_bytes(enc) == huffman._write_bits(symbols, lengths, LANE)[0]


def test_random_tables_match_the_host_payload():
  rng = np.random.default_rng(5)
  for max_code_length in (8, 11, 16):
    letters = rng.choice(256, rng.integers(2, 257), replace=False)
    weights = np.zeros(256)
    weights[letters] = rng.pareto(0.7, letters.size) + 1e-3  # heavy tails: long codes
    lengths, codes = hj.make_table(weights, max_code_length, every_letter=False)
    symbols = rng.choice(256, N, p=weights / weights.sum()).astype(np.uint8)
    decoded, enc = _roundtrip(symbols, lengths, codes, lane_symbols=LANE, capacity_words=CAPACITY)
    np.testing.assert_array_equal(decoded, symbols)
    assert _payload_bytes(enc) == huffman._write_bits(symbols, lengths, LANE)[0]


def test_single_symbol_alphabet():
  symbols = np.full(N, 7, np.uint8)
  lengths, codes = hj.make_table(np.bincount(symbols, minlength=256), every_letter=False)
  assert np.flatnonzero(lengths).tolist() == [7] and lengths[7] == 1
  decoded, enc = _roundtrip(symbols, lengths, codes, lane_symbols=LANE, capacity_words=CAPACITY)
  np.testing.assert_array_equal(decoded, symbols)
  assert int(enc.total_bits) == N and not np.any(enc.words)


@pytest.mark.parametrize("n", [1, 65])
def test_stream_shorter_than_or_not_a_multiple_of_a_lane(n):
  symbols, probabilities = _gennorm_fp4(n, 1.0, seed=n)
  lengths, codes = hj.make_table(probabilities)
  decoded, enc = _roundtrip(symbols, lengths, codes, lane_symbols=64, capacity_words=40)
  np.testing.assert_array_equal(decoded, symbols)
  assert enc.lane_bit_offsets.shape == (-(-n // 64) + 1,)


def test_empty_stream():
  lengths, codes = hj.make_table(np.ones(16))
  enc = hj.encode(np.zeros(0, np.uint8), lengths, codes, capacity_words=4)
  assert int(enc.total_bits) == 0 and bool(enc.fits) and enc.lane_bit_offsets.tolist() == [0]
  assert hj.decode(enc.words, enc.lane_bit_offsets, 0, lengths, codes).shape == (0,)


def test_total_bits_and_payload_match_the_host_coder():
  symbols, _ = _gennorm_fp4(40_001, 0.5, seed=3)  # > 32K letters: the host coder uses lanes
  lengths = huffman.code_lengths(np.bincount(symbols, minlength=256))  # what encode sends
  codes = huffman.canonical_codes(lengths)
  enc = hj.encode(symbols, lengths, codes, capacity_words=20_001)
  payload, lane_bits = huffman._write_bits(symbols, lengths, 2048)
  assert int(enc.total_bits) == int(lane_bits.sum())
  np.testing.assert_array_equal(enc.lane_bit_offsets[1:], np.cumsum(lane_bits))
  assert _payload_bytes(enc) == payload  # the same bits, MSB first
  stream = huffman.encode(symbols)
  assert stream.endswith(payload)
  np.testing.assert_array_equal(huffman.decode(stream), symbols)


@pytest.mark.slow
@pytest.mark.parametrize("packing", ["segment_sum", "cumsum"])
def test_overflow_is_reported_not_written(packing):
  symbols = np.random.default_rng(4).integers(0, 16, 5000).astype(np.uint8)
  lengths, codes = hj.make_table(np.ones(16), every_letter=False)  # 4 bits each: 625 words
  payload = huffman._write_bits(symbols, lengths, 2048)[0]
  expected = np.frombuffer(payload, ">u4").astype(np.uint32)
  encode = jax.jit(functools.partial(hj.encode, capacity_words=600, packing=packing))
  short = encode(symbols, lengths, codes)
  assert not bool(short.fits)
  assert int(short.total_bits) == 20_000 and int(short.needed_words) == 625
  np.testing.assert_array_equal(short.words, expected[:600])
  if packing == "cumsum":  # the other packing fits in every roundtrip test
    full = hj.encode(symbols, lengths, codes, capacity_words=700, packing=packing)
    assert bool(full.fits) and int(full.needed_words) == 625
    np.testing.assert_array_equal(full.words, np.pad(expected, (0, 75)))


def test_symbol_without_code_is_reported():
  lengths, codes = hj.make_table(np.ones(4), every_letter=False)  # letters 0..3 only
  enc = hj.encode(np.array([0, 1, 9, 2], np.uint8), lengths, codes, capacity_words=4)
  assert int(enc.total_bits) == -1 and not bool(enc.fits)


def test_exact_multiple_of_a_lane_exact_capacity_unrolled():
  symbols, probabilities = _gennorm_fp4(1000, 1.0)
  lengths, codes = hj.make_table(probabilities)
  bits = _bits(symbols, lengths)
  assert bits % 32
  enc = hj.encode(symbols, lengths, codes, lane_symbols=100, capacity_words=-(-bits // 32))
  assert bool(enc.fits)
  decoded = hj.decode(enc.words, enc.lane_bit_offsets, 1000, lengths, codes, lane_symbols=100,
                      max_code_length=int(lengths.max()), unroll=8)
  np.testing.assert_array_equal(decoded, symbols)


def test_make_table_codes_every_letter():
  probabilities = gennorm.symbol_probabilities(fp.FP4, 1.0, 1.0, gennorm.fp4_scale(1.0, 1.0))
  lengths, codes = hj.make_table(probabilities)
  assert np.all(lengths > 0) and lengths.max() <= huffman.DEFAULT_MAX_CODE_LENGTH
  assert np.sum(2.0 ** -lengths.astype(np.float64)) == 1.0
  np.testing.assert_array_equal(codes, huffman.canonical_codes(lengths))


def test_bad_arguments_raise():
  lengths, codes = hj.make_table(np.ones(16), every_letter=False)
  symbols = np.zeros(10, np.uint8)
  with pytest.raises(ValueError, match="uint8"):
    hj.encode(symbols.astype(np.int32), lengths, codes, capacity_words=4)
  with pytest.raises(ValueError, match="capacity_words"):
    hj.encode(symbols, lengths, codes, capacity_words=0)
  with pytest.raises(ValueError, match="codes\\[256\\]"):
    hj.encode(symbols, lengths[:16], codes, capacity_words=4)
  with pytest.raises(ValueError, match="packing"):
    hj.encode(symbols, lengths, codes, capacity_words=4, packing="sort")
  enc = hj.encode(symbols, lengths, codes, capacity_words=4)
  with pytest.raises(ValueError, match="max_code_length"):
    hj.decode(enc.words, enc.lane_bit_offsets, 10, lengths, codes, max_code_length=3)
  with pytest.raises(ValueError, match="lane_bit_offsets"):
    hj.decode(enc.words, enc.lane_bit_offsets, 10, lengths, codes, lane_symbols=4)
  with pytest.raises(ValueError, match="n must be"):
    hj.decode(enc.words, enc.lane_bit_offsets, -1, lengths, codes)
