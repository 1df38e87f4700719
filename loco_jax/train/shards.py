"""Float32 master shards (ZeRO-2, FSDP): params split onto them, gathered back for the compute
(in the compute dtype, or int8 with block scales), and gradients reduce-scattered onto them.

Each leaf is flattened and split into `layout.shard_len(size, n)` pieces over the n devices of
the data axes (the last one padded with zeros); on a mesh with model axes each device shards
its own model block of the leaf.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from loco_jax import comm
from loco_jax.comm import wire
from loco_jax.core import layout, local_blocks, quant
from loco_jax.train import mesh as mesh_lib
from loco_jax.train import sharding

PARAM_GATHERS = ("compute", "int8")


class ParamGather(NamedTuple):
  """How a step gathers the params from the master shards."""
  dtype: Any = jnp.float32   # the compute dtype
  how: str = "compute"       # "compute": in `dtype`; "int8": int8 with absmax block scales
  block_size: int = 2048     # int8's blocks


def scatter_hint(mode: str) -> str:
  """What a shape error in a sharded mode adds: the compressor it needs."""
  return (f" mode={mode!r} needs a compressor that returns this device's shard of each leaf "
          f"(reduce-scatter semantics), e.g. loco(axis_name=..., scatter=True) or "
          f"parallel.reduce_scatter(...).")


def shard_shapes(params: Any, num_shards: int) -> Any:
  """Shapes of one device's float32 master shards: [shard_len] a leaf."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(
      (layout.shard_len(x.size, num_shards),), jnp.float32), params)


def shard_params(params: Any, mesh: Mesh, axis_name: mesh_lib.AxisNames = "data") -> Any:
  """Full params -> float32 master shards per leaf: a global 1-D array split over the data
  axes (and over a model-split param's model axes: each device shards its own model block).

  Example:
    >>> shards = shard_params(params, mesh_lib.data_mesh())
    >>> shards["w"].ndim, shards["w"].sharding.spec   # flat float32, split over the devices
    (1, P('data',))
  """
  data = mesh_lib.data_axes(mesh, axis_name)
  n = mesh_lib.axes_size(mesh, data)
  specs = sharding.param_specs(params, mesh, data)

  def shard(x):  # this device's model block -> its row over the data axes
    rows = layout.shard_rows(jnp.ravel(x).astype(jnp.float32),
                             layout.leaf_layout(x.size, n, None))
    return rows[jax.lax.axis_index(data)]
  placed = jax.device_put(params, sharding.named(mesh, specs))
  return jax.jit(jax.shard_map(lambda p: jax.tree.map(shard, p), mesh=mesh, in_specs=(specs,),
                               out_specs=sharding.master_specs(specs, data)))(placed)


def unshard_params(shards: Any, like: Any, axis_name: mesh_lib.AxisNames = "data") -> Any:
  """Inverse of `shard_params`: the full leaves, shaped and typed like `like`.

  Where `like`'s leaves are split over model axes (a `NamedSharding` each, as given to
  `shard_params`), each device gathers its model block over the data axes and the result is
  split like `like`.
  """
  named = [x.sharding for x in jax.tree.leaves(like)
           if isinstance(getattr(x, "sharding", None), NamedSharding)]
  if named:
    mesh = named[0].mesh
    data = mesh_lib.data_axes(mesh, axis_name)
    specs = sharding.param_specs(like, mesh, data)
    if any(a not in data for s in jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
           for a in local_blocks.spec_axes(s)):
      blocks = sharding.local_shapes(sharding.shapes_of(like), specs, mesh)
      gather = lambda s, b: jax.lax.all_gather(s, data, tiled=True)[: b.size].reshape(
          b.shape).astype(b.dtype)
      return jax.jit(jax.shard_map(lambda t: jax.tree.map(gather, t, blocks), mesh=mesh,
                                   in_specs=(sharding.master_specs(specs, data),),
                                   out_specs=specs, check_vma=False))(shards)  # gathered
  return jax.tree.map(lambda s, x: s[: x.size].reshape(x.shape).astype(x.dtype), shards, like)


def _int8_blocks(shard: jax.Array, leaf: layout.LeafLayout) -> tuple[jax.Array, jax.Array]:
  """This device's shard as packed int8 codes [blocks, block_len], one absmax scale a block."""
  rows = layout.to_rows(shard, layout.LeafLayout(leaf.row_len, 1, leaf.row_len, leaf.blocks,
                                                 leaf.block_len))[0]
  scales = quant.absmax_scale(rows, 8)
  return quant.pack(quant.compress(rows, scales[..., None], 8), 8), scales


def gather_params(shards: Any, like: Any, axis_name: layout.AxisName,
                  gather: ParamGather) -> Any:
  """Master shards -> full params in the compute dtype; inside a shard_map over `axis_name`.

  `like`: the full leaves' shapes (this device's model blocks); `gather`: the compute dtype
  and whether the shards cross as int8 with block scales. Returns every leaf of `like`, whole.
  """
  leaves, treedef = jax.tree.flatten(like)
  local = treedef.flatten_up_to(shards)
  n = comm.axis_size(axis_name, "train step")
  layouts = [layout.leaf_layout(x.size, n, gather.block_size) for x in leaves]
  if gather.how == "int8":
    packed, scales = zip(*[_int8_blocks(s, leaf) for s, leaf in zip(local, layouts)])
    gathered, _ = comm.gather_packed(packed, scales, None, 8, jnp.zeros((), jnp.float32),
                                     axis_name)
    full = [layout.from_rows(x, leaf) for x, leaf in zip(gathered, layouts)]
  else:
    # comm.all_gather: a bf16 compute dtype crosses at 16 bits (XLA:CPU would send 32).
    full = [layout.from_rows(comm.all_gather(s.astype(gather.dtype), axis_name), leaf)
            for s, leaf in zip(local, layouts)]
  return treedef.unflatten([f.reshape(x.shape).astype(gather.dtype)
                            for f, x in zip(full, leaves)])


def reduce_scatter(axis_name: layout.AxisName = "data") -> optax.GradientTransformation:
  """Plain ZeRO-2 gradient averaging: a float32 reduce-scatter per leaf -> this device's shard.

  The uncompressed comparator of `loco(axis_name=..., scatter=True)`, with its shard layout,
  over `wire.reduce_scatter`.

  Example:
    >>> opt = reduce_scatter("data")   # then parallel.make_train_step(..., mode="zero2")
  """
  def update_fn(updates, state):
    n = comm.axis_size(axis_name, "reduce_scatter")
    def shard(g):
      rows = layout.shard_rows(g.reshape(-1).astype(jnp.float32),
                               layout.leaf_layout(g.size, n, None))
      return wire.reduce_scatter(rows, axis_name).reshape(-1) / n
    return jax.tree.map(shard, updates), state
  # Each device shards its own block of a model-split leaf, as the master shards hold it.
  return optax.GradientTransformation(lambda _: optax.EmptyState(), local_blocks.local_update(
      update_fn, axis_name, flat_output=True, name="reduce_scatter"))
