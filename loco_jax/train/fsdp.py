"""FSDP (ZeRO-3): parameters gathered layer by layer, each layer's gradient sent as it exists.

The model is a `LayeredModel`: `embed`, one `block` applied to a stack of identical layers
(their params stacked on a leading layer axis), and `head`, which returns the loss. Master
params and the optimizer state live on per-device float32 shards (as in ZeRO-2: each leaf,
and each layer of a stacked leaf, flattened and split into `layout.shard_len` pieces). A step:

  forward   gather embed's params, run embed; scan over layers: gather layer l's params in
            the compute dtype (or int8 with block scales), run the block, keep only its input
  backward  head's gradient -> compressor; a reverse scan: re-gather layer l's params, vjp of
            the block (it is recomputed), layer l's gradient -> the compressor with that
            layer's own state (LoCo's int8 error) -> this device's averaged shard; then embed
  update    the optimizer on the master shards

so a device holds 1/N of the params, gradients and optimizer state plus about one layer in
full, its activations at layer boundaries, and the compressor's state (LoCo: an int8 error of
the full gradient, 1 byte a parameter). The compressor must have reduce-scatter semantics:
`loco(axis_name=..., scatter=True)` or `parallel.reduce_scatter(...)`. Models that are not
stacks use `whole_model(loss_fn)`: every leaf is gathered at once (ZeRO-2's parameter memory,
FSDP's state). Entry points: `parallel.init_train_state` / `make_train_step` with mode="fsdp".
Callable optax masks see the full-shaped `Layered` params, stacked: a stacked bias is 2-D, so
select leaves by name there rather than by ndim.
"""

import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from loco_jax import comm
from loco_jax.core import layout, trees
from loco_jax.train import masks


class Layered(NamedTuple):
  """A layered model's params: embed's, the blocks' (stacked on a leading layer axis), head's."""
  embed: Any
  blocks: Any
  head: Any


class LayeredModel(NamedTuple):
  """loss = head(p.head, block(p.blocks[L-1], ... block(p.blocks[0], embed(p.embed, b))), b).

  embed(embed_params, batch) -> x; block(one_layer_params, x) -> x of the same shape and dtype;
  head(head_params, x, batch) -> scalar loss (this device's mean). `block` may be None when
  `Layered.blocks` is empty.
  """
  embed: Callable[[Any, Any], Any]
  block: Callable[[Any, Any], Any] | None
  head: Callable[[Any, Any, Any], jax.Array]


def whole_model(loss_fn: Callable[[Any, Any], jax.Array]) -> LayeredModel:
  """The fallback for a model that is not a stack: `loss_fn(params, batch)` as a head alone,
  with params `Layered({}, {}, params)`. Every leaf is gathered at once, once for the forward
  and once for the backward pass.

  Example:
    >>> model = whole_model(lambda p, b: jnp.mean((b @ p["w"] + p["b"]) ** 2))
    >>> float(layered_loss(model)(Layered({}, {}, params), jnp.zeros((2, 4))))
    0.0
  """
  return LayeredModel(lambda p, batch: jnp.zeros([], jnp.float32), None,
                      lambda p, x, batch: loss_fn(p, batch))


def num_layers(blocks: Any) -> int:
  """The stack's layer count: the leading axis every leaf of `blocks` shares (0 if empty)."""
  sizes = {jnp.shape(x)[0] if jnp.ndim(x) else 0 for x in jax.tree.leaves(blocks)}
  if not sizes:
    return 0
  if len(sizes) != 1 or 0 in sizes:
    raise ValueError(f"Layered.blocks must stack identical layers on a leading axis that every "
                     f"leaf shares (at least 1 layer); its leading axes are {sorted(sizes)}")
  return sizes.pop()


def _check_layered(params: Any, model: LayeredModel | None = None) -> int:
  if not isinstance(params, Layered):
    raise ValueError(f"mode='fsdp' takes params as fsdp.Layered(embed, blocks, head) (e.g. "
                     f"models.gpt.layered_params, or Layered({{}}, {{}}, params) with "
                     f"fsdp.whole_model), got a {type(params).__name__}")
  layers = num_layers(params.blocks)
  if model is not None:
    if not isinstance(model, LayeredModel):
      raise ValueError(f"mode='fsdp' takes the model as fsdp.LayeredModel(embed, block, head) "
                       f"(fsdp.whole_model(loss_fn) for a plain loss), got "
                       f"{type(model).__name__}")
    if layers and model.block is None:
      raise ValueError(f"Layered.blocks has {layers} layers but LayeredModel.block is None")
  return layers


def layered_loss(model: LayeredModel) -> Callable[[Layered, Any], jax.Array]:
  """The plain `loss(params, batch)` of a layered model (ddp, zero2, references)."""
  def loss(params: Layered, batch):
    x = model.embed(params.embed, batch)
    if jax.tree.leaves(params.blocks):
      x, _ = jax.lax.scan(lambda x, p: (model.block(p, x), None), x, params.blocks)
    return model.head(params.head, x, batch)
  return loss



