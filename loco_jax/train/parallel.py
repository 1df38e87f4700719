"""DDP / ZeRO-2 train steps under `jax.shard_map`, manual over the data axes only.

Parameters split over other mesh axes (a (data, model) mesh; `NamedSharding` over 'model') keep
that sharding: GSPMD runs the model over them, and the compressor runs in a nested shard_map
over them, so each device compresses and sends its own model shard (train/sharding.py).
Meshes and the multi-host start-up live in train/mesh.py and are re-exported here.
"""

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from loco_jax import comm
from loco_jax.comm import wire
from loco_jax.core import layout, quant, trees
from loco_jax.train import masks, sharding
from loco_jax.train.mesh import (AxisNames, axes_size, data_axes, data_mesh, initialize,
                                 node_mesh)
from loco_jax.train.sharding import opt_state_specs, shard_params, unshard_params

__all__ = ["MODES", "PARAM_GATHERS", "TrainState", "data_mesh", "node_mesh", "initialize",
           "init_opt_state", "opt_state_specs", "shard_params", "unshard_params",
           "init_train_state", "make_train_step", "reduce_scatter"]

MODES = ("ddp", "zero2", "fsdp")
PARAM_GATHERS = ("compute", "int8")


def init_opt_state(optimizer: optax.GradientTransformation, params, mesh: Mesh,
                   axis_name: AxisNames = "data"):
  """Runs `optimizer.init` on every device of the mesh; returns the state and its specs.

  Example:
    >>> opt = optax.chain(loco_jax.loco(axis_name="data"), optax.adamw(1e-3))
    >>> state, specs = init_opt_state(opt, params, data_mesh())
    >>> specs[0].error[""][0] == P("data")   # LoCo's error differs per device
    True
  """
  specs = opt_state_specs(optimizer, params, mesh, axis_name)
  init = jax.jit(jax.shard_map(optimizer.init, mesh=mesh, in_specs=P(), out_specs=specs))
  return init(params), specs


class TrainState(NamedTuple):
  """params: as placed (ddp) or this device's float32 master shard of each leaf, of its own
  model block on a mesh with model axes (zero2; fsdp: an fsdp.Layered whose stacked leaves
  hold one shard a layer)."""
  params: Any
  compressor_state: Any
  opt_state: Any
  step: jax.Array


def _shapes_of(params):
  return sharding.shapes_of(params)


def _local_shard_shapes(params, num_shards):
  return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct((layout.shard_len(x.size, num_shards),), jnp.float32), params)


class _Axes(NamedTuple):
  """A train step's axes: averaged over by hand (data) or left to GSPMD (model)."""
  data: tuple[str, ...]
  model: tuple[str, ...]
  name: str | tuple[str, ...]   # the data axes as one collective's axis_name
  n: int                        # devices along the data axes


def _axes(mesh: Mesh, axis_name: AxisNames, mode: str, compressor) -> _Axes:
  if mode not in MODES:
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
  data = data_axes(mesh, axis_name)
  model = sharding.model_axes(mesh, data)
  if mode == "fsdp" and (model or len(data) > 1):
    raise ValueError(f"mode='fsdp' runs on a mesh of one data axis (parallel.data_mesh); this "
                     f"mesh has axes {tuple(mesh.axis_names)} and axis_name={axis_name!r}: use "
                     f"mode='zero2' (or 'ddp') on a mesh with model axes or several data axes")
  if mode in ("zero2", "fsdp") and compressor is None:
    raise ValueError(f"mode={mode!r} needs a compressor with reduce-scatter semantics, e.g. "
                     "loco(axis_name='data', scatter=True) or parallel.reduce_scatter('data')")
  if mode == "ddp" and compressor is None and model:
    raise ValueError(f"on a mesh with model axes {model}, pass the averaging transformation as "
                     f"compressor= (e.g. compressor=loco(axis_name={axis_name!r})) and the rest "
                     f"as the optimizer: the compressor runs on each device's own model shard, "
                     f"the optimizer on the averaged gradient under GSPMD")
  return _Axes(data, model, data[0] if len(data) == 1 else data, axes_size(mesh, data))


