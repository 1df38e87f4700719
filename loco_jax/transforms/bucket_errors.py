"""LoCo's bucketed errors (one group's buckets over its rows, `core.buckets`) decoded per leaf
and encoded again: what `transforms.merge` averages, joins and cuts for another mesh."""

import math
from typing import Any, Callable, NamedTuple

import jax.numpy as jnp
import numpy as np

from loco_jax.core import buckets, quant


class Storage(NamedTuple):
  """How LoCo laid its error out (`loco_state.bucket_layout`, the signature's layout)."""
  block_size: int
  axes: tuple[str, ...]
  groups: tuple            # ((group key, its leaves' indices), ...)
  error_bits: int
  error_scale: float | None


def storage_of(signature: Any, name: str) -> Storage:
  """The layout `name`'s state recorded in its signature; a ValueError where it has none."""
  found = dict(getattr(signature, "layout", ()) or ())
  if set(found) != set(Storage._fields):
    raise ValueError(f"{name}: the state does not say how its buckets are laid out (no "
                     f"bucket layout in its signature): make the state to restore into with "
                     f"this version's {name}(...).init")
  return Storage(**found)


def group_plan(signature: Any, indices: tuple, rows: int, storage: Storage,
               sizes: Callable[[int], int] = lambda size: size) -> buckets.Plan:
  """The group's bucket layout over `rows` devices (`sizes`: a leaf's elements -> those sent)."""
  return buckets.plan(tuple(sizes(math.prod(shape)) if i in indices else 0
                            for i, shape in enumerate(signature.shapes)),
                      rows, storage.block_size)


def _values(codes: list, scales: list | None, plan: buckets.Plan, rows: int,
            storage: Storage) -> list[np.ndarray]:
  """int8 buckets of `rows` rows and their block scales -> float32 [rows, blocks, len] each."""
  out = []
  for c, (b, n) in enumerate(zip(plan.blocks, plan.block_lens)):
    q = np.asarray(codes[c]).reshape(rows, b, n)
    s = (np.full((rows, b), storage.error_scale, np.float32) if scales is None
         else np.asarray(scales[c], np.float32).reshape(rows, b))
    out.append(np.asarray(quant.decompress(jnp.asarray(q), jnp.asarray(s)[..., None])))
  return out


def _per_leaf(values: list, plan: buckets.Plan) -> list:
  """Buckets [rows, blocks, len] -> each leaf's flat values (None: not in the plan)."""
  firsts = [[q.block0 for q in leaf.pieces] if leaf else None for leaf in plan.leaves]
  return [None if x is None else np.asarray(x)
          for x in buckets.from_buckets([jnp.asarray(v) for v in values], plan, firsts)]


def encoded(per_leaf: list, plan: buckets.Plan, storage: Storage) -> tuple[list, list | None]:
  """Each leaf's flat float values -> int8 buckets [rows, blocks, len] and block scales
  [rows, blocks] (None with a fixed error scale), as LoCo's step stores its error."""
  values = buckets.to_buckets([None if x is None else jnp.asarray(x, jnp.float32)
                               for x in per_leaf], plan)
  codes, scales = [], []
  for x in values:
    s = (quant.absmax_scale(x, storage.error_bits) if storage.error_scale is None
         else jnp.full(x.shape[:-1], storage.error_scale, jnp.float32))
    codes.append(np.asarray(quant.compress(x, s[..., None], storage.error_bits)))
    scales.append(np.asarray(s))
  return codes, None if storage.error_scale is not None else scales


def check_buckets(name: str, codes: tuple, plan: buckets.Plan, rows: int, key: str) -> None:
  """A ValueError where a checkpoint's error buckets of group `key` are not `plan`'s."""
  have = [tuple(np.shape(c)) for c in codes]
  want = [(rows * b * n,) for b, n in zip(plan.blocks, plan.block_lens)]
  if have != want:
    raise ValueError(f"{name}: the checkpoint's error buckets of group {key!r} have shapes "
                     f"{have}, but this {name} (block size {plan.block_lens[:1]}) over "
                     f"{plan.rows} devices needs {want}: the state of another model or "
                     f"transformation")


def mean_error(errors: list, plan: buckets.Plan, rows: int, storage: Storage) -> list:
  """Devices' (codes, scales) of their whole error -> its mean per leaf (float64 -> float32)."""
  leaves = [_per_leaf(_values(c, s, plan, rows, storage), plan) for c, s in errors]
  return [None if x is None else np.mean(np.stack(
      [np.asarray(d[i], np.float64) for d in leaves]), axis=0).astype(np.float32)
          for i, x in enumerate(leaves[0])]


def shard_error(rows: list, plan: buckets.Plan, storage: Storage) -> list:
  """Each row's device's (codes [blocks * len], scales [blocks]) of its shard's error -> one
  error per leaf of the whole of it (row r: the shard device r averages)."""
  codes = [np.stack([np.asarray(r[0][c]) for r in rows]) for c in range(len(plan.blocks))]
  scales = (None if rows[0][1] is None else
            [np.stack([np.asarray(r[1][c]) for r in rows]) for c in range(len(plan.blocks))])
  return _per_leaf(_values(codes, scales, plan, len(rows), storage), plan)


def as_stored(codes: list, scales: list | None, row: int | None = None) -> tuple:
  """Buckets (all rows, or one) as the state stores them: flat arrays, one per bucket."""
  take = (lambda x: x.reshape(-1)) if row is None else (lambda x: x[row].reshape(-1))
  return tuple(map(take, codes)), None if scales is None else tuple(map(take, scales))
