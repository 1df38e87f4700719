"""Local blocks: a transformation's step on each device's own block of model-sharded leaves.

A leaf sharded over axes that the transformation does not average over (a 'model' axis) is
compressed block by block; only a 4-byte flag crosses those axes, so every shard keeps or skips
a non-finite step together. The block is found from:

  (a) manual axes: the caller's jax.shard_map is manual over 'model' too, the leaf is local;
  (b) Explicit axes (`jax.typeof(g).sharding.spec`): `local_update` and `local_init` run the
      step in a nested jax.shard_map over them;
  (c) Auto axes: the transformation's `specs=` or the `leaf_specs` context manager tells the
      specs, and it runs as in (b). Told nothing, it flattens whole leaves and warns once.

A leaf's state follows its layout: flat per-leaf state is sharded over all the leaf's axes,
per-group state (LoCo's buckets) over its group's axes.
"""

import contextlib
import contextvars
import warnings
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from loco_jax.core import leaves

_GIVEN_SPECS = contextvars.ContextVar("loco_jax_leaf_specs", default=None)
_WARNED: set = set()


@contextlib.contextmanager
def leaf_specs(specs: Any):
  """Tells the transformations updated inside how the gradient leaves are sharded.

  `specs`: the params' PartitionSpecs. Needed only where a leaf carries no spec: inside a
  jax.shard_map manual over the data axes with Auto model axes. `specs=` does it for one.

  Example:
    >>> with loco_jax.core.local_blocks.leaf_specs({"w": P(None, "model"), "b": P()}):
    ...   pass  # opt.update(grads, state) inside the shard_map step
  """
  token = _GIVEN_SPECS.set(specs)
  try:
    yield
  finally:
    _GIVEN_SPECS.reset(token)


def spec_axes(spec) -> tuple[str, ...]:
  """Every mesh axis a PartitionSpec (or None) splits over, in order."""
  return tuple(a for entry in (tuple(spec) if spec is not None else ())
               for a in entry_axes(entry))


def entry_axes(entry) -> tuple[str, ...]:
  """The mesh axes one entry of a PartitionSpec splits its dimension over."""
  if entry is None or entry is P.UNCONSTRAINED:
    return ()
  return (entry,) if isinstance(entry, str) else tuple(entry)


def spec_entry(axes: tuple[str, ...]):
  """The PartitionSpec entry that splits a dimension over `axes` (None for none)."""
  return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)


def keep_axes(spec, axes) -> P:
  """`spec` with only the axes in `axes`."""
  return P(*[spec_entry(tuple(a for a in entry_axes(e) if a in axes)) for e in tuple(spec)])


def restrict(specs: Any, axes) -> Any:
  """A tree of PartitionSpecs with only the axes in `axes` (what a shard_map manual over them
  declares)."""
  return jax.tree.map(lambda s: keep_axes(s, axes), specs, is_leaf=lambda x: isinstance(x, P))


def told_specs(fn: Callable, specs: Any) -> Callable:
  """`fn` run inside `leaf_specs(specs)` where the specs split a leaf; else `fn` itself."""
  if not any(spec_axes(s) for s in jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))):
    return fn

  def run(*args, **kwargs):
    with leaf_specs(specs):
      return fn(*args, **kwargs)
  return run


class LocalBlocks(NamedTuple):
  """The nested shard_map that gives a step the local blocks of model-sharded leaves."""
  mesh: Any                      # the (abstract) mesh of the nested shard_map
  axes: tuple[str, ...]          # the axes it makes manual
  specs: list                    # per leaf: its PartitionSpec over `axes` only
  leaf_axes: list[tuple]         # per leaf: the axes it is sharded over, in spec order


def _spec_and_mesh(x, given, context, name: str, index: int):
  """A leaf's spec, the mesh it applies to and the axis types that count: the given spec on
  the context's mesh (or the leaf's), else the leaf's own Explicit sharding."""
  sharding = getattr(leaves.abstract_type(x), "sharding", None)
  leaf_mesh = getattr(sharding, "mesh", None)
  if given is None:
    return getattr(sharding, "spec", None), leaf_mesh, (jax.sharding.AxisType.Explicit,)
  where = context if not context.empty else leaf_mesh
  if not isinstance(given, P):
    raise ValueError(f"{name}: specs holds {given!r} for leaf {index}; expected a "
                     f"PartitionSpec")
  if where is None or getattr(where, "empty", False):
    raise ValueError(f"{name}: specs= (or leaf_specs) needs a mesh to apply to: call the "
                     f"update inside jax.shard_map or under jax.set_mesh")
  unknown = [a for a in spec_axes(given) if a not in where.axis_names]
  if unknown:
    raise ValueError(f"{name}: specs name axis {unknown[0]!r}, which the mesh lacks; its axes "
                     f"are {tuple(where.axis_names)}")
  return given, where, (jax.sharding.AxisType.Auto, jax.sharding.AxisType.Explicit)


