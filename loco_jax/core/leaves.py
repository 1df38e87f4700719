"""The leaf core: a gradient tree as flat float32 vectors of this device's own blocks, and back.

Every transformation (loco, two_hop, co3, the baselines) runs the same plumbing around its own
step. `split` takes the gradient tree: the leaves to compress (float, non-empty), grouped by the
mesh axes over which they differ from device to device. `Leaves.flat` hands each one to the step
as a flat float32 vector; the step compresses, exchanges and averages one group at a time; and
`Leaves.outputs`, `Leaves.agree` and `keep_if` (or `Leaves.keep_or_skip`, for a step that takes
its results out of buckets) put the results back (the leaves' shapes and dtypes; the state kept
wherever some gradient was not finite, on every device alike).

Local blocks. A leaf may be sharded over mesh axes that the transformation does not average
over (a 'model' axis). Each device then compresses the block it holds, and nothing crosses
those axes but a 4-byte flag (so that every shard keeps or skips a non-finite step together):
  (a) manual axes (the caller's jax.shard_map is manual over 'model' too): the leaf is local
      already;
  (b) Explicit axes (jax's sharding in types: `jax.typeof(g).sharding.spec` names them):
      `local_update` and `local_init` run the step in a nested jax.shard_map over those axes,
      so it sees the local block (no all-gather, no reshape of a sharded array);
  (c) Auto axes inside a jax.shard_map that is manual over the data axes only: GSPMD lays the
      leaves out at compile time and a tracer carries no spec. Tell the specs with the
      transformation's `specs=` argument or the `leaf_specs` context manager (PartitionSpecs
      like the params), and it runs as in (b). Told nothing, the step flattens whole leaves
      (GSPMD gathers them over the Auto axes) and warns once.
A leaf's state follows its layout: flat per-leaf state (a baseline's error) is sharded over all
the axes the leaf is, P((axes...)); per-bucket state (LoCo's) over its group of leaves' axes;
in `init` as in `update`.
"""

import contextlib
import contextvars
import warnings
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from loco_jax.core import layout, quant

AxisNames = str | tuple[str, ...] | None

_TOLD = contextvars.ContextVar("loco_jax_leaf_specs", default=None)
_LOCALIZED = contextvars.ContextVar("loco_jax_localized_axes", default=())
_WARNED: set = set()
# Backends on which `Leaves.keep_or_skip` skips a non-finite step with one lax.cond; elsewhere
# it selects each leaf's state and adds the NaN flags to each leaf's update.
SKIP_BY_COND = ("cpu",)


def compressible(x) -> bool:
  """Float leaves with elements are compressed; the others pass through."""
  return jnp.issubdtype(x.dtype, jnp.floating) and int(np.prod(x.shape)) > 0


def flag(finite: jax.Array) -> jax.Array:
  """0.0, or NaN when some gradient is not finite: it travels with the payload so that every
  device of the axis learns of it (and is added to every output)."""
  return jnp.where(finite, 0.0, jnp.nan).astype(jnp.float32)


def keep_if(finite: jax.Array, new: Any, old: Any) -> Any:
  """`new` where `finite`, else `old` (trees of the same structure)."""
  return jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)


def merge(new: list | None, old: list) -> list:
  """Per leaf: the new value, or the old one where there is none (leaves that are not sent)."""
  return old if new is None else [o if n is None else n for n, o in zip(new, old)]


def _names(axes: AxisNames) -> tuple[str, ...]:
  return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)


def _varying(x) -> frozenset:
  """The manual mesh axes over which `x` differs from device to device (its vma)."""
  kind = _type(x)  # a ShapeDtypeStruct has neither
  manual = getattr(kind, "manual_axis_type", None)  # jax 0.10; older jax: `vma`
  return frozenset(manual.varying if manual is not None else getattr(kind, "vma", ()))


def vary_like(x: Any, like: jax.Array) -> Any:
  """`x` typed as varying over the manual axes `like` varies over (a host callback's result,
  typed replicated, that is in fact this device's own)."""
  missing = tuple(sorted(set().union(*[_varying(like) - _varying(v)
                                       for v in jax.tree.leaves(x)])))
  return jax.lax.pcast(x, missing, to="varying") if missing else x


