"""Canonical Huffman coding of uint8 symbols in jnp, with static shapes, for the accelerator."""

import functools
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from loco_jax.apps import huffman, huffman_codes

# Symbols per independently coded lane; decode runs one step per symbol of a lane, all lanes
# at once. The default matches huffman.py's lanes; fewer symbols a lane means more lanes and
# fewer (sequential) steps.
LANE_SYMBOLS = 2048
# Codes are at most 16 bits, so a code touches at most 2 of the 32-bit words.
MAX_CODE_LENGTH = huffman.MAX_CODE_LENGTH
_INT32_MAX = 2 ** 31 - 1

Packing = Literal["segment_sum", "cumsum"]


class Encoded(NamedTuple):
  """encode's result; a pytree, so it can leave a jitted function.

  Bits are MSB first in each word, words in order: `words` written big-endian are the same
  bytes as huffman.encode's payload for the same code lengths.
  """
  words: jax.Array             # uint32[capacity_words]: the codes back to back
  lane_bit_offsets: jax.Array  # int32[n_lanes + 1]: first bit of every lane, then total_bits
  total_bits: jax.Array        # int32: bits used; -1 when a symbol has no code

  @property
  def fits(self) -> jax.Array:
    """bool: every symbol had a code and the codes fit in `words`."""
    return (self.total_bits >= 0) & (self.total_bits <= 32 * self.words.shape[0])

  @property
  def needed_words(self) -> jax.Array:
    """int32: capacity_words that would have held the codes (when every symbol has one)."""
    return (self.total_bits + 31) // 32


def make_table(weights: np.ndarray, max_code_length: int = huffman.DEFAULT_MAX_CODE_LENGTH,
               *, every_letter: bool = True) -> tuple[np.ndarray, np.ndarray]:
  """Host side: (code_lengths uint8[256], codes uint32[256]) for counts or probabilities.

  With `every_letter`, all 256 letters get a code (a floor of 2**-20 on the normalised
  weights, as huffman.py does for model tables), so any uint8 data can be coded; without it,
  letters of zero weight have none (length 0) and encode reports them (total_bits -1).

  Example:
    >>> lengths, codes = make_table(np.array([5, 1, 1, 1]), every_letter=False)
    >>> lengths[:4], codes[:4]
    (array([1, 3, 3, 2], dtype=uint8), array([0, 6, 7, 2], dtype=uint32))
  """
  if every_letter:  # huffman.py's model tables: the same lengths, checks and cache
    lengths = huffman_codes.model_code_lengths(weights, pairs=False, max_code_length=max_code_length,
                                          floor=True)
  else:
    lengths = huffman.code_lengths(np.asarray(weights, np.float64), max_code_length)
  return lengths, huffman.canonical_codes(lengths)


