"""Errors for trees that do not match: the leaf's key path (jax.tree_util.keystr) and both shapes."""

from typing import Any

import jax
import jax.numpy as jnp
from jax.tree_util import keystr, tree_flatten_with_path


def _paths(tree: Any) -> dict:
  return {keystr(path): leaf for path, leaf in tree_flatten_with_path(tree)[0]}


def _shape(x) -> tuple:
  return tuple(getattr(x, "shape", ()))


def check_same_structure(tree: Any, like: Any, what: str, like_what: str, hint: str = "") -> None:
  """ValueError naming a leaf that one tree has and the other lacks, if their structures differ."""
  if jax.tree.structure(tree) == jax.tree.structure(like):
    return
  have, want = _paths(tree), _paths(like)
  extra = [p for p in have if p not in want]
  missing = [p for p in want if p not in have]
  where = (f"it has leaf {extra[0]}, which {like_what} lacks" if extra else
           f"it lacks leaf {missing[0]}, which {like_what} has" if missing else
           f"the tree structures differ ({jax.tree.structure(tree)} vs "
           f"{jax.tree.structure(like)})")
  raise ValueError(f"{what} does not match {like_what}: {where}.{hint}")


def check_state_matches(caller: str, updates: Any, state: Any, expected: Any) -> None:
  """ValueError naming the first gradient leaf whose part of `state` is not what
  `init(updates)` would build (`expected`, e.g. from jax.eval_shape): the leaf's key path, the
  gradient's shape and the state's shape. Every field of the NamedTuple `state` but scalars
  (step counters) is a tree like the gradient."""
  hint = (" The gradient tree must have the structure and leaf shapes of the params the state "
          "was created from (init).")
  grads = _paths(updates)
  for field, have, want in zip(state._fields, state, expected):
    if have is None or want is None or getattr(want, "ndim", None) == 0:
      continue  # absent in this mode, or a step counter rather than a tree like the gradient
    check_same_structure(updates, have, f"{caller}: the gradient tree", f"state.{field}", hint)
    stored_leaves = _paths(have)
    for path, leaf in _paths(want).items():
      stored = stored_leaves[path]
      if _shape(stored) != _shape(leaf):
        raise ValueError(
            f"{caller}: gradient leaf {path} has shape {_shape(grads[path])}, but state.{field}"
            f"{path} has shape {_shape(stored)} (a gradient of that shape needs "
            f"{_shape(leaf)}).{hint}")


def check_same_shapes(tree: Any, like: Any, what: str, like_what: str, hint: str = "") -> None:
  """ValueError naming the first leaf whose shape differs (key path and both shapes), or a leaf
  that only one of the trees has."""
  check_same_structure(tree, like, what, like_what, hint)
  wanted = _paths(like)
  for path, leaf in _paths(tree).items():
    if _shape(leaf) != _shape(wanted[path]):
      raise ValueError(f"{what} does not match {like_what}: leaf {path} has shape "
                       f"{_shape(leaf)}, {like_what} has {_shape(wanted[path])}.{hint}")