def find_blocks(tree: Any, averaged: leaves.AxisNames, specs: Any,
                name: str) -> LocalBlocks | None:
  """Where leaves are sharded over axes that are neither averaged nor manual: the nested
  shard_map that gives the step their local blocks. None where every leaf is local already."""
  flat, treedef = jax.tree.flatten(tree)
  if not flat:  # nothing to localize (optax.tree_map_params's placeholder, say)
    return None
  context = jax.sharding.get_abstract_mesh()
  specs = _GIVEN_SPECS.get() if specs is None else specs
  given = [None] * len(flat)
  if specs is not None:
    try:
      given = treedef.flatten_up_to(specs)
    except (ValueError, TypeError) as e:
      raise ValueError(f"{name}: specs must be PartitionSpecs in a tree like the gradients' "
                       f"(the params'): {e}") from None
  mesh, leaf_specs_, per_leaf = None, [], []
  for i, x in enumerate(flat):
    spec, where, kinds = _spec_and_mesh(x, given[i], context, name, i)
    leaf_specs_.append(spec)
    if spec is None or where is None or getattr(where, "empty", True) or not (
        leaves.compressible(x)):
      per_leaf.append(())
      continue
    types = dict(zip(where.axis_names, where.axis_types))
    axes = tuple(a for a in spec_axes(spec) if types.get(a) in kinds
                 and a not in leaves.axis_names(averaged) and where.shape[a] > 1)
    if axes and mesh is None:
      mesh = where
    per_leaf.append(axes)
  axes = tuple(a for a in (mesh.axis_names if mesh is not None else ())
               if any(a in leaf for leaf in per_leaf))
  if not axes:
    _warn_if_gathered(flat, context, averaged, specs, name)
    return None
  return LocalBlocks(mesh, axes, [keep_axes(spec, set(leaf)) if leaf else P()
                                  for spec, leaf in zip(leaf_specs_, per_leaf)], per_leaf)


def _warn_if_gathered(flat: list, context, averaged: leaves.AxisNames, specs,
                      name: str) -> None:
  """UserWarning (once per transformation and set of axes) where Auto axes of size > 1 may
  split leaves that no one told us about: GSPMD then gathers the whole leaf for the step."""
  if specs is not None or context.empty or not any(leaves.compressible(x) for x in flat):
    return
  auto = tuple(a for a, kind in zip(context.axis_names, context.axis_types)
               if kind == jax.sharding.AxisType.Auto and context.shape[a] > 1
               and a not in leaves.axis_names(averaged))
  if not auto or (name, auto) in _WARNED:
    return
  _WARNED.add((name, auto))
  warnings.warn(
      f"{name}: the mesh's Auto axes {auto} may shard the gradient leaves, but a leaf inside "
      f"jax.shard_map carries no spec, so each device compresses whole leaves (GSPMD gathers "
      f"them). To compress each device's own shard, do one of: pass specs= (the params' "
      f"PartitionSpecs) to the transformation; wrap the update in "
      f"loco_jax.core.local_blocks.leaf_specs(specs); or make those axes manual (shard_map "
      f"over them too) or Explicit (jax.make_mesh(..., axis_types=Explicit)).", UserWarning,
      stacklevel=4)


def state_specs_on_blocks(state: Any, treedef: Any, blocks: LocalBlocks) -> Any:
  """Specs of a transformation's state on the nested shard_map: a field shaped like the
  gradient tree follows each leaf (flat, over the leaf's axes); a `leaves.ByGroup` field is
  split over each group's axes; other arrays with a dimension (per-device statistics) are split
  over every axis; scalars (step counters) are replicated. A chain's states: each alike."""
  def field(value):
    if value is None:
      return None
    if isinstance(value, leaves.ByGroup):
      return leaves.ByGroup({key: jax.tree.map(lambda _, key=key: P(tuple(
          a for a in blocks.axes if a in leaves.key_axes(key))) if key else P(), arrays)
          for key, arrays in value.items()})
    if jax.tree.structure(value) == treedef:
      return treedef.unflatten([P(axes) if axes and np.ndim(v) else P() for v, axes in zip(
          treedef.flatten_up_to(value), blocks.leaf_axes)])
    return jax.tree.map(lambda v: P(blocks.axes) if np.ndim(v) else P(), value)
  if isinstance(state, tuple) and hasattr(state, "_fields"):
    return type(state)(*[field(v) for v in state])
  if type(state) in (tuple, list) and jax.tree.structure(state) != treedef:  # a chain's
    return type(state)(state_specs_on_blocks(s, treedef, blocks) for s in state)
  return field(state)