def unstacked(params: Layered,
              model: LayeredModel) -> tuple[dict, Callable[[dict, Any], jax.Array]]:
  """The same model for ddp / zero2 with every layer its own leaves, so that each layer's
  shard and LoCo blocks are laid out as fsdp lays them out: (params, loss(params, batch))."""
  params = {"embed": params.embed, "head": params.head,
            "blocks": [jax.tree.map(lambda x, i=i: x[i], params.blocks)
                       for i in range(num_layers(params.blocks))]}

  def loss(params: dict, batch):
    x = model.embed(params["embed"], batch)
    for layer in params["blocks"]:
      x = model.block(layer, x)
    return model.head(params["head"], x, batch)
  return params, loss

def _shapes(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), tree)


def _one_layer(blocks):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x)[1:], jnp.result_type(x)),
                      blocks)


def _layer_size(x) -> int:
  return math.prod(jnp.shape(x)[1:])


def local_shard_shapes(params: Layered, num_shards: int) -> Layered:
  """Shapes of one device's float32 master shards: [shard_len] a leaf, [layers, shard_len] a
  stacked leaf."""
  flat = lambda size: layout.shard_len(size, num_shards)
  return Layered(
      jax.tree.map(lambda x: jax.ShapeDtypeStruct((flat(x.size),), jnp.float32), params.embed),
      jax.tree.map(lambda x: jax.ShapeDtypeStruct((x.shape[0], flat(_layer_size(x))),
                                                  jnp.float32), params.blocks),
      jax.tree.map(lambda x: jax.ShapeDtypeStruct((flat(x.size),), jnp.float32), params.head))


def param_specs(params: Layered, axis_name: str) -> Layered:
  """PartitionSpecs of the master shards: split on the axis (per layer for the stack)."""
  return Layered(jax.tree.map(lambda _: P(axis_name), params.embed),
                 jax.tree.map(lambda _: P(None, axis_name), params.blocks),
                 jax.tree.map(lambda _: P(axis_name), params.head))


def shard_params(params: Layered, mesh: Mesh, axis_name: str = "data") -> Layered:
  """Full params -> global float32 master-shard arrays ([N * shard_len] a leaf, [L, N *
  shard_len] a stacked leaf: row l holds layer l's shards) placed on the mesh."""
  from loco_jax.train import parallel  # parallel delegates mode="fsdp" here
  _check_layered(params)
  n = mesh.shape[axis_name]

  def shard_stack(x):
    layout = layout.leaf_layout(_layer_size(x), n, None)
    rows = jax.vmap(lambda f: layout.shard_rows(f, layout).reshape(-1))(
        jnp.reshape(x, (x.shape[0], -1)).astype(jnp.float32))
    return jax.device_put(rows, NamedSharding(mesh, P(None, axis_name)))
  return Layered(parallel.shard_params(params.embed, mesh, axis_name),
                 jax.tree.map(shard_stack, params.blocks),
                 parallel.shard_params(params.head, mesh, axis_name))


def unshard_params(shards: Layered, like: Layered) -> Layered:
  """Inverse of `shard_params` (on global arrays): full leaves shaped and typed like `like`."""
  from loco_jax.train import parallel
  stack = lambda s, x: s[:, : _layer_size(x)].reshape(x.shape).astype(x.dtype)
  return Layered(parallel.unshard_params(shards.embed, like.embed),
                 jax.tree.map(stack, shards.blocks, like.blocks),
                 parallel.unshard_params(shards.head, like.head))


def _per_layer(spec: P) -> P:
  """A per-layer state's spec, for the state stacked on a leading layer axis."""
  return P(None, *spec)


def _opt_spec(x, axis_name: str) -> P:
  if x.ndim > 2:
    raise ValueError(f"mode='fsdp': an optimizer state leaf of shape {x.shape} is neither a "
                     f"scalar, a master shard [shard_len] nor a stacked one [layers, shard_len]")
  return (P(), P(axis_name), P(None, axis_name))[x.ndim]


def _init_stack(compressor, blocks):
  """The compressor's state of every layer, stacked on a leading layer axis."""
  if not jax.tree.leaves(blocks):
    return compressor.init(blocks)
  return jax.vmap(compressor.init)(blocks)