@functools.partial(jax.jit, static_argnames=("lane_symbols", "capacity_words", "packing"))
def encode(symbols: jax.Array, code_lengths: jax.Array, codes: jax.Array, *,
           lane_symbols: int = LANE_SYMBOLS, capacity_words: int,
           packing: Packing = "segment_sum") -> Encoded:
  """Huffman-codes uint8 `symbols` with a given table into a fixed-capacity word buffer.

  Each code's first bit is the exclusive cumulative sum of the code lengths before it; codes
  occupy disjoint bits, so a word is the sum of the (shifted) codes that touch it: a segment
  sum over word indices ("segment_sum": a sorted scatter-add; "cumsum": differences of a
  running sum at word boundaries, no scatter). The stream is continuous; lanes of
  `lane_symbols` symbols are found by their first bit, recorded in `lane_bit_offsets`.

  Overflow is reported, not written: when the codes need more than `capacity_words` words,
  `words` holds the first `capacity_words` of them, `total_bits` the full count
  (`Encoded.fits` is False, `Encoded.needed_words` the size that would do). A symbol whose
  code length is 0 makes total_bits -1 (use make_table to give every letter a code).

  Args:
    symbols: uint8[n].
    code_lengths: uint8[256], at most 16 bits (garbage otherwise: not checked under jit), e.g.
      from make_table or huffman.code_lengths.
    codes: uint32[256], the matching codes (huffman.canonical_codes).
    lane_symbols: symbols per independently decodable lane (static).
    capacity_words: size of the word buffer (static).
    packing: "segment_sum" or "cumsum" (static); the same words either way.

  Example:
    >>> lengths, codes = make_table(np.array([2, 1, 0, 1]), every_letter=False)  # 1, 2, -, 2 bits
    >>> enc = encode(np.array([0, 0, 1, 3], np.uint8), lengths, codes, capacity_words=1)
    >>> int(enc.total_bits), bool(enc.fits), hex(int(enc.words[0]))
    (6, True, '0x2c000000')
  """
  n = _check_symbols(symbols)
  _check_table(code_lengths, codes)
  _check_positive("lane_symbols", lane_symbols)
  _check_positive("capacity_words", capacity_words)
  if 32 * capacity_words > _INT32_MAX or n * MAX_CODE_LENGTH > _INT32_MAX:
    raise ValueError(f"bit offsets are int32: capacity_words must be below 2**26 and symbols "
                     f"below 2**27, got {capacity_words} and {n}.")
  if packing not in ("segment_sum", "cumsum"):
    raise ValueError(f"packing must be 'segment_sum' or 'cumsum', got {packing!r}.")
  if n == 0:
    return Encoded(jnp.zeros(capacity_words, jnp.uint32), jnp.zeros(1, jnp.int32),
                   jnp.int32(0))
  # One gather a symbol: the code left-aligned in 32 bits (so its low 16 bits are free) with
  # its length in the low 5 bits.
  lengths = code_lengths.astype(jnp.uint32)
  entries = jnp.where(lengths > 0, codes.astype(jnp.uint32) << (32 - lengths), 0) | lengths
  entry_N = _take(entries, symbols.astype(jnp.int32))
  lengths_N = (entry_N & 31).astype(jnp.int32)
  aligned_N = entry_N & ~jnp.uint32(31)
  ends_N = _cumsum(lengths_N)
  starts_N = ends_N - lengths_N
  total_bits = ends_N[-1]
  lane_bit_offsets = jnp.concatenate([starts_N[::lane_symbols], total_bits[None]])

  # Shifted right by its offset in its word, a code is `high` in that word and `low` in the
  # next one (codes of at most 16 bits touch at most 2 words).
  word_N = starts_N >> 5
  offset_N = (starts_N & 31).astype(jnp.uint32)
  high_N = aligned_N >> offset_N
  low_N = jnp.where(offset_N > 0, aligned_N << (32 - offset_N), 0).astype(jnp.uint32)
  if packing == "segment_sum":
    words = (jax.ops.segment_sum(high_N, word_N, capacity_words, indices_are_sorted=True,
                                 mode="drop")
             + jax.ops.segment_sum(low_N, word_N + 1, capacity_words, indices_are_sorted=True,
                                   mode="drop"))
  else:
    words = _cumsum_pack(high_N, low_N, starts_N, capacity_words)
  total_bits = jnp.where(jnp.all(lengths_N > 0), total_bits, -1)
  return Encoded(words, lane_bit_offsets.astype(jnp.int32), total_bits.astype(jnp.int32))


def _take(table: jax.Array, index: jax.Array) -> jax.Array:
  """table[index] with out-of-range indices clamped; XLA:CPU runs it ~3x faster than x[i]."""
  return jnp.take(table, index, mode="clip")


