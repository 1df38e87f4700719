"""Tests for loco_jax.models: the byte-level GPT and the teacher-student MLP."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from loco_jax.models import GPT, MLP, GPTConfig, gpt, mlp, num_params, teacher_student_data

TINY = GPTConfig(seq_len=16, d_model=32, n_layers=2, n_heads=4, d_ff=64)


def _tokens(shape: tuple[int, ...], seed: int = 0) -> jax.Array:
  return jax.random.randint(jax.random.key(seed), shape, 0, 256, dtype=jnp.int32)


def _train(graphdef, params, batch, apply_loss, steps: int, lr: float) -> list[float]:
  opt = optax.adamw(lr)

  @jax.jit
  def step(params, state):
    loss, grads = jax.value_and_grad(lambda p: apply_loss(graphdef, p, batch))(params)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  state, losses = opt.init(params), []
  for _ in range(steps):
    params, state, loss = step(params, state)
    losses.append(float(loss))
  return losses


@pytest.fixture(scope="module")
def tiny():
  """One tiny GPT for the module (eager init compiles per shape), its split and a jitted call."""
  model = GPT(TINY)
  graphdef, params = gpt.split_model(model)
  forward = jax.jit(lambda p, tokens: nnx.merge(graphdef, p)(tokens))
  return model, graphdef, params, forward


def test_gpt_output_shape_and_dtype(tiny):
  _, _, params, forward = tiny
  assert forward(params, _tokens((2, 16))).shape == (2, 16, 256)
  logits = forward(params, _tokens((2, 5)))  # shorter than seq_len is accepted
  assert logits.shape == (2, 5, 256) and logits.dtype == jnp.float32


def test_gpt_is_causal(tiny):
  _, _, params, forward = tiny
  tokens = _tokens((2, 16))
  t = 9
  changed = tokens.at[:, t].set((tokens[:, t] + 1) % 256)
  before, after = forward(params, tokens), forward(params, changed)
  np.testing.assert_allclose(before[:, :t], after[:, :t], atol=1e-6)
  assert not np.allclose(before[:, t:], after[:, t:], atol=1e-4)


def test_gpt_default_param_count():
  abstract = nnx.eval_shape(lambda: GPT())  # shapes only: no initializer runs
  assert 200_000 <= num_params(abstract) <= 500_000, num_params(abstract)
  c = GPTConfig()
  per_block = 4 * c.d_model + 4 * c.d_model**2 + 4 * c.d_model + 2 * c.d_model * c.d_ff \
      + c.d_ff + c.d_model
  expected = (c.vocab_size + c.seq_len) * c.d_model + c.n_layers * per_block \
      + 2 * c.d_model + (c.d_model + 1) * c.vocab_size
  assert num_params(abstract) == expected


def test_gpt_initial_loss_near_uniform(tiny):
  model, graphdef, params, _ = tiny
  loss = jax.jit(lambda p, b: gpt.apply_loss(graphdef, p, b))(params, _tokens((8, 17)))
  assert abs(float(loss) - math.log(256)) < 0.1, float(loss)


def test_gpt_same_init_for_same_rngs(tiny):
  _, _, params, _ = tiny
  again = gpt.split_model(GPT(TINY))[1]
  jax.tree.map(np.testing.assert_array_equal, params, again)
  other = gpt.split_model(GPT(TINY, rngs=nnx.Rngs(1)))[1]
  assert not np.array_equal(params["head"]["kernel"], other["head"]["kernel"])


def test_gpt_functional_loss_matches_module(tiny):
  model, graphdef, params, _ = tiny
  batch = _tokens((4, 17))
  assert all(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(params))
  expected = nnx.jit(gpt.loss_fn)(model, batch)
  jitted = jax.jit(lambda p, b: gpt.apply_loss(graphdef, p, b))
  np.testing.assert_allclose(jitted(params, batch), expected, rtol=1e-6)


def test_gpt_adamw_reduces_loss_on_repeated_batch(tiny):
  _, graphdef, params, _ = tiny
  losses = _train(graphdef, params, _tokens((4, 17)), gpt.apply_loss, steps=40, lr=3e-3)
  assert losses[-1] < 0.5 * losses[0], losses


def test_gpt_grads_under_shard_map_match_full_batch(tiny):
  if jax.device_count() < 2:
    pytest.skip("needs 2 devices")
  _, graphdef, params, _ = tiny
  batch = _tokens((4, 17))
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))
  grad_fn = jax.jit(jax.grad(lambda p, b: gpt.apply_loss(graphdef, p, b)))

  @jax.jit
  @jax.shard_map(mesh=mesh, in_specs=(jax.P(), jax.P("data")), out_specs=jax.P())
  def data_parallel_grads(params, local_batch):
    return jax.lax.pmean(grad_fn(params, local_batch), "data")

  expected = grad_fn(params, batch)
  got = data_parallel_grads(params, batch)
  jax.tree.map(lambda g, e: np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-6), got, expected)


def test_gpt_rejects_bad_config_and_input(tiny):
  model = tiny[0]
  with pytest.raises(ValueError, match="divisible by n_heads"):
    GPT(GPTConfig(d_model=30, n_heads=4))
  with pytest.raises(ValueError, match="n_layers"):
    GPT(GPTConfig(n_layers=0))
  with pytest.raises(ValueError, match="seq_len=16"):
    model(_tokens((1, 17)))
  with pytest.raises(ValueError, match="length \\+ 1"):
    gpt.loss_fn(model, _tokens((4,)))


def test_mlp_and_teacher_student_shapes():
  x, y = teacher_student_data(jax.random.key(0), 50, 8, 3, 16)
  assert x.shape == (50, 8) and y.shape == (50, 3) and y.dtype == jnp.float32
  np.testing.assert_array_equal(y, teacher_student_data(jax.random.key(0), 50, 8, 3, 16)[1])
  _, labels = teacher_student_data(jax.random.key(0), 50, 8, 3, 16, task="classification")
  assert labels.shape == (50,) and labels.dtype == jnp.int32
  assert 0 <= int(labels.min()) and int(labels.max()) < 3
  model = MLP(8, [32, 16], 3, nnx.Rngs(0))
  assert num_params(model) == 8 * 32 + 32 + 32 * 16 + 16 + 16 * 3 + 3
  graphdef, params = mlp.split_model(model)
  assert jax.jit(lambda p, x: nnx.merge(graphdef, p)(x))(params, x).shape == (50, 3)
  np.testing.assert_allclose(jax.jit(mlp.apply_loss, static_argnums=0)(graphdef, params, (x, y)),
                             nnx.jit(mlp.loss_fn)(model, (x, y)), rtol=1e-6)
  with pytest.raises(ValueError, match="task"):
    teacher_student_data(jax.random.key(0), 50, 8, 3, 16, task="ranking")
  with pytest.raises(ValueError, match="hidden"):
    MLP(8, 0, 3)


@pytest.mark.parametrize("task", ["regression", "classification"])
def test_mlp_learns_teacher(task):
  x, y = teacher_student_data(jax.random.key(1), 512, 8, 3, 16, task=task)
  graphdef, params = mlp.split_model(MLP(8, 64, 3, nnx.Rngs(0)))
  losses = _train(graphdef, params, (x, y), mlp.apply_loss, steps=150, lr=1e-2)
  assert losses[-1] < 0.25 * losses[0], (task, losses[0], losses[-1])
