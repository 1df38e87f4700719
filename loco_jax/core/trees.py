"""Errors for trees that do not match: the leaf's key path (jax.tree_util.keystr) and both shapes."""

from typing import Any

import jax
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


def check_state_matches(who: str, updates: Any, state: Any, expected: Any) -> None:
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
    check_same_structure(updates, have, f"{who}: the gradient tree", f"state.{field}", hint)
    stored_leaves = _paths(have)
    for path, leaf in _paths(want).items():
      stored = stored_leaves[path]
      if _shape(stored) != _shape(leaf):
        raise ValueError(
            f"{who}: gradient leaf {path} has shape {_shape(grads[path])}, but state.{field}"
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
