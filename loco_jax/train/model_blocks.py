"""A param's blocks over the model axes: joined into the whole param, and cut again for a mesh
of another shape over them (train/reshard.py).

A param split as P(None, "model") on a mesh with model=2 is held as 2 blocks, one a device
position over the model axes; block b holds the part at index b of each split dimension, the
blocks in the order of the devices over the spec's axes (row-major, as jax lays them out). A
mesh without a model axis splits nothing: one block, the whole param.
"""

import math
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from loco_jax.core import layout
from loco_jax.core.local_blocks import entry_axes, spec_axes
from loco_jax.train.checkpoint_record import spec_of
from loco_jax.train.mesh_change import train_layout_in
from loco_jax.transforms import merge as merges


class Split(NamedTuple):
  """A param of `shape` cut into `parts[d]` parts along each dimension d, over `axes`."""
  shape: tuple[int, ...]
  parts: tuple[int, ...]
  axes: tuple[str, ...]      # the model axes that split it, in spec order (those of size > 1)

  @property
  def blocks(self) -> int:
    return math.prod(self.parts)

  @property
  def local(self) -> tuple[int, ...]:
    """One block's shape."""
    return tuple(n // p for n, p in zip(self.shape, self.parts))

  def block_at(self, where: dict[str, int], sizes: dict[str, int]) -> int:
    """The block of the device at `where` (an index along each model axis)."""
    return int(np.ravel_multi_index([where[a] for a in self.axes],
                                    [sizes[a] for a in self.axes])) if self.axes else 0


def split_of(shape: tuple[int, ...], spec: P, sizes: dict[str, int], where: str) -> Split:
  """How `spec` splits a param of `shape` on a mesh of axis `sizes` (an axis absent: size 1).

  Example:
    >>> split_of((16, 32), P(None, "model"), {"data": 4, "model": 2}, "w")
    Split(shape=(16, 32), parts=(1, 2), axes=('model',))
  """
  entries = list(spec) + [None] * (len(shape) - len(spec))
  if len(entries) != len(shape):
    raise ValueError(f"{where}: split as {spec}, more dimensions than its shape {list(shape)}")
  parts = tuple(math.prod(sizes.get(a, 1) for a in entry_axes(e)) for e in entries)
  if any(n % p for n, p in zip(shape, parts)):
    raise ValueError(f"{where}: shape {list(shape)} split as {spec} over {sizes}: a dimension "
                     f"is not divisible by its parts {list(parts)}")
  return Split(tuple(shape), parts, tuple(a for a in spec_axes(spec) if sizes.get(a, 1) > 1))


def join(blocks: list[np.ndarray], split: Split) -> np.ndarray:
  """Each block's values (flat, `split.blocks` of them, in block order) -> the whole param.

  Example:
    >>> split = split_of((2, 4), P(None, "model"), {"model": 2}, "w")
    >>> join([np.float32([0, 1, 4, 5]), np.float32([2, 3, 6, 7])], split).tolist()
    [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0]]
  """
  rank = len(split.shape)
  x = np.stack([np.asarray(b) for b in blocks]).reshape(*split.parts, *split.local)
  return x.transpose([i for d in range(rank) for i in (d, rank + d)]).reshape(split.shape)


def cut(whole: np.ndarray, split: Split) -> list[np.ndarray]:
  """`join`'s inverse: the whole param -> each block's values, flat, in block order."""
  rank = len(split.shape)
  x = np.asarray(whole).reshape([n for pair in zip(split.parts, split.local) for n in pair])
  x = x.transpose([2 * d for d in range(rank)] + [2 * d + 1 for d in range(rank)])
  return list(x.reshape(split.blocks, -1))


class ModelBlocks(NamedTuple):
  """The params' splits over the model axes in a checkpoint and now (`train_layout`'s specs and
  shapes), in the params' tree order: what re-lays a state for another shape over the model
  axes. `sizes`: each mesh's axis sizes (an axis it lacks: 1)."""
  paths: tuple[str, ...]
  old: tuple[Split, ...]
  new: tuple[Split, ...]
  old_sizes: dict[str, int]
  new_sizes: dict[str, int]
  axes: tuple[str, ...]       # the model axes of either mesh
  treedef: Any                # the params' tree

  def select(self, indices: list[int]) -> "ModelBlocks":
    """The blocks of the params at `indices` only (a DiLoCo fragment's)."""
    pick = lambda xs: tuple(xs[i] for i in indices)
    return self._replace(paths=pick(self.paths), old=pick(self.old), new=pick(self.new))

  def positions(self, new: bool) -> list[dict[str, int]]:
    """Every device position over the model axes of the mesh (row-major)."""
    sizes = self.new_sizes if new else self.old_sizes
    counts = [sizes.get(a, 1) for a in self.axes]
    return [dict(zip(self.axes, at)) for at in np.ndindex(*counts)]

  def recut(self, i: int, blocks_at: list) -> list:
    """Param i's values at each old position (flat, of its old block) -> at each new one (a
    leaf held by none, None or empty, stays so)."""
    old, new = self.old[i], self.new[i]
    if blocks_at[0] is None or np.size(blocks_at[0]) == 0:
      return [blocks_at[0]] * len(self.positions(True))
    first = {}
    for at, x in zip(self.positions(False), blocks_at):
      first.setdefault(old.block_at(at, self.old_sizes), x)
    whole = join([first[b] for b in range(old.blocks)], old)
    pieces = cut(whole, new)
    return [pieces[new.block_at(at, self.new_sizes)] for at in self.positions(True)]


def model_blocks(saved_config: dict, config: dict, saved_mesh: list, mesh: list,
                 params_like: Any) -> ModelBlocks:
  """The params' model blocks in a checkpoint (its config and mesh) and now, from the
  `train_layout` in both configs; `params_like`: the params' tree (its key paths). A
  ValueError where a config lacks it."""
  layouts = [train_layout_in(c) for c in (saved_config, config)]
  if any(layout is None or "shapes" not in layout for layout in layouts):
    raise ValueError("the model axes change shape: put checkpoint.train_layout(mesh, params, "
                     "mode=...) in the config, of the checkpoint and now: it tells each "
                     "param's shape and split")
  paths = tuple(jax.tree_util.keystr(p) for p, _ in
                jax.tree_util.tree_flatten_with_path(params_like)[0])
  old, new = layouts
  missing = [p for p in paths if p not in new["shapes"] or p not in old["params"]]
  if missing:
    raise ValueError(f"the train_layout in the config has no param {missing[0]}: make it from "
                     f"the params the state was made from")
  sizes = [dict(m) for m in (saved_mesh, mesh)]
  axes = tuple(dict.fromkeys(a for m in (saved_mesh, mesh) for a, _ in m
                             if a not in new["data axes"]))
  splits = [tuple(split_of(tuple(layout["shapes"][p]), spec_of(layout["params"][p]), s, p)
                  for p in paths) for layout, s in zip(layouts, sizes)]
  return ModelBlocks(paths, *splits, *sizes, axes, jax.tree.structure(params_like))


def recut_rows(x: np.ndarray, split: tuple[Split, Split], devices: tuple[int, int],
               where: str) -> np.ndarray:
  """A master shard (zero2's, `train/shards.py`) of a param split `split[0]` over the model axes
  and over `devices[0]` devices of the data axes -> split `split[1]` over `devices[1]`: each
  block's rows joined, the blocks joined into the param and cut again, exactly."""
  (old, new), (d_old, d_new) = split, devices
  n_old, n_new = math.prod(old.local), math.prod(new.local)
  s_old, s_new = layout.shard_len(n_old, d_old), layout.shard_len(n_new, d_new)
  if x.shape != (d_old * old.blocks * s_old,):
    raise ValueError(f"{where}: shape checkpoint {list(x.shape)}: not the master shard of a "
                     f"param of shape {list(old.shape)} in {old.blocks} blocks over {d_old} "
                     f"devices ({d_old * old.blocks * s_old} elements): another model's state")
  rows = x.reshape(d_old, old.blocks, s_old).transpose(1, 0, 2).reshape(old.blocks, -1)
  if np.any(rows[:, n_old:]):
    raise ValueError(f"{where}: its rows hold values past the {n_old} elements of a block of "
                     f"the param: another model's state")
  pieces = np.stack(cut(join(list(rows[:, :n_old]), old), new))
  pieces = np.pad(pieces, ((0, 0), (0, d_new * s_new - n_new)))
  return pieces.reshape(new.blocks, d_new, s_new).transpose(1, 0, 2).reshape(-1)


def _part(shape: tuple, spec: P, at: dict[str, int], sizes: dict[str, int], where: str):
  """The index of what the device at `at` (an index along each mesh axis) holds of a global
  leaf of `shape` split as `spec`: a per-device state's leaves are split on dimension 0 only."""
  entries = tuple(spec)
  if any(entry_axes(e) for e in entries[1:]):
    raise ValueError(f"{where}: a leaf split as {spec}; expected a split of dimension 0 only")
  axes = entry_axes(entries[0]) if entries else ()
  counts = [sizes.get(a, 1) for a in axes]
  if math.prod(counts) == 1:
    return ...
  n, k = shape[0] // math.prod(counts), np.ravel_multi_index([at.get(a, 0) for a in axes], counts)
  return slice(int(k) * n, (int(k) + 1) * n)


def part(x: np.ndarray, spec: P, at: dict[str, int], sizes: dict[str, int],
         where: str) -> np.ndarray:
  """What the device at `at` holds of the global leaf `x`."""
  return np.asarray(x)[_part(np.shape(x), spec, at, sizes, where)]


def put(out: np.ndarray, value: np.ndarray, spec: P, at: dict[str, int],
        sizes: dict[str, int], where: str) -> None:
  """`part`'s inverse: the device at `at` holds `value` in the global leaf `out`."""
  index = _part(out.shape, spec, at, sizes, where)
  if np.shape(value) != out[index].shape:
    raise ValueError(f"{where}: a merge made a leaf of shape {np.shape(value)}, expected "
                     f"{list(out[index].shape)}, a device's part of {list(out.shape)}")
  out[index] = value


def reblocked(state: Any, specs: Any, like: Any, blocks: ModelBlocks, data: tuple[str, ...],
              where: str) -> Any:
  """A registered state (`transforms.merge`) re-laid for a mesh of another shape over the model
  axes: for each old model position, its data axes' devices merged by leaf; each param's
  blocks joined and cut again; for each new position, its devices' states made from them.
  `state` and `specs`: the checkpoint's global leaves (numpy) and their specs."""
  old_one, reblock = old_device(like, blocks, where), merges.merge_of(like).reblock
  xs, treedef = jax.tree.flatten(state)
  old_specs = treedef.flatten_up_to(specs)
  likes, like_def = jax.tree.flatten(like)
  new_specs = [l.sharding.spec for l in likes]
  one = one_device(like, blocks.new_sizes)
  grids = [_grid(data, s) for s in (blocks.old_sizes, blocks.new_sizes)]
  devices = merges.Devices(data, *[tuple(s[a] for a in data)
                                   for s in (blocks.old_sizes, blocks.new_sizes)])
  merged = [reblock.merged([treedef.unflatten([
      part(x, s, {**at, **d}, blocks.old_sizes, where) for x, s in zip(xs, old_specs)])
      for d in grids[0]], old_one, devices) for at in blocks.positions(False)]
  if any(len(v) != len(blocks.paths) for v in merged[0].leaves.values()):
    raise ValueError(f"{where}: a {type(like).__name__} of other params than the train "
                     f"layout's {len(blocks.paths)}: another model's state")
  fields = {f: [blocks.recut(i, [m.leaves[f][i] for m in merged])
                for i in range(len(blocks.paths))] for f in merged[0].leaves}
  rest = jax.tree.map(lambda *xs: merges.mean(list(xs)), *[m.rest for m in merged])
  outs = [np.zeros(l.shape, l.dtype) for l in likes]
  for q, at in enumerate(blocks.positions(True)):
    by_leaf = merges.ByLeaf({f: [v[q] for v in values] for f, values in fields.items()}, rest)
    for d, new in zip(grids[1], reblock.states(by_leaf, one, devices)):
      for out, value, s in zip(outs, like_def.flatten_up_to(new), new_specs):
        put(out, np.asarray(value), s, {**at, **d}, blocks.new_sizes, where)
  return like_def.unflatten(outs)


def one_device(like: Any, sizes: dict[str, int]) -> Any:
  """One device's part of a state whose leaves are split on dimension 0 (ShapeDtypeStructs)."""
  def local(l):
    index = _part(l.shape, l.sharding.spec, {}, sizes, "a state leaf")
    shape = l.shape if index is ... else (index.stop - index.start, *l.shape[1:])
    return jax.ShapeDtypeStruct(tuple(shape), l.dtype)
  return jax.tree.map(local, like)


def old_device(like: Any, blocks: ModelBlocks, where: str) -> Any:
  """One old device's part of a registered state (ShapeDtypeStructs), `like` on the new mesh:
  laid out for the params' old blocks."""
  reblock = merges.merge_of(like).reblock
  if reblock is None:
    raise ValueError(f"{where}: a {type(like).__name__} is re-laid for other sizes of the data "
                     f"axes only, not for another shape over the model axes")
  covered = len(getattr(getattr(like, "signature", None), "shapes", blocks.paths))
  if covered != len(blocks.paths):
    raise ValueError(f"{where}: a {type(like).__name__} of {covered} params, but the train "
                     f"layout has {len(blocks.paths)}: another model's state")
  return reblock.old_like(one_device(like, blocks.new_sizes), [s.local for s in blocks.old],
                          [s.axes for s in blocks.old])


def _grid(axes: tuple[str, ...], sizes: dict[str, int]) -> list[dict[str, int]]:
  """Every device position over `axes` (row-major), as `merge.Devices` numbers them."""
  return [dict(zip(axes, at)) for at in np.ndindex(*[sizes[a] for a in axes])]
