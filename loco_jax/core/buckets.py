"""Buckets: a pytree's compressible leaves laid out once, from shapes, in a few flat arrays.

Like DDP's buckets: a step is a few kernel calls and one all-to-all whatever the leaf count.
Each leaf is cut into `rows` rows, row j the shard device j averages (`layout.shard_len`
elements of the zero-padded leaf). Each row is cut into whole scale blocks: full blocks of
`block_size` and, for the rest, one more full block or shorter blocks (8 times powers of two,
at most three lengths a plan), whichever sends fewer bytes; no block straddles two leaves.
Bucket c holds every piece whose blocks have length `block_lens[c]`: [rows, blocks, len].
"""

import collections
import functools
import itertools
import math
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp

from loco_jax.core import layout, quant, workarounds

# Bytes a block's scale costs on the wire, and a value of padding (4 bits in the all-to-all,
# 16 in the bf16 gather), to choose between them.
_SCALE_BYTES, _PAD_BYTES = 4, 2.5
# A plan takes one block length fewer where that sends at most this fraction more bytes.
_SPARE_BYTES = 0.005


class Piece(NamedTuple):
  """`blocks` blocks of bucket `bucket`, from its block `block0` on (in every row); they hold
  the leaf's row elements from `start` on."""
  bucket: int
  start: int
  block0: int
  blocks: int


class LeafPlan(NamedTuple):
  size: int                    # elements of the leaf
  row_len: int                 # layout.shard_len(size, rows): elements of each row (shard)
  pieces: tuple[Piece, ...]

  @property
  def blocks(self) -> int:
    """Scale blocks of one row of the leaf."""
    return sum(p.blocks for p in self.pieces)


class Plan(NamedTuple):
  """Where every leaf lies in the buckets; `leaves[i]` is None for a leaf that is not sent."""
  rows: int
  block_lens: tuple[int, ...]   # per bucket: elements of each of its blocks
  blocks: tuple[int, ...]       # per bucket: blocks of each row
  leaves: tuple[LeafPlan | None, ...]

  def has_bare_leaf(self) -> bool:
    """Whether some leaf is a whole bucket without padding: taken out, it is the bucket."""
    return any(leaf is not None and len(leaf.pieces) == 1 and leaf.size == self.rows * leaf.row_len
               and leaf.row_len == self.blocks[leaf.pieces[0].bucket] * self.block_lens[
                   leaf.pieces[0].bucket] for leaf in self.leaves)