class Leaves(NamedTuple):
  """One update's gradient leaves as a transformation sees them."""
  leaves: list                  # the leaves as given: this device's blocks
  treedef: Any
  chosen: list[int]             # the leaves to compress (float, non-empty)
  groups: list[list[int]]       # `chosen`, by the non-averaged manual axes they vary over
  spread: tuple[str, ...]       # the axes over which the leaves' shards must keep-or-skip alike
  group_axes: list[tuple[str, ...]]  # per group: the axes of `spread` its leaves vary over

  def flat(self, i: int) -> jax.Array:
    """Leaf i as a flat float32 vector."""
    return self.leaves[i].reshape(-1).astype(jnp.float32)

  def per_leaf(self, tree: Any) -> list:
    """A state field shaped like the gradient tree, as a list per leaf ([None] * n for None)."""
    return [None] * len(self.leaves) if tree is None else self.treedef.flatten_up_to(tree)

  def tree(self, values: list, like: Any = True) -> Any:
    """The list per leaf as a tree like the gradient's (None where `like` is None)."""
    return None if like is None else self.treedef.unflatten(values)

  def finite(self, indices: list[int] | None = None) -> jax.Array:
    """Whether every value of the chosen leaves (or of `indices`) is finite, on this device."""
    ok = jnp.bool_(True)
    for i in self.chosen if indices is None else indices:
      ok &= jnp.all(jnp.isfinite(self.leaves[i]))
    return ok

  def agree(self, flags: jax.Array) -> jax.Array:
    """The flags summed over `spread`: one 4-byte all-reduce, so that the shards of a leaf
    (and the step counter) keep or skip the step together. Nothing where spread is empty."""
    return jax.lax.psum(flags, self.spread) if self.spread else flags

  def outputs(self, values: list, flags: jax.Array | None, shaped: bool = True) -> Any:
    """Flat float32 values per leaf (None: pass the gradient through) + flags (None: none to
    add) -> the update, in the leaves' dtypes (saturating) and, if `shaped`, their shapes."""
    out = list(self.leaves)
    for i, v in enumerate(values):
      if v is not None:
        g = self.leaves[i]
        v = v if flags is None else v + flags
        out[i] = quant.saturating_cast(v.reshape(g.shape if shaped else v.shape), g.dtype)
    return self.treedef.unflatten(out)

  def keep_or_skip(self, flags: jax.Array, taken: Callable[[], list], value_like: dict,
                   new: Any, old: Any, shards: int | None,
                   checked: bool = False) -> tuple[Any, Any]:
    """(the update, the state): `taken()`'s values and the `new` state where the flags are
    finite (0), else NaN updates and the `old` state (trees of one structure).

    `taken()` -> flat values per leaf takes the step's results out of its buckets. On
    `SKIP_BY_COND` backends one lax.cond calls it on its keep branch only, so each leaf's update
    is a bare slice (an add of the flags per leaf made ~150 more kernels for XLA:CPU to compile
    on the GPT-2-shaped tree); a GPU would read the cond's predicate back to the host, stalling
    its stream, so there the step selects and adds. `value_like`: per sent leaf, an array typed
    like its values (its manual axes, which both branches must match). `shards`: the update is
    each leaf's flat shard over that many devices (scatter). `checked`: the flags were known
    before the step, which wrote NaN values and kept the state itself: the result stands.
    """
    shaped = shards is None
    if checked:
      return self.outputs(taken(), None, shaped), new
    finite = jnp.isfinite(flags)
    if jax.default_backend() not in SKIP_BY_COND:
      return self.outputs(taken(), flags, shaped), keep_if(finite, new, old)
    # Both branches return the state typed alike: varying over the axes either one varies over.
    new, old = (jax.tree.map(vary_like, new, old), jax.tree.map(vary_like, old, new))

    def skip():
      nan = [None] * len(self.leaves)
      for i in value_like:
        size = self.leaves[i].size
        size = size if shards is None else layout.shard_len(size, shards)
        nan[i] = vary_like(jnp.full((size,), jnp.nan, jnp.float32), value_like[i])
      return self.outputs(nan, None, shaped), old

    return jax.lax.cond(finite, lambda: (self.outputs(taken(), None, shaped), new), skip)


