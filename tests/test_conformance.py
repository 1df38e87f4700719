"""What every transformation of the library passes (optax's own checklist, written here from
optax's documented behaviour): extra args, jit, inject_hyperparams (injected == plain),
MultiSteps, apply_if_finite, tree_map_params and the tree_utils helpers, contrib wrappers
(mechanize, schedule_free), nnx.Optimizer, dtypes and stable state shapes.

two_hop only runs inside a jax.shard_map over its two axes: its checks run there (`Harness`);
the wrappers whose state would hold per-device values that init types as replicated
(MultiSteps' accumulated gradients, apply_if_finite's counts) are checked on the local
transformations, where they apply.
"""

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import loco_jax
from loco_jax.train import parallel
from loco_jax.transforms import baselines

LOCO_STATIC = ("bits", "error_bits", "reset_interval", "block_size", "axis_name", "gather",
               "scatter", "scale", "error_scale")
# name -> (factory, keyword arguments, static_args for inject_hyperparams)
TRANSFORMATIONS = {
    "co3": (loco_jax.co3, dict(gamma=0.7, refit_interval=2),
            ("fmt", "refit_interval", "entropy_code", "axis_name", "capacity_bits",
             "gather_capacity_bits")),
    "loco": (loco_jax.loco, dict(beta=0.8), LOCO_STATIC),
    "loco-fixed": (loco_jax.loco, dict(scale=64.0, error_scale=256.0, beta=0.5),
                   LOCO_STATIC[:-2]),
    "two_hop": (loco_jax.two_hop, dict(beta=0.8, block_size=64),
                ("node_axis", "local_axis", "intra", "bits", "error_bits", "reset_interval",
                 "block_size", "scale", "error_scale")),
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
ON_A_MESH = {"two_hop": (("node", "local"), (2, 4))}
LOCAL = sorted(set(TRANSFORMATIONS) - set(ON_A_MESH))


def _params():
  return {"w": jnp.linspace(-1, 1, 96).reshape(8, 12), "b": jnp.zeros(12)}


def _grads(seed=0):
  k1, k2 = jax.random.split(jax.random.key(seed))
  return {"w": jax.random.normal(k1, (8, 12)), "b": jax.random.normal(k2, (12,))}


def _shapes(tree):
  return jax.tree.map(lambda x: (x.shape, x.dtype), tree)


class Harness(NamedTuple):
  """A transformation's factory, and how its optimizers are initialised and stepped: directly,
  or inside a jax.shard_map over its mesh (every device given the same gradient)."""
  make: Callable
  factory: Callable
  kwargs: dict
  static: tuple
  mesh: Any = None
  axes: tuple = ()

  def init(self, opt, params):
    if self.mesh is None:
      return opt.init(params)
    return parallel.init_opt_state(opt, params, self.mesh, self.axes)[0]

  def step(self, opt, params, **extra):
    """A jitted update(grads, state, params) -> (updates, state)."""
    if self.mesh is None:
      return jax.jit(lambda g, s, p: opt.update(g, s, p, **extra))
    _, specs = parallel.init_opt_state(opt, params, self.mesh, self.axes)
    # Each device's own copy of the gradient: varying over the axes, as a real one is.
    local = lambda g, s, p: opt.update(jax.lax.pcast(g, self.axes, to="varying"), s, p, **extra)
    smap = jax.shard_map(local, mesh=self.mesh, in_specs=(P(), specs, P()),
                         out_specs=(P(), specs))
    return jax.jit(smap)


def _harness(name: str) -> Harness:
  factory, kwargs, static = TRANSFORMATIONS[name]
  mesh, axes = None, ()
  if name in ON_A_MESH:
    axes, shape = ON_A_MESH[name]
    mesh = parallel.node_mesh(*shape, axes)
  return Harness(functools.partial(factory, **kwargs), factory, kwargs, static, mesh, axes)


@pytest.fixture(params=sorted(TRANSFORMATIONS))
def harness(request):
  return _harness(request.param)


@pytest.fixture(params=LOCAL)
def local(request):
  return _harness(request.param)


@pytest.mark.slow
def test_chain_with_adamw_under_jit_and_extra_args(harness):
  opt = optax.chain(harness.make(), optax.adamw(1e-2))
  params = _params()
  state = harness.init(opt, params)
  step = harness.step(opt, params, loss=jnp.float32(1.0))
  for seed in range(3):
    updates, new_state = step(_grads(seed), state, params)
    assert _shapes(new_state) == _shapes(state)
    state, params = new_state, optax.apply_updates(params, updates)
  assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(params))


@pytest.mark.slow
@pytest.mark.numerics
def test_inject_hyperparams_gives_the_plain_transformations_updates(harness):
  params = _params()
  injected = optax.inject_hyperparams(harness.factory, static_args=harness.static)(
      **harness.kwargs)
  plain = harness.make()
  runs = []
  for opt in (plain, injected):
    state, step, outs = harness.init(opt, params), harness.step(opt, params), []
    for seed in range(3):
      out, state = step(_grads(seed), state, params)
      outs.append(out)
    runs.append(outs)
  # Two compiled programs (beta traced in one, a constant in the other) may round the last
  # bit apart; a quantizer may then move a value by one step, never further.
  for plain_out, injected_out in zip(*runs):
    for a, b in zip(jax.tree.leaves(plain_out), jax.tree.leaves(injected_out)):
      a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
      off = ~np.isclose(a, b, rtol=1e-6, atol=1e-7)
      assert off.mean() <= 0.02, (off.mean(), a[off][:4], b[off][:4])


