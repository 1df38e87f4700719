"""What a checkpoint records of its run (`meta/metadata`), and what a restore compares.

The record: the caller's config, the device and process counts, the mesh (axis names and
sizes), every leaf's shape, dtype and PartitionSpec from its NamedSharding, and each
transformation state's layout (`TreeSignature.layout`). A global array's meaning can depend on
its mesh (zero2's master shards, LoCo's per-device errors), so a restore proceeds onto the same
mesh and specs, or is re-laid for another (train/reshard.py). What the arrays cannot show (data
and model axes, the mode, each param's model split) belongs in the config: `train_layout`.
"""

import json
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from loco_jax.core.trees import TreeSignature
from loco_jax.train import files, parallel
from loco_jax.train import sharding as sharding_lib
from loco_jax.train.checkpoint_steps import FORMAT, MAX_METADATA_BYTES, READABLE_FORMATS
from loco_jax.train.mesh import AxisNames, data_axes, model_axes

_MAX_LISTED = 8  # differences named in full; the rest are counted


def spec_record(spec: P) -> list:
  """A PartitionSpec as JSON, trailing Nones dropped: P(None, ('data', 'model')) ->
  [None, ['data', 'model']]."""
  entries = [list(e) if isinstance(e, tuple) else e for e in spec]
  while entries and entries[-1] is None:
    entries.pop()
  return entries


def spec_of(record: list | None) -> P:
  """`spec_record`'s inverse: [None, ['data', 'model']] -> P(None, ('data', 'model'))."""
  return P(*[tuple(e) if isinstance(e, list) else e for e in record or ()])


def _spec_text(spec: list | None) -> str:
  if spec is None:
    return "no mesh"
  return "P(" + ", ".join(repr(tuple(e)) if isinstance(e, list) else repr(e)
                          for e in spec) + ")"


def mesh_text(mesh: list | None) -> str:
  if mesh is None:
    return "no mesh (no leaf has a NamedSharding)"
  return "(" + ", ".join(f"{name}={size}" for name, size in mesh) + ")"


def _named_sharding(x: Any) -> NamedSharding | None:
  sharding = getattr(x, "sharding", None)
  return sharding if isinstance(sharding, NamedSharding) else None


def _mesh(state: Any) -> list | None:
  """[[axis name, size], ...] of the mesh the state's NamedShardings lie on; None if none."""
  meshes = {tuple(s.mesh.shape.items()) for x in jax.tree.leaves(state)
            if (s := _named_sharding(x)) is not None}
  if len(meshes) > 1:
    raise ValueError(f"the state's leaves lie on meshes of different shapes "
                     f"({', '.join(sorted(mesh_text(m) for m in meshes))}); a checkpoint "
                     f"records one mesh: place every leaf on the train step's mesh")
  return [[name, int(size)] for name, size in meshes.pop()] if meshes else None


def _tree(state: Any) -> dict[str, list]:
  """{path: [shape, dtype, spec]} of every leaf; spec None for a leaf without a NamedSharding
  (on one device, or a numpy array)."""
  tree = {}
  for path, x in jax.tree_util.tree_leaves_with_path(state):
    key = jax.tree_util.keystr(path)
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
      raise ValueError(f"state leaf {key} is a {type(x).__name__}; a checkpointed state holds "
                       f"arrays only (jax.Array, numpy array or jax.ShapeDtypeStruct)")
    sharding = getattr(x, "sharding", None)
    named = _named_sharding(x)
    if named is None and sharding is not None and not sharding.is_fully_replicated:
      raise ValueError(f"state leaf {key} is split by a {type(sharding).__name__}, which a "
                       f"checkpoint cannot record: place it with a NamedSharding")
    tree[key] = [list(x.shape), str(x.dtype), None if named is None else spec_record(named.spec)]
  return tree


def _layouts(state: Any) -> dict[str, list]:
  """{key path: layout} of each transformation state that records how its arrays are laid out
  (`TreeSignature.layout`: LoCo's block size, axes and error storage), which the arrays' shapes
  may not show."""
  found = jax.tree_util.tree_flatten_with_path(
      state, is_leaf=lambda x: isinstance(x, TreeSignature))[0]
  return {jax.tree_util.keystr(path): json.loads(json.dumps(x.layout)) for path, x in found
          if isinstance(x, TreeSignature) and x.layout}


def _device_count(state: Any) -> int:
  """Devices the state is laid out on: the largest device set of its leaves' shardings."""
  counts = [len(x.sharding.device_set) for x in jax.tree.leaves(state)
            if getattr(x, "sharding", None) is not None]
  return max(counts, default=jax.device_count())


