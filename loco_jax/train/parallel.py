"""Meshes, multi-host start-up, and DDP / ZeRO-2 train steps under `jax.shard_map`."""

import os
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from loco_jax import comm
from loco_jax.core import quant, trees
from loco_jax.train import masks
from loco_jax.transforms.loco import state_specs

MODES = ("ddp", "zero2", "fsdp")
PARAM_GATHERS = ("compute", "int8")


def data_mesh(num_devices: int | None = None, axis_name: str = "data") -> Mesh:
  """A 1-D mesh of the first `num_devices` devices (all by default) with Auto axis types."""
  available = jax.device_count()
  num_devices = available if num_devices is None else num_devices  # 0 is an error, not "all"
  if not 1 <= num_devices <= available:
    raise ValueError(f"num_devices must be in 1..{available} (devices present), got "
                     f"{num_devices}")
  return jax.make_mesh((num_devices,), (axis_name,), axis_types=(AxisType.Auto,),
                       devices=jax.devices()[:num_devices])


def node_mesh(nodes: int, local: int, axis_names: tuple[str, str] = ("node", "local")) -> Mesh:
  """A 2-D (node, local) mesh of nodes * local devices, for `hierarchical.two_hop`."""
  if nodes < 1 or local < 1 or nodes * local > jax.device_count():
    raise ValueError(f"nodes * local must be in 1..{jax.device_count()} (devices present), "
                     f"got {nodes} x {local}")
  return jax.make_mesh((nodes, local), axis_names, axis_types=(AxisType.Auto,) * 2,
                       devices=jax.devices()[: nodes * local])


def _check_axis(mesh: Mesh, axis_name: str) -> None:
  if axis_name not in mesh.axis_names:
    raise ValueError(f"axis_name {axis_name!r} is not an axis of the mesh; its axes are "
                     f"{tuple(mesh.axis_names)}")


def opt_state_specs(optimizer: optax.GradientTransformation, params, mesh: Mesh,
                    axis_name: str | tuple[str, ...]):
  """PartitionSpecs of `optimizer.init(params)` inside shard_map: LoCo errors per device."""
  names = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
  for name in names:
    _check_axis(mesh, name)
  init = lambda _: optimizer.init(params)
  for name in reversed(names):  # bind every axis so that init can ask for its size
    init = jax.vmap(init, axis_name=name, axis_size=mesh.shape[name])
  shapes = jax.eval_shape(init, jnp.zeros([mesh.shape[name] for name in names]))
  return state_specs(shapes, axis_name)


