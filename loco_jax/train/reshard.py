"""Elastic resume: a state checkpointed on one mesh, re-laid for a mesh whose data axes have other
sizes (`checkpoint.restore(..., reshard=True)`).

Each leaf is converted by what it holds, read from the state's types and specs:

- Split over no data axis (ddp's and DiLoCo's params, adamw's moments there, counters): a
  global array, the same on any mesh; restored as it is.
- A per-device field of a transformation's state (`transforms.specs`): merged by its type's
  merge (`transforms.merge`): LoCo's errors decoded, averaged and re-encoded, and so on.
- DiLoCo's workers and their inner optimizer states, stacked over the data axes: every new
  worker starts from the mean of the old ones. That keeps the pseudo-gradient the next sync
  averages, mean_i (params - worker_i), so the round's work so far is kept; at a sync every
  worker holds the global params, and so does every new one.
- Master shards (zero2's and fsdp's params and optimizer moments, any other leaf split over
  the data axes): each leaf's rows joined (per model block) and cut again for the new devices,
  exactly.

The model axes keep their sizes: a leaf's blocks over them are re-laid each on its own.
"""

import math
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from loco_jax.core.local_blocks import entry_axes
from loco_jax.train.diloco import DilocoState
from loco_jax.transforms import merge as merges
from loco_jax.transforms.specs import per_device_fields

_LAYOUT_KEYS = {"mode", "data axes", "model axes", "params"}


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


def _text(mesh: list) -> str:
  return "(" + ", ".join(f"{name}={size}" for name, size in mesh) + ")"


def _train_layout(config: dict) -> dict | None:
  """The `checkpoint.train_layout` in `config` (the config itself or one of its values)."""
  for value in (config, *config.values()):
    if isinstance(value, dict) and _LAYOUT_KEYS <= set(value):
      return value
  return None


def data_axes(saved: list, now: list, config: dict) -> tuple[str, ...]:
  """The data axes of a restore from mesh `saved` onto mesh `now` ([[axis, size], ...], as a
  checkpoint records them): the train_layout's in `config`, else the axes whose sizes differ.
  A ValueError naming both meshes unless only the data axes' sizes differ.

  Example:
    >>> data_axes([["data", 8]], [["data", 4]], {})
    ('data',)
  """
  both = f"checkpoint {_text(saved) if saved else 'no mesh'}, now {_text(now) if now else 'no mesh'}"
  if not saved or not now or [a for a, _ in saved] != [a for a, _ in now]:
    raise ValueError(f"mesh: {both}: a state re-laid for another mesh keeps its axes (names "
                     f"and order) and changes the data axes' sizes only")
  old, new = dict(saved), dict(now)
  layout = _train_layout(config)
  if layout is not None:
    data = tuple(layout["data axes"])
  else:
    data = tuple(a for a in old if old[a] != new[a])
    if len(data) < len(old):
      raise ValueError(f"mesh: {both}: which axes are data axes? Put "
                       f"checkpoint.train_layout(mesh, params, mode=...) in the config")
  changed = [f"{a}: checkpoint {old[a]}, now {new[a]}" for a in old
             if a not in data and old[a] != new[a]]
  if changed:
    raise ValueError(f"mesh: {both}: only the data axes {data} may change size, not the model "
                     f"axes ({'; '.join(changed)})")
  return data


def _spec(like: Any) -> P:
  sharding = getattr(like, "sharding", None)
  return sharding.spec if isinstance(sharding, NamedSharding) else P()


def _data_dim(like: Any, meshes: _Meshes, where: str) -> tuple[int, tuple, tuple] | None:
  """(dim, its data axes, its model axes) of the dimension `like` splits over data axes."""
  for dim, entry in enumerate(_spec(like)):
    axes = entry_axes(entry)
    data = tuple(a for a in axes if a in meshes.data)
    if data:
      model = tuple(a for a in axes if a not in meshes.data)
      if axes != data + model:
        raise ValueError(f"{where} is split as {_spec(like)}: the data axes must come first")
      return dim, data, model
  return None


def _same_shape(x: np.ndarray, like: Any, where: str) -> np.ndarray:
  if tuple(x.shape) != tuple(like.shape):
    raise ValueError(f"{where}: shape checkpoint {list(x.shape)}, now {list(like.shape)}: it is "
                     f"split over no data axis, so the same on any mesh: another model's state")
  return x