def _json_config(config: dict) -> dict:
  if not isinstance(config, dict):
    raise ValueError(f"config must be a dict of JSON values, got {type(config).__name__}")
  try:
    return json.loads(json.dumps(config))
  except (TypeError, ValueError) as e:
    raise ValueError(f"config must hold JSON values only (str, int, float, bool, None, lists, "
                     f"dicts with str keys): {e}") from None


def record(step: int, state: Any, config: dict) -> dict:
  """The metadata `save` writes for `state` at `step`; a ValueError for a config that the
  bounded reader of `restore` would refuse (nested over files.MAX_JSON_DEPTH levels, or too
  big)."""
  meta = {"format": FORMAT, "step": step, "config": _json_config(config),
          "device count": _device_count(state), "process count": jax.process_count(),
          "mesh": _mesh(state), "tree": _tree(state), "layouts": _layouts(state)}
  text = json.dumps(meta).encode()
  if len(text) > MAX_METADATA_BYTES or files.json_depth(text) > files.MAX_JSON_DEPTH:
    raise ValueError(f"config must nest at most {files.MAX_JSON_DEPTH - 2} levels deep and the "
                     f"metadata fit in {MAX_METADATA_BYTES} bytes")
  return meta


def _is_spec(spec: Any) -> bool:
  return spec is None or isinstance(spec, list) and all(
      e is None or isinstance(e, str)
      or isinstance(e, list) and all(isinstance(a, str) for a in e) for e in spec)


def _is_mesh(mesh: Any) -> bool:
  return mesh is None or isinstance(mesh, list) and all(
      isinstance(a, list) and len(a) == 2 and isinstance(a[0], str) and type(a[1]) is int
      for a in mesh)


def check(meta: Any, file: Any, step: int) -> dict:
  """`meta` if it is the record `save` writes (format 2 or 3) of `step`; else a ValueError
  naming `file`."""
  if not isinstance(meta, dict) or meta.get("format") not in READABLE_FORMATS:
    raise ValueError(f"{file}: unknown checkpoint metadata format "
                     f"{meta.get('format') if isinstance(meta, dict) else meta!r}; "
                     f"this version reads formats {READABLE_FORMATS}")
  kinds = {"step": int, "config": dict, "device count": int, "tree": dict}
  leaf_length = 2 if meta["format"] == 2 else 3
  wrong = [k for k, kind in kinds.items() if not isinstance(meta.get(k), kind)]
  if meta["format"] > 2 and not ("mesh" in meta and _is_mesh(meta["mesh"])):
    wrong.append("mesh")
  if not isinstance(meta.get("layouts", {}), dict):
    wrong.append("layouts")
  if wrong or meta["step"] != step or not all(
      isinstance(v, list) and len(v) == leaf_length and (leaf_length == 2 or _is_spec(v[2]))
      for v in meta["tree"].values()):
    raise ValueError(f"{file}: the metadata of step {step} is malformed "
                     f"({', '.join(wrong) or 'step or tree'}); expected the JSON that save "
                     f"writes: {', '.join(kinds)}, mesh")
  return meta


def _config_differences(old: dict, new: dict, prefix: str = "",
                        ignored: tuple = ()) -> list[str]:
  out = []
  for key in sorted(set(old) | set(new), key=str):
    a, b = old.get(key, "<absent>"), new.get(key, "<absent>")
    if f"{prefix}{key}" in ignored:
      continue
    if isinstance(a, dict) and isinstance(b, dict):
      out += _config_differences(a, b, f"{prefix}{key}.", ignored)
    elif a != b:
      out.append(f"{prefix}{key}: checkpoint {a!r}, now {b!r}")
  return out


def _spec_axes(spec: list | None) -> list[str]:
  return [a for e in spec or () for a in (e if isinstance(e, list) else [e]) if a is not None]


def _without(spec: list | None, axes: set) -> list | None:
  """A recorded spec without `axes` (entries left without an axis: None)."""
  if spec is None:
    return None
  entries = [[a for a in e if a not in axes] if isinstance(e, list) else
             None if e in axes else e for e in spec]
  entries = [None if e == [] else e[0] if isinstance(e, list) and len(e) == 1 else e
             for e in entries]
  while entries and entries[-1] is None:
    entries.pop()
  return entries


def _counted(items: list[str]) -> list[str]:
  more = len(items) - _MAX_LISTED
  return items[:_MAX_LISTED] + ([f"(and {more} more)"] if more > 0 else [])


def _without_groups(layout: Any) -> Any:
  """A recorded transformation layout without its groups of leaves, which follow the model
  axes."""
  if not isinstance(layout, list):
    return layout
  return [e for e in layout if not (isinstance(e, list) and e[:1] == ["groups"])]


