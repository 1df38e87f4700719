"""DiLoCo: each worker of the data axes trains its own copy of the params for `inner_steps`
steps without communicating; then the compressor averages the pseudo-gradients (the global
params minus each worker's), the outer optimizer updates the global params, and every worker
restarts from them (Douillard et al. 2023).

With `fragments` F > 1 (streaming DiLoCo) the leaves are cut into F runs of about equal size,
and fragment f syncs after step (f + 1) H / F of every round of H: the exchange is spread over
the round instead of one burst. Each fragment has its own compressor and outer optimizer state,
updated only when it syncs.

With `overlap` tau > 0 a sync runs beside the next tau inner steps and its result is merged
after them (Streaming DiLoCo's delayed merge). For each fragment, with W the worker's params,
theta the global params and k the 0-based inner step::

  after step k, if the fragment syncs (`sync_fragment`):
      delta = theta - W                     (every worker's own)
      theta = theta + outer(compressor.mean(delta))
      tau = 0: W = alpha * W + (1 - alpha) * theta
  after step k + tau (tau > 0):
      W = alpha * W + (1 - alpha) * theta   (W holds the tau steps taken since the sync began)

alpha defaults to 0.5 with overlap (the paper's) and to 0 without: W = theta, the blocking
sync. A sync's theta is in the state from the step it starts, so a checkpoint taken while a
sync runs holds its result (saving waits for it), and the merge tau steps later reads it back.

The overlapped sync runs on a communication device of every process (`mesh.communication_mesh`):
the global params, the compressor's and the outer optimizer's states live there, the
fragment's worker params are copied there, and the sync program and the inner steps are
independent programs on different devices. XLA:CPU runs one device's programs one after the
other, so a sync on the compute device would stop the inner steps (docs/results/diloco.md).

Programs: the inner step (no collective over the data axes); without overlap, for each fragment,
the inner step followed by that fragment's sync; with overlap, for each fragment, its sync on
the communication devices and the inner step followed by its merge. The step picks them by the
step counter, kept on the host between calls (read from the state when it is not the state the
last call returned).
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


def merge_fragment(step: int, inner_steps: int, fragments: int, overlap: int) -> int | None:
  """The fragment whose overlapped sync is merged after inner step `step`, or None.

  Example:
    >>> [merge_fragment(k, 4, 2, 1) for k in range(8)]
    [None, None, 0, None, 1, None, 0, None]
  """
  if not overlap or step < overlap:
    return None
  return sync_fragment(step - overlap, inner_steps, fragments)


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


def _outer_step(setup: Setup, part: list[int]) -> Callable:
  """A fragment's outer step, in `over_data`: `(anchor, worker, compressor_state, outer_state)`
  -> the same, the compressor averaging the pseudo-gradients and the outer optimizer moving the
  global params (the anchor) by the mean."""
  average = local_blocks.told_specs(setup.compressor.update, _pick(setup.param_specs, part))

  def outer_step(anchor: list, worker: list, compressor_state, outer_state):
    delta = [a - w[0] for a, w in zip(anchor, worker)]
    mean, compressor_state = average(delta, compressor_state, anchor)
    trees.check_same_shapes(mean, anchor, "the compressor's output", "the fragment's params")
    updates, outer_state = setup.outer.optimizer.update(mean, outer_state, anchor)
    return optax.apply_updates(anchor, updates), compressor_state, outer_state
  return outer_step


def _merged(worker: list, anchor: list, setup: Setup) -> list:
  """The workers' leaves of a fragment once its sync is merged: alpha of their own, the rest
  of the global params (alpha 0: the global params, and a non-finite worker is dropped)."""
  alpha, anchor = setup.outer.alpha, jax.tree.leaves(_per_worker(anchor, setup.axes.data))
  if not alpha:
    return anchor
  return [(alpha * w + (1 - alpha) * a).astype(w.dtype) for w, a in zip(worker, anchor)]


def _replaced(states: tuple, index: int, new: Any) -> tuple:
  return states[:index] + (new,) + states[index + 1:]


def _sync(setup: Setup, part: list[int], index: int) -> Callable:
  """Fragment `index`'s blocking sync, in `over_data`: its outer step, then its merge."""
  outer_step = _outer_step(setup, part)

  def sync(state: DilocoState) -> DilocoState:
    worker = _pick(state.workers, part)
    anchor, compressor_state, outer_state = outer_step(
        _pick(state.params, part), worker, state.compressor_state[index],
        state.outer_state[index])
    return state._replace(
        params=_put(state.params, part, anchor),
        workers=_put(state.workers, part, _merged(worker, anchor, setup)),
        compressor_state=_replaced(state.compressor_state, index, compressor_state),
        outer_state=_replaced(state.outer_state, index, outer_state))
  return sync


