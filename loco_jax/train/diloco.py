"""DiLoCo: each worker of the data axes trains its own copy of the params for `inner_steps`
steps without communicating; then the compressor averages the pseudo-gradients (the global
params minus each worker's), the outer optimizer updates the global params, and every worker
restarts from them (Douillard et al. 2023).

With `fragments` F > 1 (streaming DiLoCo) the leaves are cut into F runs of about equal size,
and fragment f syncs after step (f + 1) H / F of every round of H: the exchange is spread over
the round instead of one burst. Each fragment has its own compressor and outer optimizer state,
updated only when it syncs.

Two programs run: the inner step (no collective over the data axes) and, for each fragment, the
inner step followed by that fragment's sync. The step picks one by the step counter, kept on the
host between calls (read from the state when it is not the state the last call returned).
"""

import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from loco_jax.core import local_blocks, trees
from loco_jax.core.local_blocks import spec_entry
from loco_jax.train import sharding, steps
from loco_jax.train.state import Setup


class DilocoState(NamedTuple):
  """mode="diloco"'s state (or its PartitionSpecs).

  params: the global params, as placed (what an evaluation reads); workers: each worker's
  params, stacked on a leading axis split over the data axes; compressor_state and outer_state:
  one per fragment, over its leaves (a list); opt_state: each worker's inner optimizer state,
  stacked like `workers`; step: inner steps taken.
  """
  params: Any
  workers: Any
  compressor_state: tuple
  opt_state: Any
  outer_state: tuple
  step: jax.Array


def fragment_leaves(params: Any, fragments: int) -> list[list[int]]:
  """The leaf indices (tree order) of each fragment: runs of about equal size, none empty.

  Example:
    >>> fragment_leaves({"a": jnp.ones(6), "b": jnp.ones(2), "c": jnp.ones(4)}, 2)
    [[0], [1, 2]]
  """
  sizes = [max(math.prod(jnp.shape(x)), 1) for x in jax.tree.leaves(params)]
  if not 1 <= fragments <= len(sizes):
    raise ValueError(f"fragments must be in 1..{len(sizes)} (the params' leaves), got "
                     f"{fragments}")
  total, start, last, out = sum(sizes), 0, 0, []
  for i, size in enumerate(sizes):
    by_size = start * fragments // total
    last = max(min(by_size, last + 1), last, fragments - (len(sizes) - i))
    out.append(last)
    start += size
  return [[i for i, f in enumerate(out) if f == k] for k in range(fragments)]


def sync_fragment(step: int, inner_steps: int, fragments: int) -> int | None:
  """The fragment that syncs after inner step `step` (0-based), or None.

  Example:
    >>> [sync_fragment(k, 4, 2) for k in range(8)]
    [None, 0, None, 1, None, 0, None, 1]
  """
  due = (step + 1) % inner_steps
  for f in range(fragments):
    if due == (f + 1) * inner_steps // fragments % inner_steps:
      return f
  return None


def _pick(tree: Any, index: list[int]) -> list:
  leaves = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, P))
  return [leaves[i] for i in index]


def _put(tree: Any, index: list[int], values: list) -> Any:
  leaves, treedef = jax.tree.flatten(tree)
  for i, value in zip(index, values):
    leaves[i] = value
  return treedef.unflatten(leaves)


def _stacked(specs: Any, data: tuple[str, ...]) -> Any:
  """Specs with a leading axis split over the data axes (one entry a worker)."""
  return jax.tree.map(lambda s: P(spec_entry(data), *s), specs,
                      is_leaf=lambda x: isinstance(x, P))


def state_specs(setup: Setup) -> DilocoState:
  """Full specs of diloco's state."""
  mesh, data, pspecs, like = setup.mesh, setup.axes.data, setup.param_specs, setup.params
  parts = fragment_leaves(like, setup.outer.fragments)
  inner = sharding.gspmd_state_specs(setup.optimizer.init, like, pspecs, mesh, data)
  return DilocoState(
      pspecs, _stacked(pspecs, data),
      tuple(sharding.local_state_specs(setup.compressor.init, _pick(like, part),
                                       _pick(pspecs, part), mesh, data) for part in parts),
      _stacked(inner, data),
      tuple(sharding.gspmd_state_specs(setup.outer.optimizer.init, _pick(like, part),
                                       _pick(pspecs, part), mesh, data) for part in parts),
      P())


def _per_worker(tree: Any, data: tuple[str, ...]) -> Any:
  """`tree` as this worker's entry of a stacked tree: a leading axis of one, varying over
  `data`."""
  return jax.tree.map(lambda x: jax.lax.pcast(x, data, to="varying")[None], tree)


