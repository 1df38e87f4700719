"""Sharded train steps: `init_train_state` and `make_train_step` resolve their arguments once
(`setup`) and hand the `Setup` to the mode's module (train/ddp.py, zero2.py, fsdp.py,
diloco.py).

Each step is a `jax.shard_map` manual over the data axes. Params split over other mesh axes keep
that sharding: GSPMD runs the model over them, and the compressor, told the params' specs
(`core.local_blocks`), compresses each device's own model shard. Meshes, states and the master
shards' gathers are re-exported from train/mesh.py, state.py and shards.py.
"""

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding

from loco_jax.train import ddp, diloco, fsdp, sharding, zero2
from loco_jax.train.mesh import (AxisNames, TrainAxes, communication_mesh, data_mesh,
                                 initialize, node_mesh, train_axes)
from loco_jax.train.shards import (PARAM_GATHERS, ParamGather, reduce_scatter, shard_params,
                                   unshard_params)
from loco_jax.train.state import Outer, Setup, TrainState, init_opt_state, opt_state_specs
from loco_jax.transforms.baselines import uncompressed

__all__ = ["DILOCO_OUTER", "MODES", "Outer", "PARAM_GATHERS", "Setup", "TrainState", "data_mesh",
           "node_mesh", "initialize", "init_opt_state", "opt_state_specs", "shard_params",
           "unshard_params", "setup", "init_train_state", "make_train_step", "reduce_scatter"]

MODES = ("ddp", "zero2", "fsdp", "diloco")
# Each mode module: init(setup, params) -> (state, specs), make_step(setup, loss_fn) -> jitted.
_MODULES = {"ddp": ddp, "zero2": zero2, "fsdp": fsdp, "diloco": diloco}
# DiLoCo's outer optimizer (Douillard et al. 2023).
DILOCO_OUTER = optax.sgd(0.7, momentum=0.9, nesterov=True)


def _checked_axes(mesh: Mesh, axis_name: AxisNames, mode: str, compressor) -> TrainAxes:
  """The step's axes; a ValueError for a mode this mesh or compressor cannot run."""
  if mode not in MODES:
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
  axes = train_axes(mesh, axis_name)
  if mode == "fsdp" and (axes.model or len(axes.data) > 1):
    raise ValueError(f"mode='fsdp' runs on a mesh of one data axis (parallel.data_mesh); this "
                     f"mesh has axes {tuple(mesh.axis_names)} and axis_name={axis_name!r}: use "
                     f"mode='zero2' (or 'ddp') on a mesh with model axes or several data axes")
  if mode in ("zero2", "fsdp") and compressor is None:
    raise ValueError(f"mode={mode!r} needs a compressor with reduce-scatter semantics, e.g. "
                     "loco(axis_name='data', scatter=True) or parallel.reduce_scatter('data')")
  if mode == "ddp" and compressor is None and axes.model:
    raise ValueError(f"on a mesh with model axes {axes.model}, pass the averaging "
                     f"transformation as compressor= (e.g. compressor=loco(axis_name="
                     f"{axis_name!r})) and the rest as the optimizer: the compressor runs on "
                     f"each device's own model shard, the optimizer on the averaged gradient "
                     f"under GSPMD")
  return axes


def _checked_gather(mode: str, compute_dtype, param_gather: str,
                    block_size: int | None) -> ParamGather:
  """How the params are gathered; a ValueError for an option that would be ignored."""
  if param_gather not in PARAM_GATHERS:
    raise ValueError(f"param_gather must be one of {PARAM_GATHERS}, got {param_gather!r}")
  if mode in ("ddp", "diloco") and param_gather != "compute":
    raise ValueError(f"param_gather={param_gather!r} is a mode='zero2' option (and 'fsdp'): "
                     f"{mode} keeps whole params on every device and gathers none")
  if block_size is not None and param_gather != "int8":
    raise ValueError(f"block_size sets the blocks of param_gather='int8' and has no effect with "
                     f"param_gather={param_gather!r} (mode={mode!r})")
  block_size = 2048 if block_size is None else block_size
  if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
    raise ValueError(f"block_size must be a positive int, got {block_size!r}")
  if not jnp.issubdtype(compute_dtype, jnp.floating):
    raise ValueError(f"compute_dtype must be a float dtype (e.g. jnp.bfloat16), got "
                     f"{compute_dtype!r}")
  return ParamGather(compute_dtype, param_gather, block_size)