def _local_mean(losses: jax.Array) -> jax.Array:
  """The mean of this process's shards of `losses`, moved onto one of its devices."""
  shards = losses.addressable_shards
  return jnp.mean(jnp.concatenate(jax.device_put([s.data for s in shards], shards[0].device)))


# What lives with the sync on the communication devices when it overlaps the inner steps.
_WITH_THE_SYNC = ("params", "compressor_state", "outer_state")


def _with_the_sync(state: DilocoState, mesh, specs: DilocoState) -> DilocoState:
  """`state` with the global params and the sync's states placed on `mesh`."""
  return state._replace(**{f: sharding.placed(getattr(state, f), mesh, getattr(specs, f))
                           for f in _WITH_THE_SYNC})


def _inner_only(state: DilocoState) -> DilocoState:
  return state._replace(**dict.fromkeys(_WITH_THE_SYNC))


def init(setup: Setup, params: Any) -> tuple[DilocoState, DilocoState]:
  """diloco's state on the mesh and its full specs (`parallel.init_train_state`): every worker
  starts from `params`. With overlap the global params and the sync's states are on the
  communication devices."""
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
  if setup.outer.overlap:
    state = _with_the_sync(state, setup.outer.comm_mesh, specs)
  return state, specs


class _Programs(NamedTuple):
  inner: Callable           # (state, batch): the inner step
  syncs: tuple              # per fragment: without overlap (state, batch); with, on comm_mesh
  merges: tuple             # with overlap, per fragment: ((state, anchor), batch)


def _programs(setup: Setup, loss_fn: Callable) -> _Programs:
  """The jitted programs of the step (see the module docstring)."""
  specs, axes, outer = state_specs(setup), setup.axes, setup.outer
  parts = fragment_leaves(setup.params, outer.fragments)
  inner = _inner_step(setup, loss_fn)
  batch_spec = P(axes.name)

  def jitted(local: Callable, state_specs: Any) -> Callable:   # local(state, batch)
    io = ((state_specs, batch_spec), (state_specs, batch_spec))
    return steps.jit_step(steps.over_data(local, setup, *io), setup, io[1])

  def inner_then(after: Callable) -> Callable:
    def local(state, batch):
      state, losses = inner(state, batch)
      return after(state), losses
    return local

  if not outer.overlap:
    return _Programs(jitted(inner_then(lambda state: state), specs),
                     tuple(jitted(inner_then(_sync(setup, part, f)), specs)
                           for f, part in enumerate(parts)), ())
  inner_specs = _inner_only(specs)

  def merge(part: list[int]) -> Callable:   # ((state, the new global params), batch)
    def local(both, batch):
      state, anchor = both
      state, losses = inner(state, batch)
      workers = _put(state.workers, part, _merged(_pick(state.workers, part), anchor, setup))
      return (state._replace(workers=workers), anchor), losses
    return jitted(local, (inner_specs, _pick(setup.param_specs, part)))

  def sync(f: int, part: list[int]) -> Callable:   # on the communication devices
    anchor = _pick(setup.param_specs, part)
    ins = (anchor, _pick(specs.workers, part), specs.compressor_state[f], specs.outer_state[f])
    outs = (anchor, specs.compressor_state[f], specs.outer_state[f])
    return jax.jit(steps.over_data(_outer_step(setup, part), setup._replace(
        mesh=outer.comm_mesh), ins, outs), donate_argnums=(0, 2, 3),
                   out_shardings=sharding.named(outer.comm_mesh, outs))

  return _Programs(jitted(inner_then(lambda state: state), inner_specs),
                   tuple(sync(f, part) for f, part in enumerate(parts)),
                   tuple(merge(part) for part in parts))