def _rows(x: np.ndarray, like: Any, meshes: _Meshes, where: str) -> np.ndarray:
  """A master-shard-like leaf: per model block, the rows joined and cut again (zero padding)."""
  dim, data, model = _data_dim(like, meshes, where)
  (d_old, d_new), k = meshes.sizes(data), meshes.sizes(model)[0]
  pre, post = x.shape[:dim], x.shape[dim + 1:]
  if (pre, post) != (tuple(like.shape[:dim]), tuple(like.shape[dim + 1:])) or (
      x.shape[dim] % (d_old * k) or like.shape[dim] % (d_new * k)):
    raise ValueError(f"{where}: shape checkpoint {list(x.shape)}, now {list(like.shape)}: not "
                     f"rows of one leaf over {d_old} and {d_new} devices")
  s_old, s_new = x.shape[dim] // (d_old * k), like.shape[dim] // (d_new * k)
  at = len(pre)
  y = np.moveaxis(x.reshape(*pre, d_old, k, s_old, *post), at, at + 1)
  y = y.reshape(*pre, k, d_old * s_old, *post)
  dropped = np.take(y, range(min(d_new * s_new, y.shape[at + 1]), y.shape[at + 1]), axis=at + 1)
  if np.any(dropped):
    raise ValueError(f"{where}: its rows hold values past the {d_new * s_new} elements a leaf "
                     f"has now: another model's state")
  y = np.take(y, range(min(d_new * s_new, y.shape[at + 1])), axis=at + 1)
  pad = [(0, 0)] * y.ndim
  pad[at + 1] = (0, d_new * s_new - y.shape[at + 1])
  y = np.pad(y, pad).reshape(*pre, k, d_new, s_new, *post)
  return np.moveaxis(y, at + 1, at).reshape(like.shape)


def _per_worker(x: np.ndarray, like: Any, meshes: _Meshes, where: str) -> np.ndarray:
  """DiLoCo's stacked workers (or their optimizer states): every new one the old ones' mean."""
  d_old, d_new = meshes.sizes(meshes.data)
  if x.shape[:1] != (d_old,) or tuple(like.shape) != (d_new, *x.shape[1:]):
    raise ValueError(f"{where}: shape checkpoint {list(x.shape)}, now {list(like.shape)}: not "
                     f"one row a worker of {d_old} and {d_new} workers")
  return np.broadcast_to(merges.mean(list(x)), like.shape).copy()


def _children(tree: Any) -> tuple[list, Any]:
  return jax.tree_util.tree_flatten(tree, is_leaf=lambda node: node is not tree)


def _is_array(x: Any) -> bool:
  return x is not None and hasattr(x, "shape") and hasattr(x, "dtype")


def _per_device_mask(like: Any) -> list[bool]:
  """For each leaf of a registered state: whether it is in a per-device field."""
  fields = per_device_fields(like)
  return jax.tree.leaves(type(like)(*[jax.tree.map(lambda _, f=f: f in fields, v)
                                      for f, v in zip(like._fields, like)]))


def _splits_data(like: Any, meshes: _Meshes, where: str) -> bool:
  return any(per and _data_dim(l, meshes, where) is not None
             for l, per in zip(jax.tree.leaves(like), _per_device_mask(like)))