def _cumsum(x_N: jax.Array, block: int = 32) -> jax.Array:
  """Inclusive cumulative sum, wrapping for unsigned x.

  XLA:CPU runs a long jnp.cumsum as one reduce_window, 3-5x slower on 4M elements than
  cumulative sums within blocks of 32 plus the (recursive) cumulative sum of the blocks'
  totals; XLA:GPU rewrites that reduce_window into a blocked scan of its own.
  """
  n = x_N.shape[0]
  if jax.default_backend() != "cpu" or n <= 4096:
    return jnp.cumsum(x_N, dtype=x_N.dtype)
  within_RxB = jnp.cumsum(jnp.pad(x_N, (0, -n % block)).reshape(-1, block), axis=1,
                          dtype=x_N.dtype)
  before_R = _cumsum(within_RxB[:, -1], block) - within_RxB[:, -1]
  return (within_RxB + before_R[:, None]).reshape(-1)[:n]


def _cumsum_pack(high_N: jax.Array, low_N: jax.Array, starts_N: jax.Array,
                 capacity_words: int) -> jax.Array:
  """Words as differences of running (wrapping uint32) sums at the word boundaries."""
  zero = jnp.zeros(1, jnp.uint32)
  high_sums = jnp.concatenate([zero, _cumsum(high_N)])
  low_sums = jnp.concatenate([zero, _cumsum(low_N)])
  # first_W[k]: the first code starting in word k or later.
  first_W = jnp.searchsorted(starts_N, 32 * jnp.arange(capacity_words + 1, dtype=jnp.int32))
  high_W = _take(high_sums, first_W[1:]) - _take(high_sums, first_W[:-1])
  low_W = _take(low_sums, first_W[1:]) - _take(low_sums, first_W[:-1])
  return high_W + jnp.concatenate([zero, low_W[:-1]])


def decode(words: jax.Array, lane_bit_offsets: jax.Array, n: int, code_lengths: jax.Array,
           codes: jax.Array, *, lane_symbols: int = LANE_SYMBOLS,
           max_code_length: int = MAX_CODE_LENGTH, unroll: int = 1) -> jax.Array:
  """uint8[n] symbols of encode's `words`, decoding all lanes in lock step.

  A lookup table of 2**max_code_length entries gives the (letter, length) of the code at the
  head of every max_code_length-bit window; each of the `lane_symbols` steps of a lax.scan
  reads a 32-bit window at every lane's bit position, looks the letter up and advances.
  The table and lane size must be encode's. Nothing is checked at run time: words that are
  not an encoding that fit (Encoded.fits) give garbage symbols, never an out-of-bounds read.

  Args:
    words: uint32[capacity_words] from encode.
    lane_bit_offsets: int32[n_lanes + 1] from encode.
    n: number of symbols (static).
    code_lengths, codes: encode's table (lengths at most max_code_length).
    lane_symbols: encode's lane size (static).
    max_code_length: longest code in the table (static); sets the lookup table's size.
    unroll: lax.scan's unroll factor (static).

  Example:
    >>> lengths, codes = make_table(np.array([2, 1, 0, 1]), every_letter=False)
    >>> enc = encode(np.array([0, 0, 1, 3], np.uint8), lengths, codes, capacity_words=1)
    >>> decode(enc.words, enc.lane_bit_offsets, 4, lengths, codes, max_code_length=2)
    Array([0, 0, 1, 3], dtype=uint8)
  """
  _check_table(code_lengths, codes)
  _check_positive("lane_symbols", lane_symbols)
  _check_positive("unroll", unroll)
  if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
    raise ValueError(f"n must be a non-negative int (static), got {n!r}.")
  if isinstance(max_code_length, bool) or not 1 <= max_code_length <= MAX_CODE_LENGTH:
    raise ValueError(f"max_code_length must be in 1..{MAX_CODE_LENGTH}, got {max_code_length!r}.")
  if not isinstance(code_lengths, jax.core.Tracer):  # a concrete table can be checked
    longest = int(np.max(np.asarray(code_lengths)))
    if longest > max_code_length:
      raise ValueError(f"the table has {longest}-bit codes, more than max_code_length="
                       f"{max_code_length}; pass max_code_length >= {longest}.")
  return _decode(words, lane_bit_offsets, n, code_lengths, codes, lane_symbols=lane_symbols,
                 max_code_length=max_code_length, unroll=unroll)


