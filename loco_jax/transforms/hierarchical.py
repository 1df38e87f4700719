"""Two-hop LoCo for a (node, local) mesh: a hop inside each node, then LoCo across nodes."""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from loco_jax import comm
from loco_jax.core import quant, trees
from loco_jax.transforms.loco import (_check_args, _compressible, _feedback_step, _flag, _is_due,
                           _keep_if, _nonfinite_flag, _probe_kernel)

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
  (both hops saturate as `loco` does, and the reduce-scatter sums g / 2**k).

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

  def init_fn(params):
    leaves, treedef = jax.tree.flatten(params)
    local = comm.axis_size(local_axis, "two_hop")
    sizes = [x.size if _compressible(x) else 0 for x in leaves]
    own = [buffers(n if intra == "loco" else 0) for n in sizes]
    node = [buffers(comm.shard_len(n, local) if n else 0) for n in sizes]
    pick = lambda bufs, j: treedef.unflatten([b[j] for b in bufs])
    fixed = error_scale is not None
    return TwoHopState(jnp.zeros([], jnp.int32), pick(own, 0), None if fixed else pick(own, 1),
                       pick(node, 0), None if fixed else pick(node, 1))

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    trees.check_state_matches("two_hop", updates, state, jax.eval_shape(init_fn, updates))
    leaves, treedef = jax.tree.flatten(updates)
    flat = lambda tree: [None] * len(leaves) if tree is None else treedef.flatten_up_to(tree)
    local, nodes = comm.axis_size(local_axis, "two_hop"), comm.axis_size(node_axis, "two_hop")
    k = state.count
    step = lambda g, err, err_scale, send: _feedback_step(
        g, err, err_scale, send, _is_due(k, reset_interval), bits, scale, error_bits,
        error_scale, beta, block_size)

    chosen = [i for i, g in enumerate(leaves) if _compressible(g)]
    if not chosen:  # nothing to compress or send
      return updates, state._replace(count=optax.safe_increment(k))
    grads = [leaves[i].reshape(-1).astype(jnp.float32) for i in chosen]
    layouts1 = [comm.leaf_layout(g.size, local, wire_block) for g in grads]

    errors, error_scales = flat(state.error), flat(state.error_scale)
    new_errors, new_error_scales = list(errors), list(error_scales)
    if intra == "loco":
      sent, finite = [], jnp.bool_(True)
      for i, g, lay in zip(chosen, grads, layouts1):
        fb = step(g, errors[i], error_scales[i], lay)
        new_errors[i], new_error_scales[i] = fb.error, fb.error_scale
        finite &= fb.finite  # the step has read g already
        sent.append(fb.sent)
      shards, flags = comm.all_to_all_mean(sent, bits, scale, _flag(finite), local_axis)
      shards = [s.reshape(-1)[: lay.row_len] for s, lay in zip(shards, layouts1)]
    else:
      _, flag = _nonfinite_flag(leaves, chosen)
      down, up = quant.mean_factors(local)  # a sum of g / 2**k: finite g never overflow it
      shards = [quant.saturate(jax.lax.psum_scatter(
          comm.shard_rows(g * down, lay), local_axis, scatter_dimension=0,
          tiled=True).reshape(-1) * up) for g, lay in zip(grads, layouts1)]
      flags = jax.lax.psum(flag, local_axis)

    node_errors, node_scales = flat(state.node_error), flat(state.node_error_scale)
    new_node_errors, new_node_scales = list(node_errors), list(node_scales)
    sent, layouts2 = [], []
    for i, s in zip(chosen, shards):
      lay = comm.leaf_layout(s.size, nodes, wire_block)
      fb = step(s, node_errors[i], node_scales[i], lay)
      new_node_errors[i], new_node_scales[i] = fb.error, fb.error_scale
      sent.append(fb.sent)
      layouts2.append(lay)
    shards, flags = comm.all_to_all_mean(sent, bits, scale, flags, node_axis)
    node_shards, flags = comm.gather_bf16([quant.saturate(s, jnp.bfloat16) for s in shards],
                                          layouts2, flags, node_axis)
    averaged, flags = comm.gather_bf16(node_shards, layouts1, flags, local_axis)

    finite = jnp.isfinite(flags)
    out = list(leaves)
    for i, value in zip(chosen, averaged):
      out[i] = quant.saturating_cast((value + flags).reshape(leaves[i].shape), leaves[i].dtype)
    kept = _keep_if(finite, (new_errors, new_error_scales, new_node_errors, new_node_scales),
                    (errors, error_scales, node_errors, node_scales))
    unflat = lambda xs, tree: None if tree is None else treedef.unflatten(xs)
    return treedef.unflatten(out), TwoHopState(
        jnp.where(finite, optax.safe_increment(k), k), unflat(kept[0], state.error),
        unflat(kept[1], state.error_scale), unflat(kept[2], state.node_error),
        unflat(kept[3], state.node_error_scale))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
