"""huffman.decode on streams encode could not have made: refusal, bounded memory, fuzzing."""

import functools
import tracemalloc
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loco_jax.apps import huffman, huffman_format, huffman_lanes

STRATEGIES = ["lock_step", "walk", "doubling"]


def _craft(symbols: np.ndarray, lengths: np.ndarray, *, lane_letters: int | None = None,
           lane_base_delta: int = 0, extra_width: int = 0, flags: int = 0,
           table: bytes | None = None) -> bytes:
  """A stream in encode's layout with every field chosen by the caller, a correct CRC and a
  payload that parses: what a hostile or buggy peer could send."""
  letters = symbols
  n = letters.size
  lane_letters = huffman_format.lane_letters_for(n) if lane_letters is None else lane_letters
  payload, lane_bits = huffman._write_bits(letters, lengths, lane_letters)
  base = int(lane_bits.min()) - lane_base_delta
  offsets = lane_bits - base
  width = int(offsets.max()).bit_length() + extra_width
  bits = ((offsets[:, None] >> np.arange(width - 1, -1, -1)) & 1).astype(np.uint8)
  lanes = (huffman_format.varint_bytes(lane_letters) + huffman_format.varint_bytes(base) + bytes([width])
           + np.packbits(bits.reshape(-1)).tobytes())
  header = (b"LH\x01" + bytes([flags]) + huffman_format.varint_bytes(n)
            + zlib.crc32(symbols).to_bytes(4, "little"))
  return header + (huffman_format.pack_lengths(lengths) if table is None else table) + lanes + payload


def _two_letters(n: int) -> np.ndarray:
  return (np.random.default_rng(n).random(n) < 0.5).astype(np.uint8)


def test_crafting_encodes_choices_reproduces_encode():
  """The crafting helper is faithful: with encode's own choices it makes encode's bytes."""
  symbols = np.random.default_rng(0).integers(0, 7, 70_000).astype(np.uint8)
  lengths = huffman.code_lengths(np.bincount(symbols, minlength=256))
  assert _craft(symbols, lengths) == huffman.encode(symbols)


@pytest.mark.slow
def test_one_letter_lanes_are_refused_without_memory_blowup():
  """The tester's stream: valid payload, one letter a lane, zero-width lane table (~1 MB)."""
  symbols = _two_letters(8_000_000)
  lengths = huffman.code_lengths(np.bincount(symbols, minlength=256))
  data = _craft(symbols, lengths, lane_letters=1)
  assert len(data) > 1_000_000
  tracemalloc.start()
  with pytest.raises(ValueError, match="letters per lane"):
    huffman.decode(data)
  _, peak = tracemalloc.get_traced_memory()
  tracemalloc.stop()
  assert peak < 1 << 20


@pytest.mark.parametrize("lane_letters", [1, 2047, 2049, 4096])
def test_lane_sizes_encode_never_writes_are_refused(lane_letters):
  symbols = _two_letters(40_000)
  lengths = huffman.code_lengths(np.bincount(symbols, minlength=256))
  with pytest.raises(ValueError, match="letters per lane"):
    huffman.decode(_craft(symbols, lengths, lane_letters=lane_letters))


@pytest.mark.parametrize("delta,extra", [(1, 0), (0, 1), (5, 3)])
def test_lane_tables_encode_never_writes_are_refused(delta, extra):
  symbols = np.random.default_rng(1).integers(0, 5, 40_000).astype(np.uint8)
  lengths = huffman.code_lengths(np.bincount(symbols, minlength=256))
  assert _craft(symbols, lengths) == huffman.encode(symbols)
  with pytest.raises(ValueError, match="lane table"):
    huffman.decode(_craft(symbols, lengths, lane_base_delta=delta, extra_width=extra))


