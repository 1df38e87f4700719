"""Side-by-side size and speed of our Huffman codec, zlib and zstd on fp4 GenNorm symbols."""

import statistics
import time
import zlib
from collections.abc import Callable, Sequence

import numpy as np
import scipy.special

from zlib_ng import zlib_ng

from loco_jax.codecs import fp
from loco_jax.apps import huffman
from loco_jax.codecs import huffman_deflate

Codec = tuple[Callable[[np.ndarray], bytes], Callable[[bytes, int], np.ndarray]]  # decode(data, size)

SMALL_STREAM_SYMBOLS = 1000
_SMALL_STREAMS = 32  # sizes of small streams are averaged over this many independent draws
_FP4_THRESHOLDS = np.array([0.25, 0.75, 1.25, 1.75, 2.5])  # midpoints of {0, .5, 1, 1.5, 2, 3}


def mse_scale(beta: float) -> float:
  """CO3's MSE-good fp4 scale p(beta) for unit GenNorm data (floor 0.0009).

  Example:
    >>> round(mse_scale(1.0), 2)
    0.65
  """
  p = 0.46 - 2.85 * beta + 5.37 * beta**2 - 2.85 * beta**3 + 0.52 * beta**4
  return max(p, 0.0009)


def gennorm_fp4_symbols(n: int, beta: float, seed: int = 0) -> np.ndarray:
  """fp4 symbols of n unit GenNorm(beta) samples at the MSE-good scale.

  |x| = G**(1/beta) with G ~ Gamma(1/beta) has density ~ exp(-|x|**beta); the sign is random.

  Example:
    >>> gennorm_fp4_symbols(4, 1.0).dtype
    dtype('uint8')
  """
  rng = np.random.default_rng(seed)
  magnitude = rng.gamma(1.0 / beta, size=n) ** (1.0 / beta)
  x = np.where(rng.random(n) < 0.5, -magnitude, magnitude)
  return fp.encode(x, fp.FP4, mse_scale(beta))


def gennorm_fp4_probabilities(beta: float) -> np.ndarray:
  """float64[16]: exact probability of every fp4 symbol for unit GenNorm(beta) data.

  The model a decoder would share with the encoder after a GenNorm fit (here: the true one).

  Example:
    >>> float(gennorm_fp4_probabilities(2.0).sum())
    1.0
  """
  # P(|x| * scale < t) = P(G < (t / scale)**beta), the regularized lower incomplete gamma.
  cdf = scipy.special.gammainc(1.0 / beta, (_FP4_THRESHOLDS / mse_scale(beta)) ** beta)
  magnitude = np.diff(np.concatenate([[0.0], cdf, [1.0]]))  # 6 magnitude codes
  probabilities = np.zeros(16)
  probabilities[0] = magnitude[0]
  probabilities[1:6] = magnitude[1:] / 2
  probabilities[9:14] = magnitude[1:] / 2  # sign bit 8; negative zero is never produced
  return probabilities


def _codecs(beta: float) -> dict[str, tuple[Codec, bool]]:
  """name -> ((encode, decode), slow: timed once); zstd entries only when zstandard imports."""
  model = gennorm_fp4_probabilities(beta)
  codecs = {
      "huffman": ((huffman.encode, _sized(huffman.decode)), False),
      "huffman_pairs": ((huffman.encode_pairs, _sized(huffman.decode)), False),
      "huffman_model": ((lambda s: huffman.encode(s, probabilities=model),
                         lambda d, n: huffman.decode(d, probabilities=model)), False),
      "huffman_pairs_model": ((lambda s: huffman.encode_pairs(s, probabilities=model),
                               lambda d, n: huffman.decode(d, probabilities=model)), False),
      "zlib_6": ((lambda s: zlib.compress(s, 6), _sized(_zlib_decode)), False),
      "zlib_huffman_only": ((_zlib_huffman_only, _sized(_zlib_decode)), False),
      # co3's coder (zlib-ng's deflate, libdeflate's inflate, with its header and CRC32), and
      # its raw deflate with zlib-ng's and with Python's zlib alone: what the libraries bought.
      "huffman_deflate": ((huffman_deflate.encode, huffman_deflate.decode), False),
      "raw_huffman_only_zlib": ((lambda s: _raw_huffman_only(zlib, s),
                                 lambda d, n: _raw_inflate(zlib, d)), False),
      "raw_huffman_only_zlib_ng": ((lambda s: _raw_huffman_only(zlib_ng, s),
                                    lambda d, n: _raw_inflate(zlib_ng, d)), False),
  }
  try:
    import zstandard
  except ImportError:
    return codecs
  for level in (1, 19):
    compressor = zstandard.ZstdCompressor(level=level)
    codecs[f"zstd_{level}"] = ((compressor.compress, _sized(_zstd_decode)), level == 19)
  return codecs