@functools.partial(jax.jit, static_argnames=("n", "lane_symbols", "max_code_length", "unroll"))
def _decode(words: jax.Array, lane_bit_offsets: jax.Array, n: int, code_lengths: jax.Array,
            codes: jax.Array, *, lane_symbols: int, max_code_length: int,
            unroll: int) -> jax.Array:
  n_lanes = -(-n // lane_symbols)
  if words.ndim != 1 or words.dtype != jnp.uint32 or lane_bit_offsets.shape != (n_lanes + 1,):
    raise ValueError(f"decode takes encode's uint32[capacity_words] words and int32[{n_lanes + 1}]"
                     f" lane_bit_offsets for n={n}, lane_symbols={lane_symbols}; got "
                     f"{words.dtype}{list(words.shape)} and {list(lane_bit_offsets.shape)}.")
  if n == 0:
    return jnp.zeros(0, jnp.uint8)
  table = _lookup_table(code_lengths, codes, max_code_length)
  drop = jnp.uint32(32 - max_code_length)

  def step(position_K, _):
    # _take clips: a window may run past the last word, but only bits after the code it
    # starts with (every extension of a code maps to that code), or in a lane past its end.
    word_K = position_K >> 5
    offset_K = (position_K & 31).astype(jnp.uint32)
    head_K = _take(words, word_K) << offset_K
    tail_K = jnp.where(offset_K > 0, _take(words, word_K + 1) >> (32 - offset_K), 0)
    entry_K = _take(table, ((head_K | tail_K) >> drop).astype(jnp.int32))
    return position_K + (entry_K >> 8), entry_K.astype(jnp.uint8)

  steps = min(lane_symbols, n)
  _, letters_SxK = jax.lax.scan(step, lane_bit_offsets[:n_lanes].astype(jnp.int32), None,
                                length=steps, unroll=unroll)
  return letters_SxK.T.reshape(-1)[:n]


def _lookup_table(code_lengths: jax.Array, codes: jax.Array, peek: int) -> jax.Array:
  """int32 `length << 8 | letter` of the code at the head of every `peek`-bit window."""
  lengths = code_lengths.astype(jnp.int32)
  used = (lengths > 0) & (lengths <= peek)
  # A code owns the windows from its value left-aligned to `peek` bits up to the next code's.
  first = jnp.where(used, codes.astype(jnp.int32) << jnp.where(used, peek - lengths, 0),
                    1 << peek)
  order = jnp.argsort(first, stable=True)
  windows = jnp.arange(1 << peek, dtype=jnp.int32)
  owner = jnp.maximum(jnp.searchsorted(first[order], windows, side="right") - 1, 0)
  letter = order[owner]
  return lengths[letter] << 8 | letter


def _check_symbols(symbols: jax.Array) -> int:
  if symbols.ndim != 1 or symbols.dtype != jnp.uint8:
    raise ValueError(f"symbols must be a 1-D uint8 array, got {symbols.dtype}"
                     f"{list(symbols.shape)}.")
  return symbols.shape[0]


def _check_table(code_lengths: jax.Array, codes: jax.Array) -> None:
  if code_lengths.shape != (256,) or codes.shape != (256,):
    raise ValueError(f"the table is code_lengths[256] and codes[256] (one per uint8 letter), "
                     f"got shapes {code_lengths.shape} and {codes.shape}.")
  if not (jnp.issubdtype(code_lengths.dtype, jnp.integer)
          and jnp.issubdtype(codes.dtype, jnp.integer)):
    raise ValueError(f"code_lengths and codes must be integer arrays, got {code_lengths.dtype} "
                     f"and {codes.dtype}.")


def _check_positive(name: str, value: int) -> None:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
    raise ValueError(f"{name} must be a positive int (static), got {value!r}.")