def test_a_complete_table_encode_would_not_choose_is_refused():
  symbols = np.array([0] * 100 + [1, 2, 3], np.uint8)  # encode: lengths 1, 2, 3, 3
  swapped = np.zeros(256, np.uint8)
  swapped[:4] = [2, 1, 3, 3]  # complete, parses, right CRC, but no limit makes it
  with pytest.raises(ValueError, match="code lengths are not"):
    huffman.decode(_craft(symbols, swapped))
  flat = np.zeros(256, np.uint8)
  flat[:4] = 2  # encode's table under max_code_length=2: accepted
  np.testing.assert_array_equal(huffman.decode(_craft(symbols, flat)), symbols)
  unused = np.zeros(256, np.uint8)
  unused[:8] = 3  # a code for letters 4..7 that never occur
  with pytest.raises(ValueError, match="code lengths are not"):
    huffman.decode(_craft(symbols, unused))
  own = huffman.code_lengths(np.bincount(symbols, minlength=256))
  np.testing.assert_array_equal(huffman.decode(_craft(symbols, own)), symbols)


@pytest.mark.parametrize("limit", range(2, 17))
def test_every_length_limit_encode_accepts_still_decodes(limit):
  rng = np.random.default_rng(limit)
  weights = 2.0 ** -np.arange(12)  # a skewed source: limits bind
  symbols = rng.choice(12, 5000, p=weights / weights.sum()).astype(np.uint8)
  symbols[:12] = np.arange(12)
  data = huffman.encode(symbols, max_code_length=max(limit, 4))
  np.testing.assert_array_equal(huffman.decode(data), symbols)


def test_needless_floor_flag_is_refused():
  symbols = np.array([0, 1, 1, 2, 3] * 20, np.uint8)
  model = np.array([0.4, 0.3, 0.2, 0.1])
  data = bytearray(huffman.encode(symbols, probabilities=model))
  assert data[3] == 2  # model, no floor: the model codes every letter
  data[3] = 6
  with pytest.raises(ValueError, match="floor"):
    huffman.decode(bytes(data), probabilities=model)
  empty = bytearray(huffman.encode(np.zeros(0, np.uint8), probabilities=model))
  empty[3] = 6
  with pytest.raises(ValueError, match="floor"):
    huffman.decode(bytes(empty), probabilities=model)


# ----------------------------------------------------------------------------- memory


def _skewed_256(n: int) -> np.ndarray:
  weights = np.maximum(2.0 ** -np.arange(256), 1e-6)  # 256 letters, codes up to 15 bits
  return np.random.default_rng(n).choice(256, n, p=weights / weights.sum()).astype(np.uint8)


MEMORY_CASES = {  # valid streams that expand most per byte, or carry the longest codes
    "1-bit codes, lanes": (huffman.encode, lambda: _two_letters(1_000_000)),
    "1-bit pair codes": (huffman.encode_pairs, lambda: _two_letters(2_000_000)),
    "1-bit codes, one lane": (huffman.encode, lambda: _two_letters(30_000)),
    "lone letter": (huffman.encode, lambda: np.full(1_000_000, 3, np.uint8)),
    "long codes": (huffman.encode, lambda: _skewed_256(200_000)),
}
# Bytes of peak memory per byte of stream and per symbol decoded, plus a fixed allowance for
# the 2**15-entry lookup tables; measured peaks are ~150 per byte at most (pointer doubling).
PER_STREAM_BYTE, PER_SYMBOL, FIXED = 200, 4, 1 << 20


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("case", sorted(MEMORY_CASES))
def test_peak_memory_is_linear_in_the_stream(case, strategy, monkeypatch):
  encode, make = MEMORY_CASES[case]
  symbols = make()
  data = encode(symbols)
  monkeypatch.setattr(huffman_lanes, "decode_payload",
                      functools.partial(huffman_lanes.decode_payload, strategy=strategy))
  tracemalloc.start()
  decoded = huffman.decode(data, max_symbols=symbols.size)
  _, peak = tracemalloc.get_traced_memory()
  tracemalloc.stop()
  np.testing.assert_array_equal(decoded, symbols)
  assert peak <= PER_STREAM_BYTE * len(data) + PER_SYMBOL * symbols.size + FIXED, (
      peak / len(data))
  # In the caller's terms: a stream of at most max_symbols symbols has at most 2 bytes each.
  assert len(data) <= 2 * symbols.size + 300