def group_key(axes: tuple[str, ...]) -> str:
  """A group's name in per-group state: its axes joined by commas ("" for leaves not split)."""
  return ",".join(axes)


def key_axes(key: str) -> tuple[str, ...]:
  """The axes that a `group_key` names."""
  return tuple(a for a in key.split(",") if a)


def split(updates: Any, averaged: AxisNames = None) -> Leaves:
  """The gradient tree as `Leaves`: the compressible leaves, grouped by the manual axes other
  than `averaged` over which they vary (every leaf in one group unless a caller's shard_map is
  manual over a model axis, or `local_update` made one so).

  Example:
    >>> parts = loco_jax.core.leaves.split(grads)
    >>> parts.chosen, parts.groups, parts.flat(0).shape
    ([0, 1], [[0, 1]], (8,))
  """
  leaves, treedef = jax.tree.flatten(updates)
  chosen = [i for i, x in enumerate(leaves) if compressible(x)]
  skip = set(_names(averaged))
  keys: dict[tuple, list[int]] = {}
  for i in chosen:
    keys.setdefault(tuple(sorted(_varying(leaves[i]) - skip)), []).append(i)
  spread = set().union(*keys) if keys else set()
  if averaged is None:  # local mode: only the axes this core split keep-or-skip together
    spread &= set(_LOCALIZED.get())
  return Leaves(leaves, treedef, chosen, list(keys.values()), tuple(sorted(spread)), list(keys))


# --- Local blocks of sharded leaves ---------------------------------------------------------

@contextlib.contextmanager
def leaf_specs(specs: Any):
  """Tells the transformations updated inside how the gradient leaves are sharded.

  `specs`: PartitionSpecs like the gradient tree (the params' specs). Needed only inside a
  jax.shard_map that is manual over the data axes and leaves Auto model axes to GSPMD: there a
  leaf carries no spec, and without one LoCo compresses (and GSPMD gathers) whole leaves. The
  transformations' own `specs=` argument does the same for one transformation.

  Example:
    >>> with loco_jax.core.leaves.leaf_specs({"w": P(None, "model"), "b": P()}):
    ...   pass  # opt.update(grads, state) inside the shard_map step
  """
  token = _TOLD.set(specs)
  try:
    yield
  finally:
    _TOLD.reset(token)


def _axes_of(spec) -> list[str]:
  axes = []
  for entry in tuple(spec) if spec is not None else ():
    axes += [] if entry is None else [entry] if isinstance(entry, str) else list(entry)
  return axes


class _Layout(NamedTuple):
  mesh: Any                      # the (abstract) mesh of the nested shard_map
  axes: tuple[str, ...]          # the axes it makes manual
  specs: list                    # per leaf: its PartitionSpec over `axes` only
  leaf_axes: list[tuple]         # per leaf: the axes it is sharded over, in spec order


def _keep_axes(spec, axes: set) -> P:
  entries = []
  for entry in tuple(spec):
    names = [a for a in _axes_of(P(entry)) if a in axes]
    entries.append(None if not names else names[0] if len(names) == 1 else tuple(names))
  return P(*entries)


