"""The leaf core: a gradient tree as flat float32 vectors, grouped, and the step's finish.

Every transformation (loco, two_hop, co3, the baselines) runs the same plumbing around its own
step:

  grads = leaves.split(updates, axis_name)        # the leaves to send, grouped
  result = grads.map_groups(step)                 # step(group) -> GroupResult, per group
  update, state, count = grads.finish(result, new, old, count)

`split` groups the leaves to compress by the non-averaged mesh axes they vary over (one group
unless a model axis splits some: `core.local_blocks`). `finish` returns the update in the
leaves' shapes and dtypes and the new state where every gradient was finite, else NaN updates
and the old state, on every device and model shard alike.
"""

import contextlib
import contextvars
from typing import Any, Callable, Iterator, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from loco_jax.core import quant

AxisNames = str | tuple[str, ...] | None

# The axes of a nested shard_map that `core.local_blocks` made manual: in local mode only these
# keep-or-skip together (a caller's own manual axes are the caller's business).
_LOCAL_AXES = contextvars.ContextVar("loco_jax_local_axes", default=())


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


def axis_names(axes: AxisNames) -> tuple[str, ...]:
  """An axis name, a tuple of them or None, as a tuple."""
  return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)


def abstract_type(x):
  """jax's type of `x` (a ShapeDtypeStruct is its own)."""
  try:
    return jax.typeof(x)
  except TypeError:
    return x


def varying_axes(x) -> frozenset:
  """The manual mesh axes over which `x` differs from device to device (its vma)."""
  kind = abstract_type(x)
  manual = getattr(kind, "manual_axis_type", None)  # jax 0.10; older jax: `vma`
  return frozenset(manual.varying if manual is not None else getattr(kind, "vma", ()))


def vary_like(x: Any, like: jax.Array) -> Any:
  """`x` typed as varying over the manual axes `like` varies over (a host callback's result,
  typed replicated, that is in fact this device's own)."""
  missing = tuple(sorted(set().union(*[varying_axes(like) - varying_axes(v)
                                       for v in jax.tree.leaves(x)])))
  return jax.lax.pcast(x, missing, to="varying") if missing else x


@contextlib.contextmanager
def local_axes(axes: tuple[str, ...]) -> Iterator[None]:
  """Inside, `split` in local mode makes the shards over `axes` keep-or-skip together."""
  token = _LOCAL_AXES.set(axes)
  try:
    yield
  finally:
    _LOCAL_AXES.reset(token)


def group_key(axes: tuple[str, ...]) -> str:
  """A group's name in per-group state: its axes joined by commas ("" for leaves not split)."""
  return ",".join(axes)


def key_axes(key: str) -> tuple[str, ...]:
  """The axes that a `group_key` names."""
  return tuple(a for a in key.split(",") if a)


@jax.tree_util.register_pytree_with_keys_class
class ByGroup(dict):
  """A state field per group of leaves: {group key (`group_key`): that group's arrays}. Its
  arrays are split over the group's axes on a mesh (`core.local_blocks`)."""

  def tree_flatten_with_keys(self):
    keys = sorted(self)
    return [(jax.tree_util.DictKey(k), self[k]) for k in keys], tuple(keys)

  @classmethod
  def tree_unflatten(cls, keys, children):
    return cls(zip(keys, children))


class Group(NamedTuple):
  """Leaves that vary over the same non-averaged axes, compressed and sent together."""
  key: str                  # `group_key(axes)`: the group's name in per-group state
  indices: list[int]        # its leaves' positions in the tree
  axes: tuple[str, ...]


class GroupResult(NamedTuple):
  """What a transformation's step returns for one group."""
  values: list                 # flat float32 values per leaf of the group (None: not sent)
  flags: jax.Array             # float32 []: 0, or NaN where some device saw a non-finite value
  state: Any                   # the group's new state


class Mapped(NamedTuple):
  """Every group's results, per leaf."""
  values: list                 # flat float32 values per leaf (None: pass the gradient on)
  flags: jax.Array
  states: dict                 # {group key: the group's new state}


class Finished(NamedTuple):
  update: Any                  # the output tree
  state: Any                   # the new state, or the old one where the step was skipped
  count: Any                   # the step counter, advanced where the step was kept