def test_a_huge_stream_claiming_few_symbols_is_refused_before_any_allocation():
  """Memory follows the declared count, not len(data): 16 MB of trailing bytes cost nothing."""
  symbols = np.random.default_rng(2).integers(0, 9, 1000).astype(np.uint8)
  data = huffman.encode(symbols) + bytes(16 << 20)
  tracemalloc.start()
  with pytest.raises(ValueError, match="payload should be"):
    huffman.decode(data, max_symbols=1000)
  _, peak = tracemalloc.get_traced_memory()
  tracemalloc.stop()
  assert peak < 1 << 20


# ----------------------------------------------------------------------------- fuzzing


@st.composite
def _valid_streams(draw):
  n = draw(st.integers(0, 3000))
  alphabet = draw(st.sampled_from([1, 2, 5, 16, 256]))
  seed = draw(st.integers(0, 2**32 - 1))
  symbols = np.random.default_rng(seed).integers(0, alphabet, n).astype(np.uint8)
  mode = draw(st.sampled_from(["single", "pairs", "model"] if alphabet <= 16 else ["single"]))
  model = None
  if mode == "model":
    model = np.random.default_rng(seed + 1).random(16) + 0.01
    model[draw(st.integers(0, 15))] = 0.0  # maybe a letter the model calls impossible
    data = huffman.encode_pairs(symbols, probabilities=model)
  else:
    data = (huffman.encode_pairs if mode == "pairs" else huffman.encode)(symbols)
  return data, symbols, model


def _only_value_error_or_the_data(data: bytes, original: np.ndarray, model) -> None:
  try:
    decoded = huffman.decode(data, max_symbols=max(original.size, 1) * 2, probabilities=model)
  except ValueError:
    return
  np.testing.assert_array_equal(decoded, original)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_valid_streams(), st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 255)),
                                  min_size=1, max_size=4))
def test_fuzz_mutated_streams(stream, flips):
  data, original, model = stream
  mutated = bytearray(data)
  for position, mask in flips:
    mutated[position % len(mutated)] ^= mask
  _only_value_error_or_the_data(bytes(mutated), original, model)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_valid_streams(), st.integers(0, 10**6), st.binary(min_size=1, max_size=8))
def test_fuzz_truncated_and_spliced_streams(stream, cut, insert):
  data, original, model = stream
  cut %= len(data)
  _refused_or_canonical(data[:cut], model)
  _refused_or_canonical(data[:cut] + insert + data[cut:], model)


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=300), st.integers(0, 7))
def test_fuzz_random_bytes_after_a_valid_prefix(junk, flags):
  _refused_or_canonical(b"LH\x01" + bytes([flags]) + junk, np.ones(16) if flags & 2 else None)
  _refused_or_canonical(junk, None)


def test_the_canonical_check_accepts_encodes_streams():
  """_refused_or_canonical's acceptance path, on a stream it must accept."""
  symbols = np.array([1, 2, 2, 3], np.uint8)
  assert _refused_or_canonical(huffman.encode(symbols, max_code_length=7), None)
  assert _refused_or_canonical(huffman.encode_pairs(symbols, probabilities=np.ones(4)),
                               np.ones(4))


def _refused_or_canonical(data: bytes, model) -> bool:
  """ValueError, or data is exactly what encode makes of what it decodes to (some limit)."""
  try:
    decoded = huffman.decode(data, probabilities=model)
  except ValueError:
    return False
  encode = huffman.encode_pairs if data[3] & 1 else huffman.encode
  remade = set()
  for limit in range(1, huffman.MAX_CODE_LENGTH + 1):
    try:
      remade.add(encode(decoded, max_code_length=limit, probabilities=model))
    except ValueError:  # a limit too small for the letters, or for a model table
      pass
  assert data in remade
  return True
