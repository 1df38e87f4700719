"""Two-hop LoCo for a (node, local) mesh: a hop inside each node, then LoCo across nodes."""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from loco_jax.comm import exchange, wire
from loco_jax.core import layout, leaves, local_blocks, quant, trees
from loco_jax.kernels import feedback
from loco_jax.transforms.settings import LocoSettings, resolve

INTRA_MODES = ("reduce_scatter", "loco")
GATHER_MODES = ("bf16", "quantized")


class TwoHopState(NamedTuple):
  """Errors of both hops; every field but `count` differs per device."""
  count: jax.Array
  error: Any              # int8 [size] per leaf: the intra-node hop's error (intra="loco")
  error_scale: Any        # float32 [blocks] per leaf
  node_error: Any         # int8 [shard_len(size, local)] per leaf: the inter-node hop's error
  node_error_scale: Any
  gather_error: Any = None        # int8 per leaf: the node-averaged shard's error, re-quantized
  gather_error_scale: Any = None  # for the gather across nodes (gather="quantized")

  PER_DEVICE = ("error", "error_scale", "node_error", "node_error_scale", "gather_error",
                "gather_error_scale")


class Hops(NamedTuple):
  """Where and how the two hops run."""
  node_axis: str
  local_axis: str
  intra: str
  gather: str
  settings: LocoSettings

  def step(self, g: jax.Array, error, error_scale, send: layout.LeafLayout,
           count: jax.Array) -> feedback.Feedback:
    s = self.settings
    return feedback.feedback_step(g, error, error_scale, send,
                                  feedback.is_due(count, s.reset_interval), s.bits, s.scale,
                                  s.error_bits, s.error_scale, s.beta, s.block_size)

  def wire_layout(self, size: int, rows: int) -> layout.LeafLayout:
    return layout.leaf_layout(size, rows, self.settings.block_size
                              if self.settings.scale is None else None)


class Hop(NamedTuple):
  """One hop's result for a group of leaves."""
  shards: list            # float32 [row_len] per leaf: this device's averaged shard
  flags: jax.Array
  errors: list            # the hop's new error per leaf
  error_scales: list


def intra_node(hops: Hops, grads: list, error: list, error_scale: list, count: jax.Array,
               finite: jax.Array) -> Hop:
  """Hop 1, over `local_axis`: the node's mean of this device's shard of each leaf, by a
  float32 reduce-scatter or by LoCo's all-to-all (`intra="loco"`)."""
  local = exchange.axis_size(hops.local_axis, "two_hop")
  layouts = [hops.wire_layout(g.size, local) for g in grads]
  if hops.intra == "reduce_scatter":
    down, up = quant.mean_factors(local)  # a sum of g / 2**k: finite g never overflow it
    # wire.reduce_scatter: one all-to-all in pieces on gloo, where a whole reduce-scatter runs
    # well below the link's rate (docs/NETWORK.md, "Two levels").
    shards = [quant.saturate(wire.reduce_scatter(
        layout.shard_rows(g * down, lay), hops.local_axis).reshape(-1) * up)
              for g, lay in zip(grads, layouts)]
    return Hop(shards, jax.lax.psum(leaves.flag(finite), hops.local_axis), error, error_scale)
  steps = [hops.step(g, e, es, lay, count)
           for g, e, es, lay in zip(grads, error, error_scale, layouts)]
  finite = jnp.logical_and(finite, jnp.all(jnp.stack([f.finite for f in steps])))
  shards, flags = exchange.all_to_all_mean([f.sent for f in steps], hops.settings.bits,
                                           hops.settings.scale, leaves.flag(finite),
                                           hops.local_axis)
  return Hop([s.reshape(-1)[: lay.row_len] for s, lay in zip(shards, layouts)], flags,
             [f.error for f in steps], [f.error_scale for f in steps])