def _layout(tree: Any, averaged: AxisNames, told: Any, who: str) -> _Layout | None:
  """Where leaves are sharded over axes that are neither averaged nor manual: the nested
  shard_map that gives the step their local blocks. None where every leaf is local already."""
  leaves, treedef = jax.tree.flatten(tree)
  context = jax.sharding.get_abstract_mesh()
  told = _TOLD.get() if told is None else told
  if told is not None:
    try:
      told_leaves = treedef.flatten_up_to(told)
    except (ValueError, TypeError) as e:
      raise ValueError(f"{who}: specs must be PartitionSpecs in a tree like the gradients' "
                       f"(the params'): {e}") from None
  mesh, per_leaf = None, []
  for i, x in enumerate(leaves):
    sharding = getattr(_type(x), "sharding", None)
    leaf_mesh = getattr(sharding, "mesh", None)
    if told is not None and told_leaves[i] is not None:
      spec, where = told_leaves[i], context if not context.empty else leaf_mesh
      if not isinstance(spec, P):
        raise ValueError(f"{who}: specs holds {spec!r} for leaf {i}; expected a PartitionSpec")
      if where is None or getattr(where, "empty", False):
        raise ValueError(f"{who}: specs= (or leaf_specs) needs a mesh to apply to: call the "
                         f"update inside jax.shard_map or under jax.set_mesh")
      unknown = [a for a in _axes_of(spec) if a not in where.axis_names]
      if unknown:
        raise ValueError(f"{who}: specs name axis {unknown[0]!r}, which the mesh lacks; its "
                         f"axes are {tuple(where.axis_names)}")
      kinds = (jax.sharding.AxisType.Auto, jax.sharding.AxisType.Explicit)
    else:
      spec, where = getattr(sharding, "spec", None), leaf_mesh
      kinds = (jax.sharding.AxisType.Explicit,)
    if spec is None or where is None or getattr(where, "empty", True) or not compressible(x):
      per_leaf.append(())
      continue
    types = dict(zip(where.axis_names, where.axis_types))
    axes = tuple(a for a in _axes_of(spec) if types.get(a) in kinds
                 and a not in _names(averaged) and where.shape[a] > 1)
    if axes:
      mesh = mesh if mesh is not None else where
    per_leaf.append(axes)
  axes = tuple(a for a in (mesh.axis_names if mesh is not None else ())
               if any(a in leaf for leaf in per_leaf))
  if not axes:
    _warn_if_gathered(leaves, context, averaged, told, who)
    return None
  specs = []
  for i, x in enumerate(leaves):
    spec = (told_leaves[i] if told is not None and told_leaves[i] is not None
            else getattr(getattr(_type(x), "sharding", None), "spec", None))
    specs.append(_keep_axes(spec, set(per_leaf[i])) if per_leaf[i] else P())
  return _Layout(mesh, axes, specs, per_leaf)


def _type(x):
  try:
    return jax.typeof(x)
  except TypeError:
    return x  # a ShapeDtypeStruct: its own .sharding, if any


def _warn_if_gathered(leaves: list, context, averaged: AxisNames, told, who: str) -> None:
  """UserWarning (once per transformation and set of axes) where Auto axes of size > 1 may
  split leaves that no one told us about: GSPMD then gathers the whole leaf for the step."""
  if told is not None or context.empty or not any(compressible(x) for x in leaves):
    return
  auto = tuple(a for a, kind in zip(context.axis_names, context.axis_types)
               if kind == jax.sharding.AxisType.Auto and context.shape[a] > 1
               and a not in _names(averaged))
  if not auto or (who, auto) in _WARNED:
    return
  _WARNED.add((who, auto))
  warnings.warn(
      f"{who}: the mesh's Auto axes {auto} may shard the gradient leaves, but a leaf inside "
      f"jax.shard_map carries no spec, so each device compresses whole leaves (GSPMD gathers "
      f"them). To compress each device's own shard, do one of: pass specs= (the params' "
      f"PartitionSpecs) to the transformation; wrap the update in "
      f"loco_jax.core.leaves.leaf_specs(specs); or make those axes manual (shard_map over "
      f"them too) or Explicit (jax.make_mesh(..., axis_types=Explicit)).", UserWarning,
      stacklevel=4)