def _zlib_huffman_only(symbols: np.ndarray) -> bytes:
  compressor = zlib.compressobj(6, zlib.DEFLATED, 15, 9, zlib.Z_HUFFMAN_ONLY)
  return compressor.compress(symbols) + compressor.flush()


def _sized(decode: Callable[[bytes], np.ndarray]) -> Callable[[bytes, int], np.ndarray]:
  """A decoder that reads the size from its stream, taking the expected one as the others do."""
  return lambda data, size: decode(data)


def _raw_huffman_only(module, symbols: np.ndarray) -> bytes:
  """huffman_deflate's settings (level 1, raw deflate, memLevel 9) with `module`'s deflate."""
  compressor = module.compressobj(1, module.DEFLATED, -15, huffman_deflate.MEM_LEVEL,
                                  module.Z_HUFFMAN_ONLY)
  return compressor.compress(symbols) + compressor.flush()


def _raw_inflate(module, data: bytes) -> np.ndarray:
  return np.frombuffer(module.decompress(data, -15), np.uint8)


def _zlib_decode(data: bytes) -> np.ndarray:
  return np.frombuffer(zlib.decompress(data), np.uint8)


def _zstd_decode(data: bytes) -> np.ndarray:
  import zstandard
  return np.frombuffer(zstandard.ZstdDecompressor().decompress(data), np.uint8)


def _time_once(codec: Codec, symbols: np.ndarray) -> tuple[int, float, float]:
  """(compressed bytes, encode ms, decode ms); checks the roundtrip."""
  encode, decode = codec
  start = time.perf_counter()
  data = encode(symbols)
  middle = time.perf_counter()
  decoded = decode(data, symbols.size)
  end = time.perf_counter()
  if not np.array_equal(decoded, symbols):
    raise AssertionError("codec roundtrip failed")
  return len(data), (middle - start) * 1e3, (end - middle) * 1e3