def inter_node(hops: Hops, hop1: Hop, node_error: list, node_error_scale: list,
               count: jax.Array) -> Hop:
  """Hop 2, over `node_axis`: each node shard with its own error, re-quantized and averaged
  by LoCo's all-to-all."""
  nodes = exchange.axis_size(hops.node_axis, "two_hop")
  layouts = [hops.wire_layout(s.size, nodes) for s in hop1.shards]
  steps = [hops.step(s, e, es, lay, count)
           for s, e, es, lay in zip(hop1.shards, node_error, node_error_scale, layouts)]
  shards, flags = exchange.all_to_all_mean([f.sent for f in steps], hops.settings.bits,
                                           hops.settings.scale, hop1.flags, hops.node_axis)
  return Hop(shards, flags, [f.error for f in steps], [f.error_scale for f in steps])


def across_nodes(hops: Hops, hop1: Hop, hop2: Hop, gather_error: list,
                 gather_error_scale: list, count: jax.Array) -> tuple[list, jax.Array, Hop]:
  """Each node shard's mean, gathered across nodes: in bfloat16, or re-quantized to `bits`
  with an error of its own (gather="quantized": 4 bits instead of 16 on the slow links).
  -> (the node shards, the flags, the gather's new errors as a `Hop`)."""
  nodes = exchange.axis_size(hops.node_axis, "two_hop")
  layouts = [hops.wire_layout(s.size, nodes) for s in hop1.shards]
  if hops.gather == "bf16":
    values, flags = exchange.gather_bf16([quant.saturate(s, jnp.bfloat16) for s in hop2.shards],
                                         layouts, hop2.flags, hops.node_axis)
    return values, flags, Hop([], flags, gather_error, gather_error_scale)
  own = [hops.wire_layout(lay.row_len, 1) for lay in layouts]
  steps = [hops.step(s.reshape(-1)[: lay.row_len], e, es, one, count) for s, e, es, lay, one
           in zip(hop2.shards, gather_error, gather_error_scale, layouts, own)]
  values, flags = exchange.gather_packed([f.sent for f in steps], layouts, hops.settings.bits,
                                         hops.settings.scale, hop2.flags, hops.node_axis)
  return values, flags, Hop([], flags, [f.error for f in steps], [f.error_scale for f in steps])


def group_step(hops: Hops, grads: leaves.Leaves, group: leaves.Group, old: list,
               count: jax.Array) -> leaves.GroupResult:
  """Both hops and the two all-gathers (across nodes, then inside the node) for one group of
  leaves; `old`: the state's fields per leaf."""
  (error, error_scale, node_error, node_error_scale, gather_error,
   gather_error_scale) = [[None if f is None else f[i] for i in group.indices] for f in old]
  flat = [grads.flat(i) for i in group.indices]
  # With intra="loco" the first hop's step reads the gradients (and their finiteness).
  finite = jnp.bool_(True) if hops.intra == "loco" else grads.finite(group.indices)
  hop1 = intra_node(hops, flat, error, error_scale, count, finite)
  hop2 = inter_node(hops, hop1, node_error, node_error_scale, count)
  node_shards, flags, returned = across_nodes(hops, hop1, hop2, gather_error,
                                              gather_error_scale, count)
  local = exchange.axis_size(hops.local_axis, "two_hop")
  values, flags = exchange.gather_bf16(node_shards, [hops.wire_layout(g.size, local)
                                                     for g in flat], flags, hops.local_axis)
  new = [hop1.errors, hop1.error_scales, hop2.errors, hop2.error_scales, returned.errors,
         returned.error_scales]
  return leaves.GroupResult(lambda: values, flags, new)


