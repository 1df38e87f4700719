"""Canonical length-limited Huffman coding of uint8 symbols (CO3's lossless step), in numpy."""

import functools
import heapq
import zlib

import numpy as np

# Pair tables at GenNorm beta 0.5 need 14-15 bits (1.0116x entropy at 13, 1.0111x at 15); the
# decoder's 2**15-entry lookup tables still sit in L2.
DEFAULT_MAX_CODE_LENGTH = 15
MAX_CODE_LENGTH = 16  # code lengths travel as nibbles holding length - 1

_MAGIC = b"LH"
_VERSION = 1
_FLAG_PAIRS = 1
_FLAG_MODEL = 2
_FLAG_FLOOR = 4  # with _FLAG_MODEL: letters the model calls impossible have codes too
_KNOWN_FLAGS = _FLAG_PAIRS | _FLAG_MODEL | _FLAG_FLOOR

# Letters of one independently coded lane. Lanes are decoded in lock step (one numpy call per
# step covers every lane), so big lanes mean few Python-level steps; each lane costs ~10 bits
# of header (its bit length), ~0.1% of the payload at 2048 letters.
_LANE_LETTERS = 2048
# Streams up to this many letters are one lane: no lane table at all, decoded by pointer
# doubling, whose cost grows with the bit count rather than with the letters per lane.
_ONE_LANE_LETTERS = 1 << 15
# Bits or letters the decoder's big gathers handle at once: bounds their temporaries.
_CHUNK = 1 << 18
# When the data holds a letter its model calls impossible, the model-derived table gives every
# letter at least this much probability, so that all get a (long) code. Streams without such
# letters skip the floor: it would cost a bit on the least likely letter (0.7% at fp4 beta 2).
_PROBABILITY_FLOOR = 2.0 ** -20


# Stream layout (varint = LEB128, minimal):
#   "LH", version 1, flags (1 pairs, 2 model table, 4 model table with floor), symbol count
#   (varint), CRC32 of the symbols (4 bytes, little-endian); nothing more if the count is 0.
#   Table: the model's max_code_length (1 byte), or: largest used letter (1 byte), presence
#   bitmap of letters 0..largest (MSB first), (length - 1) nibbles of the used letters.
#   Lanes: letters per lane (varint), base bit length (varint), width (1 byte), then every
#   lane's bit length minus base in `width` bits (MSB first). Payload: the lanes' canonical
#   codes back to back, MSB first, zero-padded to a byte.

# ----------------------------------------------------------------------------- code tables