def _param_specs(params, mesh: Mesh, axes: _Axes, axis_name: AxisNames):
  """The params' specs; a ValueError for a model axis that splits none of them, along which
  every device would repeat the same work on the same batch."""
  specs = sharding.param_specs(params, mesh, axes.data)
  used = {a for s in jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
          for a in sharding.spec_axes(s)}
  idle = [a for a in axes.model if a not in used and mesh.shape[a] > 1]
  if idle:
    averaged = tuple(a for a in mesh.axis_names if a in axes.data or a in idle)
    raise ValueError(f"mesh axis {idle[0]!r} is not in axis_name={axis_name!r} and splits no "
                     f"param, so every device along it would repeat the same work: average over "
                     f"it too (axis_name={averaged!r}) or split params over it "
                     f"(NamedSharding(mesh, P(None, {idle[0]!r})))")
  return specs


def _over_data(fn, mesh: Mesh, axes: _Axes, in_specs, out_specs):
  """shard_map manual over the data axes; the model axes stay with GSPMD."""
  return jax.shard_map(fn, mesh=mesh, in_specs=sharding.restrict(in_specs, axes.data),
                       out_specs=sharding.restrict(out_specs, axes.data),
                       axis_names=set(axes.data))


def _over_model(fn, axes: _Axes, in_specs, out_specs):
  """Nested shard_map manual over the model axes too: `fn` sees each device's own blocks.

  The leaf core (core/leaves.py) sees there which leaves vary over the model axes: it
  compresses split and replicated leaves apart and makes their shards keep or skip a step
  together (a 4-byte flag over the model axes), so the outputs type-check against the specs.
  """
  if not axes.model:
    return fn
  return jax.shard_map(fn, in_specs=sharding.restrict(in_specs, axes.model),
                       out_specs=sharding.restrict(out_specs, axes.model),
                       axis_names=set(axes.model))


def _named(mesh: Mesh, specs):
  return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def init_train_state(params, optimizer: optax.GradientTransformation, mesh: Mesh, *,
                     compressor: optax.GradientTransformation | None = None,
                     mode: str = "ddp", axis_name: AxisNames = "data"):
  """A TrainState on the mesh and its PartitionSpecs (full specs on the mesh).

  `axis_name`: the data axes the gradient is averaged over (a tuple for two_hop's
  ("node", "local")); every other mesh axis is a model axis, left to the params' own
  `NamedSharding`s (e.g. P(None, "model")), which they keep.
  ddp: params as given, `optimizer` state split like them (but for per-device error fields).
  On a mesh with model axes the compressor's per-device state is split over the data axes and
  the leaf's model axes: each device compresses its own model shard.
  fsdp: `params` is an `fsdp.Layered`; as zero2, with one compressor state per layer (fsdp.py).
  zero2: params become float32 master shards (of each device's model block) and the optimizer
  state lives on those shards, about 1/N of ddp's per device; `compressor` (e.g.
  `loco(axis_name=..., scatter=True)`) keeps its per-device errors of the full gradient.
  Callable masks in `optimizer` (adamw's `mask`, `optax.masked`, multi_transform labels) see
  the full-shaped params, as in ddp (`masks.evaluate_on_full_shapes`).
  """
  axes = _axes(mesh, axis_name, mode, compressor)
  if mode == "fsdp":  # params: fsdp.Layered(embed, blocks, head); see loco_jax/fsdp.py
    from loco_jax.train import fsdp
    return fsdp.init_train_state(params, optimizer, mesh, compressor, axis_name)
  compressor = compressor or optax.identity()
  pspecs = _param_specs(params, mesh, axes, axis_name)
  comp_specs = sharding.local_state_specs(compressor.init, params, pspecs, mesh, axes.data)
  full = jax.device_put(params, _named(mesh, pspecs))
  if mode == "ddp":
    opt_specs = sharding.global_state_specs(optimizer, params, pspecs, mesh, axes.data)
    param_specs, placed = pspecs, full
    opt_init = optimizer.init  # under GSPMD over the model axes
  else:
    masks.evaluate_on_full_shapes(optimizer)
    like = _shapes_of(params)

    def shard_init(shards):
      with masks.full_shapes(like):
        return optimizer.init(shards)
    blocks = sharding.local_shapes(like, pspecs, mesh)
    opt_specs = sharding.local_state_specs(shard_init, _local_shard_shapes(blocks, axes.n),
                                           pspecs, mesh, axes.data, on_shards=True)
    param_specs = sharding.master_specs(pspecs, mesh, axes.data)
    placed = shard_params(params, mesh, axis_name)
    opt_init = _over_model(shard_init, axes, (param_specs,), opt_specs)
  specs = TrainState(param_specs, comp_specs, opt_specs, P())
  comp_init = _over_model(compressor.init, axes, (pspecs,), comp_specs)

  def init(full_params, placed_params):
    return TrainState(placed_params, comp_init(full_params), opt_init(placed_params),
                      jnp.zeros([], jnp.int32))

  state = jax.jit(_over_data(init, mesh, axes, (pspecs, param_specs), specs),
                  out_shardings=_named(mesh, specs))(full, placed)
  return state, specs


