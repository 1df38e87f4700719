"""Tests for loco_jax.apps.models: the byte-level GPT and the teacher-student MLP."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from loco_jax.apps.models import GPT, MLP, GPTConfig, gpt, mlp, num_params, teacher_student_data

# Tiny sizes keep compiles short; eager initialisation compiles once per weight shape, so
# each test module builds its models once (fixtures) and runs them under jit.
TINY = GPTConfig(seq_len=16, d_model=32, n_layers=1, n_heads=4, d_ff=64)


def _tokens(shape: tuple[int, ...], seed: int = 0) -> jax.Array:
  return jnp.asarray(np.random.default_rng(seed).integers(0, 256, shape, dtype=np.int32))


def _train(graphdef, params, batch, apply_loss, steps: int, lr: float) -> list[float]:
  opt = optax.adamw(lr)

  @jax.jit
  def step(params, state):
    loss, grads = jax.value_and_grad(lambda p: apply_loss(graphdef, p, batch))(params)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  state, losses = jax.jit(opt.init)(params), []
  for _ in range(steps):
    params, state, loss = step(params, state)
    losses.append(loss)
  return [float(loss) for loss in losses]


@pytest.fixture(scope="module")
def tiny():
  """A tiny GPT, its (graphdef, params) split, and jitted forward and loss on params."""
  model = GPT(TINY)
  graphdef, params = gpt.split_model(model)
  forward = jax.jit(lambda p, tokens: nnx.merge(graphdef, p)(tokens))
  loss = jax.jit(lambda p, batch: gpt.apply_loss(graphdef, p, batch))
  return model, graphdef, params, forward, loss


def test_gpt_output_shape_and_dtype(tiny):
  _, _, params, forward, _ = tiny
  logits = forward(params, _tokens((2, 16)))
  assert logits.shape == (2, 16, 256) and logits.dtype == jnp.float32
  short = jax.eval_shape(forward, params, _tokens((2, 5)))  # shorter than seq_len
  assert short.shape == (2, 5, 256)


def test_gpt_is_causal(tiny):
  _, _, params, forward, _ = tiny
  tokens = _tokens((2, 16))
  t = 9
  changed = tokens.at[:, t].set((tokens[:, t] + 1) % 256)
  before, after = forward(params, tokens), forward(params, changed)
  np.testing.assert_allclose(before[:, :t], after[:, :t], atol=1e-6)
  assert not np.allclose(before[:, t:], after[:, t:], atol=1e-4)


def test_gpt_default_param_count():
  abstract = nnx.eval_shape(lambda: GPT())  # shapes only: no initializer runs
  n = num_params(abstract)
  assert 200_000 <= n <= 500_000, n
  c = GPTConfig()
  per_block = (4 * c.d_model                      # two LayerNorms
               + 3 * c.d_model**2 + 3 * c.d_model  # qkv
               + c.d_model**2 + c.d_model          # attention output
               + 2 * c.d_model * c.d_ff + c.d_ff + c.d_model)  # MLP
  expected = ((c.vocab_size + c.seq_len) * c.d_model + c.n_layers * per_block
              + 2 * c.d_model + (c.d_model + 1) * c.vocab_size)
  assert n == expected


@pytest.mark.slow
def test_gpt_initial_loss_and_functional_form_match_module(tiny):
  model, _, params, _, loss = tiny
  batch = _tokens((8, 17))
  functional = loss(params, batch)
  assert abs(float(functional) - math.log(256)) < 0.1, float(functional)
  assert all(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(params))
  np.testing.assert_allclose(functional, nnx.jit(gpt.loss_fn)(model, batch), rtol=1e-6)


def test_gpt_same_init_for_same_rngs(tiny):
  params = tiny[2]
  jax.tree.map(np.testing.assert_array_equal, params, gpt.split_model(GPT(TINY))[1])
  other = gpt.split_model(GPT(TINY, rngs=nnx.Rngs(1)))[1]
  assert not np.array_equal(params["head"]["kernel"], other["head"]["kernel"])


@pytest.mark.slow
def test_gpt_adamw_reduces_loss_on_repeated_batch(tiny):
  _, graphdef, params, _, _ = tiny
  losses = _train(graphdef, params, _tokens((4, 17)), gpt.apply_loss, steps=30, lr=3e-3)
  assert losses[-1] < 0.6 * losses[0], losses


@pytest.mark.slow
def test_gpt_grads_under_shard_map_match_full_batch(tiny):
  # Params are cast to "varying" so jax.grad returns each device's local gradient; on
  # replicated (P()) params the transpose of shard_map would already psum the gradient.
  if jax.device_count() < 2:
    pytest.skip("needs 2 devices")
  _, graphdef, params, _, _ = tiny
  batch = _tokens((4, 17))
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))
  grad_fn = jax.grad(lambda p, b: gpt.apply_loss(graphdef, p, b))

  @jax.jit
  @jax.shard_map(mesh=mesh, in_specs=(jax.P(), jax.P("data")), out_specs=jax.P("data"))
  def local_grads(params, local_batch):
    grads = grad_fn(jax.lax.pcast(params, "data", to="varying"), local_batch)
    return jax.tree.map(lambda g: g[None], grads)

  per_device = local_grads(params, batch)
  head_2xDxV = per_device["head"]["kernel"]
  assert not np.allclose(head_2xDxV[0], head_2xDxV[1])
  expected = jax.jit(grad_fn)(params, batch)
  jax.tree.map(lambda g, e: np.testing.assert_allclose(g.mean(0), e, rtol=1e-4, atol=1e-6),
               per_device, expected)


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


@pytest.mark.slow
def test_teacher_student_data():
  x, y = teacher_student_data(jax.random.key(1), 512, 8, 3, 16)
  assert x.shape == (512, 8) and x.dtype == jnp.float32
  assert y.shape == (512, 3) and y.dtype == jnp.float32 and float(y.std()) > 0.1
  np.testing.assert_array_equal(y, teacher_student_data(jax.random.key(1), 512, 8, 3, 16)[1])
  xc, labels = teacher_student_data(jax.random.key(1), 512, 8, 3, 16, task="classification")
  np.testing.assert_array_equal(xc, x)  # same key: same inputs and teacher
  np.testing.assert_array_equal(labels, jnp.argmax(y, axis=-1))
  assert labels.shape == (512,) and labels.dtype == jnp.int32
  assert set(np.unique(labels)) == {0, 1, 2}
  with pytest.raises(ValueError, match="task"):
    teacher_student_data(jax.random.key(0), 50, 8, 3, 16, task="ranking")
  with pytest.raises(ValueError, match="teacher_hidden"):
    teacher_student_data(jax.random.key(0), 50, 8, 3, 0)


@pytest.mark.slow
def test_mlp_shapes_and_functional_form():
  assert num_params(nnx.eval_shape(lambda: MLP(8, [32, 16], 3))) == \
      8 * 32 + 32 + 32 * 16 + 16 + 16 * 3 + 3
  model = MLP(8, 64, 3, nnx.Rngs(0))
  x, y = teacher_student_data(jax.random.key(1), 512, 8, 3, 16)
  graphdef, params = mlp.split_model(model)
  assert jax.jit(lambda p, x: nnx.merge(graphdef, p)(x))(params, x).shape == (512, 3)
  np.testing.assert_allclose(jax.jit(mlp.apply_loss, static_argnums=0)(graphdef, params, (x, y)),
                             nnx.jit(mlp.loss_fn)(model, (x, y)), rtol=1e-6)
  with pytest.raises(ValueError, match="hidden"):
    MLP(8, 0, 3)


@pytest.mark.slow
@pytest.mark.parametrize("task", ["regression", "classification"])
def test_mlp_learns_teacher(task):
  x, y = teacher_student_data(jax.random.key(1), 512, 8, 3, 16, task=task)
  graphdef, params = mlp.split_model(MLP(8, 64, 3, nnx.Rngs(0)))
  losses = _train(graphdef, params, (x, y), mlp.apply_loss, steps=150, lr=1e-2)
  assert losses[-1] < 0.25 * losses[0], (task, losses[0], losses[-1])
