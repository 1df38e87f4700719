"""Test helper: a train state's per-device compression errors decoded into whole params (numpy),
one per device of the data axis, written apart from train/reshard.py and transforms/merge.py.

Meshes are (data=D) or (data=D, model=K); a param is split over "model" on at most one
dimension (its spec in `specs`)."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from loco_jax import error_by_leaf
from loco_jax.core import buckets, quant
from loco_jax.core.leaves import ByGroup
from loco_jax.transforms.loco_state import GroupState, LocoState


def loco_leaves(state: LocoState, params: dict, rows: int, block_size: int,
                fixed: float | None = None) -> dict:
  """One device's LoCo error (its group "") per float leaf of `params`, flat, decoded as LoCo's
  step decodes it (float32 code times the reciprocal of its block's scale)."""
  codes, scales = error_by_leaf(state, params, block_size, rows)
  floats = [jnp.issubdtype(x.dtype, jnp.floating) for x in jax.tree.leaves(params)]
  plan = buckets.plan(tuple(x.size if f else 0 for x, f in zip(jax.tree.leaves(params), floats)),
                      rows, block_size)
  out = {}
  for k, leaf in zip(sorted(params), plan.leaves):
    if leaf is None:
      continue
    lens = [plan.block_lens[q.bucket] for q in leaf.pieces for _ in range(q.blocks)]
    block_of = np.repeat(np.arange(len(lens)), lens)[: leaf.row_len]
    q = np.pad(np.asarray(codes[k], np.float32), (0, rows * leaf.row_len - leaf.size))
    q = q.reshape(rows, leaf.row_len)
    s = (np.full(q.shape, fixed, np.float32) if fixed is not None else
         np.asarray(scales[k], np.float32).reshape(rows, -1)[:, block_of])
    step = np.asarray(quant.reciprocal(jnp.asarray(s)))
    out[k] = np.where(s > 0, q * step, np.float32(0)).reshape(-1)[: leaf.size]
  return out


def _split_dim(spec: P) -> int | None:
  return next((d for d, e in enumerate(spec) if e == "model"), None)


def _local(shape: tuple, spec: P, k: int) -> tuple:
  d = _split_dim(spec)
  return tuple(n // k if i == d and k > 1 else n for i, n in enumerate(shape))


def _whole(blocks: list, shape: tuple, spec: P) -> np.ndarray:
  """The blocks of one param over "model" (flat, in order) joined along its split dimension."""
  d, k = _split_dim(spec), len(blocks)
  if d is None or k == 1:
    return np.asarray(blocks[0]).reshape(shape)
  return np.concatenate([np.asarray(b).reshape(_local(shape, spec, k)) for b in blocks], axis=d)


def loco_errors(state: LocoState, shapes: dict, specs: dict, data: int, model: int,
                block_size: int, field: str = "error", fixed: float | None = None) -> list:
  """Each data row's LoCo error decoded into whole params {name: float32 array}.

  `field`: "error", or "gather_error" (each device's error of the shard it averages: the rows
  of a block's devices then make one error of each whole param, the same for every row)."""
  split = {k: model > 1 and _split_dim(specs[k]) is not None for k in shapes}
  scale_field = "error_scale" if field == "error" else "gather_scale"
  out = []
  for d in range(data):
    blocks = {k: [] for k in shapes}
    for m in range(model):
      for key, group in state.groups.items():
        in_group = {k: split[k] == bool(key) for k in shapes}
        parts = data * (model if key else 1)
        at = d * model + m if key else d
        take = lambda arrays: None if arrays is None else tuple(
            np.asarray(a).reshape(parts, -1)[at] for a in arrays)
        if field == "gather_error":  # every device of the block: its row of the buckets
          take = lambda arrays, m=m, key=key, parts=parts: None if arrays is None else tuple(
              np.asarray(a).reshape(data, model if key else 1, -1)[:, m if key else 0]
              .reshape(-1) for a in arrays)
        one = LocoState(state.count, ByGroup({"": GroupState(
            take(getattr(group, field)), take(getattr(group, scale_field)), None, None)}), None)
        params = {k: np.zeros(_local(shapes[k], specs[k], model) if split[k] else shapes[k],
                               np.float32 if in_group[k] else np.int32) for k in shapes}
        for k, x in loco_leaves(one, params, data, block_size, fixed).items():
          if in_group[k] and (split[k] or m == 0):
            blocks[k].append(x)
    out.append({k: _whole(b, shapes[k], specs[k]) for k, b in blocks.items()})
  return out


def float_errors(tree: dict, shapes: dict, specs: dict, data: int, model: int) -> list:
  """Each data row's float per-leaf state (flat leaves split over ("data", "model"), or "data"
  where a param is not split; `data`=1 for a leaf split over "model" only) joined into whole
  params {name: float32 array}."""
  out = []
  for d in range(data):
    row = {}
    for k, x in tree.items():
      split = model > 1 and _split_dim(specs[k]) is not None
      blocks = np.asarray(x).reshape(data, model if split else 1, -1)[d]
      row[k] = _whole(list(blocks), shapes[k], specs[k])
    out.append(row)
  return out
