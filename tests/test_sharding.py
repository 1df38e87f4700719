"""Model-sharded and Explicit-sharded leaves: each device compresses its own block.

A (data=4, model=2) mesh of the 8 CPU devices: the step's collectives over 'model' (group size
2) from the compiled HLO, its bytes over 'data' (group size 4) against a 1-D data mesh, and the
results against the exact mean. Explicit axes (jax's sharding in types): every transformation
through optax's sharding checks (optax/_src/sharding_test.py: the state's type, sharding
included, is the same after init and after update, with and without jit).
"""

import functools
import inspect
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.flatten_util import ravel_pytree
from jax.sharding import PartitionSpec as P

import loco_jax
from loco_jax import comm
from loco_jax.core import local_blocks
from loco_jax.transforms import baselines

DATA, MODEL = 4, 2
SPECS = {"w1": P(None, "model"), "w2": P("model", None), "b": P("model")}


def _mesh(*shape_names, kind=AxisType.Auto):
  names, shape = zip(*shape_names)
  return jax.make_mesh(shape, names, axis_types=(kind,) * len(names),
                       devices=jax.devices()[:int(np.prod(shape))])


def _problem():
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
  params = {"w1": jax.random.normal(k1, (32, 64)) * 0.1,
            "w2": jax.random.normal(k2, (64, 16)) * 0.1, "b": jnp.zeros((16,))}
  return params, jax.random.normal(k3, (16, 32)), jnp.ones((16, 16))


def _loss(p, x, y):
  return jnp.mean((jax.nn.relu(x @ p["w1"]) @ p["w2"] + p["b"] - y) ** 2)


def _data_parallel_step(opt, mesh, params, x, y, specs=None):
  """jit(shard_map manual over 'data') of grad -> opt.update, compiled once: its collectives
  and its output."""
  replicated = {k: P() for k in params}
  if specs is not None:
    params = jax.tree.map(lambda v, s: jax.device_put(v, NamedSharding(mesh, s)), params, specs)

  def step(p, state, x, y):
    return opt.update(jax.grad(_loss)(jax.lax.pcast(p, "data", to="varying"), x, y), state, p)

  smap = lambda f, i, o: jax.shard_map(f, mesh=mesh, in_specs=i, out_specs=o,
                                       axis_names={"data"})
  state_specs = loco_jax.state_specs(jax.eval_shape(smap(opt.init, (replicated,), P()), params),
                                     "data")
  state = jax.jit(smap(opt.init, (replicated,), state_specs))(params)
  run = jax.jit(smap(step, (replicated, state_specs, P("data"), P("data")), (P(), state_specs)))
  compiled = run.lower(params, state, x, y).compile()
  return comm.collectives(compiled.as_text(), jax.device_count()), compiled(params, state, x, y)[0]


def _with_specs(fn, *args):
  with local_blocks.leaf_specs(SPECS):
    return fn(*args)


@functools.lru_cache(maxsize=None)
def _step(kind: str):
  """The steps the tests compare, each compiled once per session."""
  params, x, y = _problem()
  two_d = _mesh(("data", DATA), ("model", MODEL))
  opt = lambda **kw: loco_jax.loco(axis_name="data", block_size=256, **kw)
  if kind == "fp32":
    return _data_parallel_step(baselines.uncompressed("data"), two_d, params, x, y, SPECS)
  if kind == "told":
    return _data_parallel_step(opt(specs=SPECS), two_d, params, x, y, SPECS)
  if kind == "context":
    told = optax.GradientTransformationExtraArgs(
        lambda p: _with_specs(opt().init, p),
        lambda g, s, p=None: _with_specs(opt().update, g, s, p))
    return _data_parallel_step(told, two_d, params, x, y, SPECS)
  return _data_parallel_step(opt(), _mesh(("data", DATA)), params, x, y)  # the 1-D data mesh


def _over(found, group_size):
  return sorted((c.op, c.dtype, c.nbytes) for c in found if c.group_size == group_size)