def _state_specs(state: Any, treedef: Any, lay: _Layout) -> Any:
  """Specs of a transformation's state on the nested shard_map: a field shaped like the
  gradient tree follows each leaf (flat, over the leaf's axes); a field that a state class lists
  in `BY_BUCKET` is a dict keyed by `group_key` (the axes its arrays' leaves are split over) and
  split over those; other arrays with a dimension (per-device statistics) are split over every
  axis; scalars (step counters) are replicated."""
  by_bucket = getattr(state, "BY_BUCKET", ())

  def field(value, name=None):
    if value is None:
      return None
    if name in by_bucket:  # {group key: arrays}, split over the group's axes
      return {key: jax.tree.map(lambda _, key=key: P(tuple(
          a for a in lay.axes if a in key_axes(key))) if key else P(), arrays)
              for key, arrays in value.items()}
    if jax.tree.structure(value) == treedef:
      return treedef.unflatten([P(axes) if axes and np.ndim(v) else P()
                                for v, axes in zip(treedef.flatten_up_to(value), lay.leaf_axes)])
    return jax.tree.map(lambda v: P(lay.axes) if np.ndim(v) else P(), value)
  if isinstance(state, tuple) and hasattr(state, "_fields"):
    return type(state)(*[field(v, name) for v, name in zip(state, state._fields)])
  return field(state)


def _inside(fn: Callable, axes: tuple[str, ...]) -> Callable:
  def run(*args):
    token = _LOCALIZED.set(axes)
    try:
      return fn(*args)
    finally:
      _LOCALIZED.reset(token)
  return run


def _local_call(fn: Callable, compiled: dict, lay: _Layout, in_specs, out_specs, *args):
  """`fn` on the local blocks: a nested jax.shard_map over `lay.axes`. Called outside any
  trace, it is jitted (and kept in `compiled`): an eager shard_map dispatches op by op, which
  took seconds for one LoCo step."""
  smap = jax.shard_map(_inside(fn, lay.axes), mesh=lay.mesh, in_specs=in_specs,
                       out_specs=out_specs, axis_names=set(lay.axes))
  if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(args)):
    return smap(*args)
  key = (jax.tree.structure(args), str(in_specs), str(out_specs), lay.axes, lay.mesh)
  if key not in compiled:
    compiled[key] = jax.jit(smap)
  return compiled[key](*args)


def shapes_inside(fn: Callable, mesh: Any, in_specs: Any, axes: Any, *args) -> Any:
  """Shapes of `fn(*args)` on the blocks of a shard_map manual over `axes` (only there do groups
  of leaves split over them show)."""
  seen = []
  probe = lambda *blocks: seen.append(jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), fn(*blocks))) or jnp.zeros(())
  jax.eval_shape(jax.shard_map(probe, mesh=mesh, in_specs=in_specs, out_specs=P(),
                               axis_names=set(axes)), *args)
  return seen[0]


def local_init(init_fn: Callable, averaged: AxisNames = None, specs: Any = None,
               who: str = "init") -> Callable:
  """`init_fn(params)` run on each device's local blocks where leaves are sharded over axes
  that are not averaged (see the module doc); as is elsewhere."""
  def wrapped(params):
    lay = _layout(params, averaged, specs, who)
    if lay is None:
      return init_fn(params)
    treedef = jax.tree.structure(params)
    in_specs = (treedef.unflatten(lay.specs),)
    state = shapes_inside(_inside(init_fn, lay.axes), lay.mesh, in_specs, lay.axes, params)
    return _local_call(init_fn, compiled, lay, in_specs, _state_specs(state, treedef, lay),
                       params)
  compiled = {}
  return wrapped


def local_update(update_fn: Callable, averaged: AxisNames = None, specs: Any = None,
                 flat_output: bool = False, who: str = "update") -> Callable:
  """`update_fn(updates, state)` -> (updates, state), run on each device's local blocks where
  leaves are sharded over axes that are not averaged; as is elsewhere. `flat_output`: the
  output leaves are flat vectors (a scatter's shards), split like the state."""
  def wrapped(updates, state, params=None, **extra_args):
    del params, extra_args
    lay = _layout(updates, averaged, specs, who)
    if lay is None:
      return update_fn(updates, state)
    treedef = jax.tree.structure(updates)
    state_specs = _state_specs(state, treedef, lay)
    out_leaves = ([P(axes) if axes else P() for axes in lay.leaf_axes] if flat_output
                  else lay.specs)
    return _local_call(update_fn, compiled, lay, (treedef.unflatten(lay.specs), state_specs),
                       (treedef.unflatten(out_leaves), state_specs), updates, state)
  compiled = {}
  return wrapped