@jax.tree_util.register_pytree_node_class
class TreeSignature:
  """A tree's structure, leaf shapes and which leaves are floats, kept as static pytree
  metadata: a state field that holds no array, costs nothing under jit, and lets a
  transformation whose state does not mirror the params (LoCo's buckets) check each gradient
  tree against the params it was initialised with. `layout`: what else laid the state's arrays
  out (LoCo: its block size and axes, `buckets.plan`'s arguments), a tuple of (name, value)
  pairs, so that train/reshard.py can re-lay them for another device count.

  Example:
    >>> sig = TreeSignature.of({"w": jnp.ones((2, 3))})
    >>> sig.check({"w": jnp.ones((3, 2))}, "loco")
    Traceback (most recent call last):
    ...
    ValueError: loco: gradient leaf ['w'] has shape (3, 2), but the params the state was \
initialised with have (2, 3) there. The gradient tree must have the structure and leaf shapes \
of the params given to init.
  """

  def __init__(self, treedef: Any, shapes: tuple, floats: tuple, layout: tuple = ()):
    self.treedef, self.shapes, self.floats, self.layout = treedef, shapes, floats, layout

  @classmethod
  def of(cls, tree: Any, layout: tuple = ()) -> "TreeSignature":
    leaves, treedef = jax.tree.flatten(tree)
    return cls(treedef, tuple(_shape(x) for x in leaves), tuple(_is_float(x) for x in leaves),
               layout)

  def tree_flatten(self):
    return (), (self.treedef, self.shapes, self.floats, self.layout)

  @classmethod
  def tree_unflatten(cls, aux, children):
    del children
    return cls(*aux)

  def __eq__(self, other) -> bool:
    return isinstance(other, TreeSignature) and self.tree_flatten() == other.tree_flatten()

  def __hash__(self) -> int:
    return hash(self.tree_flatten()[1])

  def __repr__(self) -> str:
    return f"TreeSignature({self.treedef.num_leaves} leaves)"

  def check(self, tree: Any, caller: str) -> None:
    """ValueError naming the first leaf where `tree` differs from the signed tree: structure,
    shape, or a float leaf where there was none (or the reverse); float widths may differ.

    As in `jax.tree.map(f, tree, signed)`, which optax's transformations run, `tree` may stop
    where the signed tree wraps a leaf in a node of its own (flax's `nnx.Param`)."""
    hint = (" The gradient tree must have the structure and leaf shapes of the params given "
            "to init.")
    like = self.treedef.unflatten(list(range(self.treedef.num_leaves)))
    what, like_what = f"{caller}: the gradient tree", "the params the state was initialised with"
    try:
      subtrees = jax.tree.structure(tree).flatten_up_to(like)
    except (ValueError, TypeError):
      subtrees = None
    if subtrees is None or any(len(jax.tree.leaves(t)) != 1 for t in subtrees):
      check_same_structure(tree, like, what, like_what, hint)
      raise ValueError(f"{what} does not match {like_what}: the tree structures differ "
                       f"({jax.tree.structure(tree)} vs {self.treedef}).{hint}")
    for (path, x), index in zip(tree_flatten_with_path(tree)[0],
                                [jax.tree.leaves(t)[0] for t in subtrees]):
      shape, was_float = self.shapes[index], self.floats[index]
      if _shape(x) != shape:
        raise ValueError(f"{caller}: gradient leaf {keystr(path)} has shape {_shape(x)}, but the "
                         f"params the state was initialised with have {shape} there.{hint}")
      if _is_float(x) != was_float:
        raise ValueError(f"{caller}: gradient leaf {keystr(path)} is {_dtype(x)}, but the params "
                         f"the state was initialised with have a "
                         f"{'float' if was_float else 'non-float'} leaf there.{hint}")


def _dtype(x):
  return getattr(x, "dtype", type(x).__name__)


def _is_float(x) -> bool:
  return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


def is_placeholder(params: Any) -> bool:
  """Whether `params` is `optax.tree_map_params`'s stand-in for the params: an object of no
  leaves that is not a container. A state laid out in buckets, which does not mirror the
  params, then gives scalars in its place, so that the stand-in's state is a prefix of the
  real one and is left as it is."""
  return not jax.tree.leaves(params) and not isinstance(params, (dict, list, tuple, type(None)))


def arrays_of(tree: Any) -> str:
  """"N arrays of shapes [...]": a state field laid out in buckets, for an error message."""
  shapes = [tuple(jnp.shape(x)) for x in jax.tree.leaves(tree)]
  return f"{len(shapes)} arrays of shapes {shapes[:4]}" + (" ..." if len(shapes) > 4 else "")


def check_layout(caller: str, state: Any, updates: Any, have: Any, want: Any) -> None:
  """ValueError where `updates` is not like the params of `state`, or its arrays laid out in
  buckets (`have`) not like `want`'s: another transformation's settings, or another mesh."""
  if isinstance(state.signature, TreeSignature):
    state.signature.check(updates, caller)
  if jax.tree.structure(have) != jax.tree.structure(want) or any(
      jnp.shape(a) != jnp.shape(b) or jnp.result_type(a) != jnp.result_type(b)
      for a, b in zip(jax.tree.leaves(have), jax.tree.leaves(want))):
    raise ValueError(
        f"{caller}: the state holds {arrays_of(have)}, but this gradient tree needs "
        f"{arrays_of(want)} (one per bucket of its layout, buckets.plan). The gradient tree "
        f"must have the structure and leaf shapes of the params the state was created from "
        f"(init), and the state must come from a {caller} with the same settings.")
