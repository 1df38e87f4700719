"""Decoding a Huffman stream's payload: every lane at once, in lock step or by pointer doubling."""

import numpy as np

from loco_jax.apps.huffman_codes import CHUNK, decode_tables


def _bit_windows(payload: np.ndarray, pad_bytes: int) -> np.ndarray:
  """uint32 big-endian window starting at every byte of the zero-padded payload."""
  n_words = (payload.size + pad_bytes + 3) // 4 + 1
  padded = np.zeros(4 * n_words + 3, np.uint8)
  padded[:payload.size] = payload
  windows = np.empty((n_words, 4), np.uint32)
  for shift in range(4):
    windows[:, shift] = np.frombuffer(padded, ">u4", count=n_words, offset=shift)
  return windows.reshape(-1)


def decode_payload(payload: np.ndarray, lengths: np.ndarray, lane_letters: int,
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
  letter_table, length_table, peek = decode_tables(lengths.tobytes())
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
  for first in range(0, total_bits + 1, CHUNK):
    last = min(first + CHUNK, total_bits + 1)
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
  for first in range(0, index.size, CHUNK):
    table.take(index[first:first + CHUNK], out=out[first:first + CHUNK], mode="clip")
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