def run(n_symbols: int = 4_000_000, betas: Sequence[float] = (0.5, 1.0, 2.0), seed: int = 0,
        repeats: int = 5) -> list[dict]:
  """Measures every codec on n_symbols fp4 GenNorm symbols per beta, and on 1K-symbol streams.

  Records are {"name": "metric/codec/beta=b", "value": float, "unit": str} with metrics
  size_vs_entropy (compressed bits / (n * empirical entropy)), encode_ms, decode_ms,
  encode_decode_ms (medians over `repeats`, taken round-robin over the codecs; zstd level 19
  runs once, it takes seconds), time_vs_zlib_huffman_only (encode_decode_ms over zlib's) and,
  for 1K-symbol streams, small_bytes and small_size_vs_entropy (means over 32 streams).
  "zstd_available" notes whether zstandard was importable (its codecs are skipped if not).

  Example:
    >>> print(format_table(run(n_symbols=100_000, betas=(1.0,), repeats=1)))  # doctest: +SKIP
  """
  records = []

  def record(name: str, value: float, unit: str) -> None:
    records.append({"name": name, "value": float(value), "unit": unit})

  for beta in betas:
    symbols = gennorm_fp4_symbols(n_symbols, beta, seed)
    entropy = huffman.entropy_bits(symbols)
    record(f"entropy/symbols/beta={beta}", entropy, "bits/symbol")
    small_streams = [gennorm_fp4_symbols(SMALL_STREAM_SYMBOLS, beta, seed + 1 + i)
                     for i in range(_SMALL_STREAMS)]
    small_entropy_bits = sum(huffman.entropy_bits(s) * s.size for s in small_streams)
    codecs = _codecs(beta)
    # Repeats go round all codecs in turn, so that a noisy neighbour slows them alike.
    timings = {name: [] for name in codecs}
    for repeat in range(repeats):
      for name, (codec, slow) in codecs.items():
        if repeat == 0 or not slow:
          timings[name].append(_time_once(codec, symbols))
    reference_ms = statistics.median(t[1] + t[2] for t in timings["zlib_huffman_only"])
    for name, (codec, _) in codecs.items():
      size = timings[name][0][0]
      encode_ms = statistics.median(t[1] for t in timings[name])
      decode_ms = statistics.median(t[2] for t in timings[name])
      total_ms = statistics.median(t[1] + t[2] for t in timings[name])
      record(f"size_vs_entropy/{name}/beta={beta}", size * 8 / (entropy * n_symbols), "x")
      record(f"encode_ms/{name}/beta={beta}", encode_ms, "ms")
      record(f"decode_ms/{name}/beta={beta}", decode_ms, "ms")
      record(f"encode_decode_ms/{name}/beta={beta}", total_ms, "ms")
      if name != "zlib_huffman_only":
        record(f"time_vs_zlib_huffman_only/{name}/beta={beta}", total_ms / reference_ms, "x")
      small_sizes = [_time_once(codec, s)[0] for s in small_streams]
      record(f"small_bytes/{name}/beta={beta}", np.mean(small_sizes), "bytes")
      record(f"small_size_vs_entropy/{name}/beta={beta}",
             sum(small_sizes) * 8 / small_entropy_bits, "x")
  try:
    import zstandard  # noqa: F401
    available = 1.0
  except ImportError:
    available = 0.0
  record("zstd_available", available, "bool")
  return records


def format_table(records: list[dict]) -> str:
  """Markdown: one row per (metric, codec), one column per beta; other records listed after.

  Example:
    >>> format_table([{"name": "encode_ms/zlib_6/beta=1.0", "value": 9.5, "unit": "ms"}])
    '| metric | codec | beta=1.0 |\\n|---|---|---|\\n| encode_ms (ms) | zlib_6 | 9.5 |'
  """
  columns, rows, others = [], {}, []
  for r in records:
    parts = r["name"].split("/")
    if len(parts) != 3:
      others.append(r)
      continue
    metric, codec, column = parts
    if column not in columns:
      columns.append(column)
    rows.setdefault((f"{metric} ({r['unit']})", codec), {})[column] = (r["value"], r["unit"])
  # Grouped by metric, in order of first appearance.
  metric_order = {metric: i for i, (metric, _) in reversed(list(enumerate(rows)))}
  lines = []
  if rows:
    lines.append("| metric | codec | " + " | ".join(columns) + " |")
    lines.append("|---" * (2 + len(columns)) + "|")
    for metric, codec in sorted(rows, key=lambda key: metric_order[key[0]]):
      values = rows[(metric, codec)]
      cells = [_format_value(*values[c]) if c in values else "" for c in columns]
      lines.append(f"| {metric} | {codec} | " + " | ".join(cells) + " |")
  for r in others:
    lines.append(f"\n{r['name']}: {_format_value(r['value'], r['unit'])} {r['unit']}")
  return "\n".join(lines)


def _format_value(value: float, unit: str) -> str:
  if unit in ("x", "bits/symbol"):
    return f"{value:.4f}"
  if abs(value) >= 100:
    return f"{value:.0f}"
  return f"{value:.1f}"
