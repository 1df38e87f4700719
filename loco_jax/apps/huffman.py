"""Canonical length-limited Huffman coding of uint8 symbols (CO3's lossless step), in numpy:
the stream (`encode`, `encode_pairs`, `decode`); code tables in `huffman_codes`."""

import zlib
from typing import NamedTuple

import numpy as np

from loco_jax.apps import huffman_format, huffman_lanes
from loco_jax.apps.huffman_codes import (  # entropy_bits: huffman.entropy_bits, as before
    DEFAULT_MAX_CODE_LENGTH, FLAG_FLOOR, FLAG_MODEL, FLAG_PAIRS, KNOWN_FLAGS, LANE_LETTERS, MAGIC,
    MAX_CODE_LENGTH, ONE_LANE_LETTERS, VERSION, canonical_codes, check_max_code_length,
    check_symbols, code_lengths, entropy_bits, model_code_lengths)  # noqa: F401


def encode(symbols: np.ndarray, *, max_code_length: int = DEFAULT_MAX_CODE_LENGTH,
           probabilities: np.ndarray | None = None) -> bytes:
  """Huffman-codes uint8 `symbols` (any shape, read flat) into a self-describing stream.

  The stream holds a magic and version, the symbol count, a CRC32 of the symbols, the code
  lengths (unless `probabilities` is given: then both sides derive them from that model and
  only a flag is sent), a table of lane bit lengths and the bit payload. Lanes of 2048
  letters are coded independently so that decode can run them in parallel.

  Which mode wins where (codec_bench; fp4 symbols of GenNorm data at CO3's scale, beta
  0.5 / 1 / 2, size over n * empirical entropy):
  - 4M symbols: encode 1.049 / 1.024 / 1.013, encode_pairs 1.011 / 1.006 / 1.006 (its own
    bound, ideal pair Huffman, is 1.009 / 1.004 / 1.005); a model table (exact GenNorm
    probabilities) codes as well as a sent table and saves its <100 bytes. Pairs also halve
    the letters to code, so they are the fastest mode too: encode + decode 60-130 ms, 0.9-1.4x
    zlib's Huffman-only mode on a shared 2-core CPU (single symbols 95-250 ms, 1.5-2.2x).
  - 1K symbols (~260-490 bytes): the pair table (~60-90 bytes) outweighs the pair gain:
    pairs 290 / 423 / 493 bytes vs 262 / 379 / 435 for encode; with a shared model pairs
    win: 247 / 366 / 425 (encode with the model: 255 / 372 / 427). Pairs with a sent table
    overtake encode from about 6K / 10K / 20K symbols on.
  So: encode_pairs for fp4 gradients, with probabilities= when both sides share a fitted
  GenNorm; encode for wider symbols (fp8) and small streams without a model.

  Args:
    symbols: uint8 array.
    max_code_length: longest code allowed, 1..16 (8..16 with `probabilities`).
    probabilities: optional model, probability per symbol (index = symbol, up to 256 entries),
      shared with the decoder; symbols the model deems impossible still get a code.

  Example:
    >>> data = encode(np.array([0, 0, 1, 9], np.uint8))
    >>> decode(data)
    array([0, 0, 1, 9], dtype=uint8)
  """
  symbols = check_symbols(symbols)
  return _encode_letters(symbols, symbols, pairs=False, max_code_length=max_code_length,
                         probabilities=probabilities)


def encode_pairs(symbols: np.ndarray, *, max_code_length: int = DEFAULT_MAX_CODE_LENGTH,
                 probabilities: np.ndarray | None = None) -> bytes:
  """Like encode, for 4-bit symbols (< 16), coding each pair `first << 4 | second` as a letter.

  Pair letters close most of Huffman's gap to the entropy (a letter carries twice the
  information, so rounding code lengths to whole bits costs half as much per symbol), and
  halve the number of letters to code. An odd count is padded with a 0 symbol.

  Args:
    symbols: uint8 array of values below 16 (e.g. fp4 symbols).
    max_code_length: longest code allowed, 1..16 (8..16 with `probabilities`).
    probabilities: optional shared model: up to 16 per-symbol probabilities (pairs are taken
      as independent) or up to 256 per-pair probabilities.

  Example:
    >>> decode(encode_pairs(np.array([1, 2, 3], np.uint8)))
    array([1, 2, 3], dtype=uint8)
  """
  symbols = check_symbols(symbols)
  if symbols.size and int(symbols.max()) >= 16:
    raise ValueError(f"encode_pairs codes 4-bit symbols (values 0..15), got a symbol "
                     f"{int(symbols.max())}; use encode for wider symbols.")
  padded = symbols
  if symbols.size % 2:
    padded = np.append(symbols, np.uint8(0))
  # One pair per little-endian uint16: first | second << 8 -> first << 4 | second.
  pair = padded.view("<u2") if padded.flags.aligned else padded.copy().view("<u2")
  letters = ((pair << 4) | (pair >> 8)).astype(np.uint8)
  return _encode_letters(letters, symbols, pairs=True, max_code_length=max_code_length,
                         probabilities=probabilities)