class Leaves(NamedTuple):
  """One update's gradient leaves as a transformation sees them."""
  leaves: list                  # the leaves as given: this device's blocks
  treedef: Any
  sent: list[int]               # the leaves to compress (float, non-empty)
  groups: list[Group]           # `sent`, by the non-averaged manual axes they vary over
  agree_axes: tuple[str, ...]   # the axes over which the leaves' shards keep or skip together

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
    """Whether every value of the sent leaves (or of `indices`) is finite, on this device."""
    ok = jnp.bool_(True)
    for i in self.sent if indices is None else indices:
      ok &= quant.all_finite(self.leaves[i])
    return ok

  def agree(self, flags: jax.Array) -> jax.Array:
    """The flags summed over `agree_axes`: one 4-byte all-reduce, so that the shards of a leaf
    (and the step counter) keep or skip the step together. Nothing where there are none."""
    return jax.lax.psum(flags, self.agree_axes) if self.agree_axes else flags

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

  def map_groups(self, step: Callable[[Group], GroupResult]) -> Mapped:
    """Runs `step` on each group; returns the values per leaf, the flags summed over the
    groups and `agree_axes`, and each group's state under its key."""
    results = {group.key: step(group) for group in self.groups}
    values = [None] * len(self.leaves)
    for group in self.groups:
      for i, v in zip(group.indices, results[group.key].values):
        values[i] = v
    flags = self.agree(sum((r.flags for r in results.values()), jnp.float32(0)))
    return Mapped(values, flags, {key: r.state for key, r in results.items()})

  def finish(self, mapped: Mapped, new: Any, old: Any, count: jax.Array | None = None, *,
             shards: int | None = None, prechecked: jax.Array | None = None) -> Finished:
    """The update and the state: `mapped`'s values and the `new` state where its flags are
    finite (0), else NaN updates and the `old` state (trees of one structure), and `count`
    advanced where kept.

    `shards`: the update is each leaf's flat shard over that many devices (a scatter).
    `prechecked`: flags agreed before the step, which then wrote NaN values and kept the
    state itself (`workarounds.finite_first`).
    """
    finite = jnp.isfinite(mapped.flags if prechecked is None else prechecked)
    if count is not None:
      count = jnp.where(finite, optax.safe_increment(count), count)
    shaped = shards is None
    if prechecked is not None:
      return Finished(self.outputs(mapped.values, None, shaped), new, count)
    # NaN, not the flags themselves: a peer's stream that did not decode flags +inf.
    return Finished(self.outputs(mapped.values, flag(finite), shaped),
                    keep_if(finite, new, old), count)

  def by_leaf(self, states: dict, fields: list[list]) -> list[list]:
    """Per-group lists of per-leaf fields ({key: [field][leaf of the group]}) -> per-leaf
    fields ([field][leaf]); `fields` gives the leaves no group holds."""
    out = [list(f) for f in fields]
    for group in self.groups:
      for f, group_field in zip(out, states[group.key]):
        for i, value in zip(group.indices, group_field):
          f[i] = value
    return out


def split(updates: Any, averaged: AxisNames = None) -> Leaves:
  """The gradient tree as `Leaves`: the compressible leaves, grouped by the manual axes other
  than `averaged` over which they vary (every leaf in one group unless a caller's shard_map is
  manual over a model axis, or `core.local_blocks` made one so).

  Example:
    >>> grads = loco_jax.core.leaves.split(grads)
    >>> grads.sent, [g.indices for g in grads.groups], grads.flat(0).shape
    ([0, 1], [[0, 1]], (8,))
  """
  leaves, treedef = jax.tree.flatten(updates)
  sent = [i for i, x in enumerate(leaves) if compressible(x)]
  skip = set(axis_names(averaged))
  by_axes: dict[tuple, list[int]] = {}
  for i in sent:
    by_axes.setdefault(tuple(sorted(varying_axes(leaves[i]) - skip)), []).append(i)
  agree = set().union(*by_axes) if by_axes else set()
  if averaged is None:  # local mode: only the axes `core.local_blocks` split keep-or-skip together
    agree &= set(_LOCAL_AXES.get())
  groups = [Group(group_key(axes), indices, axes) for axes, indices in by_axes.items()]
  return Leaves(leaves, treedef, sent, groups, tuple(sorted(agree)))
