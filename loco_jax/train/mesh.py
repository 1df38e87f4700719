"""Meshes and multi-host start-up: 1-D data meshes, (node, local) meshes, a train step's axes,
`initialize`."""

import math
import os
from typing import NamedTuple

import jax
import numpy as np
from jax.sharding import AxisType, Mesh


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
  """A 2-D (node, local) mesh of nodes * local devices, for `transforms.two_hop`."""
  if nodes < 1 or local < 1 or nodes * local > jax.device_count():
    raise ValueError(f"nodes * local must be in 1..{jax.device_count()} (devices present), "
                     f"got {nodes} x {local}")
  return jax.make_mesh((nodes, local), axis_names, axis_types=(AxisType.Auto,) * 2,
                       devices=jax.devices()[: nodes * local])


def communication_mesh(mesh: Mesh) -> Mesh:
  """`mesh`'s twin on other devices: each device's place taken by a device of the same process
  outside `mesh`, where a DiLoCo sync runs beside the inner steps (`overlap`).

  Example:
    >>> communication_mesh(data_mesh(4)).devices.ravel().tolist() == jax.devices()[4:]
    True
  """
  used = set(mesh.devices.flat)
  spare = {}
  for device in jax.devices():
    if device not in used:
      spare.setdefault(device.process_index, []).append(device)
  twin = {}
  for device in mesh.devices.flat:
    free = spare.get(device.process_index, [])
    if not free:
      held = sum(d.process_index == device.process_index for d in used)
      raise ValueError(
          f"overlap runs each sync on a communication device of its own, and process "
          f"{device.process_index} has no {jax.default_backend()} device outside the mesh for "
          f"its {held} mesh device(s): give each process twice the mesh's devices (on CPU, "
          f"jax.config.update('jax_num_cpu_devices', 2 * n) before jax starts, and a mesh of "
          f"the first n), or pass overlap=0")
    twin[device] = free.pop(0)
  devices = [twin[d] for d in mesh.devices.flat]
  return Mesh(np.array(devices).reshape(mesh.devices.shape), mesh.axis_names,
              axis_types=mesh.axis_types)


AxisNames = str | tuple[str, ...]


def data_axes(mesh: Mesh, axis_name: AxisNames) -> tuple[str, ...]:
  """`axis_name` (one mesh axis or a tuple of them) as a tuple, checked against the mesh."""
  names = (axis_name,) if isinstance(axis_name, str) else axis_name
  if not isinstance(names, tuple) or not names or not all(isinstance(a, str) for a in names):
    raise ValueError(f"axis_name must be a mesh axis name or a non-empty tuple of them, got "
                     f"{axis_name!r}")
  if len(set(names)) != len(names):
    raise ValueError(f"axis_name {axis_name!r} names an axis twice")
  missing = [a for a in names if a not in mesh.axis_names]
  if missing:
    raise ValueError(f"axis_name {axis_name!r}: {', '.join(map(repr, missing))} "
                     f"{'is not an axis' if len(missing) == 1 else 'are not axes'} of the mesh, "
                     f"whose axes are {tuple(mesh.axis_names)}")
  return names


def axes_size(mesh: Mesh, names: tuple[str, ...]) -> int:
  """Devices along the axes `names` together."""
  return math.prod(mesh.shape[a] for a in names)


def model_axes(mesh: Mesh, data: tuple[str, ...]) -> tuple[str, ...]:
  """The mesh axes that are not data axes: left to GSPMD and the params' own shardings."""
  return tuple(a for a in mesh.axis_names if a not in data)


class TrainAxes(NamedTuple):
  """A train step's axes: averaged over by hand (data) or left to GSPMD (model)."""
  data: tuple[str, ...]
  model: tuple[str, ...]
  name: str | tuple[str, ...]   # the data axes as one collective's axis_name
  size: int                     # devices along the data axes


def train_axes(mesh: Mesh, axis_name: AxisNames) -> TrainAxes:
  """The data axes `axis_name` (checked against the mesh) and the model axes, all the others.

  Example:
    >>> train_axes(data_mesh(), "data")
    TrainAxes(data=('data',), model=(), name='data', size=8)
  """
  data = data_axes(mesh, axis_name)
  return TrainAxes(data, model_axes(mesh, data), data[0] if len(data) == 1 else data,
                   axes_size(mesh, data))


def explicit_axes(mesh: Mesh) -> tuple[str, ...]:
  """The mesh's Explicit axes (jax's sharding in types)."""
  return tuple(a for a, kind in zip(mesh.axis_names, mesh.axis_types)
               if kind == AxisType.Explicit)


def auto_mesh(mesh: Mesh) -> Mesh:
  """The same devices and axes, every axis Auto: the mesh the train steps' shard_maps run on.

  jax 0.10.2 all-gathers, at a shard_map's boundary, an input that is Explicit-sharded over an
  axis the shard_map leaves to the compiler (docs/results/sharded.md); over Auto axes it does not.
  """
  return mesh.update(axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, local_device_ids=None,
               cpu_collectives: str = "gloo", *, gloo_hostname: str | None = None,
               gloo_interface: str | None = None, **kwargs) -> None:
  """Joins a multi-host job: `jax.distributed.initialize` with explicit arguments or, where they
  are None, the usual environment (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID;
  on TPU pods, Slurm and Open MPI jax finds them itself). Call it before anything else touches
  jax devices. On CPU it selects `cpu_collectives` ("gloo") so that collectives cross processes.

  On a multi-homed host, `gloo_hostname` (e.g. "10.0.0.2") or `gloo_interface` (e.g. "eth1"),
  or LOCO_JAX_GLOO_HOSTNAME / LOCO_JAX_GLOO_INTERFACE, bind gloo there: this registers a CPU
  backend factory that passes them on, before the CPU backend exists (else a RuntimeError).

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
