"""PartitionSpecs of train states: data axes averaged over by hand, model axes left to GSPMD.

A train step is manual over the data axes only; params keep the model sharding the user gave
them, and a compressor's per-device state is split over the data axes and the model axes of its
leaf (`core.local_blocks`). Every spec here is a full spec on the mesh; `local_blocks.restrict`
keeps the part one shard_map declares.
"""

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from loco_jax.core import local_blocks
from loco_jax.core.local_blocks import entry_axes, spec_axes, spec_entry
from loco_jax.train import mesh as mesh_lib
from loco_jax.transforms.specs import state_specs


def named(mesh: Mesh, specs: Any) -> Any:
  """The specs as NamedShardings on `mesh`."""
  return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def param_specs(params: Any, mesh: Mesh, data: tuple[str, ...]) -> Any:
  """The params' PartitionSpecs on `mesh`, from each leaf's `NamedSharding` (others: replicated)."""
  def spec(path, x):
    sharding = getattr(x, "sharding", None)
    if sharding is None or sharding.is_fully_replicated:
      return P()  # replicated, on whichever devices: device_put moves it
    leaf = jax.tree_util.keystr(path) or "(the params themselves)"
    if not isinstance(sharding, NamedSharding):
      raise ValueError(f"param {leaf} has a {type(sharding).__name__}; place params with "
                       f"jax.device_put(x, NamedSharding(mesh, P(...))) over the model axes "
                       f"{mesh_lib.model_axes(mesh, data)}, or as plain arrays (replicated)")
    if dict(sharding.mesh.shape) != dict(mesh.shape):
      raise ValueError(f"param {leaf} is placed on a mesh of axes {dict(sharding.mesh.shape)}, "
                       f"the train step's mesh has {dict(mesh.shape)}: place it on that mesh")
    on_data = [a for a in spec_axes(sharding.spec) if a in data]
    if on_data:
      raise ValueError(f"param {leaf} is split over the data axis {on_data[0]!r} "
                       f"({sharding.spec}); the train step averages over {data} and splits "
                       f"params over them itself (mode='zero2'): split params over the model "
                       f"axes {mesh_lib.model_axes(mesh, data)} only, e.g. P(None, 'model')")
    return sharding.spec
  return jax.tree_util.tree_map_with_path(spec, params)


def local_shapes(like: Any, specs: Any, mesh: Mesh) -> Any:
  """Each device's block of every leaf (ShapeDtypeStructs), as a shard_map over all axes sees it."""
  def block(x, spec):
    shape = list(x.shape)
    for dim, entry in enumerate(spec):
      parts = mesh_lib.axes_size(mesh, entry_axes(entry))
      if shape[dim] % parts:
        raise ValueError(f"a param of shape {tuple(x.shape)} split as {spec} has dimension "
                         f"{dim} of {shape[dim]}, not divisible by its {parts} devices")
      shape[dim] //= parts
    return jax.ShapeDtypeStruct(tuple(shape), x.dtype)
  return jax.tree.map(block, like, specs)


def shapes_of(params: Any) -> Any:
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), params)


def device_state_shapes(init: Callable, params: Any, mesh: Mesh, data: tuple[str, ...],
                       specs: Any = None):
  """`init(params)`'s shapes on one device, and its specs over the data axes (`state_specs`).

  init runs in a shard_map manual over the data axes; with `specs` (the full-shaped params')
  over the model axes too, so that it sees each device's own blocks as the train step does.
  """
  axes = data if specs is None else tuple(mesh.axis_names)
  in_specs = P() if specs is None else local_blocks.restrict(specs, axes)
  shapes = local_blocks.shapes_inside(init, mesh_lib.auto_mesh(mesh), (in_specs,), axes, params)
  return shapes, state_specs(shapes, spec_entry(data))


def _with_param_index(tree: Any, params_like: Any) -> list[int | None]:
  """For each leaf of `tree`: the index of the param leaf it belongs to, where it lies in a
  subtree shaped like the params (adam's mu, LoCo's error), else None."""
  treedef = jax.tree.structure(params_like)
  like = lambda n: n is not None and jax.tree.structure(n) == treedef
  def mark(node):
    if like(node):
      return treedef.unflatten(list(range(treedef.num_leaves)))
    return -1
  marks = jax.tree.leaves(jax.tree.map(mark, tree, is_leaf=like))
  return [None if i < 0 else i for i in marks]


def _trim(spec: P) -> P:
  entries = list(spec)
  while entries and entries[-1] is None:
    entries.pop()
  return P(*entries)


def same_specs(a: Any, b: Any) -> bool:
  """Two trees of PartitionSpecs that split alike (trailing Nones aside)."""
  is_spec = lambda x: isinstance(x, P)
  flat_a, def_a = jax.tree.flatten(a, is_leaf=is_spec)
  flat_b, def_b = jax.tree.flatten(b, is_leaf=is_spec)
  return def_a == def_b and all(_trim(x) == _trim(y) for x, y in zip(flat_a, flat_b))


def _combine(model_spec: P, leaf_data: tuple[str, ...]) -> P:
  """`model_spec` with the data axes `leaf_data` in front of its dimension 0."""
  first = entry_axes(model_spec[0]) if len(model_spec) else ()
  return _trim(P(spec_entry(leaf_data + first), *model_spec[1:]))