def init_opt_state(optimizer: optax.GradientTransformation, params, mesh: Mesh,
                   axis_name: str | tuple[str, ...] = "data"):
  """Runs `optimizer.init` on every device of the mesh; returns the state and its specs.

  Example:
    >>> opt = optax.chain(loco_jax.loco(axis_name="data"), optax.adamw(1e-3))
    >>> state, specs = init_opt_state(opt, params, data_mesh())
    >>> specs[0].error["w"] == P("data")   # LoCo's error differs per device
    True
  """
  specs = opt_state_specs(optimizer, params, mesh, axis_name)
  init = jax.jit(jax.shard_map(optimizer.init, mesh=mesh, in_specs=P(), out_specs=specs))
  return init(params), specs


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, local_device_ids=None,
               cpu_collectives: str = "gloo", *, gloo_hostname: str | None = None,
               gloo_interface: str | None = None, **kwargs) -> None:
  """Joins a multi-host job: `jax.distributed.initialize` with explicit arguments or, where they
  are None, the usual environment (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID;
  on TPU pods, Slurm and Open MPI jax finds them itself). Call it before anything else touches
  jax devices. On CPU it selects `cpu_collectives` ("gloo") so that collectives cross processes.

  Gloo binds to the address this machine's hostname resolves to; on a multi-homed host pass
  `gloo_hostname` (this host's address on the training network, e.g. "10.0.0.2") or
  `gloo_interface` (e.g. "eth1") to bind it there instead (or the environment's
  LOCO_JAX_GLOO_HOSTNAME / LOCO_JAX_GLOO_INTERFACE). jax itself does not pass these on to
  jaxlib's `make_gloo_tcp_collectives`, so this registers a CPU backend factory that does; it
  must run before the CPU backend exists (a RuntimeError says so otherwise).

  Example:
    >>> initialize("10.0.0.1:1234", num_processes=2, process_id=0,  # doctest: +SKIP
    ...            gloo_hostname="10.0.0.1")   # joins a 2-process job: not run as a doctest
  """
  env = os.environ
  coordinator_address = coordinator_address or env.get("JAX_COORDINATOR_ADDRESS")
  if num_processes is None and "JAX_NUM_PROCESSES" in env:
    num_processes = int(env["JAX_NUM_PROCESSES"])
  if process_id is None and "JAX_PROCESS_ID" in env:
    process_id = int(env["JAX_PROCESS_ID"])
  if num_processes is not None and num_processes < 1:
    raise ValueError(f"num_processes must be >= 1, got {num_processes}")
  if process_id is not None and num_processes is not None and not 0 <= process_id < num_processes:
    raise ValueError(f"process_id must be in 0..{num_processes - 1}, got {process_id}")
  gloo_hostname = gloo_hostname or env.get("LOCO_JAX_GLOO_HOSTNAME") or None
  gloo_interface = gloo_interface or env.get("LOCO_JAX_GLOO_INTERFACE") or None
  if (gloo_hostname or gloo_interface) and cpu_collectives != "gloo":
    raise ValueError(f"gloo_hostname / gloo_interface bind gloo's collectives; they need "
                     f"cpu_collectives='gloo', got {cpu_collectives!r}")
  if cpu_collectives:
    jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
  if gloo_hostname or gloo_interface:
    _bind_gloo(gloo_hostname, gloo_interface)
  jax.distributed.initialize(coordinator_address, num_processes, process_id,
                             local_device_ids=local_device_ids, **kwargs)


def _bind_gloo(hostname: str | None, interface: str | None) -> None:
  """Replaces jax's CPU backend factory with one that binds gloo to `hostname` / `interface`.

  jax 0.10's `xla_bridge.make_cpu_client` builds gloo collectives without an address; it also
  accepts ready-made `collectives`, which keeps every other CPU client option jax sets.
  """
  from jax._src import distributed, xla_bridge  # the factory jax registers for "cpu"
  from jax._src.lib import _jax
  from jax.extend.backend import register_backend_factory

  def make_cpu_client():
    client = distributed.global_state.client
    if client is None:  # single process: nothing to bind, jax's own path
      return xla_bridge.make_cpu_client()
    return xla_bridge.make_cpu_client(collectives=_jax.make_gloo_tcp_collectives(
        distributed_client=client, hostname=hostname, interface=interface))

  try:
    register_backend_factory("cpu", make_cpu_client, priority=0, fail_quietly=False)
  except RuntimeError as e:
    raise RuntimeError("parallel.initialize(gloo_hostname=/gloo_interface=) must run before "
                       f"the CPU backend is created (before any jax.devices() call): {e}") from None


class TrainState(NamedTuple):
  """params: full (ddp) or this device's float32 master shard of each leaf (zero2, and fsdp:
  an fsdp.Layered whose stacked leaves hold one shard a layer)."""
  params: Any
  compressor_state: Any
  opt_state: Any
  step: jax.Array


def _shard_specs_of(shapes, axis_name):
  """zero2 optimizer state: every array with an axis lives on shards; scalars are replicated."""
  return jax.tree.map(lambda x: P(axis_name) if x.ndim else P(), shapes)


def _shapes_of(params):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), params)


def _local_shard_shapes(params, num_shards):
  return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct((comm.shard_len(x.size, num_shards),), jnp.float32), params)


def shard_params(params, mesh: Mesh, axis_name: str = "data"):
  """Full params -> float32 master shards per leaf: a global [N * shard_len] array split on the axis."""
  _check_axis(mesh, axis_name)
  n = mesh.shape[axis_name]
  def shard(x):
    flat = comm.shard_rows(jnp.ravel(x).astype(jnp.float32),
                           comm.leaf_layout(x.size, n, None)).reshape(-1)
    return jax.device_put(flat, NamedSharding(mesh, P(axis_name)))
  return jax.tree.map(shard, params)