@pytest.mark.slow
def test_model_sharded_leaves_add_no_collective_over_model():
  told, fp32 = _step("told")[0], _step("fp32")[0]
  # The model's own collectives over 'model', plus the 4-byte keep-or-skip flag: no gather.
  assert _over(told, MODEL) == sorted(_over(fp32, MODEL) + [("all-reduce", "f32", 4.0)])
  assert {c.op for c in told if c.group_size == DATA} == {"all-to-all", "all-gather"}


# name -> the transformation averaging over 'data', told the leaves' specs
OVER_DATA = {
    "co3": lambda: loco_jax.co3("fp4", axis_name="data", specs=SPECS),
    "int_quantized": lambda: baselines.int_quantized(block_size=64, axis_name="data",
                                                     specs=SPECS),
    "error_feedback": lambda: baselines.error_feedback(block_size=64, axis_name="data",
                                                       specs=SPECS),
    "ef21": lambda: baselines.ef21(block_size=64, axis_name="data", specs=SPECS),
    "sign_ef": lambda: baselines.sign_ef(block_size=64, axis_name="data", specs=SPECS),
    "topk_ef": lambda: baselines.topk_ef(fraction=0.25, axis_name="data", specs=SPECS),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(OVER_DATA))
def test_every_compressor_sends_only_its_model_shard(name):
  params, x, y = _problem()
  found, out = _data_parallel_step(OVER_DATA[name](), _mesh(("data", DATA), ("model", MODEL)),
                                   params, x, y, SPECS)
  extra = list(_over(found, MODEL))
  for c in _over(_step("fp32")[0], MODEL):
    extra.remove(c)
  # Beyond the model's own collectives: the 4-byte keep-or-skip flag (co3: and its overflow
  # and extension counts, which XLA may combine into one all-reduce).
  assert {op for op, _, _ in extra} == {"all-reduce"}, extra
  assert sum(nbytes for _, _, nbytes in extra) == (12 if name == "co3" else 4), extra
  assert all(np.all(np.isfinite(np.asarray(v))) for v in jax.tree.leaves(out))


@pytest.mark.slow
def test_leaf_specs_context_manager_tells_the_specs():
  assert _over(_step("context")[0], MODEL) == _over(_step("told")[0], MODEL)


def _data_bytes(found):
  return sum(c.sent_bytes for c in found if c.group_size == DATA)


@pytest.mark.slow
def test_bytes_over_data_scale_with_the_local_shard():
  ratio = _data_bytes(_step("told")[0]) / _data_bytes(_step("1d")[0])
  assert 0.45 < ratio < 0.55, ratio  # half the values and scales; flags do not halve


def _quantization_bound(grads_NxX):
  """|LoCo's first step - exact mean| <= a 4-bit rounding step of the largest block (absmax / 7,
  error 0 at the first step) plus the bfloat16 gather's rounding."""
  mean = np.mean(grads_NxX, axis=0)
  return np.max(np.abs(grads_NxX)) / 7 / 2 + np.abs(mean) * 2.0 ** -8 + 1e-7


def _per_device_grads():
  params, x, y = _problem()
  return np.stack([ravel_pytree(jax.grad(_loss)(params, xb, yb))[0]
                   for xb, yb in zip(np.split(x, DATA), np.split(y, DATA))])


@pytest.mark.slow
def test_model_sharded_results_match_the_data_mesh_within_rounding():
  per_device = _per_device_grads()
  exact, bound = per_device.mean(0), _quantization_bound(per_device)
  two_d, one_d = (np.asarray(ravel_pytree(_step(k)[1])[0]) for k in ("told", "1d"))
  assert np.all(np.abs(two_d - exact) <= bound)
  assert np.all(np.abs(one_d - exact) <= bound)
  assert not np.allclose(two_d, exact, rtol=0, atol=1e-7)  # it was compressed