def _checked_outer(mode: str, mesh: Mesh, inner_steps, outer_optimizer, fragments, overlap,
                   alpha) -> Outer | None:
  """mode="diloco"'s outer step; a ValueError for an option another mode would ignore."""
  given = {"inner_steps": inner_steps, "outer_optimizer": outer_optimizer,
           "fragments": fragments, "overlap": overlap, "alpha": alpha}
  if mode != "diloco":
    ignored = [name for name, value in given.items() if value is not None]
    if ignored:
      raise ValueError(f"{ignored[0]} is a mode='diloco' option; mode={mode!r} has no outer step")
    return None
  fragments = 1 if fragments is None else fragments
  for name, value in (("inner_steps", inner_steps), ("fragments", fragments)):
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
      raise ValueError(f"mode='diloco' needs {name} a positive int, got {value!r}")
  if inner_steps % fragments:
    raise ValueError(f"fragments={fragments} must divide inner_steps={inner_steps} (a fragment "
                     f"syncs every inner_steps / fragments steps)")
  if outer_optimizer is not None and not isinstance(outer_optimizer,
                                                    optax.GradientTransformation):
    raise TypeError(f"outer_optimizer must be an optax.GradientTransformation (e.g. "
                    f"optax.sgd(0.7, momentum=0.9, nesterov=True)), got {outer_optimizer!r}")
  overlap = 0 if overlap is None else overlap
  if isinstance(overlap, bool) or not isinstance(overlap, int) or not 0 <= overlap < inner_steps:
    raise ValueError(f"overlap must be an int in 0..{inner_steps - 1} (inner steps a sync runs "
                     f"beside; inner_steps={inner_steps}: from {inner_steps} on a fragment's "
                     f"sync would still run when its next one is due), got {overlap!r}")
  alpha = (0.5 if overlap else 0.0) if alpha is None else alpha
  if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha <= 1:
    raise ValueError(f"alpha must be a float in [0, 1] (the worker's share of its params when "
                     f"a sync is merged), got {alpha!r}")
  return Outer(outer_optimizer or DILOCO_OUTER, inner_steps, fragments, overlap, float(alpha),
               communication_mesh(mesh) if overlap else None)


def setup(params, optimizer: optax.GradientTransformation, mesh: Mesh, *,
          compressor: optax.GradientTransformation | None = None, mode: str = "ddp",
          axis_name: AxisNames = "data", compute_dtype=jnp.float32,
          param_gather: str = "compute", block_size: int | None = None,
          inner_steps: int | None = None, outer_optimizer: optax.GradientTransformation | None
          = None, fragments: int | None = None, overlap: int | None = None,
          alpha: float | None = None) -> Setup:
  """The arguments of `init_train_state` / `make_train_step`, checked and resolved once: the
  mesh's data and model axes, the params' shapes and specs, the gather. A ValueError for a
  mode this mesh or compressor cannot run, or an option that would be ignored.

  Example:
    >>> s = setup(params, optax.adamw(1e-3), data_mesh(), compressor=loco_jax.loco())
    >>> s.axes.data, s.param_specs["w"]
    (('data',), P())
  """
  axes = _checked_axes(mesh, axis_name, mode, compressor)
  gather = _checked_gather(mode, compute_dtype, param_gather, block_size)
  outer = _checked_outer(mode, mesh, inner_steps, outer_optimizer, fragments, overlap, alpha)
  if mode == "diloco" and compressor is None:
    compressor = uncompressed(axes.name)
  return Setup(mesh, axes, optimizer, compressor or optax.identity(), sharding.shapes_of(params),
               sharding.train_param_specs(params, mesh, axes), gather, outer)


def init_train_state(params, optimizer: optax.GradientTransformation, mesh: Mesh, *,
                     compressor: optax.GradientTransformation | None = None,
                     mode: str = "ddp", axis_name: AxisNames = "data",
                     inner_steps: int | None = None,
                     outer_optimizer: optax.GradientTransformation | None = None,
                     fragments: int | None = None, overlap: int | None = None,
                     alpha: float | None = None):
  """A TrainState on the mesh and its PartitionSpecs (full specs on the mesh).

  Args:
    params: the params, placed with NamedShardings over the model axes (which they keep), or
      plain. mode="fsdp": an `fsdp.Layered`.
    optimizer: any optax optimizer; its callable masks see the full-shaped params.
    compressor: averages the gradient over the data axes (e.g. `loco(axis_name="data")`);
      zero2 and fsdp need reduce-scatter semantics (`loco(..., scatter=True)`); ddp on data
      axes alone may leave it None and average in the optimizer.
      mode="diloco": averages the pseudo-gradients; None averages them in float32.
    mode: "ddp", "zero2", "fsdp" or "diloco" (train/ddp.py, zero2.py, fsdp.py, diloco.py).
    axis_name: the data axes, one or a tuple; every other mesh axis is a model axis.
    inner_steps, outer_optimizer, fragments, overlap, alpha: mode="diloco" (see
      `make_train_step`).

  Returns:
    (state, specs). zero2 and fsdp keep float32 master shards and the optimizer state on them;
    diloco a `diloco.DilocoState`.
  """
  return _MODULES[mode].init(setup(params, optimizer, mesh, compressor=compressor, mode=mode,
                                    axis_name=axis_name, inner_steps=inner_steps,
                                    outer_optimizer=outer_optimizer, fragments=fragments,
                                    overlap=overlap, alpha=alpha),
                             params)


def _check_batch(batch: Any, size: int, axis_name: AxisNames) -> None:
  for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
    leaf = jax.tree_util.keystr(path) or "(the batch itself)"
    if not jnp.ndim(x):
      raise ValueError(f"batch leaf {leaf} is a scalar: every batch leaf needs a leading batch "
                       f"axis to split over the {size} devices of axis {axis_name!r} (pass "
                       f"constants to loss_fn through a closure instead)")
    if jnp.shape(x)[0] % size:
      raise ValueError(f"batch size {jnp.shape(x)[0]} of batch leaf {leaf} is not divisible by "
                       f"the {size} devices of axis {axis_name!r}")


