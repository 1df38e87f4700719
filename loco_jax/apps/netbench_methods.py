"""netbench's exchanges: the method table, the step each method runs on its mesh, the replay of
a step's collectives alone, and which bytes cross between nodes.

Imports only the standard library at the top: the netbench CLI reads `METHODS` to check its
arguments without starting jax; the library is imported when a step is built (in the hosts).
"""

import importlib
import itertools
import math
from typing import Any, Callable, NamedTuple, Sequence

NODE, LOCAL = "node", "local"   # the axes of a two-level mesh: across nodes, inside a node


class Method(NamedTuple):
  """One exchange netbench can measure.

  help: what crosses the wire. make: the gradient transformation that averages (called in the
  host, where it may import jax). topology: "flat" runs on a 1-D "data" mesh of every device,
  "nodes" on a (node, local) mesh (`--nodes` > 1). param_dtype: ZeRO-2, the updated shards
  come back as whole parameters through an all-gather in this dtype. check_vma: shard_map's
  type check of what varies over which axis (off where a transformation over the node axis
  runs on each device's own shard: the check would take that shard for a model-split leaf).
  counts: integer fields of the transformation's state that count steps (CO3's `overflows`,
  `rejected`), reported as their increase over the timed steps. gauges: fields reported as
  their values after the last timed step (CO3's per-device `coded_bits`). conditional_count:
  the one of `counts` that counts the steps which ran the step's conditional collectives (CO3's
  raw resend after an overflow, which follows its slots' extension): each such step adds their
  bytes to the prediction. extension_count: the one that counts the steps which sent the
  coded slots' extensions (`comm.coded.is_extension`; CO3's `extended`, a superset of its
  overflow steps): each of the others adds the extensions' bytes alone.
  """
  help: str
  make: Callable[[], Any]
  topology: str = "flat"
  param_dtype: str | None = None
  check_vma: bool = True
  counts: tuple[str, ...] = ()
  gauges: tuple[str, ...] = ()
  conditional_count: str | None = None
  extension_count: str | None = None


def _lib(module: str):
  return importlib.import_module(f"loco_jax.{module}")


def hierarchical(across: Callable[[], Any] | None = None, node_axis: str = NODE,
                 local_axis: str = LOCAL):
  """The mean over a (node, local) mesh in three hops, built from the library's public parts:
  a float32 reduce-scatter inside each node, then each device's shard averaged across nodes
  (by `across()`, a transformation over `node_axis` such as `loco(axis_name=node_axis)`, on
  the shard; None: a float32 all-reduce), then an all-gather inside the node (float32; bf16,
  as two_hop's, after `across`). Only the middle hop crosses between nodes."""
  import jax
  import jax.numpy as jnp
  import optax
  comm, wire, rows_of = _lib("comm"), _lib("comm.wire"), _lib("core.layout")
  inner = across() if across is not None else None

  def layout(x):
    return rows_of.leaf_layout(x.size, comm.axis_size(local_axis, "netbench"), None)

  def init(params):
    if inner is None:
      return optax.EmptyState()
    return inner.init(jax.tree.map(lambda x: jnp.zeros((layout(x).row_len,), jnp.float32),
                                   params))

  def update(updates, state, params=None):
    del params
    local = comm.axis_size(local_axis, "netbench")

    def scatter(g):  # this device's shard of its node's mean
      rows = rows_of.shard_rows(g.reshape(-1).astype(jnp.float32), layout(g))
      return wire.reduce_scatter(rows, local_axis).reshape(-1) / local

    shards = jax.tree.map(scatter, updates)
    dtype = jnp.float32 if inner is None else jnp.bfloat16
    if inner is None:
      shards = jax.tree.map(lambda s: jax.lax.pmean(s, node_axis), shards)
    else:
      shards, state = inner.update(shards, state)

    def gather(s, g):
      full = rows_of.from_rows(comm.all_gather(s.astype(dtype), local_axis), layout(g))
      return full.reshape(g.shape).astype(g.dtype)

    return jax.tree.map(gather, shards, updates), state

  return optax.GradientTransformation(init, update)


def _two_hop(**kwargs):
  return _lib("transforms.two_hop").two_hop(NODE, LOCAL, **kwargs)


