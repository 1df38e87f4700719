"""CO3's host side: the Huffman coding of each device's symbols in callbacks, and the decoding
of every peer's stream (each decoded once per host, shared by the devices of the host)."""

import collections
import concurrent.futures
import threading

import jax
import numpy as np
from jax.experimental.buffer_callback import buffer_callback

from loco_jax.codecs import huffman


def _host(fn, result, *args):
  """Runs the numpy function `fn(*args)` on the host (once per device under shard_map).

  On the CPU backend, jax.pure_callback copies its arguments onto CPU device 0, which under
  shard_map may be blocked in a collective waiting for this very callback: a deadlock.
  buffer_callback hands over the buffers themselves instead.
  """
  if jax.default_backend() != "cpu":
    return jax.pure_callback(fn, result, *args)

  def run(ctx, out, *buffers):
    del ctx
    values = fn(*[np.asarray(b) for b in buffers])
    for buffer, value in zip(jax.tree.leaves(out), jax.tree.leaves(values)):
      np.asarray(buffer)[...] = value
  return buffer_callback(run, result)(*args)


def _encode(symbols: np.ndarray, pairs: bool) -> bytes:
  # Pairs of fp4 symbols as one letter close most of Huffman's gap to the entropy.
  return huffman.encode_pairs(symbols) if pairs else huffman.encode(symbols)


def _code(symbols: np.ndarray, capacity: int, pairs: bool) -> tuple[np.ndarray, np.ndarray]:
  """Host side: Huffman-codes one device's symbols into a fixed-capacity buffer plus length."""
  data = _encode(symbols, pairs)
  if len(data) <= capacity:  # this host will receive the stream back: it need not decode it
    known, first = _claim((data, symbols.size))
    if first:
      known.set_result(symbols.copy())  # the callback's buffer does not outlive the call
  buffer = np.zeros(capacity, np.uint8)
  kept = min(len(data), capacity)
  buffer[:kept] = np.frombuffer(data, np.uint8)[:kept]
  return buffer, np.int32(len(data))


# Decoded streams of the last few steps, by (coded bytes, symbol count). Devices that share a
# host decode the same peers' streams, each in its own callback thread at the same moment: each
# stream is decoded once, by the first thread to reach it, or not at all if this host coded it.
_DECODED: "collections.OrderedDict[tuple[bytes, int], concurrent.futures.Future]" = (
    collections.OrderedDict())
_DECODED_LOCK = threading.Lock()
DECODED_KEPT = 64  # streams: a few steps of a host's devices


def _claim(key: tuple[bytes, int]) -> tuple[concurrent.futures.Future, bool]:
  """The cache entry for `key`, and whether this call created it (and so must fill it)."""
  with _DECODED_LOCK:
    entry = _DECODED.get(key)
    if entry is not None:
      return entry, False
    entry = _DECODED[key] = concurrent.futures.Future()
    while len(_DECODED) > DECODED_KEPT:
      _DECODED.popitem(last=False)
    return entry, True


def _decoded(data: bytes, total: int) -> concurrent.futures.Future:
  """The decoded stream, decoded here if no other thread has started on it."""
  entry, first = _claim((data, total))
  if first:
    try:
      symbols = huffman.decode(data, max_symbols=total)
      if symbols.size != total:  # numpy would broadcast a lone symbol over the whole row
        raise ValueError(f"co3: a peer's stream holds {symbols.size} symbols, this step's "
                         f"row holds {total}: the peer coded other gradients.")
      entry.set_result(symbols)
    except Exception as e:  # noqa: BLE001 - every thread gets the same ValueError
      entry.set_exception(e)
  return entry


def _decode_all(buffers: np.ndarray, lengths: np.ndarray, total: int) -> np.ndarray:
  """Host side: decodes every device's buffer (untrusted input: huffman.decode checks it)."""
  out = np.zeros((buffers.shape[0], total), np.uint8)
  # Streams another thread is decoding are skipped, then waited for: the threads share the work.
  decoded = {d: _decoded(buffers[d, :lengths[d]].tobytes(), total)
             for d in range(buffers.shape[0])
             if lengths[d] <= buffers.shape[1]}  # an overflowed device's symbols come another way
  for d, stream in decoded.items():
    out[d] = stream.result()
  return out


def _roundtrip(symbols: np.ndarray, pairs: bool) -> tuple[np.ndarray, np.ndarray]:
  """Host side, local mode: encode then decode, so the codec is inside the training loop."""
  data = _encode(symbols, pairs)
  return huffman.decode(data, max_symbols=symbols.size), np.int32(len(data))