def _check_placed(params: Any, specs: Any) -> None:
  """A ValueError where `params` (a train state's) are split otherwise than `specs` say."""
  for (path, x), spec in zip(jax.tree_util.tree_flatten_with_path(params)[0],
                             jax.tree.structure(params).flatten_up_to(specs)):
    placed = getattr(x, "sharding", None)
    if isinstance(placed, NamedSharding) and not sharding.same_specs(placed.spec, spec):
      raise ValueError(f"state.params{jax.tree_util.keystr(path)} is split as {placed.spec}, "
                       f"params_like's shardings make it {spec}: pass as params_like the params "
                       f"given to init_train_state, placed with the same NamedShardings")


def make_train_step(loss_fn: Callable[[Any, Any], jax.Array],
                    optimizer: optax.GradientTransformation, mesh: Mesh, params_like, *,
                    compressor: optax.GradientTransformation | None = None,
                    mode: str = "ddp", axis_name: AxisNames = "data",
                    compute_dtype=jnp.float32, param_gather: str = "compute",
                    block_size: int | None = None, inner_steps: int | None = None,
                    outer_optimizer: optax.GradientTransformation | None = None,
                    fragments: int | None = None, overlap: int | None = None,
                    alpha: float | None = None):
  """A jitted `step(state, batch) -> (state, mean loss)` for `loss_fn(params, batch)`.

  Args:
    loss_fn: `loss_fn(params, batch) -> scalar`, run under GSPMD over the model axes.
      mode="fsdp": an `fsdp.LayeredModel`.
    optimizer, mesh, compressor, mode, axis_name: as given to `init_train_state`.
    params_like: the params given to `init_train_state` (or their shapes), placed alike.
    compute_dtype: the float dtype the model computes in.
    param_gather: zero2 and fsdp: "compute" (gather in `compute_dtype`) or "int8" (absmax
      blocks of `block_size`, default 2048, ZeRO++ qwZ style).
    inner_steps: mode="diloco": H, the steps each worker takes alone between two syncs; the
      optimizer is then the inner one, each worker's own.
    outer_optimizer: mode="diloco": updates the global params with the averaged
      pseudo-gradient; default Nesterov SGD, lr 0.7, momentum 0.9 (`DILOCO_OUTER`).
    fragments: mode="diloco": F, parts of the params synced in turn, one every H / F steps
      (streaming DiLoCo); default 1.
    overlap: mode="diloco": tau, the inner steps a sync runs beside before its result is
      merged (default 0: the sync blocks). Each sync runs on a communication device of every
      process (`communication_mesh`), so each process needs devices outside `mesh`.
    alpha: mode="diloco": the worker's share of its own params when a sync is merged; default
      0.5 with overlap (Streaming DiLoCo), else 0 (the worker takes the global params).

  Returns:
    The step; the batch's leading axis is split over the data axes. `step.jitted` is the
    jitted function, for lowering: `comm.lowered_collectives(step.jitted, state, batch)`.
    mode="diloco": `step.jitted` is the inner step; `step.syncs`, `step.merges` and
    `step.lowered` are described in `diloco.make_step`.

  Example:
    >>> mesh, compressor = data_mesh(), loco_jax.loco(axis_name="data")
    >>> loss_fn = lambda p, batch: jnp.mean((batch @ p["w"] + p["b"]) ** 2)
    >>> state, specs = init_train_state(params, optax.adamw(1e-3), mesh,
    ...                                 compressor=compressor)
    >>> step = make_train_step(loss_fn, optax.adamw(1e-3), mesh, params,
    ...                        compressor=compressor)
    >>> state, loss = step(state, jnp.ones((16, 4)))   # 16 rows: 2 on each of 8 devices
  """
  resolved = setup(params_like, optimizer, mesh, compressor=compressor, mode=mode,
                   axis_name=axis_name, compute_dtype=compute_dtype, param_gather=param_gather,
                   block_size=block_size, inner_steps=inner_steps,
                   outer_optimizer=outer_optimizer, fragments=fragments, overlap=overlap,
                   alpha=alpha)
  jitted = _MODULES[mode].make_step(resolved, loss_fn)
  axes, pspecs = resolved.axes, resolved.param_specs
  placed = (None if mode == "fsdp" or not axes.model else pspecs if mode in ("ddp", "diloco")
            else sharding.master_specs(pspecs, axes.data))

  def step(state: TrainState, batch):
    nonlocal placed
    _check_batch(batch, axes.size, axes.name)
    if placed is not None:  # once: the state's model split is that of params_like
      _check_placed(state.params, placed)
      placed = None
    return jitted(state, batch)

  step.jitted = getattr(jitted, "jitted", jitted)
  if mode == "diloco":
    step.syncs, step.merges, step.lowered = jitted.syncs, jitted.merges, jitted.lowered
  return step