def _encode_letters(letters: np.ndarray, symbols: np.ndarray, *, pairs: bool,
                    max_code_length: int, probabilities: np.ndarray | None) -> bytes:
  check_max_code_length(max_code_length)
  flags = FLAG_PAIRS if pairs else 0
  counts = np.bincount(letters, minlength=256)
  if probabilities is not None:
    flags |= FLAG_MODEL
    lengths = model_code_lengths(probabilities, pairs, max_code_length, floor=False)
    if np.any(lengths[counts > 0] == 0):  # a letter the model calls impossible
      flags |= FLAG_FLOOR
      lengths = model_code_lengths(probabilities, pairs, max_code_length, floor=True)
  elif letters.size:
    lengths = code_lengths(counts, max_code_length)
  header = [MAGIC, bytes([VERSION, flags]), huffman_format.varint_bytes(symbols.size),
            zlib.crc32(symbols).to_bytes(4, "little")]
  if not letters.size:
    return b"".join(header)
  header.append(bytes([max_code_length]) if probabilities is not None
                else huffman_format.pack_lengths(lengths))
  lane_letters = huffman_format.lane_letters_for(letters.size)
  payload, lane_bits = _write_bits(letters, lengths, lane_letters)
  header.append(huffman_format.pack_lanes(lane_letters, lane_bits))
  header.append(payload)
  return b"".join(header)