def _loco(**kwargs):
  return _lib("transforms.loco").loco(axis_name="data", **kwargs)


# Slots for LoCo's coded codes: netbench's gradients (scales 1..7 in every block) code to about
# 2.5 bits a 4-bit code (`huffman_deflate`, 2.54); a slot that does not fit sends the step raw.
ENTROPY_SLOT_BITS = 2.75


# Slots fitted to netbench's gradients, as ENTROPY_SLOT_BITS for LoCo's codes
# (experiments/co3_slot_needs.py, 12 steps): a step's largest stream needs 2.79-2.84 bits a fp4
# symbol (the all-to-all at 4 hosts, the all-gather at 2) and the sums of 4 hosts' levels
# 3.85-3.88 bits an element, against co3's default slots of 3.08 and 4.19 (the fitted model's
# entropy up to beta 1; they extend to its worst case, 3.76 and 5.51, on the steps that need
# it: `extended`). A stream that does not fit sends the step raw (`overflows`).
CO3_FITTED_SLOT_BITS = {"capacity_bits": 3.0, "gather_capacity_bits": 4.1}


def _co3(help_text: str, fmt: str, gather: str = "bf16", **slots) -> Method:
  """CO3 at gamma 0.7 with `collective="auto"`: the record's `exchange` says which one ran."""
  return Method(help_text, lambda: _lib("transforms.co3").co3(fmt, gamma=0.7, axis_name="data",
                                                               gather=gather, **slots),
                counts=("overflows", "extended", "rejected"), gauges=("coded_bits",),
                conditional_count="overflows", extension_count="extended")


METHODS: dict[str, Method] = {
    "fp32": Method("float32 all-reduce (gloo's ring)",
                   lambda: _lib("transforms.baselines").uncompressed("data")),
    "bf16": Method("bf16 mean (on CPU: uint16 all-to-all, f32 sum, uint16 all-gather)",
                   lambda: _lib("transforms.baselines").bf16("data")),
    "loco": Method("LoCo: 4-bit all-to-all, bf16 gather", _loco),
    "loco-quantized": Method("LoCo: 4-bit all-to-all, 4-bit gather",
                             lambda: _loco(gather="quantized")),
    "loco-entropy": Method(f"LoCo, the all-to-all's codes Huffman-coded in slots of "
                           f"{ENTROPY_SLOT_BITS} bits a code, bf16 gather",
                           lambda: _loco(entropy_code=True, capacity_bits=ENTROPY_SLOT_BITS)),
    "loco-quantized-entropy": Method(
        "LoCo, coded all-to-all as loco-entropy, 4-bit gather",
        lambda: _loco(gather="quantized", entropy_code=True, capacity_bits=ENTROPY_SLOT_BITS)),
    "int4": Method("4-bit all-to-all without error feedback",
                   lambda: _lib("transforms.baselines").int_quantized(4, axis_name="data")),
    "zero2-fp32": Method("ZeRO-2: fp32 reduce-scatter + fp32 parameter all-gather",
                         lambda: _lib("train.parallel").reduce_scatter("data"),
                         param_dtype="float32"),
    "zero2-loco": Method("ZeRO-2: LoCo scatter=True + bf16 parameter all-gather",
                         lambda: _loco(scatter=True), param_dtype="bfloat16"),
    "co3-fp4": _co3("CO3 fp4 in Huffman-coded slots: the all-gather of whole coded gradients "
                    "where it sends less than the per-shard all-to-all + bf16 gather",
                    "fp4"),
    "co3-fp8": _co3("CO3 fp8, its exchange chosen as co3-fp4's", "fp8"),
    "co3-fp4-coded": _co3("CO3 fp4, per-shard coded all-to-all + coded gather of the averaged "
                          "shards (2 devices: the all-gather)", "fp4", gather="coded"),
    "co3-fp4-coded-fitted": _co3(
        f"co3-fp4-coded in slots fitted to netbench's gradients "
        f"({CO3_FITTED_SLOT_BITS['capacity_bits']} bits a symbol, "
        f"{CO3_FITTED_SLOT_BITS['gather_capacity_bits']} an element of the gather)",
        "fp4", gather="coded", **CO3_FITTED_SLOT_BITS),
    "fp32-hier": Method("float32: reduce-scatter in the node, all-reduce across nodes, "
                        "all-gather in the node", hierarchical, "nodes"),
    "two-hop": Method("two_hop: float32 reduce-scatter in the node, LoCo across nodes",
                      _two_hop, "nodes"),
    "two-hop-quantized": Method("two_hop(gather='quantized'): as two-hop, the averaged node "
                                "shards back across nodes in 4 bits with their own error",
                                lambda: _two_hop(gather="quantized"), "nodes"),
    "two-hop-loco": Method("two_hop(intra='loco'): LoCo in the node and across nodes",
                           lambda: _two_hop(intra="loco"), "nodes"),
    # Not in the library: two_hop's hops rebuilt from public parts, with LoCo's bf16 gather
    # across nodes (the same wire as two-hop) and with its 4-bit gather (docs/results/network.md).
    "hier-loco": Method("float32 reduce-scatter in the node, loco across nodes on the shard, "
                        "bf16 all-gather in the node",
                        lambda: hierarchical(lambda: _lib("transforms.loco").loco(
                            axis_name=NODE)), "nodes", check_vma=False),
    "hier-loco-quantized": Method(
        "as hier-loco with loco(gather='quantized') across nodes: 4 bits each way",
        lambda: hierarchical(lambda: _lib("transforms.loco").loco(
            axis_name=NODE, gather="quantized")), "nodes", check_vma=False),
}
FLAT_DEFAULT = ("fp32", "bf16", "loco", "loco-quantized", "int4", "zero2-fp32", "zero2-loco",
                "co3-fp4", "co3-fp4-coded")
