"""FSDP (ZeRO-3): parameters gathered layer by layer, each layer's gradient sent as it exists.

The model is a `LayeredModel`: `embed`, one `block` scanned over a stack of identical layers
(params stacked on a leading axis) and `head`, which returns the loss. Master params and the
optimizer state live on per-device float32 shards, as in ZeRO-2. A step::

  forward   gather embed's params; scan: gather layer l's params (compute dtype or int8), run it
  backward  head's gradient -> compressor; a reverse scan re-gathers each layer, recomputes its
            vjp and sends its gradient through the compressor with its own state; then embed
  update    the optimizer on the global master shards, under GSPMD (as zero2's)

A device holds 1/N of the params, gradients and optimizer state, about one layer in full and
the compressor's state. The compressor must reduce-scatter: `loco(axis_name=..., scatter=True)`
or `parallel.reduce_scatter(...)`. Models that are not stacks use `whole_model(loss_fn)`.
Callable optax masks see the stacked `Layered` params: select leaves by name, not by ndim.
"""

import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from loco_jax.core import layout, trees
from loco_jax.train import masks, sharding, shards, steps
from loco_jax.train.state import Setup, TrainState, opt_state_specs


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
  """A model that is not a stack: `loss_fn(params, batch)` as a head alone, with params
  `Layered({}, {}, params)`; every leaf is gathered at once.

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


def check_layered(params: Any, model: LayeredModel | None = None) -> int:
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


def _one_layer(blocks):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x)[1:], jnp.result_type(x)),
                      blocks)


def _layer_size(x) -> int:
  return math.prod(jnp.shape(x)[1:])


def local_shard_shapes(params: Layered, num_shards: int) -> Layered:
  """Shapes of one device's float32 master shards: [shard_len] a leaf, [layers, shard_len] a
  stacked leaf."""
  stack = lambda x: jax.ShapeDtypeStruct(
      (x.shape[0], layout.shard_len(_layer_size(x), num_shards)), jnp.float32)
  return Layered(shards.shard_shapes(params.embed, num_shards),
                 jax.tree.map(stack, params.blocks), shards.shard_shapes(params.head, num_shards))


def param_specs(params: Layered, axis_name: str) -> Layered:
  """PartitionSpecs of the master shards: split on the axis (per layer for the stack)."""
  return Layered(jax.tree.map(lambda _: P(axis_name), params.embed),
                 jax.tree.map(lambda _: P(None, axis_name), params.blocks),
                 jax.tree.map(lambda _: P(axis_name), params.head))


def shard_params(params: Layered, mesh: Mesh, axis_name: str = "data") -> Layered:
  """Full params -> global float32 master-shard arrays ([N * shard_len] a leaf, [L, N *
  shard_len] a stacked leaf: row l holds layer l's shards) placed on the mesh."""
  check_layered(params)
  n = mesh.shape[axis_name]

  def shard_stack(x):
    leaf = layout.leaf_layout(_layer_size(x), n, None)
    rows = jax.vmap(lambda f: layout.shard_rows(f, leaf).reshape(-1))(
        jnp.reshape(x, (x.shape[0], -1)).astype(jnp.float32))
    return jax.device_put(rows, NamedSharding(mesh, P(None, axis_name)))
  return Layered(shards.shard_params(params.embed, mesh, axis_name),
                 jax.tree.map(shard_stack, params.blocks),
                 shards.shard_params(params.head, mesh, axis_name))


def unshard_params(master: Layered, like: Layered) -> Layered:
  """Inverse of `shard_params` (on global arrays): full leaves shaped and typed like `like`."""
  stack = lambda s, x: s[:, : _layer_size(x)].reshape(x.shape).astype(x.dtype)
  return Layered(shards.unshard_params(master.embed, like.embed),
                 jax.tree.map(stack, master.blocks, like.blocks),
                 shards.unshard_params(master.head, like.head))


def _compressor_specs(compressor: optax.GradientTransformation, params: Layered, mesh: Mesh,
                      axis_name: str) -> Layered:
  """Specs of the compressor's state of embed, of each layer (stacked) and of head."""
  layer_specs = opt_state_specs(compressor, _one_layer(params.blocks), mesh, axis_name)
  return Layered(
      opt_state_specs(compressor, params.embed, mesh, axis_name),
      jax.tree.map(lambda s: P(None, *s), layer_specs) if jax.tree.leaves(params.blocks)
      else layer_specs,  # stacked on a leading layer axis
      opt_state_specs(compressor, params.head, mesh, axis_name))


def state_specs(setup: Setup) -> TrainState:
  """Full specs of fsdp's state: master shards, the optimizer state split like them, one
  compressor state for embed, each layer (stacked) and head."""
  check_layered(setup.params)
  masks.evaluate_on_full_shapes(setup.optimizer)
  mesh, name = setup.mesh, setup.axes.name
  shard_specs = param_specs(setup.params, name)
  master = jax.eval_shape(lambda p: shard_params(p, mesh, name), setup.params)
  opt_init = masks.on_full_shapes(setup.optimizer.init, setup.params)
  return TrainState(
      shard_specs, _compressor_specs(setup.compressor, setup.params, mesh, name),
      sharding.gspmd_state_specs(opt_init, master, shard_specs, mesh, setup.axes.data), P())


def init(setup: Setup, params: Layered) -> tuple[TrainState, TrainState]:
  """fsdp's state on the mesh and its specs (`parallel.init_train_state(mode="fsdp")`); the
  optimizer's callable masks see the full-shaped params."""
  specs, compressor = state_specs(setup), setup.compressor
  master = shard_params(params, setup.mesh, setup.axes.name)
  opt_init = masks.on_full_shapes(setup.optimizer.init, setup.params)

  def compressor_init(full: Layered):  # every layer's state stacked on a leading axis
    stack = jax.vmap(compressor.init) if jax.tree.leaves(full.blocks) else compressor.init
    return Layered(compressor.init(full.embed), stack(full.blocks), compressor.init(full.head))

  def init_fn(full: Layered, master: Layered):
    return TrainState(master, steps.over_data(compressor_init, setup, (P(),),
                                              specs.compressor_state)(full),
                      opt_init(master), jnp.zeros([], jnp.int32))
  full = jax.device_put(params, NamedSharding(setup.mesh, P()))
  return jax.jit(init_fn, out_shardings=sharding.named(setup.mesh, specs))(full, master), specs


def _keep_if_finite(grads: Any, new: Any, old: Any, axis_name: str) -> Any:
  """`new` where every gradient on every device is finite, else `old`.

  zero2's one exchange keeps or skips the compressor's step as a whole; here each unit (embed,
  a layer, head) decides alone, so a 4-byte all-reduce makes them keep or skip together.
  """
  finite = jnp.bool_(True)
  for g in jax.tree.leaves(grads):
    finite &= jnp.all(jnp.isfinite(g))
  finite = jax.lax.pmin(finite.astype(jnp.int32), axis_name) > 0
  return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)


