"""Elastic resume: a state checkpointed on one mesh, re-laid for a mesh whose data axes have other
sizes, or whose model axes have another shape (`checkpoint.restore(..., reshard=True)`).

Each leaf is converted by what it holds, read from the state's types and specs:

- Split over no data axis (ddp's and DiLoCo's params, adamw's moments there, counters): a
  global array, the same on any mesh; restored as it is, placed with the new model split.
- A per-device field of a transformation's state (`transforms.specs`): merged by its type's
  merge (`transforms.merge`): LoCo's errors decoded, averaged and re-encoded, and so on.
- DiLoCo's workers and their inner optimizer states, stacked over the data axes: every new
  worker starts from the mean of the old ones. That keeps the pseudo-gradient the next sync
  averages, mean_i (params - worker_i), so the round's work so far is kept; at a sync every
  worker holds the global params, and so does every new one.
- Master shards (zero2's and fsdp's params and optimizer moments, any other leaf split over
  the data axes): each leaf's rows joined (per model block) and cut again for the new devices,
  exactly.

Where the model axes keep their shape, a leaf's blocks over them are re-laid each on its own.
Where they change (`model_blocks`: from the train_layout in both configs), a master shard's
blocks are joined into the whole param and cut again, exactly; a per-device state is merged
over the data axes block by block, by param leaf (`merge.Reblock`), each param's merged
blocks joined and cut again, and the new devices' states made from them.
"""

import math
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from loco_jax.core.local_blocks import entry_axes
from loco_jax.train import model_blocks
from loco_jax.train.checkpoint_record import mesh_text
from loco_jax.train.diloco import DilocoState, fragment_leaves
from loco_jax.train.mesh_change import model_changed
from loco_jax.train.model_blocks import ModelBlocks
from loco_jax.transforms import merge as merges
from loco_jax.transforms.specs import per_device_fields

class Resharded(NamedTuple):
  """How a restore re-laid a state saved on another mesh: the meshes, and per kind of leaf
  what was done to it (`str()` gives one line for a log)."""
  checkpoint_mesh: str          # "(data=8)"
  mesh: str                     # "(data=4)"
  data_axes: tuple[str, ...]
  how: tuple[str, ...]          # "what (at where): how", one per kind of leaf

  def __str__(self) -> str:
    return (f"resharded from {self.checkpoint_mesh} to {self.mesh} (data axes "
            f"{', '.join(self.data_axes)}): " + "; ".join(self.how))


class Restored(NamedTuple):
  """`checkpoint.restore(..., reshard=True)`'s result."""
  state: Any
  step: int
  resharded: Resharded | None   # None: the same mesh, restored as saved (bit for bit)


class _Meshes(NamedTuple):
  data: tuple[str, ...]
  old: dict[str, int]
  new: dict[str, int]

  def sizes(self, axes: tuple[str, ...]) -> tuple[int, int]:
    return (math.prod(self.old[a] for a in axes), math.prod(self.new[a] for a in axes))


def _spec(like: Any) -> P:
  sharding = getattr(like, "sharding", None)
  return sharding.spec if isinstance(sharding, NamedSharding) else P()


def _split(spec: P, sizes: dict, meshes: _Meshes, where: str) -> tuple[int, int] | None:
  """(the dimension `spec` splits over the data axes, the devices of the model axes after them
  there), None if it splits none. The data axes come first, in order; jax leaves out axes of
  size 1 (`sizes`: of the mesh `spec` is on)."""
  for dim, entry in enumerate(spec):
    axes = entry_axes(entry)
    data = tuple(a for a in axes if a in meshes.data)
    if not data:
      continue
    if (axes[:len(data)] != data or data != tuple(a for a in meshes.data if a in data)
        or any(sizes[a] > 1 for a in meshes.data if a not in data)):
      raise ValueError(f"{where} is split as {spec}: expected the data axes {meshes.data} "
                       f"first, in that order")
    return dim, math.prod(sizes[a] for a in axes[len(data):])
  return None


def _same_shape(x: np.ndarray, like: Any, where: str) -> np.ndarray:
  if tuple(x.shape) != tuple(like.shape):
    raise ValueError(f"{where}: shape checkpoint {list(x.shape)}, now {list(like.shape)}: it is "
                     f"split over no data axis, so the same on any mesh: another model's state")
  return x