def unshard_params(shards, like):
  """Inverse of `shard_params` (on global arrays): the full leaves, shaped and typed like `like`."""
  return jax.tree.map(lambda s, x: s[: x.size].reshape(x.shape).astype(x.dtype), shards, like)


def init_train_state(params, optimizer: optax.GradientTransformation, mesh: Mesh, *,
                     compressor: optax.GradientTransformation | None = None,
                     mode: str = "ddp", axis_name: str = "data"):
  """A TrainState on the mesh and its PartitionSpecs.

  ddp: params replicated, `optimizer` state replicated (but for per-device error fields).
  fsdp: `params` is an `fsdp.Layered`; as zero2, with one compressor state per layer (fsdp.py).
  zero2: params become float32 master shards and the optimizer state lives on those shards,
  about 1/N of ddp's per device; `compressor` (e.g. `loco(axis_name=..., scatter=True)`) keeps
  its per-device errors of the full gradient. Callable masks in `optimizer` (adamw's `mask`,
  `optax.masked`, multi_transform labels) see the full-shaped params, as in ddp
  (`masks.evaluate_on_full_shapes`).
  """
  if mode not in MODES:
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
  _check_axis(mesh, axis_name)
  if mode in ("zero2", "fsdp") and compressor is None:
    raise ValueError(f"mode={mode!r} needs a compressor with reduce-scatter semantics, e.g. "
                     "loco(axis_name='data', scatter=True) or parallel.reduce_scatter('data')")
  if mode == "fsdp":  # params: fsdp.Layered(embed, blocks, head); see loco_jax/fsdp.py
    from loco_jax.train import fsdp
    return fsdp.init_train_state(params, optimizer, mesh, compressor, axis_name)
  n = mesh.shape[axis_name]
  compressor = compressor or optax.identity()
  comp_specs = opt_state_specs(compressor, params, mesh, axis_name)
  if mode == "ddp":
    opt_specs = opt_state_specs(optimizer, params, mesh, axis_name)
    param_specs = jax.tree.map(lambda _: P(), params)
    placed = jax.device_put(params, NamedSharding(mesh, P()))
    opt_init = optimizer.init
  else:
    masks.evaluate_on_full_shapes(optimizer)
    like = _shapes_of(params)
    with masks.full_shapes(like):
      opt_specs = _shard_specs_of(
          jax.eval_shape(optimizer.init, _local_shard_shapes(params, n)), axis_name)
    param_specs = jax.tree.map(lambda _: P(axis_name), params)
    placed = shard_params(params, mesh, axis_name)

    def opt_init(shards):
      with masks.full_shapes(like):
        return optimizer.init(shards)
  specs = TrainState(param_specs, comp_specs, opt_specs, P())
  full = jax.device_put(params, NamedSharding(mesh, P()))

  def init(full_params, placed_params):
    return TrainState(placed_params, compressor.init(full_params), opt_init(placed_params),
                      jnp.zeros([], jnp.int32))

  state = jax.jit(jax.shard_map(init, mesh=mesh, in_specs=(P(), param_specs),
                                out_specs=specs))(full, placed)
  return state, specs


def reduce_scatter(axis_name: str = "data") -> optax.GradientTransformation:
  """Plain ZeRO-2 gradient averaging: a float32 reduce-scatter per leaf -> this device's shard.

  The uncompressed comparator of `loco(axis_name=..., scatter=True)`; same shard layout.
  """
  def update_fn(updates, state, params=None):
    del params
    n = comm.axis_size(axis_name, "reduce_scatter")
    def shard(g):
      rows = comm.shard_rows(g.reshape(-1).astype(jnp.float32), comm.leaf_layout(g.size, n, None))
      return jax.lax.psum_scatter(rows, axis_name, scatter_dimension=0, tiled=True).reshape(-1) / n
    return jax.tree.map(shard, updates), state
  return optax.GradientTransformation(lambda _: optax.EmptyState(), update_fn)