def two_hop(node_axis: str = "node", local_axis: str = "local", intra: str = "reduce_scatter",
            bits: int = 4, scale: float | None = None, error_bits: int = 8,
            error_scale: float | None = None, beta: float = 0.8, reset_interval: int = 1024,
            block_size: int = 2048, specs: Any = None,
            gather: str = "bf16") -> optax.GradientTransformationExtraArgs:
  """Mean over a (node, local) mesh in two hops, each hop with its own int8 error.

  Hop 1, inside each node (over `local_axis`): `intra="reduce_scatter"` is a float32
  reduce-scatter; `intra="loco"` is LoCo's all-to-all of packed `bits` codes (the DeepSpeed LoCo
  design). Either leaves each device the node's mean of its shard. Hop 2, across nodes (over
  `node_axis`): that shard gets the inter-node error added, is re-quantized, and is averaged by
  LoCo's all-to-all. Two all-gathers return the mean: across nodes in bf16 or, with
  `gather="quantized"`, re-quantized to `bits` with an error of its own (the slow links then
  carry `bits` both ways, as `loco(gather="quantized")`), then inside the node in bf16. Links
  inside a node (NVLink, ICI) are about ten times faster than those between nodes, so the
  default compresses only across them. Non-finite gradients and saturation: as in `loco`.

  Args:
    node_axis: the mesh axis across nodes.
    local_axis: the mesh axis inside a node.
    intra: "reduce_scatter" or "loco", the first hop.
    gather: "bf16" or "quantized", the gather across nodes.
    bits, scale, error_bits, error_scale, beta, reset_interval, block_size, specs: as in
      `loco` (absmax block scales).

  Returns:
    An `optax.GradientTransformationExtraArgs` to call inside `jax.shard_map` over both axes,
    whose `TwoHopState` is created there too and declared with
    `state_specs(state, (node_axis, local_axis))`.

  Example:
    >>> opt = optax.chain(two_hop("node", "local"), optax.adamw(3e-4))
  """
  settings = resolve(bits, scale, error_bits, error_scale, beta, reset_interval, block_size,
                     scale_method="absmax")
  if intra not in INTRA_MODES:
    raise ValueError(f"intra must be one of {INTRA_MODES}, got {intra!r}")
  if gather not in GATHER_MODES:
    raise ValueError(f"gather must be one of {GATHER_MODES}, got {gather!r}")
  if node_axis == local_axis:
    raise ValueError(f"node_axis and local_axis must differ, both are {node_axis!r}")
  hops = Hops(node_axis, local_axis, intra, gather, settings)
  axes = (node_axis, local_axis)

  def buffers(size):
    blocks = layout.leaf_layout(size, 1, settings.block_size).blocks if size else 0
    return jnp.zeros((size,), jnp.int8), jnp.zeros((blocks,), jnp.float32)

  def init_fn(params):
    grads = leaves.split(params, axes)
    sizes = [x.size if i in grads.sent else 0 for i, x in enumerate(grads.leaves)]
    local, nodes = ((exchange.axis_size(local_axis, "two_hop"),
                     exchange.axis_size(node_axis, "two_hop")) if any(sizes) else (1, 1))
    node_sizes = [layout.shard_len(n, local) if n else 0 for n in sizes]
    own = [buffers(n if intra == "loco" else 0) for n in sizes]
    node = [buffers(n) for n in node_sizes]
    returned = [buffers(layout.shard_len(n, nodes) if n else 0) for n in node_sizes]
    pick = lambda bufs, j, used=True: grads.tree([b[j] for b in bufs]) if used else None
    fixed, quantized = error_scale is not None, gather == "quantized"
    return TwoHopState(jnp.zeros([], jnp.int32), pick(own, 0), pick(own, 1, not fixed),
                       pick(node, 0), pick(node, 1, not fixed), pick(returned, 0, quantized),
                       pick(returned, 1, quantized and not fixed))

  def update_fn(updates, state):
    trees.check_state_matches("two_hop", updates, state, init_fn(updates))
    grads, count = leaves.split(updates, axes), state.count
    if not grads.sent:  # nothing to compress or send
      return updates, state._replace(count=optax.safe_increment(count))
    fields = state[1:]
    old = [grads.per_leaf(f) for f in fields]
    mapped = grads.map_groups(lambda group: group_step(hops, grads, group, old, count))
    done = grads.finish(mapped, grads.by_leaf(mapped.states, old), old, count)
    return done.update, TwoHopState(done.count, *[grads.tree(x, like)
                                                  for x, like in zip(done.state, fields)])

  return optax.GradientTransformationExtraArgs(
      local_blocks.local_init(init_fn, axes, specs, "two_hop"),
      local_blocks.local_update(update_fn, axes, specs, name="two_hop"))
