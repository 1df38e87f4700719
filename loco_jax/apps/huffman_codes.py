"""Huffman code tables (length-limited, canonical) and the stream format's constants."""

import functools
import heapq

import numpy as np

# Pair tables at GenNorm beta 0.5 need 14-15 bits (1.0116x entropy at 13, 1.0111x at 15); the
# decoder's 2**15-entry lookup tables still sit in L2.
DEFAULT_MAX_CODE_LENGTH = 15
MAX_CODE_LENGTH = 16  # code lengths travel as nibbles holding length - 1

MAGIC = b"LH"
VERSION = 1
FLAG_PAIRS = 1
FLAG_MODEL = 2
FLAG_FLOOR = 4  # with FLAG_MODEL: letters the model calls impossible have codes too
KNOWN_FLAGS = FLAG_PAIRS | FLAG_MODEL | FLAG_FLOOR

# Letters of one independently coded lane. Lanes are decoded in lock step (one numpy call per
# step covers every lane), so big lanes mean few Python-level steps; each lane costs ~10 bits
# of header (its bit length), ~0.1% of the payload at 2048 letters.
LANE_LETTERS = 2048
# Streams up to this many letters are one lane: no lane table at all, decoded by pointer
# doubling, whose cost grows with the bit count rather than with the letters per lane.
ONE_LANE_LETTERS = 1 << 15
# Bits or letters the decoder's big gathers handle at once: bounds their temporaries.
CHUNK = 1 << 18
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
  check_max_code_length(max_code_length)
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
def decode_tables(lengths_bytes: bytes) -> tuple[np.ndarray, np.ndarray, int]:
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


def model_code_lengths(probabilities: np.ndarray, pairs: bool, max_code_length: int,
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


def check_max_code_length(max_code_length: int) -> None:
  if (isinstance(max_code_length, bool) or not isinstance(max_code_length, (int, np.integer))
      or not 1 <= max_code_length <= MAX_CODE_LENGTH):
    raise ValueError(f"max_code_length must be an integer in 1..{MAX_CODE_LENGTH}, got "
                     f"{max_code_length!r}.")


# ----------------------------------------------------------------------------- encoding


def check_symbols(symbols: np.ndarray) -> np.ndarray:
  symbols = np.asarray(symbols)
  if symbols.dtype != np.uint8:
    raise ValueError(f"symbols must be a uint8 array, got dtype {symbols.dtype}.")
  return np.ascontiguousarray(symbols).reshape(-1)


def entropy_bits(symbols: np.ndarray) -> float:
  """Empirical (order-0) entropy of uint8 `symbols` in bits per symbol; 0.0 when empty.

  Example:
    >>> entropy_bits(np.array([0, 1, 2, 3], np.uint8))
    2.0
  """
  symbols = check_symbols(symbols)
  if not symbols.size:
    return 0.0
  counts = np.bincount(symbols, minlength=256)
  p = counts[counts > 0] / symbols.size
  return float(-(p * np.log2(p)).sum()) + 0.0
