"""Finite in, finite out: gradients up to each dtype's maximum through loco (every mode),
two_hop, the baselines and the fused kernel give no inf, NaN or silently zeroed output and no
poisoned state, and later normal gradients give normal outputs."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

from loco_jax import kernels
from loco_jax.core import quant
from loco_jax.kernels import reference
from loco_jax.train import parallel
from loco_jax.transforms import baselines
from loco_jax.transforms.two_hop import two_hop
from loco_jax.transforms.loco import loco

N = 8
BLOCK = 64
EXTREME_STEPS = 3
F16, BF16, F32 = (float(jnp.finfo(t).max) for t in (jnp.float16, jnp.bfloat16, jnp.float32))
# One leaf per float dtype: "f32" and "f16" are whole blocks on every row (loco's fused kernel),
# "bf16" is ragged (loco's jnp step, padded blocks).
PARAMS = {"f32": jnp.zeros((N, BLOCK)), "bf16": jnp.zeros((5, 37), jnp.bfloat16),
          "f16": jnp.zeros((N * BLOCK,), jnp.float16)}
FIXED = dict(scale=2.0 ** 17, error_scale=2.0 ** 19)
EXAMPLES = settings(max_examples=6, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow])

# The transformations. `reset_interval=EXTREME_STEPS`: the step after the extreme ones starts
# from a zeroed error, so its output must equal a fresh state's (nothing else of the extreme
# steps may survive). Baselines have no reset: their error must drain instead (`DRAIN`).
_loco = functools.partial(loco, block_size=BLOCK, reset_interval=EXTREME_STEPS)
_two_hop = functools.partial(two_hop, "node", "local", block_size=BLOCK,
                             reset_interval=EXTREME_STEPS)
LOCAL = {
    "loco": _loco,
    "loco_bits2": functools.partial(_loco, bits=2),   # subnormal scales near the maximum
    "loco_fixed": functools.partial(_loco, **FIXED),
    "uncompressed": baselines.uncompressed,
    "bf16": baselines.bf16,
    "int_quantized": functools.partial(baselines.int_quantized, block_size=BLOCK),
    "error_feedback": functools.partial(baselines.error_feedback, block_size=BLOCK),
    "ef21": functools.partial(baselines.ef21, block_size=BLOCK),
    "sign_ef": functools.partial(baselines.sign_ef, block_size=BLOCK),
    "topk_ef": functools.partial(baselines.topk_ef, fraction=0.25),
}
MESH = {
    "loco_bf16_gather": _loco,
    "loco_quantized_gather": functools.partial(_loco, gather="quantized"),
    "loco_scatter": functools.partial(_loco, scatter=True),
    "loco_fixed": functools.partial(_loco, **FIXED),
    **{name: make for name, make in LOCAL.items() if not name.startswith("loco")},
}
TWO_HOP = {"two_hop_reduce_scatter": _two_hop,
           "two_hop_loco": functools.partial(_two_hop, intra="loco")}
# Baselines: normal steps after which the output is back to the gradients' size (absmax 4-bit
# feedback leaves at most 1/14 of a block's largest value each step: 3.4e38 / 14**34 < 1).
DRAIN = {"uncompressed": 1, "bf16": 1, "int_quantized": 1, "error_feedback": 40, "ef21": 40,
         "sign_ef": 0, "topk_ef": 0}


def _magnitude():
  """Largest |g| of a leaf: the float maxima, values near them, or 10**u for u in [-30, 38.5]."""
  special = st.sampled_from([F16, BF16, F32, 1e36, 1e37, 1e38, 1e-30, 1.0])
  return st.one_of(special, st.floats(-30.0, 38.5).map(lambda u: 10.0 ** u))


def _grads(magnitudes: dict, seed: int, devices: int):
  """[devices, *shape] per leaf: +-magnitude (clipped to the leaf dtype's maximum) at two
  places, uniform values below it elsewhere; every device's the same signs, scaled by 1..1/2
  (no cancellation in the mean)."""
  rng = np.random.default_rng(seed)
  out = {}
  for k, x in PARAMS.items():
    top = float(jnp.finfo(x.dtype).max)
    u = rng.uniform(-1.0, 1.0, (1, x.size))
    u[:, 0], u[:, 1] = 1.0, -1.0
    u = u * np.linspace(1.0, 0.5, devices)[:, None]
    g = np.clip(u * min(magnitudes[k], top), -top, top)
    out[k] = jnp.asarray(g.reshape(devices, *x.shape), x.dtype)
  return out


def _normal_grads(seed: int, devices: int):
  rng = np.random.default_rng(seed)
  return {k: jnp.asarray(rng.standard_normal((devices, *x.shape)), x.dtype)
          for k, x in PARAMS.items()}


def _f32(x) -> np.ndarray:
  return np.asarray(x).astype(np.float32)


def _output_floor(name: str, dtype) -> float:
  """sign_ef sends each block's mean |h| with the signs: a block of values that all lie below
  BLOCK x half the leaf dtype's smallest subnormal may average to less than half of it, and
  rightly round to 0 in that dtype (a float16 leaf of 7e-8 did)."""
  return BLOCK * float(jnp.finfo(dtype).smallest_subnormal) / 2 if name == "sign_ef" else 0.0


def _check(name, grads, out, state, smallest_sent=0.0):
  """Finite output and state; no leaf silently zero where the devices' mean gradient (what the
  output is; one device's in local mode) has a value above `smallest_sent` (what a fixed scale
  can send at all; inf: no such check) and above what the leaf's dtype can hold of the
  method's output (`_output_floor`, and its smallest subnormal: float16 gradients of 6e-8 on
  one device of 8 rightly average to 0 in float16)."""
  for k in PARAMS:
    o = _f32(out[k])
    assert np.all(np.isfinite(o)), (name, k, o[~np.isfinite(o)][:4])
    dtype = PARAMS[k].dtype
    floor = max(smallest_sent, _output_floor(name, dtype),
                float(jnp.finfo(dtype).smallest_subnormal))
    if np.max(np.abs(np.mean(_f32(grads[k]).astype(np.float64), axis=0))) > floor:
      assert np.any(o != 0), (name, k, "silently zero")
  for leaf in jax.tree.leaves(state):
    if jnp.issubdtype(leaf.dtype, jnp.floating):
      assert np.all(np.isfinite(_f32(leaf))), (name, "state not finite")


def _smallest_sent(name: str, t: int) -> float:
  """EF21 sends Q(g - g_i): after a step near the maximum, a much smaller g is below that
  difference's resolution and the estimate can be exactly 0 for a while (it converges back,
  which `DRAIN` checks); its first step must not be zero."""
  if name == "ef21" and t > 0:
    return np.inf
  return 0.5 / FIXED["scale"] if name.endswith("fixed") else 0.0


# --- One compiled step per configuration, reused by every example ---------------------------

@functools.cache
def _local(name):
  opt = LOCAL[name]()
  update = jax.jit(lambda g, s: opt.update(jax.tree.map(lambda x: x[0], g), s))
  return update, opt.init(PARAMS)


@functools.cache
def _mesh(name, table="mesh"):
  if table == "two_hop":
    opt, mesh, axes = TWO_HOP[name](), parallel.node_mesh(2, N // 2), ("node", "local")
  else:
    opt, mesh, axes = MESH[name](axis_name="data"), parallel.data_mesh(N), "data"
  state, specs = parallel.init_opt_state(opt, PARAMS, mesh, axes)
  out_specs = jax.tree.map(lambda _: P(axes) if name == "loco_scatter" else P(), PARAMS)
  update = lambda g, s: opt.update(jax.tree.map(lambda x: x.reshape(x.shape[1:]), g), s)
  step = jax.jit(jax.shard_map(update, mesh=mesh, in_specs=(
      jax.tree.map(lambda _: P(axes), PARAMS), specs), out_specs=(out_specs, specs)))
  return step, state


def _run(name, step, fresh, magnitudes, seed, devices):
  """EXTREME_STEPS steps of extreme gradients, then normal ones; checks every output."""
  state = fresh
  for t, m in enumerate(magnitudes):
    grads = _grads(m, seed + t, devices)
    out, state = step(grads, state)
    _check(name, grads, out, state, _smallest_sent(name, t))
  normal = _normal_grads(seed, devices)
  out, state = step(normal, state)
  _check(name, normal, out, state, _smallest_sent(name, len(magnitudes)))
  if name.startswith(("loco", "two_hop")):
    # The error was reset before this step: the output is a fresh state's, bit for bit (the
    # same program on the same numbers; the tolerance only allows for nothing).
    want, _ = step(normal, fresh)
    for k in PARAMS:
      np.testing.assert_allclose(_f32(out[k]), _f32(want[k]), rtol=1e-6, err_msg=f"{name} {k}")
    return
  scale = max(np.max(np.abs(_f32(g))) for g in jax.tree.leaves(normal))
  # On a mesh EF21's output is a sum of bf16-gathered means: their rounding after steps near
  # the maximum stays in it for good (its docstring says so); it is only checked to be finite.
  drain = 0 if name == "ef21" and devices > 1 else DRAIN[name]
  for _ in range(drain - 1):
    out, state = step(normal, state)
    _check(name, normal, out, state, _smallest_sent(name, len(magnitudes)))
  if drain:
    _check(name, normal, out, state)
    biggest = max(np.max(np.abs(_f32(o))) for o in jax.tree.leaves(out))
    assert biggest <= 2 * scale, (name, "not back to normal", biggest, scale)


_STEPS = st.lists(st.fixed_dictionaries({k: _magnitude() for k in PARAMS}),
                  min_size=EXTREME_STEPS, max_size=EXTREME_STEPS)


@pytest.mark.numerics
@pytest.mark.parametrize("name", sorted(LOCAL))
@EXAMPLES
@given(magnitudes=_STEPS, seed=st.integers(0, 2 ** 16))
def test_local_transformation_stays_finite(name, magnitudes, seed):
  _run(name, *_local(name), magnitudes, seed, 1)


@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.parametrize("name", sorted(MESH) + sorted(TWO_HOP))
@EXAMPLES
@given(magnitudes=_STEPS, seed=st.integers(0, 2 ** 16))
def test_transformation_on_a_mesh_stays_finite(name, magnitudes, seed):
  _run(name, *_mesh(name, "two_hop" if name in TWO_HOP else "mesh"), magnitudes, seed, N)


@pytest.mark.numerics
def test_feedback_errors_drain_instead_of_growing():
  """sign_ef and topk_ef after gradients at the float32 maximum: their error shrinks under
  normal gradients (it never grows, is never inf, and the output stays finite)."""
  for name in ("sign_ef", "topk_ef"):
    step, state = _local(name)
    grads = _grads({k: F32 for k in PARAMS}, 0, 1)
    for _ in range(EXTREME_STEPS):
      _, state = step(grads, state)
    largest = lambda s: max(np.max(np.abs(_f32(e))) for e in jax.tree.leaves(s.error))
    before = largest(state)
    assert np.isfinite(before) and before > 1e30
    normal = _normal_grads(1, 1)
    for _ in range(8):
      out, state = step(normal, state)
      _check(name, normal, out, state)
    assert largest(state) < before, name


# --- The fused kernel against the float64 reference near the maximum -------------------------

@functools.cache
def _kernel_steps(bits):
  """kernels.compress_step (jnp, and Pallas in interpret mode)."""
  return {impl: jax.jit(functools.partial(
      kernels.compress_step, bits=bits, block_size=BLOCK, decompressed=True,
      implementation=impl)) for impl in ("jnp", "pallas")}


@pytest.mark.slow
@pytest.mark.numerics
@EXAMPLES
@given(first=_magnitude(), second=_magnitude(), seed=st.integers(0, 2 ** 16),
       bits=st.sampled_from([4, 2]))
def test_fused_kernel_matches_the_reference_near_the_maximum(first, second, seed, bits):
  size = 4 * BLOCK
  rng = np.random.default_rng(seed)
  for impl, step in _kernel_steps(bits).items():
    error, error_scale = jnp.zeros(size, jnp.int8), jnp.zeros(size // BLOCK, jnp.float32)
    for m in (first, second, 1.0):
      g = np.clip(rng.uniform(-1, 1, size) * m, -F32, F32).astype(np.float32)
      g[0] = np.float32(min(m, F32))
      got = step(jnp.asarray(g), error, error_scale)
      for field in ("scales", "error_scale", "decompressed"):
        assert np.all(np.isfinite(np.asarray(getattr(got, field)))), (impl, field)
      check = reference.check_step(
          g.reshape(4, BLOCK), np.asarray(error).reshape(4, BLOCK), np.asarray(error_scale),
          np.asarray(quant.unpack(got.packed, bits)).reshape(4, BLOCK), np.asarray(got.scales),
          np.asarray(got.error).reshape(4, BLOCK), np.asarray(got.error_scale),
          np.asarray(got.decompressed).reshape(4, BLOCK), bits=bits, error_bits=8, beta=0.8)
      assert check.passed, (impl, check)
      assert np.any(np.asarray(got.decompressed) != 0), impl
      error, error_scale = got.error, got.error_scale


# --- Fixed scales whose arithmetic the hardware would flush -----------------------------------

@pytest.mark.parametrize("scale", [1e-39, 1e-38, 2.0 ** 127, 3e38])
def test_fixed_scales_beyond_normal_float32_are_refused(scale):
  """q / s is computed as q * (1 / s), and CPUs and GPUs flush subnormals: a scale below
  2**-126 gave NaN (0 / 0), one above 2**126 a silent 0; both are refused up front."""
  for kwargs in (dict(scale=scale), dict(error_scale=scale)):
    with pytest.raises(ValueError, match=r"\[2\*\*-126, 2\*\*126\]"):
      loco(**kwargs)
    with pytest.raises(ValueError, match=r"\[2\*\*-126, 2\*\*126\]"):
      two_hop(**kwargs)


def test_fixed_scales_at_the_limits_stay_finite():
  grads = {"w": jnp.asarray(np.linspace(-F32, F32, 64, dtype=np.float32))}
  ones = jax.tree.map(jnp.ones_like, grads)  # below 2**-126's resolution (1 / s / 2): may be 0
  for scale in (2.0 ** -126, 2.0 ** 126):
    opt = loco(scale=scale, error_scale=scale, block_size=BLOCK)
    update, state = jax.jit(opt.update), opt.init(grads)
    for g, must_send in ((grads, True), (jax.tree.map(jnp.negative, grads), True), (ones, False)):
      out, state = update(g, state)
      assert np.all(np.isfinite(np.asarray(out["w"]))), scale
      assert np.any(np.asarray(out["w"]) != 0) or not must_send, scale