def make_step(setup: Setup, loss_fn: Callable[[Any, Any], jax.Array]) -> Callable:
  """diloco's `step(state, batch) -> (state, mean loss)` (`parallel.make_train_step`): an
  inner step on every worker, then the sync (or, with overlap, the merge) due after it.

  `step.jitted` is the inner step's program (it sends nothing over the data axes). Without
  overlap `step.syncs[f]` is the program of an inner step followed by fragment f's sync; with
  overlap it is fragment f's sync on the communication devices, and `step.merges[f]` the inner
  step followed by its merge. `step.lowered(state, batch)` lowers each program, with its share
  of the steps. The loss is the mean of this process's workers (of all of them on one host):
  averaging it over the hosts would cost a collective every step.
  """
  specs, outer = state_specs(setup), setup.outer
  parts = fragment_leaves(setup.params, outer.fragments)
  programs = _programs(setup, loss_fn)
  last = (None, 0)  # (the step array the last call returned, its value)

  def step(state: DilocoState, batch):
    nonlocal last
    fresh = state.step is not last[0]
    k = int(state.step) if fresh else last[1]
    if not outer.overlap:
      fragment = sync_fragment(k, outer.inner_steps, outer.fragments)
      state, losses = (programs.inner if fragment is None else programs.syncs[fragment])(
          state, batch)
    else:
      state, losses = _overlapped(state if not fresh else
                                  _with_the_sync(state, outer.comm_mesh, specs), batch, k)
    last = (state.step, k + 1)
    return state, _local_mean(losses)

  def _overlapped(state: DilocoState, batch, k: int) -> tuple[DilocoState, jax.Array]:
    merging = merge_fragment(k, outer.inner_steps, outer.fragments, outer.overlap)
    if merging is None:
      inner, losses = programs.inner(_inner_only(state), batch)
    else:
      anchor = sharding.placed(_pick(state.params, parts[merging]), setup.mesh,
                       _pick(setup.param_specs, parts[merging]))
      (inner, _), losses = programs.merges[merging]((_inner_only(state), anchor), batch)
    state = inner._replace(**{f: getattr(state, f) for f in _WITH_THE_SYNC})
    f = sync_fragment(k, outer.inner_steps, outer.fragments)
    if f is not None:
      part = parts[f]
      worker = sharding.placed(_pick(inner.workers, part), outer.comm_mesh,
                               _pick(specs.workers, part))
      anchor, compressor_state, outer_state = programs.syncs[f](
          _pick(state.params, part), worker, state.compressor_state[f], state.outer_state[f])
      state = state._replace(
          params=_put(state.params, part, anchor),
          compressor_state=_replaced(state.compressor_state, f, compressor_state),
          outer_state=_replaced(state.outer_state, f, outer_state))
    return state, losses

  def lowered(state: DilocoState, batch) -> list[tuple[Any, float]]:
    h = outer.inner_steps
    if not outer.overlap:
      return ([(programs.inner.lower(state, batch), (h - len(parts)) / h)]
              + [(sync.lower(state, batch), 1 / h) for sync in programs.syncs])
    inner = _inner_only(state)
    out = [(programs.inner.lower(inner, batch), (h - len(parts)) / h)]
    on_comm = lambda tree, specs: sharding.shapes_on(tree, outer.comm_mesh, specs)
    for f, part in enumerate(parts):
      anchor, anchor_specs = _pick(state.params, part), _pick(setup.param_specs, part)
      out.append((programs.merges[f].lower(
          (inner, sharding.shapes_on(anchor, setup.mesh, anchor_specs)), batch), 1 / h))
      out.append((programs.syncs[f].lower(
          on_comm(anchor, anchor_specs), on_comm(_pick(state.workers, part),
                                                 _pick(specs.workers, part)),
          on_comm(state.compressor_state[f], specs.compressor_state[f]),
          on_comm(state.outer_state[f], specs.outer_state[f])), 1 / h))
    return out

  step.jitted, step.syncs, step.merges, step.lowered = (programs.inner, programs.syncs,
                                                        programs.merges, lowered)
  return step
