"""Huffman codec in jnp (huffman_jnp, under jit) against the host codec through pure_callback."""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from loco_jax.apps import huffman, huffman_jnp  # noqa: E402
from loco_jax.codecs import fp, gennorm  # noqa: E402
from loco_jax.apps.huffman_codes import LANE_LETTERS  # noqa: E402
from loco_jax.transforms.co3_host import default_capacity_bits  # noqa: E402

# A stream's bytes beside its payload: magic, count, CRC and code lengths (under 256 bytes)
# and at most 4 bytes a lane of LANE_LETTERS letters for the lane table.
STREAM_HEADER_BYTES = 256
LANE_TABLE_BYTES = 4

USAGE = """Examples:
  python experiments/codec_device_bench.py                    # 1M and 4M symbols, all codecs
  python experiments/codec_device_bench.py --sizes 1048576 --repeats 3 --unroll 8
Codecs: jnp-<lanes>[-cumsum] (huffman_jnp, <lanes> symbols a lane, segment_sum or cumsum
packing), host (huffman.encode with the model table, single symbols, what jnp codes) and
host-pairs (huffman.encode_pairs with the model, CO3's mode), the host ones through
jax.pure_callback from a jitted function."""


class Variant(NamedTuple):
  """One codec's three jitted functions on one input size."""
  name: str
  lanes: int | None
  encode: Callable[[jax.Array], Any]    # symbols -> coded form
  decode: Callable[[Any], jax.Array]    # coded form -> symbols
  roundtrip: Callable[[jax.Array], Any]  # symbols -> (symbols, coded bits), one jitted call
  coded_bits: Callable[[Any], int]      # coded form -> bits on the wire


