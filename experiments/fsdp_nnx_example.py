"""FSDP (ZeRO-3) with LoCo on a flax nnx model, split into embed / stacked blocks / head.

A residual MLP regressor in nnx: `Embed` (a Linear), `depth` identical `Block`s, `Head`
(LayerNorm, Linear, mean squared error). `fsdp` needs three pure functions and the params
stacked on a layer axis: `layered` builds both from the modules (nnx.split / nnx.merge), so
the model stays an ordinary nnx model. Trains on 8 simulated CPU devices with
`parallel.make_train_step(mode="fsdp")` and LoCo, and prints the losses.
  python experiments/fsdp_nnx_example.py [--steps 100] [--depth 6]
"""

import argparse

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from loco_jax import loco
from loco_jax.train import fsdp, parallel
from loco_jax.apps.models import teacher_student_data

IN, OUT = 32, 8


class Embed(nnx.Module):
  def __init__(self, width: int, rngs: nnx.Rngs):
    self.proj = nnx.Linear(IN, width, rngs=rngs)

  def __call__(self, x_BxI: jax.Array) -> jax.Array:
    return self.proj(x_BxI)


class Block(nnx.Module):
  """x + W2 gelu(W1 ln(x)): every layer the same shapes, so their params stack."""

  def __init__(self, width: int, rngs: nnx.Rngs):
    self.ln = nnx.LayerNorm(width, rngs=rngs)
    self.fc1 = nnx.Linear(width, 4 * width, rngs=rngs)
    self.fc2 = nnx.Linear(4 * width, width, kernel_init=nnx.initializers.normal(0.01),
                          rngs=rngs)

  def __call__(self, x_BxD: jax.Array) -> jax.Array:
    return x_BxD + self.fc2(jax.nn.gelu(self.fc1(self.ln(x_BxD))))


class Head(nnx.Module):
  def __init__(self, width: int, rngs: nnx.Rngs):
    self.ln = nnx.LayerNorm(width, rngs=rngs)
    self.out = nnx.Linear(width, OUT, rngs=rngs)

  def __call__(self, x_BxD: jax.Array) -> jax.Array:
    return self.out(self.ln(x_BxD))


class ResidualMLP(nnx.Module):
  """The plain nnx model: what `layered` takes apart, and the reference for its loss."""

  def __init__(self, width: int, depth: int, rngs: nnx.Rngs):
    self.embed = Embed(width, rngs)
    self.blocks = nnx.List([Block(width, rngs) for _ in range(depth)])
    self.head = Head(width, rngs)

  def __call__(self, x_BxI: jax.Array) -> jax.Array:
    x_BxD = self.embed(x_BxI)
    for block in self.blocks:
      x_BxD = block(x_BxD)
    return self.head(x_BxD)


def mse(predictions_BxO: jax.Array, batch_BxIO: jax.Array) -> jax.Array:
  return jnp.mean((predictions_BxO.astype(jnp.float32) - batch_BxIO[:, IN:]) ** 2)


def layered(model: ResidualMLP) -> tuple[fsdp.LayeredModel, fsdp.Layered]:
  """The model as fsdp's embed / block / head functions and its params, blocks stacked."""
  split = lambda module: nnx.split(module, nnx.Param)
  (embed_def, embed_params), (head_def, head_params) = split(model.embed), split(model.head)
  block_defs, block_params = zip(*(split(block) for block in model.blocks))
  as_dict = nnx.to_pure_dict
  stacked = jax.tree.map(lambda *layers: jnp.stack(layers), *map(as_dict, block_params))
  functions = fsdp.LayeredModel(
      embed=lambda p, batch: nnx.merge(embed_def, p)(batch[:, :IN]),
      block=lambda p, x: nnx.merge(block_defs[0], p)(x),
      head=lambda p, x, batch: mse(nnx.merge(head_def, p)(x), batch))
  return functions, fsdp.Layered(as_dict(embed_params), stacked, as_dict(head_params))


def batches(steps: int, size: int = 64):
  x, y = teacher_student_data(jax.random.key(1), steps * size, IN, OUT, teacher_hidden=64)
  data = jnp.concatenate([x, y], axis=1)
  return [data[i * size: (i + 1) * size] for i in range(steps)]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=100)
  parser.add_argument("--depth", type=int, default=6)
  parser.add_argument("--width", type=int, default=64)
  args = parser.parse_args()
  jax.config.update("jax_num_cpu_devices", 8)  # before anything touches a device
  model = ResidualMLP(args.width, args.depth, nnx.Rngs(0))
  functions, params = layered(model)
  mesh, optimizer = parallel.data_mesh(8), optax.adamw(3e-3)
  compressor = loco(axis_name="data", scatter=True)
  state, specs = parallel.init_train_state(params, optimizer, mesh, compressor=compressor,
                                           mode="fsdp")
  step = parallel.make_train_step(functions, optimizer, mesh, params,
                                  compressor=compressor, mode="fsdp",
                                  compute_dtype=jnp.bfloat16)
  for i, batch in enumerate(batches(args.steps)):
    state, loss = step(state, batch)
    if i % 10 == 0 or i == args.steps - 1:
      print(f"step {i + 1:4d}  loss {float(loss):.4f}")
  # The trained master shards back into the nnx model (blocks unstacked layer by layer).
  trained = fsdp.unshard_params(state.params, params)
  nnx.update(model.embed, trained.embed)
  nnx.update(model.head, trained.head)
  for i, block in enumerate(model.blocks):
    nnx.update(block, jax.tree.map(lambda x: x[i], trained.blocks))
  fresh = batches(1)[0]  # drawn apart from the training batches
  print(f"the nnx model with the trained params, on a fresh batch: loss "
        f"{float(mse(model(fresh[:, :IN]), fresh)):.4f}")


if __name__ == "__main__":
  main()
