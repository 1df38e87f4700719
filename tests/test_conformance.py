"""What every transformation of the library passes (optax's own checklist): extra args, jit,
inject_hyperparams, MultiSteps, apply_if_finite, nnx.Optimizer, dtypes and stable state shapes."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import loco_jax
from loco_jax.transforms import baselines

# name -> (factory, keyword arguments, static_args for inject_hyperparams)
TRANSFORMATIONS = {
    "co3": (loco_jax.co3, dict(gamma=0.7, refit_interval=2),
            ("fmt", "refit_interval", "entropy_code", "axis_name", "capacity_bits")),
    "loco": (loco_jax.loco, dict(beta=0.8),
             ("bits", "error_bits", "reset_interval", "block_size", "axis_name", "gather",
              "scatter", "scale", "error_scale")),
    "loco-fixed": (loco_jax.loco, dict(scale=64.0, error_scale=256.0, beta=0.5),
                   ("bits", "error_bits", "reset_interval", "block_size", "axis_name",
                    "gather", "scatter")),
    "uncompressed": (baselines.uncompressed, {}, ("axis_name",)),
    "bf16": (baselines.bf16, {}, ("axis_name",)),
    "int_quantized": (baselines.int_quantized, dict(bits=4, block_size=64),
                      ("bits", "block_size", "axis_name")),
    "error_feedback": (baselines.error_feedback, dict(bits=4, block_size=64),
                       ("bits", "block_size", "axis_name")),
    "ef21": (baselines.ef21, dict(bits=4, block_size=64), ("bits", "block_size", "axis_name")),
    "sign_ef": (baselines.sign_ef, dict(block_size=64), ("block_size", "axis_name")),
    "topk_ef": (baselines.topk_ef, dict(fraction=0.25), ("fraction", "axis_name")),
}


def _params():
  return {"w": jnp.linspace(-1, 1, 96).reshape(8, 12), "b": jnp.zeros(12)}


def _grads(seed=0):
  k1, k2 = jax.random.split(jax.random.key(seed))
  return {"w": jax.random.normal(k1, (8, 12)), "b": jax.random.normal(k2, (12,))}


def _shapes(tree):
  return jax.tree.map(lambda x: (x.shape, x.dtype), tree)


@pytest.fixture(params=sorted(TRANSFORMATIONS))
def make(request):
  factory, kwargs, static = TRANSFORMATIONS[request.param]
  return functools.partial(factory, **kwargs), factory, kwargs, static


def test_chain_with_adamw_under_jit_and_extra_args(make):
  opt = optax.chain(make[0](), optax.adamw(1e-2))
  params = _params()
  state = opt.init(params)
  step = jax.jit(lambda g, s, p: opt.update(g, s, p, loss=jnp.float32(1.0)))
  for seed in range(3):
    updates, new_state = step(_grads(seed), state, params)
    assert _shapes(new_state) == _shapes(state)
    state, params = new_state, optax.apply_updates(params, updates)
  assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(params))


def test_inject_hyperparams(make):
  _, factory, kwargs, static = make
  opt = optax.inject_hyperparams(factory, static_args=static)(**kwargs)
  state = opt.init(_params())
  out, state = jax.jit(opt.update)(_grads(), state)
  assert _shapes(out) == _shapes(_grads())
  if "beta" in state.hyperparams:  # the transformations that have it
    state.hyperparams["beta"] = jnp.float32(0.0)
  out2, _ = jax.jit(opt.update)(_grads(1), state)
  assert np.all(np.isfinite(np.asarray(out2["w"])))


def test_multi_steps(make):
  opt = optax.MultiSteps(optax.chain(make[0](), optax.sgd(0.1)), every_k_schedule=2)
  params = _params()
  state = opt.init(params)
  step = jax.jit(opt.update)
  u1, state = step(_grads(0), state, params)
  u2, state = step(_grads(1), state, params)
  np.testing.assert_array_equal(np.asarray(u1["w"]), 0)
  assert np.any(np.asarray(u2["w"]) != 0)


def test_apply_if_finite(make):
  opt = optax.apply_if_finite(optax.chain(make[0](), optax.sgd(0.1)), 2)
  params = _params()
  state = opt.init(params)
  bad = jax.tree.map(lambda g: g.at[0].set(jnp.nan), _grads())
  updates, after = jax.jit(opt.update)(bad, state, params)
  assert all(np.all(np.asarray(u) == 0) for u in jax.tree.leaves(updates))
  assert int(after.total_notfinite) == 1


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_dtype_in_dtype_out(make, dtype):
  grads = jax.tree.map(lambda g: g.astype(dtype), _grads())
  opt = make[0]()
  out, _ = jax.jit(opt.update)(grads, opt.init(grads))
  assert all(o.dtype == dtype for o in jax.tree.leaves(out))


def test_nnx_optimizer(make):
  model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.chain(make[0](), optax.adamw(1e-2)), wrt=nnx.Param)
  x, y = jnp.ones((16, 4)), jnp.zeros((16, 3))
  loss = lambda m: jnp.mean((m(x) - y) ** 2)

  @nnx.jit
  def train_step(model, optimizer):
    value, grads = nnx.value_and_grad(loss)(model)
    optimizer.update(model, grads)
    return value

  losses = [float(train_step(model, optimizer)) for _ in range(30)]
  assert losses[-1] < 0.5 * losses[0]