def _write_bits(letters: np.ndarray, lengths: np.ndarray,
                lane_letters: int) -> tuple[bytes, np.ndarray]:
  """MSB-first concatenation of the letters' codes, and the bit length of every lane."""
  lengths = np.asarray(lengths, np.uint8)
  # Codes left-aligned in 64 bits: shifting one right by its start's offset within a 32-bit
  # word places it in a 64-bit window beginning at that word.
  left_aligned = canonical_codes(lengths).astype(np.uint64) << (64 - lengths).astype(np.uint64)
  n = letters.size
  bounds = np.zeros(n + 1, np.int64)  # bounds[i] = first bit of letter i
  np.cumsum(lengths.take(letters), out=bounds[1:])
  start = bounds[:-1]
  total_bits = int(bounds[-1])
  lane_ends = bounds[np.minimum(np.arange(lane_letters, n + lane_letters, lane_letters), n)]
  lane_bits = np.diff(lane_ends, prepend=0)
  windows = left_aligned.take(letters)
  np.right_shift(windows, (start & 31).view(np.uint64), out=windows)
  # Codes never share bits, so adding the windows of one word ORs them; a window's low half
  # is what sticks out into the next word (at most 15 bits).
  n_words = (total_bits + 31) // 32
  sums = np.zeros(n_words + 1, np.uint64)
  np.add.at(sums, start >> 5, windows)
  words = (sums >> np.uint64(32)).astype(np.uint32)
  words[1:] |= sums[:-1].astype(np.uint32)
  payload = words[:n_words].astype(">u4").tobytes()[:(total_bits + 7) // 8]
  return payload, lane_bits


# ----------------------------------------------------------------------------- decoding


def decode(data: bytes, *, max_symbols: int | None = None,
           probabilities: np.ndarray | None = None) -> np.ndarray:
  """uint8 symbols of a stream made by encode or encode_pairs.

  Every stream that is not exactly one that encode could have made raises ValueError:
  truncation, trailing bytes, corrupt tables (a sent table must be the one encode derives from
  the decoded letters' counts), lane sizes or a lane table encode would not write, a payload
  that does not parse into the lanes the header promises, or a CRC32 mismatch. Claimed sizes
  are checked against `max_symbols` and against what the payload could hold before anything
  large is allocated. Peak memory is at most ~200 bytes per byte of the stream's payload plus
  ~4 bytes per symbol and ~1 MB of lookup tables (tests/test_huffman_hostile.py measures it);
  the payload is checked against the count first, and a stream of n symbols has at most
  2n + 300 bytes, so memory is bounded by the caller's `max_symbols` whatever len(data) is.
  A `data` that is not bytes-like raises TypeError.

  Args:
    data: the stream (bytes, bytearray or memoryview).
    max_symbols: optional cap on the symbol count the caller is willing to receive; pass it
      whenever the caller knows it (a larger stream raises before anything is decoded).
    probabilities: the same model that was given to encode, for streams coded with one.

  Example:
    >>> decode(encode(np.array([3, 3, 7], np.uint8)), max_symbols=10)
    array([3, 3, 7], dtype=uint8)
  """
  try:
    data = memoryview(data).cast("B")
  except TypeError as e:
    raise TypeError(f"decode takes bytes, got {type(data).__name__}.") from e
  reader = huffman_format.Reader(data)
  head = _read_header(reader, max_symbols, probabilities)
  if head.count == 0:
    if head.flags & FLAG_FLOOR:  # the floor is only set for letters the data hold
      raise ValueError(f"corrupt Huffman stream: flags {head.flags:#x} set floor for no "
                       f"symbols.")
    huffman_format.expect_end(reader)
    if head.crc != zlib.crc32(b""):
      raise ValueError("corrupt Huffman stream: CRC32 mismatch.")
    return np.zeros(0, np.uint8)
  n_letters = (head.count + 1) // 2 if head.pairs else head.count
  if head.flags & FLAG_MODEL:
    max_code_length = reader.byte("max code length")
    check_max_code_length(max_code_length)
    lengths = model_code_lengths(probabilities, head.pairs, max_code_length,
                                 floor=bool(head.flags & FLAG_FLOOR))
  else:
    lengths = huffman_format.unpack_lengths(reader)
  letters = _read_letters(reader, data, lengths, n_letters, head.count)
  if head.flags & FLAG_MODEL:  # any table the model makes is encode's; only the floor is a choice
    if head.flags & FLAG_FLOOR:
      _check_table_matches_letters(lengths, letters, model_code_lengths(
          probabilities, head.pairs, max_code_length, floor=False))
  else:
    _check_table_matches_letters(lengths, letters, None)
  return _symbols(letters, head)


class _Header(NamedTuple):
  flags: int
  pairs: bool
  count: int
  crc: int


def _read_header(reader: huffman_format.Reader, max_symbols: int | None,
                 probabilities: np.ndarray | None) -> _Header:
  """Magic, version, flags, symbol count and CRC, each checked."""
  magic = bytes(reader.take(2, "magic"))
  if magic != MAGIC:
    raise ValueError(f"not a loco_jax Huffman stream: magic {magic!r}, expected {MAGIC!r}.")
  version, flags = reader.byte("version"), reader.byte("flags")
  if version != VERSION:
    raise ValueError(f"unsupported Huffman stream version {version}; this decoder reads "
                     f"version {VERSION}.")
  if flags & ~KNOWN_FLAGS:
    raise ValueError(f"corrupt Huffman stream: unknown flags {flags:#x}.")
  count = reader.varint("symbol count")
  if max_symbols is not None and count > max_symbols:
    raise ValueError(f"Huffman stream holds {count} symbols, more than max_symbols="
                     f"{max_symbols}.")
  crc = int.from_bytes(reader.take(4, "CRC32"), "little")
  if flags & FLAG_FLOOR and not flags & FLAG_MODEL:
    raise ValueError(f"corrupt Huffman stream: flags {flags:#x} set floor without model.")
  if flags & FLAG_MODEL and probabilities is None:
    raise ValueError("this Huffman stream was coded with a model table: pass the encoder's "
                     "probabilities to decode.")
  if not flags & FLAG_MODEL and probabilities is not None:
    raise ValueError("this Huffman stream carries its own table; decode it without "
                     "probabilities.")
  return _Header(flags, bool(flags & FLAG_PAIRS), count, crc)


def _read_letters(reader: huffman_format.Reader, data, lengths: np.ndarray, n_letters: int,
                  count: int) -> np.ndarray:
  """The lane table and the payload, checked against the letters they must hold, decoded."""
  used_lengths = lengths[lengths > 0].astype(np.int64)
  shortest, longest = int(used_lengths.min()), int(used_lengths.max())
  # Every letter takes at least `shortest` bits: a count the rest of the stream cannot hold is
  # rejected before anything of its size exists.
  if n_letters * shortest > 8 * reader.remaining():
    raise ValueError(f"corrupt Huffman stream: {count} symbols cannot fit in "
                     f"{reader.remaining()} bytes.")
  lane_letters = reader.varint("letters per lane")
  # Lane sizes are not the sender's choice: tiny lanes would make the decoder's per-lane state
  # (~100 bytes a lane) dwarf the stream.
  if lane_letters != huffman_format.lane_letters_for(n_letters):
    raise ValueError(f"corrupt Huffman stream: {lane_letters} letters per lane for "
                     f"{n_letters} letters; encode writes "
                     f"{huffman_format.lane_letters_for(n_letters)}.")
  n_lanes = -(-n_letters // lane_letters)
  lane_counts = np.full(n_lanes, lane_letters, np.int64)
  lane_counts[-1] = n_letters - (n_lanes - 1) * lane_letters
  lane_bits = huffman_format.unpack_lanes(reader, n_lanes)
  if np.any(lane_bits < lane_counts * shortest) or np.any(lane_bits > lane_counts * longest):
    raise ValueError("corrupt Huffman stream: a lane's bit length does not fit its letters.")
  total_bits = int(lane_bits.sum())
  payload_size = (total_bits + 7) // 8
  if reader.remaining() != payload_size:
    raise ValueError(f"corrupt Huffman stream: the payload should be {payload_size} bytes, "
                     f"{reader.remaining()} are left.")
  payload = np.frombuffer(data, np.uint8, offset=len(data) - payload_size)
  if total_bits % 8 and payload[-1] & ((1 << (8 - total_bits % 8)) - 1):
    raise ValueError("corrupt Huffman stream: padding bits are not zero.")
  if used_lengths.size == 1:  # a lone letter: 1-bit codes, all zero
    if np.any(payload):
      raise ValueError("corrupt Huffman stream: a one-letter payload must be all zero bits.")
    return np.full(n_letters, np.flatnonzero(lengths)[0], np.uint8)
  return huffman_lanes.decode_payload(payload, lengths, lane_letters, lane_counts, lane_bits)


def _symbols(letters: np.ndarray, head: _Header) -> np.ndarray:
  """Letters -> symbols (pairs split), with the pad and the CRC checked."""
  if head.pairs:
    symbols = np.empty(2 * letters.size, np.uint8)
    symbols[0::2] = letters >> 4
    symbols[1::2] = letters & 15
    if head.count % 2 and symbols[-1]:
      raise ValueError("corrupt Huffman stream: the pad symbol of an odd count is not 0.")
    symbols = symbols[:head.count]
  else:
    symbols = letters
  if zlib.crc32(symbols) != head.crc:
    raise ValueError("corrupt Huffman stream: CRC32 of the decoded symbols does not match.")
  return symbols


def _check_table_matches_letters(lengths: np.ndarray, letters: np.ndarray,
                                 unfloored: np.ndarray | None) -> None:
  """ValueError unless encode would have chosen this table for these letters.

  `unfloored`: for a model table with the floor flag, the model's table without the floor
  (encode sets the flag only when that table misses a letter of the data); else None.
  """
  counts = np.bincount(letters, minlength=256)
  if unfloored is not None:
    if np.all(unfloored[counts > 0] > 0):
      raise ValueError("corrupt Huffman stream: the floor flag is set but the model codes "
                       "every decoded letter.")
  elif not _is_encoders_table(counts, lengths):
    raise ValueError("corrupt Huffman stream: the code lengths are not the ones encode derives "
                     "from the decoded letters' counts.")


def _is_encoders_table(counts: np.ndarray, lengths: np.ndarray) -> bool:
  """Whether code_lengths(counts, limit) is `lengths` for some limit encode accepts."""
  for limit in range(int(lengths.max()), MAX_CODE_LENGTH + 1):
    candidate = code_lengths(counts, limit)
    if np.array_equal(candidate, lengths):
      return True
    if int(candidate.max()) < limit:  # plain Huffman fits: larger limits give the same lengths
      return False
  return False