def code_lengths(weights: np.ndarray,
                 max_code_length: int = DEFAULT_MAX_CODE_LENGTH) -> np.ndarray:
  """Optimal prefix-code lengths of at most `max_code_length` bits (package-merge).

  Plain Huffman first; when its longest code exceeds the limit, package-merge (Larmore &
  Hirschberg), which is exact: among all codes whose lengths are at most the limit it
  minimises sum(weights * lengths). Letters of zero weight get length 0 (no code); a lone
  letter gets 1 bit. Two or more letters always get a complete code (Kraft sum exactly 1).

  Args:
    weights: non-negative finite counts or probabilities, one per letter (at most 256).
    max_code_length: the length limit, 1..16; 2**max_code_length must cover the letters used.

  Returns:
    uint8[256] code lengths.

  Example:
    >>> code_lengths(np.array([5, 1, 1, 1]), 2)[:4]  # unlimited Huffman: [1, 3, 3, 2]
    array([2, 2, 2, 2], dtype=uint8)
  """
  _check_max_code_length(max_code_length)
  weights = np.asarray(weights, dtype=np.float64)
  if weights.ndim != 1 or weights.size > 256:
    raise ValueError(f"code_lengths takes one weight per letter (a 1-D array of at most 256), "
                     f"got shape {weights.shape}.")
  if not np.all(np.isfinite(weights)) or np.any(weights < 0):
    raise ValueError("code_lengths takes non-negative finite weights.")
  lengths = np.zeros(256, np.uint8)
  used = np.flatnonzero(weights > 0)
  if used.size <= 1:
    lengths[used] = 1
    return lengths
  if used.size > 2 ** max_code_length:
    raise ValueError(f"{used.size} letters need codes longer than max_code_length="
                     f"{max_code_length}; accepted: 2**max_code_length >= letters used.")
  # Lightest first; ties by letter so that encoder and decoder always agree.
  order = used[np.argsort(weights[used], kind="stable")]
  leaf_weights = weights[order]
  unlimited = _huffman_depths(leaf_weights.tolist())
  if max(unlimited) <= max_code_length:
    lengths[order] = unlimited
    return lengths
  n = leaf_weights.size
  # Forward pass, from the deepest level up: each level's list is the leaves merged with the
  # pairwise packages of the level below. Only which positions hold leaves is kept.
  leaf_flags_by_level = [np.ones(n, bool)]
  items = leaf_weights
  for _ in range(max_code_length - 1):
    pairs = items[0:items.size // 2 * 2:2] + items[1:items.size // 2 * 2:2]
    merged = np.concatenate([leaf_weights, pairs])
    order_merged = np.argsort(merged, kind="stable")  # leaves before packages on ties
    items = merged[order_merged]
    leaf_flags_by_level.append(order_merged < n)
  # Backward pass: the 2n - 2 cheapest items of the top level are chosen; in every level the
  # chosen items are a prefix, so the chosen leaves are the lightest ones and a letter's code
  # length is the number of levels whose chosen prefix contains it.
  depth = np.zeros(n + 1, np.int64)
  chosen = 2 * n - 2
  for leaf_flags in reversed(leaf_flags_by_level):
    chosen_leaves = int(np.count_nonzero(leaf_flags[:chosen]))
    depth[0] += 1
    depth[chosen_leaves] -= 1
    chosen = 2 * (chosen - chosen_leaves)
  lengths[order] = np.cumsum(depth[:n])
  return lengths


def _huffman_depths(weights: list[float]) -> list[int]:
  """Leaf depths of a Huffman tree; a Python heap beats numpy on <= 256 letters."""
  n = len(weights)
  heap = [(weight, leaf) for leaf, weight in enumerate(weights)]
  heapq.heapify(heap)
  parent = [0] * (2 * n - 1)
  for node in range(n, 2 * n - 1):
    weight_a, a = heapq.heappop(heap)
    weight_b, b = heapq.heappop(heap)
    parent[a] = parent[b] = node
    heapq.heappush(heap, (weight_a + weight_b, node))
  depth = [0] * (2 * n - 1)
  for node in range(2 * n - 3, -1, -1):  # parents are created after their children
    depth[node] = depth[parent[node]] + 1
  return depth[:n]


def canonical_codes(lengths: np.ndarray) -> np.ndarray:
  """uint32[256] canonical codes (shorter first, then by letter) for the given lengths.

  Example:
    >>> canonical_codes(np.array([1, 2, 2] + [0] * 253, np.uint8))[:3]
    array([0, 2, 3], dtype=uint32)
  """
  lengths = np.asarray(lengths, np.int64)
  codes = np.zeros(256, np.uint32)
  order, lengths_sorted = _sorted_letters(lengths)
  if order.size:
    top = int(lengths_sorted[-1])
    span = np.left_shift(1, top - lengths_sorted)
    left_aligned = np.cumsum(span) - span  # canonical codes, left-aligned to `top` bits
    codes[order] = (left_aligned >> (top - lengths_sorted)).astype(np.uint32)
  return codes


def _sorted_letters(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  order = np.lexsort((np.arange(lengths.size), lengths))
  order = order[lengths[order] > 0]
  return order, lengths[order]


@functools.lru_cache(maxsize=64)
def _decode_tables(lengths_bytes: bytes) -> tuple[np.ndarray, np.ndarray, int]:
  """(letter, length) of the code at the head of every `peek`-bit window, and peek."""
  lengths = np.frombuffer(lengths_bytes, np.uint8).astype(np.int64)
  order, lengths_sorted = _sorted_letters(lengths)
  peek = int(lengths_sorted[-1])
  # Canonical codes tile the window space in sorted order: code i owns 2**(peek - l_i) windows.
  repeats = np.left_shift(1, peek - lengths_sorted)
  letter_table = np.repeat(order.astype(np.uint8), repeats)
  length_table = np.repeat(lengths_sorted.astype(np.uint8), repeats)
  letter_table.setflags(write=False)
  length_table.setflags(write=False)
  return letter_table, length_table, peek


@functools.lru_cache(maxsize=64)
def _model_lengths(probabilities_bytes: bytes, pairs: bool, max_code_length: int,
                   floor: bool) -> np.ndarray:
  probabilities = np.frombuffer(probabilities_bytes, np.float64)
  if pairs and probabilities.size <= 16:
    per_symbol = np.zeros(16)
    per_symbol[:probabilities.size] = probabilities
    probabilities = np.outer(per_symbol, per_symbol).reshape(-1)  # letter = first << 4 | second
  letter_probabilities = np.zeros(256)
  letter_probabilities[:probabilities.size] = probabilities
  letter_probabilities /= letter_probabilities.sum()
  if floor:
    letter_probabilities += _PROBABILITY_FLOOR
  lengths = code_lengths(letter_probabilities, max_code_length)
  lengths.setflags(write=False)
  return lengths


def _model_code_lengths(probabilities: np.ndarray, pairs: bool, max_code_length: int,
                        floor: bool) -> np.ndarray:
  """Code lengths both sides derive from the model; all 256 letters get a code with `floor`."""
  probabilities = np.asarray(probabilities, dtype=np.float64)
  if (probabilities.ndim != 1 or not 1 <= probabilities.size <= 256
      or not np.all(np.isfinite(probabilities)) or np.any(probabilities < 0)
      or not probabilities.sum() > 0):
    raise ValueError(
        "probabilities must be a 1-D array of at most 256 non-negative finite numbers with a "
        f"positive sum (index = symbol; for pairs, at most 16 per-symbol probabilities or up "
        f"to 256 per-pair ones, pair = first << 4 | second), got shape {probabilities.shape}.")
  if max_code_length < 8:
    raise ValueError(f"a model-derived table may have to code all 256 letters, which needs "
                     f"max_code_length >= 8, got {max_code_length}.")
  return _model_lengths(np.ascontiguousarray(probabilities).tobytes(), pairs, max_code_length,
                        floor)


def _check_max_code_length(max_code_length: int) -> None:
  if (isinstance(max_code_length, bool) or not isinstance(max_code_length, (int, np.integer))
      or not 1 <= max_code_length <= MAX_CODE_LENGTH):
    raise ValueError(f"max_code_length must be an integer in 1..{MAX_CODE_LENGTH}, got "
                     f"{max_code_length!r}.")


# ----------------------------------------------------------------------------- encoding


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
  symbols = _check_symbols(symbols)
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
  symbols = _check_symbols(symbols)
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


def _check_symbols(symbols: np.ndarray) -> np.ndarray:
  symbols = np.asarray(symbols)
  if symbols.dtype != np.uint8:
    raise ValueError(f"symbols must be a uint8 array, got dtype {symbols.dtype}.")
  return np.ascontiguousarray(symbols).reshape(-1)


def _encode_letters(letters: np.ndarray, symbols: np.ndarray, *, pairs: bool,
                    max_code_length: int, probabilities: np.ndarray | None) -> bytes:
  _check_max_code_length(max_code_length)
  flags = _FLAG_PAIRS if pairs else 0
  counts = np.bincount(letters, minlength=256)
  if probabilities is not None:
    flags |= _FLAG_MODEL
    lengths = _model_code_lengths(probabilities, pairs, max_code_length, floor=False)
    if np.any(lengths[counts > 0] == 0):  # a letter the model calls impossible
      flags |= _FLAG_FLOOR
      lengths = _model_code_lengths(probabilities, pairs, max_code_length, floor=True)
  elif letters.size:
    lengths = code_lengths(counts, max_code_length)
  header = [_MAGIC, bytes([_VERSION, flags]), _varint(symbols.size),
            zlib.crc32(symbols).to_bytes(4, "little")]
  if not letters.size:
    return b"".join(header)
  header.append(bytes([max_code_length]) if probabilities is not None
                else _pack_lengths(lengths))
  lane_letters = _lane_letters(letters.size)
  payload, lane_bits = _write_bits(letters, lengths, lane_letters)
  header.append(_pack_lanes(lane_letters, lane_bits))
  header.append(payload)
  return b"".join(header)


def _lane_letters(n_letters: int) -> int:
  """Letters per lane, as encode picks them (decode accepts nothing else)."""
  return n_letters if n_letters <= _ONE_LANE_LETTERS else _LANE_LETTERS


def _pack_lengths(lengths: np.ndarray) -> bytes:
  """Largest used letter, a presence bitmap up to it, then (length - 1) nibbles of those used."""
  used = np.flatnonzero(lengths)
  top = int(used[-1])
  bitmap = np.packbits(lengths[:top + 1] > 0).tobytes()
  nibbles = lengths[used] - 1
  if nibbles.size % 2:
    nibbles = np.append(nibbles, np.uint8(0))
  return bytes([top]) + bitmap + ((nibbles[0::2] << 4) | nibbles[1::2]).astype(np.uint8).tobytes()


def _pack_lanes(lane_letters: int, lane_bits: np.ndarray) -> bytes:
  """Letters per lane, then every lane's bit length as `base + width-bit offset`."""
  base = int(lane_bits.min())
  width = int(lane_bits.max() - base).bit_length()
  offsets = (lane_bits - base).astype(np.uint64)
  shifts = np.arange(width - 1, -1, -1, dtype=np.uint64)
  bits = ((offsets[:, None] >> shifts[None, :]) & np.uint64(1)).astype(np.uint8)
  return (_varint(lane_letters) + _varint(base) + bytes([width])
          + np.packbits(bits.reshape(-1)).tobytes())


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


def _varint(value: int) -> bytes:
  out = bytearray()
  while True:
    byte, value = value & 0x7F, value >> 7
    out.append(byte | (0x80 if value else 0))
    if not value:
      return bytes(out)


# ----------------------------------------------------------------------------- decoding


class _Reader:
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
  reader = _Reader(data)
  magic = bytes(reader.take(2, "magic"))
  if magic != _MAGIC:
    raise ValueError(f"not a loco_jax Huffman stream: magic {magic!r}, expected {_MAGIC!r}.")
  version, flags = reader.byte("version"), reader.byte("flags")
  if version != _VERSION:
    raise ValueError(f"unsupported Huffman stream version {version}; this decoder reads "
                     f"version {_VERSION}.")
  if flags & ~_KNOWN_FLAGS:
    raise ValueError(f"corrupt Huffman stream: unknown flags {flags:#x}.")
  pairs = bool(flags & _FLAG_PAIRS)
  count = reader.varint("symbol count")
  if max_symbols is not None and count > max_symbols:
    raise ValueError(f"Huffman stream holds {count} symbols, more than max_symbols="
                     f"{max_symbols}.")
  crc = int.from_bytes(reader.take(4, "CRC32"), "little")
  if flags & _FLAG_FLOOR and not flags & _FLAG_MODEL:
    raise ValueError(f"corrupt Huffman stream: flags {flags:#x} set floor without model.")
  if flags & _FLAG_MODEL:
    if probabilities is None:
      raise ValueError("this Huffman stream was coded with a model table: pass the encoder's "
                       "probabilities to decode.")
  elif probabilities is not None:
    raise ValueError("this Huffman stream carries its own table; decode it without "
                     "probabilities.")
  if count == 0:
    if flags & _FLAG_FLOOR:  # the floor is only set for letters the data hold
      raise ValueError(f"corrupt Huffman stream: flags {flags:#x} set floor for no symbols.")
    _expect_end(reader)
    if crc != zlib.crc32(b""):
      raise ValueError("corrupt Huffman stream: CRC32 mismatch.")
    return np.zeros(0, np.uint8)

  n_letters = (count + 1) // 2 if pairs else count
  if flags & _FLAG_MODEL:
    max_code_length = reader.byte("max code length")
    _check_max_code_length(max_code_length)
    lengths = _model_code_lengths(probabilities, pairs, max_code_length,
                                  floor=bool(flags & _FLAG_FLOOR))
  else:
    lengths = _unpack_lengths(reader)
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
  if lane_letters != _lane_letters(n_letters):
    raise ValueError(f"corrupt Huffman stream: {lane_letters} letters per lane for "
                     f"{n_letters} letters; encode writes {_lane_letters(n_letters)}.")
  n_lanes = -(-n_letters // lane_letters)
  lane_counts = np.full(n_lanes, lane_letters, np.int64)
  lane_counts[-1] = n_letters - (n_lanes - 1) * lane_letters
  lane_bits = _unpack_lanes(reader, n_lanes)
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
    letters = np.full(n_letters, np.flatnonzero(lengths)[0], np.uint8)
  else:
    letters = _decode_payload(payload, lengths, lane_letters, lane_counts, lane_bits)
  if flags & _FLAG_MODEL:  # any table the model makes is encode's; only the floor is a choice
    if flags & _FLAG_FLOOR:
      _check_table_matches_letters(lengths, letters, _model_code_lengths(
          probabilities, pairs, max_code_length, floor=False))
  else:
    _check_table_matches_letters(lengths, letters, None)
  if pairs:
    symbols = np.empty(2 * n_letters, np.uint8)
    symbols[0::2] = letters >> 4
    symbols[1::2] = letters & 15
    if count % 2 and symbols[-1]:
      raise ValueError("corrupt Huffman stream: the pad symbol of an odd count is not 0.")
    symbols = symbols[:count]
  else:
    symbols = letters
  if zlib.crc32(symbols) != crc:
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


def _expect_end(reader: _Reader) -> None:
  if reader.remaining():
    raise ValueError(f"corrupt Huffman stream: {reader.remaining()} unexpected trailing bytes.")


def _unpack_lengths(reader: _Reader) -> np.ndarray:
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


def _unpack_lanes(reader: _Reader, n_lanes: int) -> np.ndarray:
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


def _bit_windows(payload: np.ndarray, pad_bytes: int) -> np.ndarray:
  """uint32 big-endian window starting at every byte of the zero-padded payload."""
  n_words = (payload.size + pad_bytes + 3) // 4 + 1
  padded = np.zeros(4 * n_words + 3, np.uint8)
  padded[:payload.size] = payload
  windows = np.empty((n_words, 4), np.uint32)
  for shift in range(4):
    windows[:, shift] = np.frombuffer(padded, ">u4", count=n_words, offset=shift)
  return windows.reshape(-1)


def _decode_payload(payload: np.ndarray, lengths: np.ndarray, lane_letters: int,
                    lane_counts: np.ndarray, lane_bits: np.ndarray,
                    strategy: str | None = None) -> np.ndarray:
  """Letters of all lanes, lane after lane; ValueError unless every lane ends where it should.

  Three strategies, picked by a rough cost model (seconds on this 2-core CPU):
  - lock step: one numpy call per step decodes the next letter of every lane from the bit
    stream (8 calls a step); cheapest for big streams, where the per-call cost is spread
    over many lanes.
  - walk: first decode at every bit offset (letter and next code start), then follow all
    lanes' chains in lock step with 2 calls a step; for mid-size streams.
  - doubling: the same tables, then pointer doubling finds the code starts in log2(lane
    letters) rounds; for small streams and single-lane streams.
  """
  letter_table, length_table, peek = _decode_tables(lengths.tobytes())
  lane_ends = np.cumsum(lane_bits)
  lane_starts = lane_ends - lane_bits
  total_bits = int(lane_ends[-1])
  n_letters = int(lane_counts.sum())
  rounds = max(lane_letters - 1, 1).bit_length()
  bit_tables_cost = total_bits * 18e-9
  costs = {
      "lock_step": lane_letters * 8 * 2.5e-6 + n_letters * 8 * 2e-9,
      "walk": bit_tables_cost + lane_letters * 6e-6 + n_letters * 2 * 2e-9,
      "doubling": bit_tables_cost + rounds * total_bits * 4.5e-9 + n_letters * 4e-9,
  }
  if total_bits >= 2**31 - 2**20:  # bit tables hold int32 offsets
    strategy = "lock_step"
  elif strategy is None:
    strategy = min(costs, key=costs.get)
  if strategy == "lock_step":
    decoded, final = _decode_in_lock_step(payload, letter_table, length_table, peek, lane_starts,
                                          lane_letters, lane_counts)
  else:
    letter_at, next_start = _bit_tables(payload, letter_table, length_table, peek, total_bits)
    follow = _walk if strategy == "walk" else _double
    decoded, final = follow(letter_at, next_start, lane_starts, lane_letters, lane_counts)
  if not np.array_equal(final, lane_ends):
    raise ValueError("corrupt Huffman stream: the payload does not parse into its lanes.")
  return decoded


def _decode_in_lock_step(payload: np.ndarray, letter_table: np.ndarray,
                         length_table: np.ndarray, peek: int, lane_starts: np.ndarray,
                         lane_letters: int,
                         lane_counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Letters (lane after lane) and every lane's end bit, decoding one letter per lane a step."""
  n_lanes = lane_counts.size
  # Corrupt lanes may run past their end by up to lane_letters * peek bits: pad that far, so
  # that every index below is in range and takes can skip bounds checks (mode="clip").
  windows = _bit_windows(payload, (lane_letters * peek) // 8 + 8).astype(np.uint64)
  windows <<= np.uint64(32)  # the window's first bit at the top: shifts drop what passed
  length_table = length_table.astype(np.int64)
  decoded = np.empty((lane_letters, n_lanes), np.uint8)
  final = np.empty(n_lanes, np.int64)
  last_lane_count = int(lane_counts[-1])
  # The loop runs thousands of steps over ~1000 lanes, where numpy's per-call overhead is a
  # large share of the time: every operand is a preallocated array of one dtype (no casts, no
  # scalar conversion), uint64/int64 views of the same buffer stand in for casts, and
  # bound methods are locals.
  position = lane_starts.astype(np.int64)
  byte = np.empty(n_lanes, np.int64)
  bit = np.empty(n_lanes, np.int64)
  window = np.empty(n_lanes, np.uint64)
  code_length = np.empty(n_lanes, np.int64)
  three = np.full(n_lanes, 3, np.int64)
  seven = np.full(n_lanes, 7, np.int64)
  drop = np.full(n_lanes, 64 - peek, np.uint64)
  take_window, take_letter, take_length = windows.take, letter_table.take, length_table.take
  right_shift, left_shift, bitwise_and, add = (np.right_shift, np.left_shift, np.bitwise_and,
                                               np.add)

  def views(n):
    return (position[:n], byte[:n], bit[:n], bit[:n].view(np.uint64), window[:n],
            window[:n].view(np.int64), code_length[:n], three[:n], seven[:n], drop[:n])

  (position_, byte_, bit_, bit_u, window_, index_, code_length_, three_, seven_,
   drop_) = views(n_lanes)
  for step in range(lane_letters):
    if step == last_lane_count:  # the last lane is complete: record its end, drop it
      final[-1] = position[-1]
      (position_, byte_, bit_, bit_u, window_, index_, code_length_, three_, seven_,
       drop_) = views(n_lanes - 1)
    right_shift(position_, three_, out=byte_)
    take_window(byte_, out=window_, mode="clip")
    bitwise_and(position_, seven_, out=bit_)
    left_shift(window_, bit_u, out=window_)
    right_shift(window_, drop_, out=window_)
    take_letter(index_, out=decoded[step, :index_.size], mode="clip")
    take_length(index_, out=code_length_, mode="clip")
    add(position_, code_length_, out=position_)
  final[:position_.size] = position_
  return decoded.T.reshape(-1)[:int(lane_counts.sum())], final


def _bit_tables(payload: np.ndarray, letter_table: np.ndarray, length_table: np.ndarray,
                peek: int, total_bits: int) -> tuple[np.ndarray, np.ndarray]:
  """For a code starting at every bit q in [0, total_bits]: its letter and the next start.

  Next starts are clipped to total_bits, a sink, so that corrupt chains stay in range.
  """
  windows = _bit_windows(payload, 8)[:total_bits // 8 + 1]
  offsets_in_byte = np.arange(8, dtype=np.uint32)
  letter_at = np.empty(total_bits + 1, np.uint8)
  next_start = np.empty(total_bits + 1, np.int32)
  # In chunks: a window index per bit, as the intp that take wants, would be 8 bytes a bit.
  for first in range(0, total_bits + 1, _CHUNK):
    last = min(first + _CHUNK, total_bits + 1)
    index = ((windows[first // 8:(last + 7) // 8, None] << offsets_in_byte)
             >> np.uint32(32 - peek)).reshape(-1)[:last - first].astype(np.intp)
    letter_table.take(index, out=letter_at[first:last])
    next_start[first:last] = length_table.take(index)
    next_start[first:last] += np.arange(first, last, dtype=np.int32)
  np.minimum(next_start, total_bits, out=next_start)
  return letter_at, next_start


def _take_in_chunks(table: np.ndarray, index: np.ndarray) -> np.ndarray:
  """table.take(index, mode="clip") without a whole intp copy of a big int32 index."""
  out = np.empty(index.size, table.dtype)
  for first in range(0, index.size, _CHUNK):
    table.take(index[first:first + _CHUNK], out=out[first:first + _CHUNK], mode="clip")
  return out


def _walk(letter_at: np.ndarray, next_start: np.ndarray, lane_starts: np.ndarray,
          lane_letters: int, lane_counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Follows every lane's chain of code starts one step at a time, all lanes at once."""
  n_lanes = lane_counts.size
  position = lane_starts.astype(np.int32)
  following = np.empty_like(position)
  decoded = np.empty((lane_letters, n_lanes), np.uint8)
  last_lane_count = int(lane_counts[-1])
  final = np.empty(n_lanes, np.int64)
  take_letter, take_next = letter_at.take, next_start.take
  for step in range(lane_letters):
    if step == last_lane_count:
      final[-1] = position[-1]
      position, following = position[:-1], following[:-1]
    take_letter(position, out=decoded[step, :position.size], mode="clip")
    take_next(position, out=following, mode="clip")
    position, following = following, position
  final[:position.size] = position
  return decoded.T.reshape(-1)[:int(lane_counts.sum())], final


def _double(letter_at: np.ndarray, next_start: np.ndarray, lane_starts: np.ndarray,
            lane_letters: int, lane_counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Finds every lane's code starts by pointer doubling: log2(lane_letters) rounds."""
  n_lanes = lane_counts.size
  starts = np.empty((n_lanes, lane_letters), np.int32)
  starts[:, 0] = lane_starts
  jump = next_start
  known = 1
  while known < lane_letters:  # invariant: jump is next_start applied `known` times
    todo = min(known, lane_letters - known)
    starts[:, known:known + todo] = jump.take(starts[:, :todo], mode="clip")
    known += todo
    if known < lane_letters:
      jump = _take_in_chunks(jump, jump)
  final = next_start[starts[np.arange(n_lanes), lane_counts - 1]].astype(np.int64)
  decoded = _take_in_chunks(letter_at, starts.reshape(-1)[:int(lane_counts.sum())])
  return decoded, final


# ----------------------------------------------------------------------------- statistics


def entropy_bits(symbols: np.ndarray) -> float:
  """Empirical (order-0) entropy of uint8 `symbols` in bits per symbol; 0.0 when empty.

  Example:
    >>> entropy_bits(np.array([0, 1, 2, 3], np.uint8))
    2.0
  """
  symbols = _check_symbols(symbols)
  if not symbols.size:
    return 0.0
  counts = np.bincount(symbols, minlength=256)
  p = counts[counts > 0] / symbols.size
  return float(-(p * np.log2(p)).sum()) + 0.0
