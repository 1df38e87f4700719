"""Byte framing for every exchange: [rows, ...] arrays of any dtype side by side in one uint8
buffer [rows, bytes], and cut back out of what arrives (a gather's rows outnumber the sent)."""

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np


class Part(NamedTuple):
  """One framed array: its dtype and the shape of one of its rows."""
  dtype: np.dtype
  shape: tuple[int, ...]

  @property
  def nbytes(self) -> int:
    return int(np.prod(self.shape, dtype=int)) * self.dtype.itemsize


def to_bytes(x: jax.Array) -> jax.Array:
  """[rows, ...] of any dtype -> [rows, nbytes] uint8: a bitcast, no conversion."""
  rows = x.shape[0]
  if x.dtype.itemsize == 1:
    return jax.lax.bitcast_convert_type(x.reshape(rows, -1), jnp.uint8)
  return jax.lax.bitcast_convert_type(x, jnp.uint8).reshape(rows, -1)


def from_bytes(b: jax.Array, dtype, shape: Sequence[int] = (-1,)) -> jax.Array:
  """Inverse of `to_bytes`: [rows, nbytes] uint8 -> `[rows, *shape]` of `dtype`."""
  dtype = np.dtype(dtype)
  rows = b.shape[0]
  if dtype.itemsize == 1:
    return jax.lax.bitcast_convert_type(b.reshape(rows, *shape), dtype)
  return jax.lax.bitcast_convert_type(b.reshape(rows, *shape, dtype.itemsize), dtype)


def frame(parts: Sequence[jax.Array], unit=jnp.uint8) -> tuple[jax.Array, list[Part]]:
  """[rows, ...] arrays (one row count) -> (their bytes [rows, ...] in `unit` words, what `unframe`
  needs). A wider `unit` (its size dividing a row's bytes) shows the wire's values as they are:
  uint16 for 16-bit floats, int32 for indices and float32 values."""
  layout = [Part(np.dtype(p.dtype), tuple(p.shape[1:])) for p in parts]
  return from_bytes(jnp.concatenate([to_bytes(p) for p in parts], axis=1), unit), layout


def cut(x: jax.Array, widths: Sequence[int]) -> list[jax.Array]:
  """[rows, sum(widths)] -> [rows, w] per width."""
  out, at = [], 0
  for w in widths:
    out.append(x[:, at: at + w])
    at += w
  return out


def unframe(buffer: jax.Array, layout: Sequence[Part]) -> list[jax.Array]:
  """Inverse of `frame` on a received buffer [rows', ...]: each part as `[rows', *shape]`."""
  return [from_bytes(b, p.dtype, p.shape)
          for b, p in zip(cut(to_bytes(buffer), [p.nbytes for p in layout]), layout)]
