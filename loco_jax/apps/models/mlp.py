"""A tiny MLP in flax nnx and random-teacher data for teacher-student experiments."""
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

Params = Any  # nested dict of jax arrays, as returned by `split_model`
TASKS = ("regression", "classification")


def _widths(hidden: int | Sequence[int]) -> tuple[int, ...]:
  widths = (hidden,) if isinstance(hidden, int) else tuple(hidden)
  if any(not isinstance(w, int) or isinstance(w, bool) or w < 1 for w in widths):
    raise ValueError(f"hidden must be a positive int or a sequence of positive ints, "
                     f"got {hidden!r}.")
  return widths


class MLP(nnx.Module):
  """ReLU multilayer perceptron: in_dim -> hidden... -> out_dim (linear output).

  Example:
    >>> MLP(8, 32, 3, nnx.Rngs(0))(jnp.ones((5, 8))).shape
    (5, 3)
  """

  def __init__(self, in_dim: int, hidden: int | Sequence[int], out_dim: int,
               rngs: nnx.Rngs | None = None):
    for name, value in (("in_dim", in_dim), ("out_dim", out_dim)):
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}.")
    rngs = nnx.Rngs(0) if rngs is None else rngs
    dims = (in_dim, *_widths(hidden), out_dim)
    self.layers = nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in zip(dims[:-1], dims[1:])])

  def __call__(self, x_BxI: jax.Array) -> jax.Array:
    h_BxH = x_BxI
    for layer in self.layers[:-1]:
      h_BxH = jax.nn.relu(layer(h_BxH))
    return self.layers[-1](h_BxH)


def loss_fn(model: MLP, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
  """Mean loss on `batch = (x [B, in_dim], y)`, chosen by the dtype of y.

  Float y [B, out_dim]: mean squared error (mean over batch and outputs).
  Integer y [B]: softmax cross entropy over out_dim classes.

  Example:
    >>> x, y = teacher_student_data(jax.random.key(0), 64, 8, 2, 16)
    >>> float(loss_fn(MLP(8, 32, 2, nnx.Rngs(0)), (x, y))) > 0
    True
  """
  x_BxI, y = batch
  out_BxO = model(x_BxI)
  if jnp.issubdtype(y.dtype, jnp.integer):
    return optax.softmax_cross_entropy_with_integer_labels(out_BxO, y).mean()
  return jnp.mean((out_BxO - y) ** 2)


def split_model(model: nnx.Module) -> tuple[nnx.GraphDef, Params]:
  """Splits a model into a static graphdef and a params pytree (nested dict of arrays).

  Example:
    >>> graphdef, params = split_model(MLP(8, 32, 2, nnx.Rngs(0)))
    >>> sorted(params["layers"])
    [0, 1]
  """
  graphdef, state = nnx.split(model)
  return graphdef, nnx.to_pure_dict(state)


def apply_loss(graphdef: nnx.GraphDef, params: Params,
               batch: tuple[jax.Array, jax.Array]) -> jax.Array:
  """`loss_fn` of the model rebuilt from `split_model`'s output; pure, so jit/grad/shard_map safe.

  Example:
    >>> graphdef, params = split_model(MLP(8, 32, 2, nnx.Rngs(0)))
    >>> batch = teacher_student_data(jax.random.key(0), 64, 8, 2, 16)
    >>> grads = jax.grad(apply_loss, argnums=1)(graphdef, params, batch)
  """
  return loss_fn(nnx.merge(graphdef, params), batch)


def teacher_student_data(key: jax.Array, n: int, in_dim: int, out_dim: int,
                         teacher_hidden: int, task: str = "regression",
                         noise: float = 0.0) -> tuple[jax.Array, jax.Array]:
  """Gaussian inputs labelled by a random one-hidden-layer tanh teacher.

  x ~ N(0, I) [n, in_dim]; teacher(x) = tanh(x W1 / sqrt(in_dim)) W2 / sqrt(teacher_hidden)
  with W1, W2 standard normal, so an output's variance is about 0.4 on average over
  teachers. The teacher depends only on `key`; for train and eval sets from one teacher,
  draw n_train + n_eval in one call and slice.

  task="regression": y = teacher(x) + noise * N(0, 1), float32 [n, out_dim] (use MSE).
  task="classification": y = argmax(teacher(x) + noise * N(0, 1)), int32 [n], out_dim classes.

  Example:
    >>> x, y = teacher_student_data(jax.random.key(0), 100, 8, 3, 16, task="classification")
    >>> x.shape, y.shape, str(y.dtype)
    ((100, 8), (100,), 'int32')
  """
  if task not in TASKS:
    raise ValueError(f"task must be one of {TASKS}, got {task!r}.")
  for name, value in (("n", n), ("in_dim", in_dim), ("out_dim", out_dim),
                      ("teacher_hidden", teacher_hidden)):
    if not isinstance(value, int) or value < 1:
      raise ValueError(f"{name} must be a positive int, got {value!r}.")
  if noise < 0:
    raise ValueError(f"noise must be >= 0, got {noise!r}.")
  return _teacher_student(key, n, in_dim, out_dim, teacher_hidden, task, noise)


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4, 5))
def _teacher_student(key: jax.Array, n: int, in_dim: int, out_dim: int, teacher_hidden: int,
                     task: str, noise: float) -> tuple[jax.Array, jax.Array]:
  k_w1, k_w2, k_x, k_noise = jax.random.split(key, 4)
  w1_IxH = jax.random.normal(k_w1, (in_dim, teacher_hidden)) / jnp.sqrt(in_dim)
  w2_HxO = jax.random.normal(k_w2, (teacher_hidden, out_dim)) / jnp.sqrt(teacher_hidden)
  x_NxI = jax.random.normal(k_x, (n, in_dim))
  y_NxO = jnp.tanh(x_NxI @ w1_IxH) @ w2_HxO
  y_NxO = y_NxO + noise * jax.random.normal(k_noise, y_NxO.shape)
  if task == "classification":
    return x_NxI, jnp.argmax(y_NxO, axis=-1).astype(jnp.int32)
  return x_NxI, y_NxO.astype(jnp.float32)