def init(setup: Setup, params: Any) -> tuple[DilocoState, DilocoState]:
  """diloco's state on the mesh and its full specs (`parallel.init_train_state`): every worker
  starts from `params`."""
  specs, pspecs, data = state_specs(setup), setup.param_specs, setup.axes.data
  parts = fragment_leaves(setup.params, setup.outer.fragments)

  def init_fn(placed):
    compressor = tuple(local_blocks.told_specs(setup.compressor.init, _pick(pspecs, part))(
        _pick(placed, part)) for part in parts)
    outer = tuple(setup.outer.optimizer.init(_pick(placed, part)) for part in parts)
    return DilocoState(placed, _per_worker(placed, data), compressor,
                       _per_worker(setup.optimizer.init(placed), data), outer,
                       jnp.zeros([], jnp.int32))
  placed = jax.device_put(params, sharding.named(setup.mesh, pspecs))
  state = jax.jit(steps.over_data(init_fn, setup, (pspecs,), specs),
                  out_shardings=sharding.named(setup.mesh, specs))(placed)
  return state, specs


def _inner_step(setup: Setup, loss_fn: Callable) -> Callable:
  """One inner step on this worker, in `over_data`: its params, its batch, its optimizer."""
  dtype = setup.gather.dtype
  cast = lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
  one = lambda tree: jax.tree.map(lambda x: x[0], tree)

  def inner(state: DilocoState, batch):
    workers = one(state.workers)
    trees.check_same_shapes(workers, setup.params, "state.workers[i]", "params_like")
    loss, grads = steps.loss_and_grads(loss_fn, jax.tree.map(cast, workers), batch, setup)
    grads = jax.tree.map(lambda g, w: g.astype(w.dtype)[None], grads, workers)

    # The optimizer runs vmapped over the stacked axis (of one) instead of on the unstacked
    # worker: stacking its outputs again made XLA copy the moments on entry to the program.
    def update(grads, opt_state, workers):
      updates, opt_state = setup.optimizer.update(grads, opt_state, workers)
      return optax.apply_updates(workers, updates), opt_state
    new_workers, opt_state = jax.vmap(update)(grads, state.opt_state, state.workers)
    return state._replace(workers=new_workers, opt_state=opt_state,
                          step=state.step + 1), loss[None]
  return inner


def _sync(setup: Setup, part: list[int], index: int) -> Callable:
  """Fragment `index`'s outer step, in `over_data`: the compressor averages the pseudo-gradients
  of its leaves, the outer optimizer updates the global params, and the workers take them."""
  specs = _pick(setup.param_specs, part)
  average = local_blocks.told_specs(setup.compressor.update, specs)
  data = setup.axes.data

  def sync(state: DilocoState) -> DilocoState:
    anchor = _pick(state.params, part)
    worker = [x[0] for x in _pick(state.workers, part)]
    delta = [a - w for a, w in zip(anchor, worker)]
    mean, compressor_state = average(delta, state.compressor_state[index], anchor)
    trees.check_same_shapes(mean, anchor, "the compressor's output", "the fragment's params")
    updates, outer_state = setup.outer.optimizer.update(mean, state.outer_state[index], anchor)
    anchor = optax.apply_updates(anchor, updates)
    replace = lambda states, new: states[:index] + (new,) + states[index + 1:]
    return state._replace(
        params=_put(state.params, part, anchor),
        workers=_put(state.workers, part, jax.tree.leaves(_per_worker(anchor, data))),
        compressor_state=replace(state.compressor_state, compressor_state),
        outer_state=replace(state.outer_state, outer_state))
  return sync


def _local_mean(losses: jax.Array) -> jax.Array:
  """The mean of this process's shards of `losses`, moved onto one of its devices."""
  shards = losses.addressable_shards
  return jnp.mean(jnp.concatenate(jax.device_put([s.data for s in shards], shards[0].device)))


def make_step(setup: Setup, loss_fn: Callable[[Any, Any], jax.Array]) -> Callable:
  """diloco's `step(state, batch) -> (state, mean loss)` (`parallel.make_train_step`): an
  inner step on every worker, then the sync of the fragment due after it, if any.

  `step.jitted` is the inner step's program (it sends nothing over the data axes);
  `step.syncs[f]` the program of an inner step followed by fragment f's sync. The loss is the
  mean of this process's workers (of all of them on one host): averaging it over the hosts
  would cost a collective every step.
  """
  specs, axes, outer = state_specs(setup), setup.axes, setup.outer
  inner = _inner_step(setup, loss_fn)
  io = ((specs, P(axes.name)), (specs, P(axes.name)))

  def program(sync: Callable | None) -> Callable:
    def local(state, batch):
      state, losses = inner(state, batch)
      return (state if sync is None else sync(state)), losses
    return steps.jit_step(steps.over_data(local, setup, *io), setup, io[1])

  jitted = program(None)
  syncs = tuple(program(_sync(setup, part, f))
                for f, part in enumerate(fragment_leaves(setup.params, outer.fragments)))
  last = (None, 0)  # (the step array the last call returned, its value)

  def step(state: DilocoState, batch):
    nonlocal last
    k = last[1] if state.step is last[0] else int(state.step)
    fragment = sync_fragment(k, outer.inner_steps, outer.fragments)
    state, losses = (jitted if fragment is None else syncs[fragment])(state, batch)
    last = (state.step, k + 1)
    return state, _local_mean(losses)

  step.jitted, step.syncs = jitted, syncs
  return step
