"""Two-hop LoCo for a (node, local) mesh: a hop inside each node, then LoCo across nodes."""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from loco_jax import comm
from loco_jax.core import feedback, leaves, quant, trees
from loco_jax.transforms.loco import _check_args, _probe_kernel

INTRA_MODES = ("reduce_scatter", "loco")


class TwoHopState(NamedTuple):
  """Errors of both hops; every field but `count` differs per device."""
  count: jax.Array
  error: Any              # int8 [size] per leaf: the intra-node hop's error (intra="loco")
  error_scale: Any        # float32 [blocks] per leaf
  node_error: Any         # int8 [shard_len(size, local)] per leaf: the inter-node hop's error
  node_error_scale: Any

  PER_DEVICE = ("error", "error_scale", "node_error", "node_error_scale")


def two_hop(
    node_axis: str = "node",
    local_axis: str = "local",
    intra: str = "reduce_scatter",
    bits: int = 4,
    scale: float | None = None,
    error_bits: int = 8,
    error_scale: float | None = None,
    beta: float = 0.8,
    reset_interval: int = 1024,
    block_size: int = 2048,
    specs: Any = None,
) -> optax.GradientTransformationExtraArgs:
  """Mean over a (node, local) mesh in two hops, each hop with its own int8 error.

  Hop 1, inside each node (over `local_axis`): `intra="reduce_scatter"` is a float32
  reduce-scatter; `intra="loco"` is LoCo's all-to-all of packed `bits` codes (the DeepSpeed LoCo
  design). Either leaves each device the node's mean of its shard. Hop 2, across nodes (over
  `node_axis`): that shard gets the inter-node error added, is re-quantized, and is averaged by
  LoCo's all-to-all. Two bf16 all-gathers (across nodes, then inside the node) return the mean.

  The default compresses only across nodes: links inside a node (NVLink, ICI) are about ten
  times faster than those between nodes, so compressing there saves little time and adds a
  second quantization error; `intra="loco"` is for nodes whose own links are the bottleneck.
  Call it inside `jax.shard_map` over both axes; create the state there too and declare it
  with `state_specs(state, (node_axis, local_axis))`. A non-finite gradient (on any device)
  makes every output NaN and keeps the state; finite gradients give finite outputs and state
  (both hops saturate as `loco` does, and the reduce-scatter sums g / 2**k). Leaves sharded
  over other mesh axes (a model axis) send each device's own block, as in `loco` (`specs`).

  Example:
    >>> opt = optax.chain(two_hop("node", "local"), optax.adamw(3e-4))
  """
  _check_args(bits, scale, error_bits, error_scale, beta, reset_interval, block_size, "bf16")
  _probe_kernel(bits, scale, error_bits, error_scale, beta, block_size)
  if intra not in INTRA_MODES:
    raise ValueError(f"intra must be one of {INTRA_MODES}, got {intra!r}")
  if node_axis == local_axis:
    raise ValueError(f"node_axis and local_axis must differ, both are {node_axis!r}")
  wire_block = block_size if scale is None else None

  def buffers(size):
    blocks = comm.leaf_layout(size, 1, block_size).blocks if size else 0
    return jnp.zeros((size,), jnp.int8), jnp.zeros((blocks,), jnp.float32)

  def init_body(params):
    parts = leaves.split(params, (node_axis, local_axis))
    local = comm.axis_size(local_axis, "two_hop")
    sizes = [x.size if i in parts.chosen else 0 for i, x in enumerate(parts.leaves)]
    own = [buffers(n if intra == "loco" else 0) for n in sizes]
    node = [buffers(comm.shard_len(n, local) if n else 0) for n in sizes]
    pick = lambda bufs, j: parts.tree([b[j] for b in bufs])
    fixed = error_scale is not None
    return TwoHopState(jnp.zeros([], jnp.int32), pick(own, 0), None if fixed else pick(own, 1),
                       pick(node, 0), None if fixed else pick(node, 1))

  def hops(grads: list[jax.Array], old: list, new: list, k: jax.Array,
           finite: jax.Array) -> tuple[list[jax.Array], jax.Array]:
    """Both hops for one group of leaves (`grads`, flat; `old`/`new`: their state fields, the
    new ones written in place). -> the averaged leaves and the flags."""
    local, nodes = comm.axis_size(local_axis, "two_hop"), comm.axis_size(node_axis, "two_hop")
    step = lambda g, err, err_scale, send: feedback.feedback_step(
        g, err, err_scale, send, feedback.is_due(k, reset_interval), bits, scale, error_bits,
        error_scale, beta, block_size)
    layouts1 = [comm.leaf_layout(g.size, local, wire_block) for g in grads]
    if intra == "loco":
      sent = []
      for j, (g, lay) in enumerate(zip(grads, layouts1)):
        fb = step(g, old[0][j], old[1][j], lay)
        new[0][j], new[1][j] = fb.error, fb.error_scale
        finite &= fb.finite  # the step has read g already
        sent.append(fb.sent)
      shards, flags = comm.all_to_all_mean(sent, bits, scale, leaves.flag(finite), local_axis)
      shards = [s.reshape(-1)[: lay.row_len] for s, lay in zip(shards, layouts1)]
    else:
      down, up = quant.mean_factors(local)  # a sum of g / 2**k: finite g never overflow it
      shards = [quant.saturate(jax.lax.psum_scatter(
          comm.shard_rows(g * down, lay), local_axis, scatter_dimension=0,
          tiled=True).reshape(-1) * up) for g, lay in zip(grads, layouts1)]
      flags = jax.lax.psum(leaves.flag(finite), local_axis)

    sent, layouts2 = [], []
    for j, s in enumerate(shards):
      lay = comm.leaf_layout(s.size, nodes, wire_block)
      fb = step(s, old[2][j], old[3][j], lay)
      new[2][j], new[3][j] = fb.error, fb.error_scale
      sent.append(fb.sent)
      layouts2.append(lay)
    shards, flags = comm.all_to_all_mean(sent, bits, scale, flags, node_axis)
    node_shards, flags = comm.gather_bf16([quant.saturate(s, jnp.bfloat16) for s in shards],
                                          layouts2, flags, node_axis)
    return comm.gather_bf16(node_shards, layouts1, flags, local_axis)

  def update_body(updates, state):
    trees.check_state_matches("two_hop", updates, state, init_body(updates))
    parts, k = leaves.split(updates, (node_axis, local_axis)), state.count
    if not parts.chosen:  # nothing to compress or send
      return updates, state._replace(count=optax.safe_increment(k))
    fields = (state.error, state.error_scale, state.node_error, state.node_error_scale)
    old = [parts.per_leaf(f) for f in fields]
    new, values, flags = [list(f) for f in old], [None] * len(parts.leaves), jnp.float32(0)
    for group in parts.groups:
      group_old = [[f[i] for i in group] for f in old]
      group_new = [list(f) for f in group_old]
      # With intra="loco" the first hop's step reads the gradients (and their finiteness).
      finite = jnp.bool_(True) if intra == "loco" else parts.finite(group)
      averaged, group_flags = hops([parts.flat(i) for i in group], group_old, group_new, k,
                                   finite)
      for j, i in enumerate(group):
        values[i] = averaged[j]
        for f, g in zip(new, group_new):
          f[i] = g[j]
      flags = flags + group_flags
    flags = parts.agree(flags)  # every shard, like every device, keeps or skips the step
    finite = jnp.isfinite(flags)
    kept = leaves.keep_if(finite, new, old)
    return parts.outputs(values, flags), TwoHopState(
        jnp.where(finite, optax.safe_increment(k), k),
        *[parts.tree(x, like) for x, like in zip(kept, fields)])

  axes = (node_axis, local_axis)
  return optax.GradientTransformationExtraArgs(
      leaves.local_init(init_body, axes, specs, "two_hop"),
      leaves.local_update(update_body, axes, specs, who="two_hop"))