def _rows(x: np.ndarray, split: tuple[int, int], like: Any, meshes: _Meshes,
          where: str) -> np.ndarray:
  """A master-shard-like leaf: per model block, the rows joined and cut again (zero padding)."""
  (dim, k), (d_old, d_new) = split, meshes.sizes(meshes.data)
  pre, post = x.shape[:dim], x.shape[dim + 1:]
  if (_split(_spec(like), meshes.new, meshes, where) != split
      or (pre, post) != (tuple(like.shape[:dim]), tuple(like.shape[dim + 1:]))
      or x.shape[dim] % (d_old * k) or like.shape[dim] % (d_new * k)):
    raise ValueError(f"{where}: shape checkpoint {list(x.shape)}, now {list(like.shape)}: not "
                     f"rows of one leaf over {d_old} and {d_new} devices")
  s_old, s_new = x.shape[dim] // (d_old * k), like.shape[dim] // (d_new * k)
  at, keep = len(pre), min(d_new * s_new, d_old * s_old)
  y = np.moveaxis(x.reshape(*pre, d_old, k, s_old, *post), at, at + 1)
  y = y.reshape(*pre, k, d_old * s_old, *post)
  if np.any(np.take(y, range(keep, d_old * s_old), axis=at + 1)):
    raise ValueError(f"{where}: its rows hold values past the {d_new * s_new} elements a leaf "
                     f"has now: another model's state")
  pad = [(0, 0)] * y.ndim
  pad[at + 1] = (0, d_new * s_new - keep)
  y = np.pad(np.take(y, range(keep), axis=at + 1), pad).reshape(*pre, k, d_new, s_new, *post)
  return np.moveaxis(y, at + 1, at).reshape(like.shape)


def _per_worker(x: np.ndarray, like: Any, meshes: _Meshes, where: str) -> np.ndarray:
  """DiLoCo's stacked workers (or their optimizer states): every new one the old ones' mean."""
  d_old, d_new = meshes.sizes(meshes.data)
  if x.shape[:1] != (d_old,) or tuple(like.shape) != (d_new, *x.shape[1:]):
    raise ValueError(f"{where}: shape checkpoint {list(x.shape)}, now {list(like.shape)}: not "
                     f"one row a worker of {d_old} and {d_new} workers")
  return np.broadcast_to(merges.mean(list(x)), like.shape).copy()


def _children(tree: Any) -> tuple[list, list[str], Any]:
  """A node's children, their key paths (keystr) and the node's treedef."""
  flat, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda n: n is not tree)
  return [x for _, x in flat], [jax.tree_util.keystr(p) for p, _ in flat], treedef


def _is_array(x: Any) -> bool:
  return x is not None and hasattr(x, "shape") and hasattr(x, "dtype")


def _per_device_mask(state: Any) -> list[bool]:
  """For each leaf of a registered state: whether it is in a per-device field."""
  fields = per_device_fields(state)
  return jax.tree.leaves(type(state)(*[jax.tree.map(lambda _, f=f: f in fields, v)
                                       for f, v in zip(state._fields, state)]))


def _splits_data(like: Any, meshes: _Meshes, where: str) -> bool:
  return merges.merge_of(like) is not None and any(
      per and _split(_spec(l), meshes.new, meshes, where) is not None
      for l, per in zip(jax.tree.leaves(like), _per_device_mask(like)))