def _gather_params(shards, like, axis_name: str, compute_dtype, how: str, block_size: int):
  """Master shards -> full params in the compute dtype (or through int8 with block scales)."""
  leaves, treedef = jax.tree.flatten(like)
  local = treedef.flatten_up_to(shards)
  n = comm.axis_size(axis_name, "train step")
  layouts = [comm.leaf_layout(x.size, n, block_size) for x in leaves]
  if how == "int8":
    payloads = []
    for s, lay in zip(local, layouts):
      rows = comm.to_rows(s, comm.LeafLayout(lay.row_len, 1, lay.row_len, lay.blocks,
                                             lay.block_len))
      scales = quant.absmax_scale(rows, 8)
      payloads.append(comm.Payload(quant.compress(rows, scales[..., None], 8), scales))
    full, _ = comm.gather_packed(payloads, layouts, 8, None, jnp.zeros((), jnp.float32),
                                 axis_name)
  else:
    # comm.all_gather: a bf16 compute dtype crosses at 16 bits (XLA:CPU would send 32).
    full = [comm.from_rows(comm.all_gather(s.astype(compute_dtype), axis_name), lay)
            for s, lay in zip(local, layouts)]
  return treedef.unflatten([f.reshape(x.shape).astype(compute_dtype)
                            for f, x in zip(full, leaves)])


def make_train_step(loss_fn: Callable[[Any, Any], jax.Array],
                    optimizer: optax.GradientTransformation, mesh: Mesh, specs: TrainState,
                    params_like, *, compressor: optax.GradientTransformation | None = None,
                    mode: str = "ddp", axis_name: str = "data", compute_dtype=jnp.float32,
                    param_gather: str = "compute", block_size: int | None = None):
  """A jitted `step(state, batch) -> (state, mean loss)` for `loss_fn(params, batch)`.

  The batch's leading axis is split over `axis_name`. ddp: `compressor` (or, when None, the
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
  _check_axis(mesh, axis_name)
  if mode == "fsdp" and compressor is None:
    raise ValueError("mode='fsdp' needs a compressor with reduce-scatter semantics, e.g. "
                     "loco(axis_name='data', scatter=True) or parallel.reduce_scatter('data')")
  n = mesh.shape[axis_name]
  compressor = compressor or optax.identity()
  like = _shapes_of(params_like)
  if mode in ("zero2", "fsdp"):
    masks.evaluate_on_full_shapes(optimizer)
  zero2_hint = (" mode='zero2' needs a compressor that returns this device's shard of each leaf "
                "(reduce-scatter semantics), e.g. loco(axis_name=..., scatter=True) or "
                "parallel.reduce_scatter(...)." if mode == "zero2" else "")

  def local_step(state: TrainState, batch):
    if mode == "ddp":
      trees.check_same_shapes(state.params, like, "state.params", "params_like")
      params = jax.tree.map(
          lambda x: x.astype(compute_dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x,
          state.params)
    else:
      trees.check_same_shapes(state.params, _local_shard_shapes(like, n),
                              "state.params (master shards)", "params_like's shards")
      params = _gather_params(state.params, like, axis_name, compute_dtype, param_gather,
                              block_size)
    # Replicated params would make jax.grad psum the gradient in full precision (the transpose
    # of the implicit broadcast); marked varying, each device keeps its own gradient.
    params = jax.lax.pcast(params, axis_name, to="varying")
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    grads, comp_state = compressor.update(grads, state.compressor_state, params)
    trees.check_same_shapes(grads, state.params, "the compressor's output",
                            "state.params" + (" (master shards)" if mode == "zero2" else ""),
                            zero2_hint)
    with masks.full_shapes(like if mode == "zero2" else None):
      updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    new_params = optax.apply_updates(state.params, updates)
    return (TrainState(new_params, comp_state, opt_state, state.step + 1),
            jax.lax.pmean(loss, axis_name))

  if mode == "fsdp":  # loss_fn: an fsdp.LayeredModel; params_like: an fsdp.Layered
    from loco_jax.train import fsdp
    sharded = fsdp.sharded_step(loss_fn, optimizer, mesh, specs, params_like, compressor,
                                axis_name, compute_dtype, param_gather, block_size)
  else:
    sharded = jax.jit(jax.shard_map(local_step, mesh=mesh, in_specs=(specs, P(axis_name)),
                                    out_specs=(specs, P())), donate_argnums=0)

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
