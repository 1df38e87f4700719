"""Callable optax masks under ZeRO-2: evaluated on the full-shaped params, not on flat shards.

ZeRO-2 gives the optimizer flat 1-D master shards, so a mask such as `lambda p: jax.tree.map(
lambda x: x.ndim > 1, p)` would see no matrix. `evaluate_on_full_shapes` wraps every callable
mask or label function in the optimizer so that, inside `full_shapes(like)`, it is evaluated
on `like` (the full-shaped params) and its result applies leaf by leaf to the shards.
"""

import contextlib
import contextvars
import functools
import types
from typing import Any, Callable, Iterator

import jax
import optax

# Closure variables (and inject_hyperparams keyword names) of optax's transformations that hold
# a function of the params tree: masked's and add_decayed_weights' `mask`, multi_transform's
# `param_labels`.
_PARAMS_FUNCTIONS = ("mask", "param_labels")
_FULL_SHAPED: contextvars.ContextVar = contextvars.ContextVar("full_shaped_params", default=None)


class _OnFullShapes:
  """A params function that, inside `full_shapes`, sees the full-shaped params instead."""

  def __init__(self, fn):
    self.fn = fn
    functools.update_wrapper(self, fn)

  def __call__(self, tree):
    like = _FULL_SHAPED.get()
    return self.fn(tree if like is None else _aligned(tree, like))


def _aligned(tree: Any, like: Any) -> Any:
  """`like` where `tree` has a leaf; optax.MaskedNode where an outer mask took the leaf out."""
  masked_node = lambda x: isinstance(x, optax.MaskedNode)
  try:
    return jax.tree.map(lambda t, full: t if masked_node(t) else full, tree, like,
                        is_leaf=masked_node)
  except ValueError:
    raise ValueError(
        f"a callable optax mask (or multi_transform label function) was given a tree that is "
        f"not the params tree, so it cannot be evaluated on the full-shaped params under "
        f"mode='zero2'; pass the mask as a pytree of bools instead. Tree: "
        f"{jax.tree.structure(tree)}; params: {jax.tree.structure(like)}") from None


@contextlib.contextmanager
def full_shapes(like: Any) -> Iterator[None]:
  """Inside, wrapped params functions are evaluated on `like` (e.g. ShapeDtypeStructs)."""
  token = _FULL_SHAPED.set(like)
  try:
    yield
  finally:
    _FULL_SHAPED.reset(token)


def _is_params_function(value) -> bool:
  # inject_hyperparams wraps a callable it takes for a schedule (no static_args) in an object
  # with `init`: that one is called with the step count, not with the params.
  return callable(value) and not hasattr(value, "init")


def _wrap(fn):
  return fn if isinstance(fn, _OnFullShapes) else _OnFullShapes(fn)


def evaluate_on_full_shapes(transformation: Any) -> int:
  """Wraps, in place, every mask or label function found in the closures of `transformation`
  (optax.chain, masked, adamw, multi_transform, inject_hyperparams ...); outside `full_shapes`
  they behave as before. Returns how many are wrapped (again calls find the same ones).

  Example:
    >>> opt = optax.adamw(1e-3, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p))
    >>> evaluate_on_full_shapes(opt)
    1
  """
  seen, found = set(), 0

  def visit(obj):
    nonlocal found
    if id(obj) in seen:
      return
    seen.add(id(obj))
    if isinstance(obj, types.FunctionType):
      for name, cell in zip(obj.__code__.co_freevars, obj.__closure__ or ()):
        try:
          value = cell.cell_contents
        except ValueError:  # a cell not filled yet
          continue
        if name in _PARAMS_FUNCTIONS and _is_params_function(value):
          found += id(cell) not in seen  # init and update share the cell
          seen.add(id(cell))
          cell.cell_contents = _wrap(value)
        else:
          visit(value)
    elif isinstance(obj, functools.partial):
      visit(obj.func)
      visit(obj.args)
      visit(obj.keywords)
    elif isinstance(obj, (tuple, list)):
      for item in obj:
        visit(item)
    elif isinstance(obj, dict):
      for key, value in list(obj.items()):
        if key in _PARAMS_FUNCTIONS and _is_params_function(value):
          obj[key] = _wrap(value)
          found += 1
        else:
          visit(value)

  visit(transformation)
  return found


def on_full_shapes(fn: Callable, like: Any) -> Callable:
  """`fn` run inside `full_shapes(like)`: e.g. an optimizer's init or update on master shards,
  whose callable masks then see the full-shaped params `like`."""
  def run(*args):
    with full_shapes(like):
      return fn(*args)
  return run
