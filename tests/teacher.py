"""The small regression task the train-step tests share: a tanh MLP fit to a random teacher."""

import jax
import jax.numpy as jnp
import numpy as np


def params():
  """The MLP's params: w1 [16, 64], b1, w2 [64, 4], b2."""
  k1, k2 = jax.random.split(jax.random.key(0))
  return {"w1": jax.random.normal(k1, (16, 64)) * 0.3, "b1": jnp.zeros(64),
          "w2": jax.random.normal(k2, (64, 4)) * 0.3, "b2": jnp.zeros(4)}


def loss(params, batch):
  """Mean squared error of the MLP on a batch of rows [x (16), teacher's y (4)]."""
  h = jnp.tanh(batch[:, :16] @ params["w1"] + params["b1"])
  return jnp.mean((h @ params["w2"] + params["b2"] - batch[:, 16:]) ** 2)


def batches(steps, size):
  """`steps` float32 batches of `size` rows, the same on every call."""
  rng = np.random.default_rng(0)
  teacher = rng.standard_normal((16, 4))
  out = []
  for _ in range(steps):
    x = rng.standard_normal((size, 16)).astype(np.float32)
    out.append(jnp.asarray(np.concatenate([x, np.tanh(x @ teacher)], axis=1), jnp.float32))
  return out
