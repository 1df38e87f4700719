"""Two-hop LoCo for a (node, local) mesh: a hop inside each node, then LoCo across nodes.

Both hops run LoCo's step on buckets (`transforms.bucket_step`): each hop lays its leaves out
in buckets over its axis's devices, with an error of its own per bucket.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from loco_jax.comm import bucketed, gathers, wire
from loco_jax.core import buckets, layout, leaves, local_blocks, quant, trees
from loco_jax.transforms.bucket_step import (Averaging, average, bucket_plans, compress_buckets,
                                             group_shapes, is_due)
from loco_jax.transforms.loco_state import GroupState, bucket_layout
from loco_jax.transforms.settings import GATHER_MODES, LocoSettings, resolve

INTRA_MODES = ("reduce_scatter", "loco")


class TwoHopState(NamedTuple):
  """Errors of both hops, one array per bucket of each group ({group key: tuple}, as in
  `LocoState`); every field but `count` and `signature` differs per device."""
  count: jax.Array
  error: Any              # int8: the intra-node hop's error (intra="loco"), buckets over local
  error_scale: Any        # float32 block scales of `error`
  node_error: Any         # int8: the inter-node hop's error of the node shards, buckets over nodes
  node_error_scale: Any
  gather_error: Any = None        # int8: the node-averaged shard's error, re-quantized for the
  gather_error_scale: Any = None  # gather across nodes (gather="quantized")
  signature: Any = None   # trees.TreeSignature of the params


class Hops(NamedTuple):
  """Where and how the two hops run."""
  node_axis: str
  local_axis: str
  intra: str
  gather: str
  settings: LocoSettings

  def sizes(self) -> tuple[int, int]:
    """(devices in a node, nodes)."""
    return (gathers.axis_size(self.local_axis, "two_hop"),
            gathers.axis_size(self.node_axis, "two_hop"))

  def plans(self, grads: leaves.Leaves) -> tuple[dict, dict]:
    """Each group's bucket layouts: of the leaves over `local_axis`, of their node shards
    (`layout.shard_len` of each leaf over the node's devices) over `node_axis`. None sent:
    none, and no axis needs to be bound."""
    if not grads.sent:
      return {}, {}
    local, nodes = self.sizes()
    shard_sizes = [layout.shard_len(x.size, local) for x in grads.leaves]
    block_size = self.settings.block_size
    return (bucket_plans(grads, local, block_size),
            bucket_plans(grads, nodes, block_size, shard_sizes))


def _fields(hops: Hops, groups: dict) -> list:
  """{group key: the group's six state fields} -> the six fields, each {group key: buckets} or
  None where this mode has no such field."""
  s = hops.settings
  used = [hops.intra == "loco", hops.intra == "loco" and s.error_scale is None, True,
          s.error_scale is None, hops.gather == "quantized",
          hops.gather == "quantized" and s.error_scale is None]
  return [leaves.ByGroup({key: g[f] for key, g in groups.items()}) if use else None
          for f, use in enumerate(used)]


def intra_node(hops: Hops, grads: leaves.Leaves, group: leaves.Group, plan: buckets.Plan,
               old: GroupState, count: jax.Array) -> tuple[list, jax.Array, GroupState]:
  """Hop 1, over `local_axis`: the node's mean of this device's shard of each leaf of the
  group ([shard_len] float32 each), by a float32 reduce-scatter or by LoCo's all-to-all
  (`intra="loco"`); the flags, agreed in the node; the hop's new error."""
  flat = [grads.flat(i) if i in group.indices else None for i in range(len(grads.leaves))]
  if hops.intra == "reduce_scatter":
    local = plan.rows
    down, up = quant.mean_factors(local)  # a sum of g / 2**k: finite g never overflow it
    # wire.reduce_scatter: one all-to-all in pieces on gloo, where a whole reduce-scatter runs
    # well below the link's rate (docs/results/network.md, "Two levels").
    shards = [None if g is None else quant.saturate(wire.reduce_scatter(
        layout.shard_rows(g * down, layout.leaf_layout(g.size, local, None)),
        hops.local_axis).reshape(-1) * up) for g in flat]
    flags = jax.lax.psum(leaves.flag(grads.finite(group.indices)), hops.local_axis)
    return shards, flags, old
  s = hops.settings
  sent = compress_buckets(buckets.to_buckets(flat, plan), old.error, old.error_scale, s,
                          is_due(count, s.reset_interval), decompressed=False)
  means, flags = bucketed.all_to_all_mean(sent.packed, sent.scales, s.scale, s.bits,
                                          leaves.flag(sent.finite), hops.local_axis)
  return buckets.shards(means, plan, buckets.starts(plan, count)), flags, sent.state


def group_step(hops: Hops, grads: leaves.Leaves, group: leaves.Group, plans: tuple,
               old: tuple, count: jax.Array) -> leaves.GroupResult:
  """Both hops and the two all-gathers (across nodes, then inside the node) for one group of
  leaves; `old`: the group's six state fields."""
  plan1, plan2 = plans
  s = hops.settings
  shards, flags, hop1 = intra_node(hops, grads, group, plan1, GroupState(*old[:2], None, None),
                                   count)
  # Hop 2 and the gather across nodes: LoCo over `node_axis` on the node shards, the flags of
  # the first hop (agreed in the node) sent with it.
  reset = is_due(count, s.reset_interval)
  sent = compress_buckets(buckets.to_buckets(shards, plan2), old[2], old[3], s, reset, False)
  sent = sent._replace(finite=sent.finite & jnp.isfinite(flags))
  node_old = GroupState(*old[2:])
  averaged = average(sent, plan2, node_old, s, Averaging(hops.node_axis, hops.gather, False,
                                                         None), reset)
  node_shards = buckets.from_buckets(averaged.values, plan2, buckets.starts(plan2, count))
  gathered, sides = gathers.gather_bf16([node_shards[i] for i in group.indices],
                                        averaged.flags, hops.local_axis)
  values = [v.reshape(-1)[: grads.leaves[i].size] for v, i in zip(gathered, group.indices)]
  new = (hop1.error, hop1.error_scale, sent.state.error, sent.state.error_scale,
         averaged.gather_error, averaged.gather_scale)
  return leaves.GroupResult(values, sides[0], new)


def two_hop(node_axis: str = "node", local_axis: str = "local", intra: str = "reduce_scatter",
            bits: int = 4, scale: float | None = None, error_bits: int = 8,
            error_scale: float | None = None, beta: float = 0.8, reset_interval: int = 1024,
            block_size: int = 2048, specs: Any = None,
            gather: str = "bf16") -> optax.GradientTransformationExtraArgs:
  """Mean over a (node, local) mesh in two hops, each hop with its own int8 error.

  Hop 1, inside each node: a float32 reduce-scatter (`intra="reduce_scatter"`) or LoCo's
  all-to-all (`intra="loco"`, DeepSpeed LoCo's design) leaves each device the node's mean of
  its shard. Hop 2, across nodes: LoCo's step on that shard with an error of its own. Two
  all-gathers return the mean: across nodes in bf16 or, with `gather="quantized"`, re-quantized
  with an error of its own, then inside the node in bf16. Non-finite gradients: as in `loco`.

  The other arguments are `loco`'s (absmax block scales). Call it inside `jax.shard_map` over
  both axes; declare its `TwoHopState` with `state_specs(state, (node_axis, local_axis))`.

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
  block_scales = settings.error_scale is None

  def expected_fields(plans1: dict, plans2: dict) -> list:
    """The shapes of the state's six fields (`_fields`) for these plans."""
    hop1 = lambda k: group_shapes(plans1[k], block_scales, False)[:2] if intra == "loco" else ()
    return _fields(hops, {k: (hop1(k) or (None, None)) + group_shapes(
        plans2[k], block_scales, gather == "quantized") for k in plans1})

  def init_fn(params):
    if trees.is_placeholder(params):  # optax.tree_map_params's: no state here mirrors the params
      return TwoHopState(jnp.zeros([], jnp.int32), *[jnp.zeros([], jnp.int8)] * 7)
    grads = leaves.split(params, axes)
    fields = expected_fields(*hops.plans(grads))
    layout = bucket_layout(grads, axes, settings.block_size, settings.error_bits,
                           settings.error_scale)
    return TwoHopState(jnp.zeros([], jnp.int32), *optax.tree.zeros_like(fields),
                       trees.TreeSignature.of(params, layout))

  def update_fn(updates, state):
    grads = leaves.split(updates, axes)
    plans1, plans2 = hops.plans(grads)
    trees.check_layout("two_hop", state, updates, list(state[1:7]),
                       expected_fields(plans1, plans2))
    old = {g.key: tuple(None if f is None else f[g.key] for f in state[1:7])
           for g in grads.groups}
    mapped = grads.map_groups(lambda group: group_step(
        hops, grads, group, (plans1[group.key], plans2[group.key]), old[group.key],
        state.count))
    done = grads.finish(mapped, mapped.states, old, state.count)
    return done.update, TwoHopState(done.count, *_fields(hops, done.state), state.signature)

  return optax.GradientTransformationExtraArgs(
      local_blocks.local_init(init_fn, axes, specs, "two_hop"),
      local_blocks.local_update(update_fn, axes, specs, name="two_hop"))