@pytest.mark.slow
def test_manual_model_axis_leaves_are_already_local():
  """Case (a): the caller runs the update in a shard_map manual over 'model' too (the gradient
  comes from GSPMD); replicated and sharded leaves mix (LoCo buckets them apart)."""
  mesh = _mesh(("data", DATA), ("model", MODEL))
  params, x, y = _problem()
  specs = dict(SPECS, b=P())
  opt = loco_jax.loco(axis_name="data", block_size=256)
  placed = jax.tree.map(lambda v, s: jax.device_put(v, NamedSharding(mesh, s)), params, specs)

  def nested(f, in_specs, out_specs):
    return jax.shard_map(f, in_specs=in_specs, out_specs=out_specs, axis_names={"model"})

  def step(p, x, y):
    g = jax.grad(_loss)(jax.lax.pcast(p, "data", to="varying"), x, y)  # GSPMD over 'model'
    return nested(lambda g: opt.update(g, opt.init(g))[0], (specs,), specs)(g)

  run = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=({k: P() for k in params},
                                                           P("data"), P("data")),
                              out_specs=P(), axis_names={"data"}))
  out = run(placed, x, y)
  assert out["w1"].sharding.spec == P(None, "model")
  found = comm.compiled_collectives(run, placed, x, y)
  assert not [c for c in found if c.group_size == MODEL and c.op == "all-gather"]
  per_device = _per_device_grads()
  got = np.asarray(ravel_pytree(out)[0])
  assert np.all(np.abs(got - per_device.mean(0)) <= _quantization_bound(per_device))


def _traced_step(opt):
  """Traces (no compile) init and update inside a shard_map manual over 'data' only."""
  mesh = _mesh(("data", DATA), ("model", MODEL))
  params, x, y = _problem()

  def step(p, x, y):
    g = jax.grad(_loss)(jax.lax.pcast(p, "data", to="varying"), x, y)
    return opt.update(g, opt.init(p), p)[0]

  return jax.eval_shape(jax.shard_map(step, mesh=mesh, in_specs=P(), out_specs=P(),
                                      axis_names={"data"}), params, x, y)


def test_auto_axes_without_specs_warn_once_naming_the_ways_out():
  local_blocks._WARNED.clear()
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    _traced_step(loco_jax.loco(axis_name="data", block_size=256))
    _traced_step(loco_jax.loco(axis_name="data", block_size=256, specs=SPECS))  # told: silent
  messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
  assert len(messages) == 1, messages  # init and update of the untold one: one warning
  assert all(way in messages[0] for way in ("specs=", "leaf_specs", "manual", "Explicit"))
  assert "('model',)" in messages[0]


def test_bad_specs_say_what_is_accepted():
  with pytest.raises(ValueError, match="lacks; its axes are"):
    _traced_step(loco_jax.loco(axis_name="data", specs=dict(SPECS, b=P("tensor"))))
  with pytest.raises(ValueError, match="PartitionSpecs in a tree like the gradients"):
    _traced_step(loco_jax.loco(axis_name="data", specs={"w1": P()}))


# --- Explicit axes: every transformation through optax's sharding checks ---------------------

# name -> factory of the transformation in local mode (axis_name=None)
LOCAL = {
    "loco": lambda: loco_jax.loco(block_size=64),
    "loco-fixed": lambda: loco_jax.loco(scale=64.0, error_scale=256.0, block_size=64),
    "co3": lambda: loco_jax.co3("fp4", refit_interval=1),
    "co3-raw": lambda: loco_jax.co3("fp8", entropy_code=False),
    "uncompressed": baselines.uncompressed,
    "bf16": baselines.bf16,
    "int_quantized": lambda: baselines.int_quantized(bits=4, block_size=64),
    "error_feedback": lambda: baselines.error_feedback(bits=4, block_size=64),
    "ef21": lambda: baselines.ef21(bits=4, block_size=64),
    "sign_ef": lambda: baselines.sign_ef(block_size=64),
    "topk_ef": lambda: baselines.topk_ef(fraction=0.25),
}


def test_the_checklist_holds_every_transformation():
  public = {name for name, fn in inspect.getmembers(baselines, inspect.isfunction)
            if not name.startswith("_") and fn.__module__ == baselines.__name__
            and "GradientTransformation" in str(inspect.signature(fn).return_annotation)}
  assert len(public) >= 7 and public | {"loco", "co3"} <= {name.split("-")[0] for name in LOCAL}


def _types(tree):
  """Each leaf's type (shape, dtype and sharding, as optax's checks compare them)."""
  return jax.tree.map(lambda x: (str(jax.typeof(x)), jax.typeof(x).sharding.spec), tree)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(LOCAL))