def _remainder_pieces(rest: int, full: int, lengths: tuple[int, ...]) -> tuple[float, list[int]]:
  """(bytes, block lengths) for the `rest` values (a multiple of 8) left after a row's full
  blocks: one more full block, or blocks of the shorter `lengths` (longest first, the last one
  padded), whichever sends fewer bytes."""
  pieces, left = [], rest
  for n in sorted(lengths, reverse=True):
    pieces += [n] * (left // n)
    left -= n * (left // n)
  pieces += [min(lengths)] * (left > 0)
  as_pieces = (sum(pieces) - rest) * _PAD_BYTES + len(pieces) * _SCALE_BYTES
  as_full = (full - rest) * _PAD_BYTES + _SCALE_BYTES
  return (as_full, [full]) if as_full <= as_pieces else (as_pieces, pieces)


def _short_blocks(rests: list[int], full: int, has_full: bool,
                  row_bytes: float) -> tuple[int, ...]:
  """Block lengths below `full` (powers of two times 8) for the leaves' remainders, at most three
  lengths in all with `full` where a row holds a full block: the fewest lengths that send the
  remainders within `_SPARE_BYTES` x `row_bytes` (a row of every leaf) of the fewest bytes.
  Each length is a bucket, and each bucket a set of kernels to compile: a length that saves
  almost no bytes costs more compile time than it saves (docs/results/performance.md)."""
  candidates = [8 * 2 ** k for k in range(16) if 8 * 2 ** k < full] or [full]
  leaves_with = collections.Counter(r for r in rests if r)
  options = []
  for count in (1, 2, 3):
    for lengths in itertools.combinations_with_replacement(candidates, count):
      pieces = {r: _remainder_pieces(r, full, lengths) for r in leaves_with}
      used = {n for _, cut in pieces.values() for n in cut} | ({full} if has_full else set())
      if len(used) <= 3:
        cost = sum(leaves_with[r] * pieces[r][0] for r in leaves_with)
        options.append((len(used), cost, [-n for n in lengths], lengths))
  enough = min(cost for _, cost, _, _ in options) + _SPARE_BYTES * row_bytes
  return min(option for option in options if option[1] <= enough)[-1]


@functools.lru_cache(maxsize=256)
def plan(sizes: tuple[int, ...], rows: int, block_size: int) -> Plan:
  """The bucket layout of leaves of `sizes` elements (0: not sent) over `rows` rows.

  Example:
    >>> p = plan((4096, 96, 0), rows=1, block_size=2048)
    >>> p.block_lens, p.blocks, p.leaves[2]
    ((2048, 32), (2, 3), None)
  """
  unit = quant.PACK_UNIT
  full = unit * max(1, math.ceil(block_size / unit))
  row_lens = [layout.shard_len(size, rows) for size in sizes if size]
  short = _short_blocks([n % full for n in row_lens], full, any(n >= full for n in row_lens),
                        sum(row_lens) * _PAD_BYTES)
  pieces_by_leaf = []
  for size in sizes:
    if not size:
      pieces_by_leaf.append(None)
      continue
    row_len = layout.shard_len(size, rows)
    lengths = [full] * (row_len // full)
    rest = row_len - len(lengths) * full
    if rest:
      lengths += _remainder_pieces(rest, full, short)[1]
    pieces_by_leaf.append((size, row_len, lengths))
  block_lens = sorted({n for leaf in pieces_by_leaf if leaf for n in leaf[2]}, reverse=True)
  index = {n: c for c, n in enumerate(block_lens)}
  counts = [0] * len(block_lens)
  leaves = []
  for leaf in pieces_by_leaf:
    if leaf is None:
      leaves.append(None)
      continue
    size, row_len, lengths = leaf
    pieces, start = [], 0
    for n in lengths:  # runs of equal lengths make one piece
      c = index[n]
      if pieces and pieces[-1].bucket == c:
        pieces[-1] = pieces[-1]._replace(blocks=pieces[-1].blocks + 1)
      else:
        pieces.append(Piece(c, start, counts[c], 1))
      counts[c] += 1
      start += n
    leaves.append(LeafPlan(size, row_len, tuple(pieces)))
  return Plan(rows, tuple(block_lens), tuple(counts), tuple(leaves))


def _padded_rows(flat: jax.Array, leaf: LeafPlan, rows: int, width: int) -> jax.Array:
  """[size] -> [rows, width], zero-padded: the leaf's rows, each padded to its pieces' length."""
  x = jnp.pad(flat, (0, rows * leaf.row_len - leaf.size)).reshape(rows, leaf.row_len)
  return jnp.pad(x, ((0, 0), (0, width - leaf.row_len))) if width > leaf.row_len else x


def _concatenated(parts: list[list], dtype) -> list[jax.Array]:
  """Per bucket, its pieces ([rows, blocks, width] each, in block order) -> the bucket."""
  return [(jnp.concatenate(pieces, axis=1) if len(pieces) > 1 else pieces[0]).astype(dtype)
          for pieces in parts]


def to_buckets(flats: Sequence[jax.Array | None], p: Plan) -> list[jax.Array]:
  """Flat leaves ([size] each, None where not sent) -> buckets [rows, blocks, len], padded
  with zeros."""
  parts = [[] for _ in p.block_lens]
  dtype = jnp.float32
  for flat, leaf in zip(flats, p.leaves):
    if leaf is None:
      continue
    dtype = flat.dtype
    width = sum(q.blocks * p.block_lens[q.bucket] for q in leaf.pieces)
    x = _padded_rows(flat, leaf, p.rows, width)
    for q in leaf.pieces:
      n = p.block_lens[q.bucket]
      parts[q.bucket].append(x[:, q.start: q.start + q.blocks * n].reshape(p.rows, q.blocks, n))
  return _concatenated(parts, dtype)


def starts(p: Plan, count: jax.Array) -> list[list | None]:
  """Each leaf's pieces' first blocks, for `from_buckets`, `shards` and `scales_from_buckets`
  (`workarounds.opaque_offsets` of the step counter `count`)."""
  block_starts = [[q.block0 for q in leaf.pieces] if leaf else [] for leaf in p.leaves]
  flat = workarounds.opaque_offsets([b for f in block_starts for b in f], count)
  out, at = [], 0
  for f, leaf in zip(block_starts, p.leaves):
    out.append(flat[at: at + len(f)] if leaf else None)
    at += len(f)
  return out


def leaf_rows(buckets: Sequence[jax.Array], leaf: LeafPlan, first_blocks: list) -> jax.Array:
  """One leaf's rows out of buckets [rows, blocks, width] -> [rows, sum of its blocks' widths].

  With values (width = block length) that is the leaf's padded rows; with [rows, blocks, 1]
  scales, its blocks' scales in order. `first_blocks`: its pieces' (`starts`).
  """
  # The offsets are never negative: no wrapping of negative indices to trace and compile.
  parts = [jax.lax.dynamic_slice_in_dim(buckets[q.bucket], first, q.blocks, axis=1,
                                        allow_negative_indices=False).reshape(
      buckets[q.bucket].shape[0], -1) for q, first in zip(leaf.pieces, first_blocks)]
  return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)


def from_buckets(buckets: Sequence[jax.Array], p: Plan,
                 first_blocks: list) -> list[jax.Array | None]:
  """Inverse of `to_buckets`: buckets [rows, blocks, len] -> flat leaves [size] (None where not
  sent). `first_blocks`: `starts(p, ...)`."""
  return [None if leaf is None else
          leaf_rows(buckets, leaf, first)[:, : leaf.row_len].reshape(-1)[: leaf.size]
          for leaf, first in zip(p.leaves, first_blocks)]


def shards(buckets: Sequence[jax.Array], p: Plan, first_blocks: list) -> list[jax.Array | None]:
  """This device's averaged bucket shards ([blocks * len] each) -> its shard of each leaf,
  [row_len] (layout.shard_len: the per-leaf shard layout of sharded optimizers)."""
  one_row = [b.reshape(1, n, -1) for b, n in zip(buckets, p.blocks)]
  return [None if leaf is None else leaf_rows(one_row, leaf, first)[0, : leaf.row_len]
          for leaf, first in zip(p.leaves, first_blocks)]


def scales_from_buckets(buckets: Sequence[jax.Array], p: Plan,
                        first_blocks: list) -> list[jax.Array | None]:
  """Block scales per bucket [rows, blocks] -> per leaf [rows * blocks] (its rows' blocks in
  order, as the values' `from_buckets`)."""
  with_width = [b.reshape(p.rows, -1, 1) for b in buckets]
  return [None if leaf is None else leaf_rows(with_width, leaf, first).reshape(-1)
          for leaf, first in zip(p.leaves, first_blocks)]