def local_state_specs(init: Callable, params: Any, specs: Any, mesh: Mesh,
                      data: tuple[str, ...]) -> Any:
  """Full specs of the state `init` makes in a train step: in a shard_map manual over the data
  axes, told the full-shaped params' `specs`. The fields `state_specs` names are split over the
  data axes, and over the model axes as `local_blocks.state_specs_on_blocks` says, on dim 0."""
  like = shapes_of(params)
  shapes, data_specs = device_state_shapes(init, like, mesh, data, specs)
  with jax.sharding.use_abstract_mesh(mesh_lib.auto_mesh(mesh).abstract_mesh):
    blocks = local_blocks.find_blocks(like, data, specs, "the train step")
  is_spec = lambda x: isinstance(x, P)
  model_specs = (jax.tree.map(lambda _: P(), shapes) if blocks is None else
                 local_blocks.state_specs_on_blocks(shapes, jax.tree.structure(like), blocks))
  return jax.tree.map(lambda m, d: _combine(m, spec_axes(d)), model_specs, data_specs,
                      is_leaf=is_spec)


def gspmd_state_specs(init: Callable, params: Any, specs: Any, mesh: Mesh,
                      data: tuple[str, ...], *, per_device: bool = False) -> Any:
  """Full specs of an optimizer state that GSPMD updates on `params` split as `specs`: ddp's
  after the average, zero2's and fsdp's on the global master shards. A leaf shaped like its
  param is split like it (adam's mu), the rest replicated. `per_device`: fields that differ per
  device (a compressor inside the optimizer) are allowed, split over the data axes."""
  shapes, data_specs = device_state_shapes(init, shapes_of(params), mesh, data)
  shape_leaves, state_def = jax.tree.flatten(shapes)
  data_leaves = state_def.flatten_up_to(data_specs)
  if any(spec_axes(d) for d in data_leaves) and (len(mesh.shape) > len(data) or not per_device):
    model = mesh_lib.model_axes(mesh, data)
    where = f"on a mesh with model axes {model}" if model else "with master shards"
    raise ValueError(
        f"the optimizer holds per-device state (a compressor such as loco inside it); {where} "
        f"pass the averaging transformation as compressor= and the rest as the optimizer, e.g. "
        f"compressor=loco(axis_name={spec_entry(data)!r}), optimizer=optax.adamw(...), so that it "
        f"compresses each device's own shard")
  leaves, treedef = jax.tree.flatten(params)
  spec_leaves = treedef.flatten_up_to(specs)
  like_param = lambda x, i: i is not None and x.shape == jnp.shape(leaves[i])
  out = [spec_leaves[i] if like_param(x, i) and not spec_axes(d) else d
         for x, d, i in zip(shape_leaves, data_leaves, _with_param_index(shapes, params))]
  return state_def.unflatten(out)


def master_specs(specs: Any, data: tuple[str, ...]) -> Any:
  """zero2's float32 master shards: 1-D, split over the data axes and the param's model axes
  (`specs`: the params', over the model axes only)."""
  return jax.tree.map(lambda s: P(spec_entry(data + spec_axes(s))), specs,
                      is_leaf=lambda x: isinstance(x, P))


def train_param_specs(params: Any, mesh: Mesh, axes: mesh_lib.TrainAxes) -> Any:
  """The params' specs (`param_specs`); a ValueError for a model axis that splits none of
  them, along which every device would repeat the same work on the same batch."""
  specs = param_specs(params, mesh, axes.data)
  used = {a for s in jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
          for a in spec_axes(s)}
  idle = [a for a in axes.model if a not in used and mesh.shape[a] > 1]
  if idle:
    averaged = tuple(a for a in mesh.axis_names if a in axes.data or a in idle)
    raise ValueError(f"mesh axis {idle[0]!r} is not in axis_name={axes.name!r} and splits no "
                     f"param, so every device along it would repeat the same work: average over "
                     f"it too (axis_name={averaged!r}) or split params over it "
                     f"(NamedSharding(mesh, P(None, {idle[0]!r})))")
  return specs


def moved(x: jax.Array, target: NamedSharding) -> jax.Array:
  """`x` on `target`'s devices: each of this process's shards copied to the device at its
  place in `target`'s mesh (no collective, whatever the process count)."""
  source = x.sharding
  if source == target:
    return x
  if not (isinstance(source, NamedSharding)
          and source.mesh.devices.shape == target.mesh.devices.shape
          and source.mesh.axis_names == target.mesh.axis_names
          and same_specs(source.spec, target.spec)):
    return jax.device_put(x, target)
  twin = dict(zip(source.mesh.devices.flat, target.mesh.devices.flat))
  return jax.make_array_from_single_device_arrays(
      x.shape, target, [jax.device_put(s.data, twin[s.device]) for s in x.addressable_shards])


def placed(tree: Any, mesh: Mesh, specs: Any) -> Any:
  """`tree` on `mesh`, each leaf as its spec says (`moved`)."""
  return jax.tree.map(moved, tree, named(mesh, specs))


def shapes_on(tree: Any, mesh: Mesh, specs: Any) -> Any:
  """`tree`'s shapes and dtypes, placed on `mesh` as `specs` say (for lowering)."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree,
                      named(mesh, specs))