class _View(NamedTuple):
  """A registered state's leaves as its devices hold them: `pre`, the stacked axes ahead of
  the devices (fsdp's layers); per leaf its model blocks' devices, 0 where not per device."""
  pre: tuple
  blocks: list[int]

  def local(self, shape: tuple, devices: int, k: int) -> tuple:
    """One device's shape of a leaf: [pre, devices * k * n, ...] -> [n, ...] (k = 0: [...])."""
    at = len(self.pre)
    return tuple(shape[at:]) if not k else (shape[at] // (devices * k), *shape[at + 1:])

  def devices(self, x: np.ndarray, devices: int, k: int) -> np.ndarray:
    """[b, devices, k, *local] (a replicated leaf: [b, *local])."""
    b = math.prod(self.pre)
    return x.reshape(b, *self.local(x.shape, devices, k)) if not k else x.reshape(
        b, devices, k, *self.local(x.shape, devices, k))


def _view(leaves: list, specs: list, mask: list, sizes: dict, meshes: _Meshes,
          where: str) -> _View:
  splits = [_split(s, sizes, meshes, where) if per else None for s, per in zip(specs, mask)]
  dims = {s[0] for s in splits if s is not None}
  if len(dims) != 1 or any(per and s is None for per, s in zip(mask, splits)):
    raise ValueError(f"{where}: its per-device fields are not all split over the data axes on "
                     f"one dimension (found {sorted(dims)})")
  pre = tuple(next(np.shape(x) for x, s in zip(leaves, splits) if s)[:dims.pop()])
  d = math.prod(sizes[a] for a in meshes.data)
  if any(tuple(np.shape(x)[:len(pre)]) != pre or s and np.shape(x)[len(pre)] % (d * s[1])
         for x, s in zip(leaves, splits)):
    raise ValueError(f"{where}: its leaves are not {d} devices' own after the stacked axes "
                     f"{pre}: another mesh's or model's state")
  return _View(pre, [0 if s is None else s[1] for s in splits])


def _one_device(like: Any, meshes: _Meshes, where: str) -> tuple[Any, _View]:
  """One new device's state (ShapeDtypeStructs) of a registered state, and its view."""
  likes, treedef = jax.tree.flatten(like)
  view = _view(likes, [_spec(l) for l in likes], _per_device_mask(like), meshes.new, meshes,
               where)
  d_new = meshes.sizes(meshes.data)[1]
  return treedef.unflatten([jax.ShapeDtypeStruct(view.local(tuple(l.shape), d_new, k), l.dtype)
                            for l, k in zip(likes, view.blocks)]), view


def _devices(meshes: _Meshes) -> merges.Devices:
  return merges.Devices(meshes.data, tuple(meshes.old[a] for a in meshes.data),
                        tuple(meshes.new[a] for a in meshes.data))


def _merged(state: Any, specs: Any, like: Any, meshes: _Meshes, where: str) -> Any:
  """A registered state's per-device fields merged (`transforms.merge`), per stacked layer and
  model block; `specs`: the checkpoint's specs of `state`'s leaves."""
  merge = merges.merge_of(like).merge
  xs, treedef = jax.tree.flatten(state)
  old_view = _view(xs, treedef.flatten_up_to(specs), _per_device_mask(state), meshes.old,
                   meshes, where)
  like_one, new_view = _one_device(like, meshes, where)
  likes, like_treedef = jax.tree.flatten(like)
  (d_old, d_new), b = meshes.sizes(meshes.data), math.prod(new_view.pre)
  if old_view.pre != new_view.pre:
    raise ValueError(f"{where}: stacked {old_view.pre} in the checkpoint, {new_view.pre} now")
  views = [old_view.devices(np.asarray(x), d_old, k) for x, k in zip(xs, old_view.blocks)]
  outs = [np.zeros((b, d_new, k, *l.shape) if k else (b, *l.shape), l.dtype)
          for l, k in zip(jax.tree.leaves(like_one), new_view.blocks)]
  for i in range(b):
    for kk in range(max(new_view.blocks)):
      olds = [treedef.unflatten([v[i, d, kk % k] if k else v[i] for v, k in
                                 zip(views, old_view.blocks)]) for d in range(d_old)]
      for j, new in enumerate(merge(olds, like_one, _devices(meshes))):
        for out, value, k in zip(outs, jax.tree.leaves(new), new_view.blocks):
          if np.shape(value) != out.shape[3 if k else 1:]:
            raise ValueError(f"{where}: its merge made a leaf of shape {np.shape(value)}, "
                             f"expected {out.shape[3 if k else 1:]}")
          if k:
            out[i, j, kk % k] = value
          elif j == 0:
            out[i] = value
  return like_treedef.unflatten([o.reshape(l.shape) for o, l in zip(outs, likes)])


_NEW_BLOCKS = ("per model block, by leaf: each param's blocks joined and cut again for the new "
               "model axes")


def _relay(state: Any, specs: Any, like: Any, meshes: _Meshes, where: str, notes: dict,
           blocks: ModelBlocks | None, param: int | None = None) -> Any:
  """`state` (numpy, the checkpoint's shapes; `specs` its specs) re-laid as `like` says;
  `notes` collects how. `blocks`: the params' model blocks where the model axes change shape
  (None where they keep it); `param`: the param a leaf of a tree like the params belongs to."""
  if _splits_data(like, meshes, where):
    what = f"{type(like).__name__} ({where or 'the state'})"
    if blocks is not None:
      notes.setdefault(what, merges.merge_of(like).how + "; " + _NEW_BLOCKS)
      return model_blocks.reblocked(state, specs, like, blocks, meshes.data, where)
    notes.setdefault(what, merges.merge_of(like).how)
    return _merged(state, specs, like, meshes, where)
  if isinstance(like, DilocoState):
    return _diloco(state, specs, like, meshes, where, notes, blocks)
  if _is_array(like):
    split = _split(specs, meshes.old, meshes, where)
    if split is None:
      return _same_shape(np.asarray(state), like, where)
    if blocks is None:
      notes["master shards"] = "rows joined and cut again for the new devices, exactly"
      return _rows(np.asarray(state), split, like, meshes, where)
    if param is None:
      raise ValueError(f"{where}: split over the data axes, but not a param's master shard: "
                       f"it cannot be re-laid for other model axes")
    notes["master shards"] = ("rows joined, each param's model blocks joined and cut again "
                              "for the new model axes and devices, exactly")
    return _same_shape(model_blocks.recut_rows(
        np.asarray(state), (blocks.old[param], blocks.new[param]), meshes.sizes(meshes.data),
        where), like, where)
  children, paths, treedef = _children(like)
  old, old_specs = treedef.flatten_up_to(state), treedef.flatten_up_to(specs)
  like_params = blocks is not None and treedef == blocks.treedef
  return treedef.unflatten([
      _relay(x, s, l, meshes, where + p, notes, blocks, i if like_params else param)
      for i, (x, s, l, p) in enumerate(zip(old, old_specs, children, paths))])


def _diloco(state: DilocoState, specs: DilocoState, like: DilocoState, meshes: _Meshes,
            where: str, notes: dict, blocks: ModelBlocks | None) -> DilocoState:
  """DiLoCo's workers and their optimizer states from their mean; each fragment's compressor
  state with its own params' blocks."""
  notes.setdefault("DiLoCo's workers and inner optimizer states",
                   "every new worker from the mean of the old ones: the pseudo-gradient the "
                   "next sync averages is kept")
  stacked = {f: jax.tree.map(lambda x, l: _per_worker(np.asarray(x), l, meshes, where),
                             getattr(state, f), getattr(like, f))
             for f in ("workers", "opt_state")}
  parts = [None] * len(like.compressor_state) if blocks is None else _fragments(like, blocks)
  compressors = tuple(_relay(x, s, l, meshes, f"{where}.compressor_state[{f}]", notes, b)
                      for f, (x, s, l, b) in enumerate(zip(state.compressor_state,
                                                           specs.compressor_state,
                                                           like.compressor_state, parts)))
  rest = {f: _relay(getattr(state, f), getattr(specs, f), getattr(like, f), meshes,
                    f"{where}.{f}", notes, blocks) for f in ("params", "outer_state", "step")}
  return DilocoState(**stacked, compressor_state=compressors, **rest)


def _paths(like: Any, meshes: _Meshes, where: str, blocks: ModelBlocks | None) -> Any:
  """`like`'s tree with each leaf's key path, each registered state laid out as it is on the
  old devices (`transforms.merge`'s layouts: LoCo's buckets depend on the device count and,
  with `blocks`, on the params' old model blocks)."""
  if _splits_data(like, meshes, where):
    one = (_one_device(like, meshes, where)[0] if blocks is None else
           model_blocks.old_device(like, blocks, where))
    old = merges.merge_of(like).layout(one, _devices(meshes))
    return jax.tree_util.tree_map_with_path(lambda p, _: where + jax.tree_util.keystr(p), old)
  if _is_array(like):
    return where
  if isinstance(like, DilocoState) and blocks is not None:
    return like._replace(compressor_state=tuple(
        _paths(c, meshes, f"{where}.compressor_state[{f}]", b)
        for f, (c, b) in enumerate(zip(like.compressor_state, _fragments(like, blocks)))),
        **{f: _paths(getattr(like, f), meshes, f"{where}.{f}", None)
           for f in like._fields if f != "compressor_state"})
  children, paths, treedef = _children(like)
  return treedef.unflatten([_paths(c, meshes, where + p, blocks) for c, p in zip(children, paths)])


def _fragments(like: DilocoState, blocks: ModelBlocks) -> list[ModelBlocks]:
  """The model blocks of each DiLoCo fragment's params (its compressor state's)."""
  return [blocks.select(part)
          for part in fragment_leaves(like.params, len(like.compressor_state))]


def saved_paths(like: Any, saved_mesh: list, data: tuple[str, ...],
                blocks: ModelBlocks | None = None) -> Any:
  """The tree of the state a checkpoint of this run holds on mesh `saved_mesh`, each leaf its
  key path there (as `checkpoint_record` records it): `like`'s, but for the per-device
  states whose layout depends on the device count (LoCo's buckets) or, where the model axes
  change shape (`blocks`), on the params' model blocks.

  Example:
    >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("data",))
    >>> like = {"w": jax.ShapeDtypeStruct((8,), np.float32, sharding=NamedSharding(mesh, P()))}
    >>> saved_paths(like, [["data", 8]], ("data",))
    {'w': "['w']"}
  """
  return _paths(like, _meshes(data, saved_mesh, _mesh_of(like)), "", blocks)


def _meshes(data: tuple[str, ...], saved_mesh: list, mesh: Any) -> _Meshes:
  """Both meshes' sizes over the axes of either (an axis a mesh lacks: size 1)."""
  old, new = dict(saved_mesh), dict(mesh.shape)
  axes = list(dict.fromkeys([*old, *new]))
  return _Meshes(tuple(data), {a: old.get(a, 1) for a in axes}, {a: new.get(a, 1) for a in axes})


def _mesh_of(like: Any) -> Any:
  mesh = next((x.sharding.mesh for x in jax.tree.leaves(like)
               if isinstance(getattr(x, "sharding", None), NamedSharding)), None)
  if mesh is None:
    raise ValueError("reshard: the state to restore into has no leaf on a mesh "
                     "(NamedSharding): nothing says how to lay it out")
  return mesh


def relay(state: Any, like: Any, saved_mesh: list, data: tuple[str, ...],
          specs: Any = None, blocks: ModelBlocks | None = None) -> tuple[Any, Resharded]:
  """`state` as the checkpoint holds it (its leaves' shapes and specs, `saved_paths`' tree,
  readable on this host) re-laid as `like` (a state on the new mesh, or its ShapeDtypeStructs)
  says: its arrays placed with `like`'s shardings, and the record of what was done. `specs`:
  the checkpoint's PartitionSpecs of `state`'s leaves (default: `like`'s, where the trees are
  alike). `blocks`: the params' model blocks before and now (`model_blocks.model_blocks`),
  needed where the model axes change shape.

  Example:
    >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("data",))
    >>> like = jax.ShapeDtypeStruct((8,), np.float32, sharding=NamedSharding(mesh, P("data")))
    >>> saved = np.float32([1, 2, 3, 4, 5, 6] + [0] * 10)   # 6 values in 8 rows of 2
    >>> state, how = relay(saved, like, [["data", 8]], ("data",))
    >>> np.asarray(state).tolist()
    [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 0.0, 0.0]
    >>> how.how
    ('master shards: rows joined and cut again for the new devices, exactly',)
  """
  mesh = _mesh_of(like)
  meshes = _meshes(data, saved_mesh, mesh)
  if model_changed(saved_mesh, list(mesh.shape.items()), data) and blocks is None:
    raise ValueError(f"reshard: the model axes change shape ({mesh_text(saved_mesh)} to "
                     f"{mesh_text(list(mesh.shape.items()))}): pass the params' blocks, "
                     f"blocks=model_blocks.model_blocks(...)")
  if specs is None:
    specs = jax.tree.map(_spec, like)
  notes: dict[str, str] = {}
  relaid = _relay(state, specs, like, meshes, "", notes, blocks)

  def place(x, l):
    sharding = getattr(l, "sharding", None)
    x = np.asarray(x, l.dtype)
    return x if sharding is None else jax.make_array_from_callback(
        x.shape, sharding, lambda index: x[index])
  placed = jax.tree.map(place, relaid, like)
  record = Resharded(mesh_text(saved_mesh), mesh_text(list(mesh.shape.items())), tuple(data),
                     tuple(f"{what}: {how}" for what, how in notes.items()))
  return placed, record