def reduce_scatter(axis_name: AxisNames = "data") -> optax.GradientTransformation:
  """Plain ZeRO-2 gradient averaging: a float32 reduce-scatter per leaf -> this device's shard.

  The uncompressed comparator of `loco(axis_name=..., scatter=True)`; same shard layout. Its
  reduce-scatter is `wire.reduce_scatter` (on gloo an all-to-all and a local sum: gloo's own
  algorithm sends more than each peer's row).
  """
  def update_fn(updates, state, params=None):
    del params
    n = comm.axis_size(axis_name, "reduce_scatter")
    def shard(g):
      rows = layout.shard_rows(g.reshape(-1).astype(jnp.float32), layout.leaf_layout(g.size, n, None))
      return wire.reduce_scatter(rows, axis_name).reshape(-1) / n
    return jax.tree.map(shard, updates), state
  return optax.GradientTransformation(lambda _: optax.EmptyState(), update_fn)


def _gather_params(shards, like, axis_name: str, compute_dtype, how: str, block_size: int):
  """Master shards -> full params in the compute dtype (or through int8 with block scales)."""
  leaves, treedef = jax.tree.flatten(like)
  local = treedef.flatten_up_to(shards)
  n = comm.axis_size(axis_name, "train step")
  layouts = [layout.leaf_layout(x.size, n, block_size) for x in leaves]
  if how == "int8":
    payloads = []
    for s, lay in zip(local, layouts):
      rows = layout.to_rows(s, layout.LeafLayout(lay.row_len, 1, lay.row_len, lay.blocks,
                                             lay.block_len))
      scales = quant.absmax_scale(rows, 8)
      payloads.append(layout.Payload(quant.compress(rows, scales[..., None], 8), scales))
    full, _ = comm.gather_packed(payloads, layouts, 8, None, jnp.zeros((), jnp.float32),
                                 axis_name)
  else:
    # comm.all_gather: a bf16 compute dtype crosses at 16 bits (XLA:CPU would send 32).
    full = [layout.from_rows(comm.all_gather(s.astype(compute_dtype), axis_name), lay)
            for s, lay in zip(local, layouts)]
  return treedef.unflatten([f.reshape(x.shape).astype(compute_dtype)
                            for f, x in zip(full, leaves)])