def _fp4_data(n: int, beta: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """fp4 symbols of GenNorm(beta) data at CO3's scale, and the model's probabilities."""
  scale = gennorm.fp4_scale(beta, 1.0)
  x = gennorm.sample(np.random.default_rng(seed), beta, 1.0, (n,))
  return fp.encode(x, fp.FP4, scale), gennorm.symbol_probabilities(fp.FP4, beta, 1.0, scale)


def _jnp_variant(spec: str, n: int, probabilities: np.ndarray, capacity_bits: float,
                 unroll: int) -> Variant:
  parts = spec.split("-")
  lanes, packing = int(parts[1]), "cumsum" if parts[2:] == ["cumsum"] else "segment_sum"
  lengths, codes = huffman_jnp.make_table(probabilities)
  longest = int(lengths.max())
  lengths, codes = jnp.asarray(lengths), jnp.asarray(codes)
  capacity_words = math.ceil(n * capacity_bits / 32)

  def encode(symbols):
    return huffman_jnp.encode(symbols, lengths, codes, lane_symbols=lanes,
                              capacity_words=capacity_words, packing=packing)

  def decode(enc):
    return huffman_jnp.decode(enc.words, enc.lane_bit_offsets, n, lengths, codes,
                              lane_symbols=lanes, max_code_length=longest, unroll=unroll)

  def roundtrip(symbols):
    enc = encode(symbols)
    return decode(enc), enc.total_bits

  def coded_bits(enc):  # payload and a 32-bit offset a lane
    fits = bool(enc.fits)
    return int(enc.total_bits) + 32 * (enc.lane_bit_offsets.size - 1) if fits else -1

  return Variant(spec, lanes, jax.jit(encode), jax.jit(decode), jax.jit(roundtrip), coded_bits)


def _host_variant(name: str, n: int, probabilities: np.ndarray,
                  capacity_bits: float) -> Variant:
  pairs = name == "host-pairs"
  capacity = (STREAM_HEADER_BYTES + math.ceil(capacity_bits / 8 * n)
              + LANE_TABLE_BYTES * -(-n // LANE_LETTERS))
  probabilities = probabilities[:16] if pairs else probabilities
  coder = huffman.encode_pairs if pairs else huffman.encode
  coded_type = (jax.ShapeDtypeStruct((capacity,), jnp.uint8), jax.ShapeDtypeStruct((), jnp.int32))
  symbols_type = jax.ShapeDtypeStruct((n,), jnp.uint8)

  def host_encode(symbols):
    data = coder(np.asarray(symbols), probabilities=probabilities)
    buffer = np.zeros(capacity, np.uint8)
    kept = min(len(data), capacity)
    buffer[:kept] = np.frombuffer(data, np.uint8)[:kept]
    return buffer, np.int32(len(data))

  def host_decode(buffer, nbytes):
    nbytes = int(nbytes)
    if nbytes > capacity:
      return np.zeros(n, np.uint8)
    return huffman.decode(np.asarray(buffer)[:nbytes].tobytes(), max_symbols=n,
                          probabilities=probabilities)

  def host_roundtrip(symbols):
    data = coder(np.asarray(symbols), probabilities=probabilities)
    return huffman.decode(data, max_symbols=n, probabilities=probabilities), np.int32(len(data))

  def encode(symbols):
    return jax.pure_callback(host_encode, coded_type, symbols)

  def decode(coded):
    return jax.pure_callback(host_decode, symbols_type, *coded)

  def roundtrip(symbols):
    return jax.pure_callback(host_roundtrip, (symbols_type, coded_type[1]), symbols)

  def coded_bits(coded):
    nbytes = int(coded[1])
    return 8 * nbytes if nbytes <= capacity else -1

  return Variant(name, None, jax.jit(encode), jax.jit(decode), jax.jit(roundtrip), coded_bits)


def _time(fn: Callable[[], Any]) -> float:
  start = time.perf_counter()
  jax.block_until_ready(fn())
  return time.perf_counter() - start


def bench(sizes: list[int], codecs: list[str], repeats: int, beta: float,
          unroll: int) -> list[dict[str, Any]]:
  """Median encode / decode / encode+decode seconds of every codec, repeats interleaved."""
  capacity_bits = default_capacity_bits(fp.FP4)
  rows = []
  for n in sizes:
    symbols_np, probabilities = _fp4_data(n, beta)
    symbols = jax.device_put(symbols_np)
    variants = [_jnp_variant(c, n, probabilities, capacity_bits, unroll) if c.startswith("jnp")
                else _host_variant(c, n, probabilities, capacity_bits) for c in codecs]
    coded, results = {}, {}
    for v in variants:  # compile, check, and keep each codec's coded form for its decode
      coded[v.name] = jax.block_until_ready(v.encode(symbols))
      decoded, _ = jax.block_until_ready(v.roundtrip(symbols))
      ok = (np.array_equal(np.asarray(decoded), symbols_np)
            and np.array_equal(np.asarray(jax.block_until_ready(v.decode(coded[v.name]))),
                               symbols_np))
      bits = v.coded_bits(coded[v.name])
      results[v.name] = {"encode": [], "decode": [], "roundtrip": [], "ok": ok, "bits": bits}
    for _ in range(repeats):
      for v in variants:
        times = results[v.name]
        times["encode"].append(_time(lambda v=v: v.encode(symbols)))
        times["decode"].append(_time(lambda v=v: v.decode(coded[v.name])))
        times["roundtrip"].append(_time(lambda v=v: v.roundtrip(symbols)))
    for v in variants:
      r = results[v.name]
      rows.append({"codec": v.name, "symbols": n, "lanes": v.lanes or "-",
                   **{k: statistics.median(r[k]) for k in ("encode", "decode", "roundtrip")},
                   "bits_per_symbol": r["bits"] / n if r["bits"] >= 0 else float("nan"),
                   "ok": r["ok"] and r["bits"] >= 0})
  return rows


def markdown(rows: list[dict[str, Any]], backend: str) -> str:
  lines = ["| backend | codec | symbols | lanes | encode ms | decode ms | encode+decode ms "
           "| bits/symbol | roundtrip ok |", "|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    lines.append(f"| {backend} | {r['codec']} | {r['symbols'] / 2**20:g}M | {r['lanes']} "
                 f"| {1e3 * r['encode']:.1f} | {1e3 * r['decode']:.1f} "
                 f"| {1e3 * r['roundtrip']:.1f} | {r['bits_per_symbol']:.3f} | {r['ok']} |")
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__, epilog=USAGE,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")],
                      default=[2**20, 2**22], help="symbol counts, comma-separated")
  parser.add_argument("--codecs", type=lambda s: s.split(","),
                      default=["jnp-2048", "jnp-256", "jnp-2048-cumsum", "host", "host-pairs"])
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--beta", type=float, default=1.0, help="GenNorm shape of the data")
  parser.add_argument("--unroll", type=int, default=1, help="lax.scan unroll of jnp decode")
  args = parser.parse_args(argv)
  for c in args.codecs:
    if not (c in ("host", "host-pairs") or (c.startswith("jnp-") and c.split("-")[1].isdigit()
                                            and c.split("-")[2:] in ([], ["cumsum"]))):
      parser.error(f"unknown codec {c!r}; accepted: jnp-<lanes>[-cumsum], host, host-pairs")
  start = time.perf_counter()
  backend = jax.default_backend()
  scale = gennorm.fp4_scale(args.beta, 1.0)
  print(f"jax {jax.__version__}, {backend}: {jax.devices()[0].device_kind}; fp4 symbols of "
        f"GenNorm(beta={args.beta}) data, model entropy "
        f"{gennorm.entropy_bits(fp.FP4, args.beta, 1.0, scale):.3f} bits; medians of "
        f"{args.repeats} interleaved repeats; jnp decode unroll {args.unroll}\n", flush=True)
  rows = bench(args.sizes, args.codecs, args.repeats, args.beta, args.unroll)
  print("bits/symbol: jnp payload plus a 32-bit offset a lane; host whole stream (header, lane "
        "table, payload)")
  print(markdown(rows, backend))
  print(f"({time.perf_counter() - start:.0f} s)")
  return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
  sys.exit(main())