def make_step(setup: Setup, model: LayeredModel) -> Callable:
  """fsdp's jitted `step(state, batch) -> (state, mean loss)` (`parallel.make_train_step`):
  each unit's params gathered as `setup.gather` says, the batch's leading axis split over the
  data axis."""
  specs, axes, compressor, like = state_specs(setup), setup.axes, setup.compressor, setup.params
  stacked = check_layered(like, model) > 0
  layer_like = _one_layer(like.blocks)
  shard_like = local_shard_shapes(like, axes.size)

  def gathered(master, leaves_like):
    full = shards.gather_params(master, leaves_like, axes.name, setup.gather)
    # Replicated params would make the vjp psum their gradient in full precision (the
    # transpose of the implicit broadcast); marked varying, each device keeps its own.
    return jax.lax.pcast(full, axes.name, to="varying")

  def local_grads(master: Layered, comp: Layered, batch):
    trees.check_same_shapes(master, shard_like, "state.params (fsdp master shards)",
                            "params_like's shards")
    x = model.embed(gathered(master.embed, like.embed), batch)
    if stacked:
      def forward(x, layer_shards):
        return model.block(gathered(layer_shards, layer_like), x), x  # keep the block's input
      x, inputs = jax.lax.scan(forward, x, master.blocks)
    head_params = gathered(master.head, like.head)
    loss, head_vjp = jax.vjp(lambda p, x: model.head(p, x, batch), head_params, x)
    head_grads, dx = head_vjp(jnp.ones_like(loss))
    head_grads, head_comp = compressor.update(head_grads, comp.head, head_params)
    block_grads, block_comp = master.blocks, comp.blocks  # stay empty without a stack
    if stacked:
      def backward(dy, layer):
        layer_shards, x, layer_comp = layer
        params = gathered(layer_shards, layer_like)  # gathered again: dropped after the forward
        _, block_vjp = jax.vjp(model.block, params, x)
        grads, dx = block_vjp(dy)
        grads, layer_comp = compressor.update(grads, layer_comp, params)
        return dx, (grads, layer_comp)
      dx, (block_grads, block_comp) = jax.lax.scan(
          backward, dx, (master.blocks, inputs, comp.blocks), reverse=True)
    embed_params = gathered(master.embed, like.embed)
    _, embed_vjp = jax.vjp(lambda p: model.embed(p, batch), embed_params)
    embed_grads, embed_comp = compressor.update(embed_vjp(dx)[0], comp.embed, embed_params)
    grads = Layered(embed_grads, block_grads, head_grads)
    trees.check_same_shapes(grads, shard_like, "the compressor's output",
                            "state.params (fsdp master shards)",
                            shards.scatter_hint("fsdp"))
    new_comp = _keep_if_finite(grads, Layered(embed_comp, block_comp, head_comp), comp, axes.name)
    return grads, new_comp, jax.lax.pmean(loss, axes.name)

  return steps.on_master_shards(
      steps.over_data(local_grads, setup, (specs.params, specs.compressor_state, P(axes.name)),
                      (specs.params, specs.compressor_state, P())), setup, specs)