def make_train_step(loss_fn: Callable[[Any, Any], jax.Array],
                    optimizer: optax.GradientTransformation, mesh: Mesh, specs: TrainState,
                    params_like, *, compressor: optax.GradientTransformation | None = None,
                    mode: str = "ddp", axis_name: AxisNames = "data",
                    compute_dtype=jnp.float32, param_gather: str = "compute",
                    block_size: int | None = None):
  """A jitted `step(state, batch) -> (state, mean loss)` for `loss_fn(params, batch)`.

  The batch's leading axis is split over the data axes `axis_name` (one axis or a tuple, as in
  `init_train_state`); `loss_fn` runs under GSPMD over the other (model) axes, on params split
  as `params_like`'s `NamedSharding`s say, and the compressor runs on each device's own model
  shard. ddp: `compressor` (or, when None, the
  optimizer itself, e.g. `optax.chain(loco(axis_name=...), optax.adamw(...))`) must average the
  gradients over the axis. zero2: every device gathers the parameters in `compute_dtype` from
  the float32 master shards (`param_gather="int8"`: int8 with absmax blocks of `block_size`,
  default 2048, ZeRO++ qwZ style), computes its gradient, the compressor returns this device's
  averaged gradient shard, and the optimizer updates the master shard (callable masks in it see
  the full-shaped params). ddp computes on its params cast to `compute_dtype`; `param_gather`
  and `block_size` are zero2 options (a ValueError in ddp: nothing is gathered there).
  fsdp (ZeRO-3, loco_jax/fsdp.py): `loss_fn` is an `fsdp.LayeredModel` and `params_like` an
  `fsdp.Layered`; parameters are gathered and gradients sent layer by layer, with the same
  options as zero2.
  Example:
    >>> mesh, compressor = data_mesh(), loco_jax.loco(axis_name="data")
    >>> loss_fn = lambda p, batch: jnp.mean((batch @ p["w"] + p["b"]) ** 2)
    >>> state, specs = init_train_state(params, optax.adamw(1e-3), mesh,
    ...                                 compressor=compressor)
    >>> step = make_train_step(loss_fn, optax.adamw(1e-3), mesh, specs, params,
    ...                        compressor=compressor)
    >>> state, loss = step(state, jnp.ones((16, 4)))   # 16 rows: 2 on each of 8 devices
  """
  if mode not in MODES:
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
  if param_gather not in PARAM_GATHERS:
    raise ValueError(f"param_gather must be one of {PARAM_GATHERS}, got {param_gather!r}")
  if mode == "ddp" and param_gather != "compute":
    raise ValueError(f"param_gather={param_gather!r} is a mode='zero2' option (and 'fsdp'): "
                     f"ddp keeps whole params on every device and gathers none")
  if block_size is not None and param_gather != "int8":
    raise ValueError(f"block_size sets the blocks of param_gather='int8' and has no effect with "
                     f"param_gather={param_gather!r} (mode={mode!r})")
  block_size = 2048 if block_size is None else block_size
  if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
    raise ValueError(f"block_size must be a positive int, got {block_size!r}")
  if not jnp.issubdtype(compute_dtype, jnp.floating):
    raise ValueError(f"compute_dtype must be a float dtype (e.g. jnp.bfloat16), got "
                     f"{compute_dtype!r}")
  axes = _axes(mesh, axis_name, mode, compressor)
  n = axes.n
  compressor = compressor or optax.identity()
  like = _shapes_of(params_like)
  if mode in ("zero2", "fsdp"):
    masks.evaluate_on_full_shapes(optimizer)
  zero2_hint = (" mode='zero2' needs a compressor that returns this device's shard of each leaf "
                "(reduce-scatter semantics), e.g. loco(axis_name=..., scatter=True) or "
                "parallel.reduce_scatter(...)." if mode == "zero2" else "")
  if mode != "fsdp":
    pspecs = _param_specs(params_like, mesh, axes, axis_name)
    blocks = sharding.local_shapes(like, pspecs, mesh)
    expected = pspecs if mode == "ddp" else sharding.master_specs(pspecs, mesh, axes.data)
    if axes.model and not sharding.same_specs(specs.params, expected):
      raise ValueError(f"specs.params {specs.params} are not those of params_like's shardings "
                       f"({expected}): pass as params_like the params given to "
                       f"init_train_state, placed with the same NamedShardings")

  def compress(grads, comp_state, params):
    return compressor.update(grads, comp_state, params)

  def gather(shards):  # zero2: this device's model blocks from the master shards
    trees.check_same_shapes(shards, _local_shard_shapes(blocks, n),
                            "state.params (master shards)", "params_like's shards")
    return _gather_params(shards, blocks, axes.name, compute_dtype, param_gather, block_size)

  def update_shards(grads, comp_state, shards, opt_state, params):  # zero2, on own blocks
    grads, comp_state = compress(grads, comp_state, params)
    trees.check_same_shapes(grads, shards, "the compressor's output",
                            "state.params (master shards)", zero2_hint)
    with masks.full_shapes(like):
      updates, opt_state = optimizer.update(grads, opt_state, shards)
    return optax.apply_updates(shards, updates), comp_state, opt_state

  def local_step(state: TrainState, batch):
    if mode == "ddp":
      trees.check_same_shapes(state.params, like, "state.params", "params_like")
      params = jax.tree.map(
          lambda x: x.astype(compute_dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x,
          state.params)
    else:
      params = _over_model(gather, axes, (specs.params,), pspecs)(state.params)
    # Replicated params would make jax.grad psum the gradient in full precision (the transpose
    # of the implicit broadcast); marked varying, each device keeps its own gradient.
    params = jax.lax.pcast(params, axes.name, to="varying")
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)  # GSPMD over the model axes
    if mode == "ddp":
      grads, comp_state = _over_model(compress, axes, (pspecs, specs.compressor_state, pspecs),
                                      (pspecs, specs.compressor_state))(
                                          grads, state.compressor_state, params)
      trees.check_same_shapes(grads, state.params, "the compressor's output", "state.params")
      updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
      new_params = optax.apply_updates(state.params, updates)
    else:
      new_params, comp_state, opt_state = _over_model(
          update_shards, axes,
          (pspecs, specs.compressor_state, specs.params, specs.opt_state, pspecs),
          (specs.params, specs.compressor_state, specs.opt_state))(
              grads, state.compressor_state, state.params, state.opt_state, params)
    return (TrainState(new_params, comp_state, opt_state, state.step + 1),
            jax.lax.pmean(loss, axes.name))

  if mode == "fsdp":  # loss_fn: an fsdp.LayeredModel; params_like: an fsdp.Layered
    from loco_jax.train import fsdp
    sharded = fsdp.sharded_step(loss_fn, optimizer, mesh, specs, params_like, compressor,
                                axis_name, compute_dtype, param_gather, block_size)
  else:
    sharded = jax.jit(_over_data(local_step, mesh, axes, (specs, P(axes.name)), (specs, P())),
                      donate_argnums=0, out_shardings=(_named(mesh, specs), _named(mesh, P())))

  def step(state: TrainState, batch):
    for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
      leaf = jax.tree_util.keystr(path) or "(the batch itself)"
      if not jnp.ndim(x):
        raise ValueError(f"batch leaf {leaf} is a scalar: every batch leaf needs a leading "
                         f"batch axis to split over the {n} devices of axis {axis_name!r} "
                         f"(pass constants to loss_fn through a closure instead)")
      if jnp.shape(x)[0] % n:
        raise ValueError(f"batch size {jnp.shape(x)[0]} of batch leaf {leaf} is not divisible "
                         f"by the {n} devices of axis {axis_name!r}")
    return sharded(state, batch)

  step.jitted = sharded  # for lowering: comm.lowered_collectives(step.jitted, state, batch)
  return step