def differences(saved: dict, now: dict, mesh_keys: tuple[str, ...] | None = None,
                data: tuple[str, ...] = (), model: bool = False) -> list[str]:
  """'what: checkpoint A, now B' for every config key (nested keys joined by '.'), the device
  count, the mesh, and the tree: each leaf's shape, dtype and, on the same mesh, spec.

  `mesh_keys`: a restore re-laid for another mesh (`reshard`): these config keys describe the
  mesh and may differ; the device counts, meshes, leaves and the shapes of leaves split over
  the `data` axes are left to the re-laying; the dtypes and specs of the leaves both trees have
  and the shapes of the others are compared. `model`: the model axes change shape too; the
  specs are compared over the data axes only, the layouts without their groups of leaves."""
  relaid = mesh_keys is not None
  out = _counted(_config_differences(saved["config"], now["config"], "", mesh_keys or ()))
  if saved["device count"] != now["device count"] and not relaid:
    out.append(f"device count: checkpoint {saved['device count']}, now {now['device count']}")
  same_mesh = "mesh" not in saved or saved["mesh"] == now["mesh"]  # format 2: on one device
  if not same_mesh and not relaid:
    out.append(f"mesh: checkpoint {mesh_text(saved['mesh'])}, now {mesh_text(now['mesh'])}")
  if "layouts" in saved:  # from this version on
    old, new = saved["layouts"], now["layouts"]
    if model:
      old, new = ({k: _without_groups(v) for k, v in x.items()} for x in (old, new))
    out += _counted([f"layout of {k}: checkpoint {old.get(k, '<absent>')}, now "
                     f"{new.get(k, '<absent>')}" for k in sorted(set(old) | set(new))
                     if old.get(k) != new.get(k)])
  old_tree, new_tree = saved["tree"], now["tree"]
  tree = [] if relaid else [f"{k} only in the checkpoint" for k in old_tree if k not in new_tree]
  tree += [] if relaid else [f"{k} only now" for k in new_tree if k not in old_tree]
  # jax leaves axes of size 1 out of a spec: another mesh may have other such axes.
  ones = {a for mesh in (saved.get("mesh"), now["mesh"]) if relaid and mesh
          for a, size in mesh if size == 1 or model and a not in data}
  for k in (k for k in old_tree if k in new_tree):
    (old_shape, old_dtype, *old_spec), (shape, dtype, spec) = old_tree[k], new_tree[k]
    on_data = relaid and any(a in data for e in (old_spec[0] if old_spec else None, spec)
                             for a in _spec_axes(e))
    tree += [f"{k} {what} checkpoint {a}, now {b}" for what, a, b in
             (("shape", old_shape, shape), ("dtype", old_dtype, dtype))
             if a != b and not (on_data and what == "shape")]
    if ones and old_spec:
      old_spec, spec = [_without(old_spec[0], ones)], _without(spec, ones)
    if (same_mesh or relaid) and old_spec and old_spec[0] != spec:
      tree.append(f"{k} sharding checkpoint {_spec_text(old_spec[0])}, now {_spec_text(spec)}")
  if tree:
    more = f" (and {len(tree) - 3} more)" if len(tree) > 3 else ""
    out.append("tree: " + ", ".join(tree[:3]) + more)
  return out


def train_layout(mesh: Mesh, params: Any, *, mode: str, axis_name: AxisNames = "data") -> dict:
  """What a train state's arrays do not show, as JSON for its checkpoint's config: the mode,
  the data and model axes, each param's split over the model axes (its PartitionSpec) and its
  shape (zero2's master shards are flat), which re-lay a state for other model axes.

  The arguments are those of `parallel.init_train_state`. Put the result in the config of
  `checkpoint.save` and `checkpoint.restore`, which then refuse a run laid out otherwise.

  Example:
    >>> layout = train_layout(parallel.data_mesh(), params, mode="zero2")
    >>> layout["mode"], layout["data axes"], layout["model axes"], layout["params"]
    ('zero2', ['data'], [], {"['b']": [], "['w']": []})
    >>> layout["shapes"]
    {"['b']": [8], "['w']": [4, 8]}
  """
  if mode not in parallel.MODES:
    raise ValueError(f"mode must be one of {parallel.MODES}, got {mode!r}")
  data = data_axes(mesh, axis_name)
  specs = sharding_lib.param_specs(params, mesh, data)
  leaves = jax.tree_util.tree_leaves_with_path(specs, is_leaf=lambda x: isinstance(x, P))
  return {"mode": mode, "data axes": list(data),
          "model axes": list(model_axes(mesh, data)),
          "params": {jax.tree_util.keystr(path): spec_record(s) for path, s in leaves},
          "shapes": {jax.tree_util.keystr(path): list(np.shape(x)) for path, x in
                     jax.tree_util.tree_leaves_with_path(params)}}