TWO_LEVEL_DEFAULT = ("fp32", "fp32-hier", "loco", "two-hop", "two-hop-quantized", "two-hop-loco")


def state_field(state: Any, name: str) -> Any:
  """The field `name` of the first NamedTuple in `state` (depth first) that has one; a
  KeyError if none has."""
  if hasattr(state, "_fields") and name in state._fields:
    return getattr(state, name)
  if isinstance(state, (tuple, list)):
    for part in state:
      try:
        return state_field(part, name)
      except KeyError:
        pass
  raise KeyError(f"no state field {name!r}")


def mesh_axes(mesh) -> str | tuple[str, ...]:
  """The axis name a method's transformation and its gradient spec use on `mesh`."""
  names = tuple(mesh.axis_names)
  return names[0] if len(names) == 1 else names


def exchange_step(name: str, n_params: int, mesh):
  """(jitted step(grads [devices, n_params], state) -> (averaged, state), initial state) of
  method `name` on `mesh` (1-D "data" for flat methods, (node, local) for the others)."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import PartitionSpec as P
  comm, parallel, rows_of = _lib("comm"), _lib("train.parallel"), _lib("core.layout")
  method = METHODS[name]
  params = {"w": jnp.zeros((n_params,), jnp.float32)}
  comp = method.make()
  axes = mesh_axes(mesh)
  state, specs = parallel.init_opt_state(comp, params, mesh, axes)

  def local(g_1xN, s):
    out, s = comp.update({"w": g_1xN[0]}, s, params)
    if method.param_dtype is not None:  # the shards come back as full parameters
      layout = rows_of.leaf_layout(n_params, comm.axis_size(axes, name), None)
      shard = out["w"].astype(jnp.dtype(method.param_dtype))
      out = {"w": rows_of.from_rows(comm.all_gather(shard, axes), layout)}
    return out, s

  step = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(axes), specs),
                               out_specs=({"w": P()}, specs), check_vma=method.check_vma))
  return step, state


def group_axes(mesh, groups: Sequence[Sequence[int]]) -> tuple[str, ...]:
  """The mesh axes along which a collective with these replica groups runs (ids: positions in
  the mesh's flattened devices; () means every device). A ValueError if no axes match."""
  import numpy as np
  names = tuple(mesh.axis_names)
  ids = np.arange(mesh.size).reshape(mesh.devices.shape)
  want = sorted(sorted(g) for g in groups) if groups else [list(range(mesh.size))]
  for k in range(len(names), 0, -1):
    for chosen in itertools.combinations(range(len(names)), k):
      rest = [i for i in range(len(names)) if i not in chosen]
      size = math.prod(ids.shape[i] for i in chosen)
      rows = np.transpose(ids, rest + list(chosen)).reshape(-1, size)
      if sorted(sorted(r) for r in rows.tolist()) == want:
        return tuple(names[i] for i in chosen)
  raise ValueError(f"replica groups {groups} are no mesh axes of {dict(mesh.shape)}")


def crossing_bytes(c: Any, node_of: Sequence[int]) -> list[float] | None:
  """Bytes each node sends the other nodes in one run of the compiled collective `c` as gloo
  runs it: an all-to-all sends each other member its 1/g of the buffer directly; an all-gather
  is a ring, each member sending g-1 blocks to the next rank; an all-reduce a ring, each member
  sending 2(g-1)/g of the buffer to the previous rank; a reduce-scatter of 2 members sends each
  the other's half. `node_of[i]`: the node of device i. None for a collective that spans nodes
  and runs otherwise (no model of it here)."""
  sent = [0.0] * (max(node_of) + 1)
  for group in c.groups or (tuple(range(len(node_of))),):
    g, nodes = len(group), [node_of[d] for d in group]
    if len(set(nodes)) < 2:
      continue
    for r in range(g):
      if c.op == "all-to-all":
        sends = [(j, c.nbytes / g) for j in range(g) if j != r]
      elif c.op == "all-gather":
        sends = [((r + 1) % g, (g - 1) * c.nbytes / g)]
      elif c.op == "all-reduce":
        sends = [((r - 1) % g, 2 * (g - 1) * c.nbytes / g)]
      elif c.op == "reduce-scatter" and g == 2:
        sends = [(1 - r, c.nbytes / 2)]
      else:
        return None
      sent[nodes[r]] += sum(b for j, b in sends if nodes[j] != nodes[r])
  return sent


def node_sent_bytes(found: Sequence[Any], node_of: Sequence[int]) -> list[float] | None:
  """Bytes each node sends the other nodes in one step of the collectives `found`
  (comm.compiled_collectives; the conditional ones left out), by `crossing_bytes`."""
  total = [0.0] * (max(node_of) + 1)
  for c in (c for c in found if not c.conditional):
    sent = crossing_bytes(c, node_of)
    if sent is None:
      return None
    total = [a + b for a, b in zip(total, sent)]
  return total


_DTYPES = {"u8": "uint8", "s8": "int8", "u16": "uint16", "s16": "int16", "bf16": "uint16",
           "f16": "uint16", "u32": "uint32", "s32": "int32", "f32": "float32"}


def collectives_replay(found: Sequence[Any], mesh):
  """A jitted program that runs just the collectives of `found` (each piece as compiled: op,
  dtype, bytes, the mesh axes of its groups) on zeros, in order: the exchange's wire time
  without the step's compute. Takes and returns a float32 [devices] array."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import PartitionSpec as P
  every = mesh_axes(mesh)

  def local(x):
    for c in (c for c in found if not c.conditional):
      axes, n = group_axes(mesh, c.groups), c.group_size
      dtype = jnp.dtype(_DTYPES.get(c.dtype, "uint8"))
      count = int(c.nbytes // (dtype.itemsize if c.dtype in _DTYPES else 1))
      if c.op != "all-reduce":   # the others cut it into n pieces
        count = max(count - count % n, n)
      count = max(count, 1)
      zeros = jnp.zeros((count,), dtype) + x[0].astype(dtype)   # not a constant: runs each step
      if c.op == "all-reduce":
        out = jax.lax.psum(zeros, axes)
      elif c.op == "all-to-all":
        out = jax.lax.all_to_all(zeros.reshape(n, -1), axes, 0, 0, tiled=True)
      elif c.op == "all-gather":
        out = jax.lax.all_gather(zeros[: count // n], axes, tiled=True, to="invarying")
      elif c.op == "reduce-scatter":
        out = jax.lax.psum_scatter(zeros, axes, tiled=True)
      else:
        out = jax.lax.ppermute(zeros[: count // n], axes, [(i, (i + 1) % n) for i in range(n)])
      x = x + out.reshape(-1)[:1].astype(x.dtype) * 0   # keeps the order: each waits for the last
    return x

  return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P(every), out_specs=P(every),
                               check_vma=False))