@pytest.mark.slow
def test_inject_hyperparams_changes_beta_on_the_fly(harness):
  injected = optax.inject_hyperparams(harness.factory, static_args=harness.static)(
      **harness.kwargs)
  params = _params()
  state = harness.init(injected, params)
  out, state = harness.step(injected, params)(_grads(), state, params)
  assert _shapes(out) == _shapes(_grads())
  if "beta" not in state.hyperparams:
    pytest.skip("this transformation has no beta")
  state.hyperparams["beta"] = jnp.float32(0.0)
  out2, _ = harness.step(injected, params)(_grads(1), state, params)
  assert np.all(np.isfinite(np.asarray(out2["w"])))


def test_multi_steps(local):
  opt = optax.MultiSteps(optax.chain(local.make(), optax.sgd(0.1)), every_k_schedule=2)
  params = _params()
  state = opt.init(params)
  step = jax.jit(opt.update)
  u1, state = step(_grads(0), state, params)
  u2, state = step(_grads(1), state, params)
  np.testing.assert_array_equal(np.asarray(u1["w"]), 0)
  assert np.any(np.asarray(u2["w"]) != 0)


def test_apply_if_finite(local):
  opt = optax.apply_if_finite(optax.chain(local.make(), optax.sgd(0.1)), 2)
  params = _params()
  state = opt.init(params)
  bad = jax.tree.map(lambda g: g.at[0].set(jnp.nan), _grads())
  updates, after = jax.jit(opt.update)(bad, state, params)
  assert all(np.all(np.asarray(u) == 0) for u in jax.tree.leaves(updates))
  assert int(after.total_notfinite) == 1
  jax.tree.map(np.testing.assert_array_equal, after.inner_state, state.inner_state)


def _map_like_params(f, state, params):
  """optax.tree_map_params's documented result: `f` on every subtree of `state` shaped like
  the params tree, everything else as it is."""
  treedef = jax.tree.structure(params)
  like = lambda node: node is not None and jax.tree.structure(node) == treedef
  return jax.tree.map(lambda node: jax.tree.map(f, node) if like(node) else node, state,
                      is_leaf=like)


def test_tree_map_params_maps_what_mirrors_the_params_and_leaves_the_rest(harness):
  opt = optax.chain(harness.make(), optax.adam(1e-3))
  params = _params()
  state = harness.init(opt, params)
  doubled = optax.tree_map_params(opt, lambda p: p * 2, state)
  assert jax.tree.structure(doubled) == jax.tree.structure(state)
  jax.tree.map(np.testing.assert_array_equal, doubled,
               _map_like_params(lambda p: p * 2, state, params))
  # LoCo's buckets do not mirror the params: left as they are.
  if isinstance(state[0], loco_jax.LocoState):
    jax.tree.map(np.testing.assert_array_equal, doubled[0], state[0])
  # transform_non_params reaches everything else; extra trees like the params ride along.
  specs = jax.tree.map(lambda _: P(), params)
  only = optax.tree_map_params(opt, lambda _, spec: spec, state, specs,
                               transform_non_params=lambda _: None)
  is_spec = lambda x: x is None or isinstance(x, P)
  assert all(is_spec(x) for x in jax.tree.leaves(only, is_leaf=is_spec))
  assert only[1][0].mu == specs and only[1][0].count is None


def test_tree_utils_get_and_set_the_step_counters(harness):
  opt = optax.chain(harness.make(), optax.adam(1e-3))
  state = harness.init(opt, _params())
  counts = optax.tree_utils.tree_get_all_with_path(state, "count")
  assert counts, "adam's count at least"
  reset = optax.tree_utils.tree_set(state, count=jnp.asarray(7, jnp.int32))
  for _, value in optax.tree_utils.tree_get_all_with_path(reset, "count"):
    assert int(value) == 7
  assert jax.tree.structure(reset) == jax.tree.structure(state)


def test_mechanize(local):
  opt = optax.contrib.mechanize(optax.chain(local.make(), optax.sgd(0.1)))
  params = _params()
  state = opt.init(params)
  step = jax.jit(opt.update)
  for seed in range(3):
    updates, new_state = step(_grads(seed), state, params)
    assert _shapes(new_state) == _shapes(state)
    state, params = new_state, optax.apply_updates(params, updates)
  assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(params))
  doubled = optax.tree_map_params(opt, lambda p: p * 2, state)
  assert jax.tree.structure(doubled) == jax.tree.structure(state)


def test_schedule_free(local):
  opt = optax.chain(local.make(), optax.contrib.schedule_free_sgd(0.5))
  params = _params()
  state = opt.init(params)
  step = jax.jit(opt.update)
  for seed in range(3):
    updates, state = step(_grads(seed), state, params)
    params = optax.apply_updates(params, updates)
  evaluated = optax.contrib.schedule_free_eval_params(state[1], params)
  assert _shapes(evaluated) == _shapes(params)
  assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(evaluated))
  assert np.any(np.asarray(evaluated["w"]) != np.asarray(params["w"]))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_dtype_in_dtype_out(harness, dtype):
  grads = jax.tree.map(lambda g: g.astype(dtype), _grads())
  opt = harness.make()
  out, _ = harness.step(opt, grads)(grads, harness.init(opt, grads), grads)
  assert all(o.dtype == dtype for o in jax.tree.leaves(out))


@pytest.mark.numerics
def test_nnx_optimizer(local):
  model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.chain(local.make(), optax.adamw(1e-2)), wrt=nnx.Param)
  x, y = jnp.ones((16, 4)), jnp.zeros((16, 3))
  loss = lambda m: jnp.mean((m(x) - y) ** 2)

  @nnx.jit
  def train_step(model, optimizer):
    value, grads = nnx.value_and_grad(loss)(model)
    optimizer.update(model, grads)
    return value

  losses = [float(train_step(model, optimizer)) for _ in range(30)]
  assert losses[-1] < 0.5 * losses[0]