def test_explicit_sharding_state_types_match_and_no_gather(name):
  mesh = _mesh(("data", DATA), ("model", MODEL), kind=AxisType.Explicit)
  opt = LOCAL[name]()
  assert opt.init(jax.ShapeDtypeStruct((2, 4, 8), jnp.float32)) is not None  # abstract params
  with jax.set_mesh(mesh):
    params = {"w": jnp.zeros((8, 16), jnp.float16, out_sharding=P("data", "model")),
              "b": jnp.zeros((8,), jnp.float32)}
    grads = jax.tree.map(lambda p: jax.reshard(
        (jnp.linspace(-1, 1, p.size).reshape(p.shape) * 0.01).astype(p.dtype), p.sharding.spec),
        params)
    state0 = opt.init(params)
    out, state1 = opt.update(grads, state0, params)
    assert _types(state0) == _types(state1)
    assert _types(jax.jit(opt.init)(params)) == _types(state0)
    compiled = jax.jit(opt.update).lower(grads, state0, params).compile()
    out_jit, state_jit = compiled(grads, state0, params)
    assert _types(state_jit) == _types(state1)
    assert _types(out) == _types(grads) == _types(out_jit)
  # Nothing crosses devices but the flag that keeps every shard's step alike.
  found = comm.collectives(compiled.as_text(), jax.device_count())
  assert all(c.op == "all-reduce" and c.nbytes <= 4 for c in found), found
  for g, o in zip(jax.tree.leaves(grads), jax.tree.leaves(out)):
    g, o = np.asarray(g, np.float32), np.asarray(o, np.float32)
    assert np.all(np.abs(o - g) <= np.max(np.abs(g)) + 1e-7)  # d stays at the scale of g
    if name in ("uncompressed", "int_quantized", "error_feedback", "loco", "ef21"):
      assert np.allclose(o, g, atol=np.max(np.abs(g)) / 7 * 0.5 + 1e-3 * np.abs(g).max())


@pytest.mark.slow
def test_two_hop_on_an_explicit_model_axis():
  """two_hop (where it applies: inside a shard_map over its two data axes) on leaves that an
  Explicit 'model' axis shards: the state keeps its sharding, nothing is gathered over it."""
  mesh = _mesh(("node", 2), ("local", 2), ("model", 2), kind=AxisType.Explicit)
  opt = loco_jax.two_hop("node", "local", block_size=64)
  with jax.set_mesh(mesh):
    params = {"w": jnp.zeros((8, 16), out_sharding=P(None, "model")), "b": jnp.zeros((8,))}
    grads = jax.tree.map(lambda p: jax.reshard(
        jnp.linspace(-1, 1, p.size).reshape(p.shape), p.sharding.spec), params)

    same = []

    def step(g):
      state = opt.init(g)
      out, new = opt.update(g, state)
      # Inside the shard_map the new errors vary over the data axes (declared per device in
      # state_specs): compare what optax compares outside, shape, dtype and sharding.
      layout = lambda tree: jax.tree.map(
          lambda x: (x.shape, x.dtype, jax.typeof(x).sharding.spec), tree)
      same.append(layout(state) == layout(new))
      return out

    smap = lambda f: jax.jit(jax.shard_map(f, in_specs=P(), out_specs=P(),
                                           axis_names={"node", "local"}))
    out = smap(step)(grads)
    found = comm.compiled_collectives(smap(step), grads)
    # jax 0.10's shard_map boundary itself gathers an Explicit-sharded input in float32 (any
    # body, even x * 2, shows it): two_hop adds no float32 gather or all-to-all of its own.
    boundary = comm.compiled_collectives(smap(lambda g: jax.tree.map(lambda x: 2 * x, g)),
                                         grads)
  assert same and all(same)
  assert out["w"].sharding.spec == P(None, "model")
  f32 = lambda cs: sorted(c._replace(op_name="") for c in cs  # two programs: names differ
                         if c.dtype == "f32" and c.op in ("all-gather", "all-to-all"))
  assert f32(found) == f32(boundary)
  np.testing.assert_allclose(np.asarray(out["w"]), np.asarray(grads["w"]), atol=1 / 7 / 2 + 0.01)
