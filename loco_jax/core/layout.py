"""How a flattened leaf lies on the wire: rows (one per device), blocks, block length."""

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from loco_jax.core import quant

AxisName = str | tuple[str, ...]


class LeafLayout(NamedTuple):
  """How one flattened leaf of `size` elements lies on the wire: rows x blocks x block_len.

  Row j is the shard device j averages: `row_len` (`shard_len`) elements of the zero-padded
  leaf, whatever the block size, so that parameter and gradient shards line up. Each row is cut
  into `blocks` blocks of `block_len` elements (a multiple of 8) with one scale each.
  """
  size: int
  rows: int
  row_len: int
  blocks: int
  block_len: int

  @property
  def padded(self) -> int:
    return self.rows * self.blocks * self.block_len


def shard_len(size: int, rows: int) -> int:
  """Elements of each device's shard of a leaf of `size` elements: ceil(size / rows), to 8."""
  return quant.PACK_UNIT * max(math.ceil(size / rows / quant.PACK_UNIT), 1)


def leaf_layout(size: int, rows: int, block_size: int | None) -> LeafLayout:
  """Near-equal blocks of at most about `block_size` elements (None: one block per row)."""
  row_len = shard_len(size, rows)
  blocks = 1 if block_size is None else math.ceil(row_len / block_size)
  block_len = quant.PACK_UNIT * math.ceil(row_len / blocks / quant.PACK_UNIT)
  return LeafLayout(size, rows, row_len, blocks, block_len)


def shard_rows(flat: jax.Array, layout: LeafLayout) -> jax.Array:
  """[size] -> [rows, row_len], zero-padded: row j is device j's shard."""
  return jnp.pad(flat, (0, layout.rows * layout.row_len - layout.size)).reshape(layout.rows, -1)


def to_rows(flat: jax.Array, layout: LeafLayout) -> jax.Array:
  """[size] -> [rows, blocks, block_len], zero-padded."""
  rows = jnp.pad(shard_rows(flat, layout),
                 ((0, 0), (0, layout.blocks * layout.block_len - layout.row_len)))
  return rows.reshape(layout.rows, layout.blocks, layout.block_len)


def from_rows(rows: jax.Array, layout: LeafLayout) -> jax.Array:
  """[rows, blocks, block_len] -> [size]; also [rows, row_len] -> [size]."""
  rows = rows.reshape(layout.rows, -1)[:, : layout.row_len]
  return rows.reshape(-1)[: layout.size]