def _merged(state: Any, like: Any, meshes: _Meshes, where: str) -> Any:
  """A registered state's per-device fields merged (`transforms.merge`), per stacked layer and
  model block."""
  merge, _ = merges.merge_of(like)
  mask = _per_device_mask(like)
  xs, treedef = jax.tree.flatten(state)
  likes = jax.tree.leaves(like)
  found = [_data_dim(l, meshes, where) if per else None for l, per in zip(likes, mask)]
  dims = {(f[0], f[1]) for f in found if f is not None}
  if len(dims) != 1:
    raise ValueError(f"{where}: its per-device fields are split {sorted(dims)}; expected every "
                     f"one over the same data axes, on the same dimension")
  (dim, data), = dims
  pre = tuple(next(l for l, f in zip(likes, found) if f).shape[:dim])
  b = math.prod(pre)
  (d_old, d_new), devices = meshes.sizes(data), merges.Devices(
      data, tuple(meshes.old[a] for a in data), tuple(meshes.new[a] for a in data))
  blocks = [1 if f is None else meshes.sizes(f[2])[0] for f in found]

  def local(shape, d, k):  # one device's shape inside [pre, d * k * s, ...]
    if tuple(shape[:dim]) != pre or shape[dim] % (d * k):
      raise ValueError(f"{where}: a per-device leaf of shape {list(shape)} is not {d} x {k} "
                       f"devices' own after the stacked axes {pre}")
    return (shape[dim] // (d * k), *shape[dim + 1:])
  views, outs, one_like = [], [], []
  for x, l, per, k in zip(xs, likes, mask, blocks):
    x = np.asarray(x)
    if per:
      old_local, new_local = local(x.shape, d_old, k), local(tuple(l.shape), d_new, k)
      views.append(x.reshape(b, d_old, k, *old_local))
      outs.append(np.zeros((b, d_new, k, *new_local), l.dtype))
      one_like.append(jax.ShapeDtypeStruct(new_local, l.dtype))
    else:
      views.append(x.reshape(b, *x.shape[dim:]) if x.shape[:dim] == pre else None)
      outs.append(np.zeros((b, *l.shape[dim:]), l.dtype))
      one_like.append(jax.ShapeDtypeStruct(tuple(l.shape[dim:]), l.dtype))
  if any(v is None for v in views):
    raise ValueError(f"{where}: its leaves are not stacked alike ({pre} ahead of the devices)")
  like_one = treedef.unflatten(one_like)
  for i in range(b):
    for kk in range(max(blocks)):
      olds = [treedef.unflatten([v[i, d, kk % k] if per else v[i] for v, per, k in
                                 zip(views, mask, blocks)]) for d in range(d_old)]
      news = merge(olds, like_one, devices)
      for j, new in enumerate(news):
        for out, value, per, k in zip(outs, jax.tree.leaves(new), mask, blocks):
          if np.shape(value) != out.shape[3 if per else 1:]:
            raise ValueError(f"{where}: its merge made a leaf of shape {np.shape(value)}, "
                             f"expected {out.shape[3 if per else 1:]}")
          if per:
            out[i, j, kk % k] = value
          elif j == 0:
            out[i] = value
  return treedef.unflatten([o.reshape(l.shape) for o, l in zip(outs, likes)])


def _relay(state: Any, like: Any, meshes: _Meshes, where: str, notes: dict) -> Any:
  """`state` (numpy, the checkpoint's shapes) re-laid as `like` says; `notes` collects how."""
  if merges.merge_of(like) is not None and _splits_data(like, meshes, where):
    _, how = merges.merge_of(like)
    notes.setdefault(f"{type(like).__name__} ({where or 'the state'})", how)
    return _merged(state, like, meshes, where)
  if isinstance(like, DilocoState):
    notes.setdefault("DiLoCo's workers and inner optimizer states",
                     "every new worker from the mean of the old ones: the pseudo-gradient the "
                     "next sync averages is kept")
    stacked = {f: jax.tree.map(lambda x, l: _per_worker(np.asarray(x), l, meshes, f"{where}.{f}"),
                               getattr(state, f), getattr(like, f))
               for f in ("workers", "opt_state")}
    rest = {f: _relay(getattr(state, f), getattr(like, f), meshes, f"{where}.{f}", notes)
            for f in like._fields if f not in stacked}
    return DilocoState(**stacked, **rest)
  if _is_array(like):
    if _data_dim(like, meshes, where) is None:
      return _same_shape(np.asarray(state), like, where)
    notes["master shards"] = "rows joined and cut again for the new devices, exactly"
    return _rows(np.asarray(state), like, meshes, where)
  children, treedef = _children(like)
  old = treedef.flatten_up_to(state)
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(
      like, is_leaf=lambda node: node is not like)[0]]
  return treedef.unflatten([_relay(x, l, meshes, where + p, notes)
                            for x, l, p in zip(old, children, paths)])


def relay(state: Any, like: Any, saved_mesh: list, data: tuple[str, ...]) -> tuple[Any, Resharded]:
  """`state` as the checkpoint holds it (its leaves' shapes, readable on this host) re-laid as
  `like` (a state on the new mesh, or its ShapeDtypeStructs) says: its arrays placed with
  `like`'s shardings, and the record of what was done.

  Example:
    >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("data",))
    >>> like = jax.ShapeDtypeStruct((8,), np.float32, sharding=NamedSharding(mesh, P("data")))
    >>> saved = np.float32([1, 2, 3, 4, 5, 6] + [0] * 10)   # 6 values in 8 rows of 2
    >>> state, how = relay(saved, like, [["data", 8]], ("data",))
    >>> np.asarray(state).tolist(), str(how)
    ([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 0.0, 0.0], 'resharded from (data=8) to (data=4) (data axes data): master shards: rows joined and cut again for the new devices, exactly')
  """
  mesh = next((x.sharding.mesh for x in jax.tree.leaves(like)
               if isinstance(getattr(x, "sharding", None), NamedSharding)), None)
  if mesh is None:
    raise ValueError("reshard: the state to restore into has no leaf on a mesh "
                     "(NamedSharding): nothing says how to lay it out")
  meshes = _Meshes(tuple(data), dict(saved_mesh), dict(mesh.shape))
  notes: dict[str, str] = {}
  relaid = _relay(state, like, meshes, "", notes)

  def place(x, l):
    sharding = getattr(l, "sharding", None)
    x = np.asarray(x, l.dtype)
    return x if sharding is None else jax.make_array_from_callback(
        x.shape, sharding, lambda index: x[index])
  placed = jax.tree.map(place, relaid, like)
  record = Resharded(_text(saved_mesh), _text(list(mesh.shape.items())), tuple(data),
                     tuple(f"{what}: {how}" for what, how in notes.items()))
  return placed, record