def init_train_state(params: Layered, optimizer: optax.GradientTransformation, mesh: Mesh,
                     compressor: optax.GradientTransformation, axis_name: str = "data"):
  """`parallel.init_train_state(mode="fsdp")`: master shards, per-layer compressor states."""
  from loco_jax.train import parallel
  _check_layered(params)
  masks.evaluate_on_full_shapes(optimizer)
  n = mesh.shape[axis_name]
  like = _shapes(params)
  layer_specs = parallel.opt_state_specs(compressor, _one_layer(params.blocks), mesh, axis_name)
  comp_specs = Layered(
      parallel.opt_state_specs(compressor, params.embed, mesh, axis_name),
      jax.tree.map(_per_layer, layer_specs) if jax.tree.leaves(params.blocks) else layer_specs,
      parallel.opt_state_specs(compressor, params.head, mesh, axis_name))
  with masks.full_shapes(like):
    opt_specs = jax.tree.map(lambda x: _opt_spec(x, axis_name), jax.eval_shape(
        optimizer.init, local_shard_shapes(params, n)))
  specs = parallel.TrainState(param_specs(params, axis_name), comp_specs, opt_specs, P())

  def init(full: Layered, shards: Layered):
    with masks.full_shapes(like):
      opt_state = optimizer.init(shards)
    comp_state = Layered(compressor.init(full.embed), _init_stack(compressor, full.blocks),
                         compressor.init(full.head))
    return parallel.TrainState(shards, comp_state, opt_state, jnp.zeros([], jnp.int32))

  full = jax.device_put(params, NamedSharding(mesh, P()))
  state = jax.jit(jax.shard_map(init, mesh=mesh, in_specs=(P(), specs.params),
                                out_specs=specs))(full, shard_params(params, mesh, axis_name))
  return state, specs


def sharded_step(model: LayeredModel, optimizer: optax.GradientTransformation, mesh: Mesh,
                 specs, params_like: Layered, compressor: optax.GradientTransformation,
                 axis_name: str, compute_dtype, param_gather: str, block_size: int):
  """The jitted shard_map'd fsdp step (arguments checked by `parallel.make_train_step`)."""
  from loco_jax.train import parallel
  stacked = _check_layered(params_like, model) > 0
  n = mesh.shape[axis_name]
  like = _shapes(params_like)
  layer_like = _one_layer(params_like.blocks)
  shard_shapes = local_shard_shapes(like, n)
  hint = (" mode='fsdp' needs a compressor that returns this device's shard of each leaf "
          "(reduce-scatter semantics), e.g. loco(axis_name=..., scatter=True) or "
          "parallel.reduce_scatter(...).")

  def gather(shards, leaves_like):
    full = parallel._gather_params(shards, leaves_like, axis_name, compute_dtype, param_gather,
                                   block_size)
    # Replicated params would make the vjp psum their gradient in full precision (the
    # transpose of the implicit broadcast); marked varying, each device keeps its own.
    return jax.lax.pcast(full, axis_name, to="varying")

  def local_step(state, batch):
    trees.check_same_shapes(state.params, shard_shapes, "state.params (fsdp master shards)",
                            "params_like's shards")
    shards, comp = state.params, state.compressor_state
    x = model.embed(gather(shards.embed, like.embed), batch)
    if stacked:
      def forward(x, layer_shards):
        return model.block(gather(layer_shards, layer_like), x), x  # keep the block's input
      x, inputs = jax.lax.scan(forward, x, shards.blocks)
    head_params = gather(shards.head, like.head)
    loss, head_vjp = jax.vjp(lambda p, x: model.head(p, x, batch), head_params, x)
    head_grads, dx = head_vjp(jnp.ones_like(loss))
    head_grads, head_comp = compressor.update(head_grads, comp.head, head_params)
    block_grads, block_comp = shards.blocks, comp.blocks  # stay empty without a stack
    if stacked:
      def backward(dy, layer):
        layer_shards, x, layer_comp = layer
        params = gather(layer_shards, layer_like)  # gathered again: dropped after the forward
        _, block_vjp = jax.vjp(model.block, params, x)
        grads, dx = block_vjp(dy)
        grads, layer_comp = compressor.update(grads, layer_comp, params)
        return dx, (grads, layer_comp)
      dx, (block_grads, block_comp) = jax.lax.scan(
          backward, dx, (shards.blocks, inputs, comp.blocks), reverse=True)
    embed_params = gather(shards.embed, like.embed)
    _, embed_vjp = jax.vjp(lambda p: model.embed(p, batch), embed_params)
    embed_grads, embed_comp = compressor.update(embed_vjp(dx)[0], comp.embed, embed_params)
    grads = Layered(embed_grads, block_grads, head_grads)
    trees.check_same_shapes(grads, shards, "the compressor's output",
                            "state.params (fsdp master shards)", hint)
    # zero2's one exchange keeps or skips the compressor's step as a whole (a non-finite
    # gradient on any device leaves its state unchanged); here each unit decides alone, so a
    # 4-byte all-reduce makes every unit on every device keep or skip together.
    finite = jnp.bool_(True)
    for g in jax.tree.leaves(grads):
      finite &= jnp.all(jnp.isfinite(g))
    finite = jax.lax.pmin(finite.astype(jnp.int32), axis_name) > 0
    new_comp = jax.tree.map(lambda new, old: jnp.where(finite, new, old),
                            Layered(embed_comp, block_comp, head_comp), comp)
    with masks.full_shapes(like):
      updates, opt_state = optimizer.update(grads, state.opt_state, shards)
    new_state = parallel.TrainState(optax.apply_updates(shards, updates), new_comp, opt_state,
                                    state.step + 1)
    return new_state, jax.lax.pmean(loss, axis_name)

  return jax.jit(jax.shard_map(local_step, mesh=mesh, in_specs=(specs, P(axis_name)),
                               out_specs=(specs, P())), donate_argnums=0)