def _inside(fn: Callable, axes: tuple[str, ...]) -> Callable:
  def run(*args):
    with leaves.local_axes(axes):
      return fn(*args)
  return run


def on_blocks(fn: Callable, mesh: Any, axes: tuple[str, ...], in_specs: Any,
              out_specs: Any) -> Callable:
  """`fn` in a nested jax.shard_map manual over `axes`: it sees each device's own blocks.

  `mesh`: None for the context's (inside a shard_map over other axes). The leaf core sees
  there which leaves vary over `axes`: their shards keep or skip a step together. No axes: `fn`.
  """
  if not axes:
    return fn
  return jax.shard_map(_inside(fn, axes), mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                       axis_names=set(axes))


def _call_on_blocks(fn: Callable, compiled: dict, blocks: LocalBlocks, in_specs, out_specs,
                    *args):
  """`fn` on the local blocks (`on_blocks`). Called outside any trace, it is jitted (and kept
  in `compiled`): an eager shard_map dispatches op by op."""
  smap = on_blocks(fn, blocks.mesh, blocks.axes, in_specs, out_specs)
  if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(args)):
    return smap(*args)
  key = (jax.tree.structure(args), str(in_specs), str(out_specs), blocks.axes, blocks.mesh)
  if key not in compiled:
    compiled[key] = jax.jit(smap)
  return compiled[key](*args)


def shapes_inside(fn: Callable, mesh: Any, in_specs: Any, axes: Any, *args) -> Any:
  """Shapes of `fn(*args)` on the blocks of a shard_map manual over `axes` (only there do groups
  of leaves split over them show)."""
  seen = []
  probe = lambda *local: seen.append(jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), fn(*local))) or jnp.zeros(())
  jax.eval_shape(jax.shard_map(probe, mesh=mesh, in_specs=in_specs, out_specs=P(),
                               axis_names=set(axes)), *args)
  return seen[0]


def local_init(init_fn: Callable, averaged: leaves.AxisNames = None, specs: Any = None,
               name: str = "init") -> Callable:
  """`init_fn(params)` run on each device's local blocks where leaves are sharded over axes
  that are not averaged (see the module doc); as is elsewhere."""
  compiled = {}

  def init(params):
    blocks = find_blocks(params, averaged, specs, name)
    if blocks is None:
      return init_fn(params)
    treedef = jax.tree.structure(params)
    in_specs = (treedef.unflatten(blocks.specs),)
    state = shapes_inside(_inside(init_fn, blocks.axes), blocks.mesh, in_specs, blocks.axes,
                          params)
    return _call_on_blocks(init_fn, compiled, blocks, in_specs,
                           state_specs_on_blocks(state, treedef, blocks), params)
  return init


def local_update(update_fn: Callable, averaged: leaves.AxisNames = None, specs: Any = None,
                 flat_output: bool = False, name: str = "update") -> Callable:
  """`update_fn(updates, state)` -> (updates, state), run on each device's local blocks where
  leaves are sharded over axes that are not averaged; as is elsewhere. `flat_output`: the
  output leaves are flat vectors (a scatter's shards), split like the state."""
  compiled = {}

  def update(updates, state, params=None, **extra_args):
    del params, extra_args
    blocks = find_blocks(updates, averaged, specs, name)
    if blocks is None:
      return update_fn(updates, state)
    treedef = jax.tree.structure(updates)
    state_specs = state_specs_on_blocks(state, treedef, blocks)
    out_leaves = ([P(axes) if axes else P() for axes in blocks.leaf_axes] if flat_output
                  else blocks.specs)
    return _call_on_blocks(update_fn, compiled, blocks,
                           (treedef.unflatten(blocks.specs), state_specs),
                           (treedef.unflatten(out_leaves), state_specs), updates, state)
  return update
