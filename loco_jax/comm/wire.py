"""Chunked collectives: an all-to-all or all-gather cut into pieces of at most N bytes a peer.

Why: over gloo (XLA:CPU across processes) the two directions of a TCP pair take turns, so a
large collective moves at about half the duplex rate; cut into a sequence of smaller ones, an
all-to-all came back to ~90% of a 1 Gb/s link (docs/results/network.md). Each collective costs a few
milliseconds to set up, so a piece must not be too small either.

`chunk_bytes()` chunks cross-process CPU collectives at DEFAULT_CPU_CHUNK_BYTES a peer and runs
GPU, TPU and in-process CPU ones whole. Override it with `chunking(nbytes)` at trace time or
LOCO_JAX_WIRE_CHUNK_BYTES (a byte count, or "none"). The pieces are separate collectives whose
bytes add up to the whole one's, and the result is the same bit for bit.

`reduce_scatter` where pieces are cut is an all-to-all and a local sum: gloo's own sends +8.7%
more bytes at 4 hosts (docs/results/network.md).
"""

import contextlib
import math
import os
from typing import Iterator

import jax
import jax.numpy as jnp

AxisName = str | tuple[str, ...]
ENV = "LOCO_JAX_WIRE_CHUNK_BYTES"
# 2 hosts, all-to-all at 1 Gb/s / 100 Mb/s: 256 KB pieces (docs/results/network.md has the sweep).
DEFAULT_CPU_CHUNK_BYTES = 256 * 1024
_override: list[int | None] = []


def _check(nbytes) -> int | None:
  if nbytes is None:
    return None
  if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 1:
    raise ValueError(f"a chunk size must be a positive number of bytes or None (no "
                     f"chunking), got {nbytes!r}")
  return nbytes


def _from_env(text: str) -> int | None:
  if text.strip().lower() in ("none", "0", ""):
    return None
  try:
    return _check(int(text))
  except ValueError:
    raise ValueError(f"{ENV} must be a positive byte count or 'none', got {text!r}") from None


def chunk_bytes(backend: str | None = None, processes: int | None = None) -> int | None:
  """The most bytes one collective piece sends to one peer here; None: collectives run whole.

  The innermost `chunking(...)` wins, then LOCO_JAX_WIRE_CHUNK_BYTES, then the backend's
  default: DEFAULT_CPU_CHUNK_BYTES for CPU collectives across processes (gloo), else None.

  Example:
    >>> from loco_jax.comm import wire
    >>> with wire.chunking(1 << 20):
    ...   wire.chunk_bytes()
    1048576
  """
  if _override:
    return _override[-1]
  if ENV in os.environ:
    return _from_env(os.environ[ENV])
  backend = backend or jax.default_backend()
  processes = jax.process_count() if processes is None else processes
  return DEFAULT_CPU_CHUNK_BYTES if backend == "cpu" and processes > 1 else None


@contextlib.contextmanager
def chunking(nbytes: int | None) -> Iterator[None]:
  """Collectives traced inside are cut into pieces of at most `nbytes` a peer (None: whole)."""
  _override.append(_check(nbytes))
  try:
    yield
  finally:
    _override.pop()


def _piece_lengths(length: int, unit_bytes: int, chunk: int | None) -> list[int]:
  """`length` units of `unit_bytes` each, split into near-equal pieces of at most `chunk` bytes."""
  if chunk is None or length * unit_bytes <= chunk:
    return [length]
  pieces = min(length, math.ceil(length * unit_bytes / chunk))
  base, extra = divmod(length, pieces)
  return [base + (i < extra) for i in range(pieces)]


def _split(x: jax.Array, lengths: list[int], axis: int) -> list[jax.Array]:
  starts = [sum(lengths[:i]) for i in range(len(lengths))]
  return [jax.lax.slice_in_dim(x, s, s + n, axis=axis) for s, n in zip(starts, lengths)]


def all_to_all(x_NxC: jax.Array, axis_name: AxisName,
               chunk: int | None = None) -> jax.Array:
  """`jax.lax.all_to_all(x, axis_name, 0, 0, tiled=True)` on [N, C] rows (row j goes to
  device j), as pieces of at most `chunk` bytes a peer (default `chunk_bytes()`)."""
  chunk = chunk_bytes() if chunk is None else _check(chunk)
  if x_NxC.ndim != 2:
    raise ValueError(f"wire.all_to_all takes [devices, columns] rows, got shape {x_NxC.shape}")
  lengths = _piece_lengths(x_NxC.shape[1], x_NxC.dtype.itemsize, chunk)
  pieces = [jax.lax.all_to_all(p, axis_name, 0, 0, tiled=True)
            for p in _split(x_NxC, lengths, 1)]
  return pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces, axis=1)


def all_gather(x: jax.Array, axis_name: AxisName, chunk: int | None = None) -> jax.Array:
  """`jax.lax.all_gather(x, axis_name, axis=0, tiled=True, to="invarying")`, as pieces of at
  most `chunk` bytes (default `chunk_bytes()`): each device's x is cut along its flattened
  elements, and the gathered pieces are put back in device order."""
  chunk = chunk_bytes() if chunk is None else _check(chunk)
  if x.ndim == 0:
    raise ValueError("wire.all_gather gathers along axis 0: x needs at least one axis")
  lengths = _piece_lengths(x.size, x.dtype.itemsize, chunk)
  if len(lengths) == 1:
    return jax.lax.all_gather(x, axis_name, axis=0, tiled=True, to="invarying")
  pieces = [jax.lax.all_gather(p, axis_name, axis=0, tiled=False, to="invarying")
            for p in _split(x.reshape(-1), lengths, 0)]
  gathered_NxS = jnp.concatenate(pieces, axis=1)
  return gathered_NxS.reshape(-1, *x.shape[1:])


def reduce_scatter(x_NxC: jax.Array, axis_name: AxisName,
                   chunk: int | None = None) -> jax.Array:
  """Row j of every device's [N, C] summed, on device j: `jax.lax.psum_scatter(x, axis_name,
  scatter_dimension=0, tiled=True)` as [1, C] when collectives run whole; where they are cut
  into pieces (`chunk_bytes()`, gloo) an all-to-all of the rows in pieces, then their sum in
  device order (the same sum within float rounding), each peer sent exactly its row."""
  chunk = chunk_bytes() if chunk is None else _check(chunk)
  if x_NxC.ndim != 2:
    raise ValueError(f"wire.reduce_scatter takes [devices, columns] rows, got shape "
                     f"{x_NxC.shape}")
  if chunk is None:
    return jax.lax.psum_scatter(x_NxC, axis_name, scatter_dimension=0, tiled=True)
  received_NxC = all_to_all(x_NxC, axis_name, chunk)
  total = received_NxC[0]
  for row in range(1, received_NxC.shape[0]):  # quant.sum_rows: XLA:CPU reduces axis 0 slowly
    total = total + received_NxC[row]
  return total[None]
