"""The `co3` transformation: semantics, the codec in the loop, the mesh average, overflow."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from loco_jax import comm
from loco_jax.codecs import fp, gennorm
from loco_jax.train import parallel
from loco_jax.transforms.co3 import co3
from loco_jax.transforms.co3_host import default_capacity_bits, usual_capacity_bits

N = 8
PARAMS = {"w": jnp.zeros((64, 128)), "b": jnp.zeros(96)}


def _grads(seed, devices=None):
  rng = np.random.default_rng(seed)
  shape = lambda x: x.shape if devices is None else (devices, *x.shape)
  return {k: jnp.asarray(gennorm.sample(rng, 1.0, 1e-3, shape(x)).astype(np.float32))
          for k, x in sorted(PARAMS.items())}


def _np_step(g, e, scale, gamma, fmt):
  a = g + gamma * e
  q = fp.quantize(a, fmt, scale)
  return q, a - q


@pytest.mark.slow
def test_local_semantics_and_lossless_codec():
  coded, raw = co3("fp4", gamma=0.7, refit_interval=3), co3("fp4", gamma=0.7, refit_interval=3,
                                                             entropy_code=False)
  s_coded, s_raw = coded.init(PARAMS), raw.init(PARAMS)
  e = {k: np.zeros(x.size, np.float32) for k, x in PARAMS.items()}
  scales = []
  for seed in range(5):
    g = _grads(seed)
    out, s_coded = jax.jit(coded.update)(g, s_coded)
    out_raw, s_raw = jax.jit(raw.update)(g, s_raw)
    for k in PARAMS:  # the Huffman round trip is lossless: the same values as uncoded symbols
      np.testing.assert_array_equal(np.asarray(out[k]), np.asarray(out_raw[k]))
      scale = float(s_coded.scale[k][0])
      q, e[k] = _np_step(np.asarray(g[k]).reshape(-1), e[k], scale, np.float32(0.7), fp.FP4)
      np.testing.assert_allclose(np.asarray(out[k]).reshape(-1), q, rtol=1e-6, atol=1e-12)
      np.testing.assert_allclose(np.asarray(s_coded.error[k]), e[k], rtol=1e-5, atol=1e-9)
    scales.append(float(s_coded.scale["w"][0]))
    assert 1.0 < float(s_coded.coded_bits[0]) < 4.0  # fp4 symbols of Laplace-like data
  assert scales[0] == scales[1] == scales[2] and scales[3] != scales[2]  # refit at k = 0, 3
  fit = gennorm.fit(np.asarray(_grads(0)["w"]))
  assert scales[0] == pytest.approx(gennorm.fp4_scale(fit.beta, fit.alpha), rel=0.05)


@pytest.mark.slow
def test_fp8_codes_more_bits_with_less_error():
  g = _grads(0)
  errs, bits = {}, {}
  for fmt in ("fp4", "fp8"):
    opt = co3(fmt)
    out, state = jax.jit(opt.update)(g, opt.init(PARAMS))
    errs[fmt] = float(jnp.abs(out["w"] - g["w"]).mean())
    bits[fmt] = float(state.coded_bits[0])
  assert errs["fp8"] < errs["fp4"] / 4 and bits["fp4"] < bits["fp8"] < 8


@pytest.mark.slow
def test_non_finite_keeps_state():
  opt = co3()
  state = opt.init(PARAMS)
  _, state = opt.update(_grads(0), state)
  bad = _grads(1)
  bad["w"] = bad["w"].at[0, 0].set(jnp.nan)
  out, after = jax.jit(opt.update)(bad, state)
  assert np.all(np.isnan(np.asarray(out["b"])))
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)),
               after, state)


@pytest.mark.parametrize("kwargs,match", [
    (dict(fmt="fp6"), "fmt"), (dict(gamma=1.5), "gamma"), (dict(gamma=-0.1), "gamma"),
    (dict(refit_interval=0), "refit_interval"), (dict(capacity_bits=0.0), "capacity_bits")])
def test_bad_arguments(kwargs, match):
  with pytest.raises(ValueError, match=match):
    co3(**kwargs)


def _mesh_step(opt):
  mesh = parallel.data_mesh(N)
  state, specs = parallel.init_opt_state(opt, PARAMS, mesh)
  gspecs = jax.tree.map(lambda _: P("data"), PARAMS)
  step = jax.jit(jax.shard_map(lambda g, s: opt.update(jax.tree.map(lambda x: x[0], g), s),
                               mesh=mesh, in_specs=(gspecs, specs),
                               out_specs=(jax.tree.map(lambda _: P(), PARAMS), specs)))
  return step, state


@pytest.mark.slow
@pytest.mark.parametrize("capacity_bits", [None, 0.5])
def test_mesh_average_of_decoded_symbols(capacity_bits):
  """Every device's coded symbols are decoded and averaged. The default capacity runs the
  per-shard exchange (its bf16 gather rounds the mean once); a tiny one picks the all-gather
  of whole gradients (an exact float32 mean), overflows into the raw path and still gives the
  same result."""
  step, state = _mesh_step(co3("fp4", axis_name="data", capacity_bits=capacity_bits))
  local = co3("fp4", entropy_code=False)
  local_states = [local.init(PARAMS) for _ in range(N)]
  rtol = 1e-5 if capacity_bits else 2.0 ** -8
  for seed in range(3):
    grads = _grads(seed, N)
    out, state = step(grads, state)
    per_device = []
    for d in range(N):
      o, local_states[d] = jax.jit(local.update)(jax.tree.map(lambda g: g[d], grads),
                                                 local_states[d])
      per_device.append(o)
    for k in PARAMS:
      want = np.mean([np.asarray(o[k], np.float64) for o in per_device], axis=0)
      np.testing.assert_allclose(np.asarray(out[k]), want, rtol=rtol, atol=rtol * 1e-3)
  assert int(state.overflows) == (3 if capacity_bits else 0)
  bits = np.asarray(state.coded_bits)
  assert bits.shape == (N,) and np.all((bits > 1) & (bits < 4))


def test_wire_bytes_of_the_all_gather_exchange():
  n_params = sum(x.size for x in jax.tree.leaves(PARAMS))
  step, state = _mesh_step(co3("fp4", axis_name="data", collective="all_gather"))
  found = comm.lowered_collectives(step, _grads(0, N), state)
  always = [c for c in found if not c.conditional]
  overflow = [c for c in found if c.conditional]
  # The coded slots, and the 4-byte verdict on what receivers decoded.
  assert sorted(c.op for c in always) == ["all-gather", "all-reduce"]
  # The slots' extension and the raw resend, on the steps that need them.
  assert [c.op for c in overflow] == ["all-gather"] * 2 and {c.dtype for c in overflow} == {"u8"}
  # The coded buffer's usual capacity per symbol, plus its header, as the all-gather carries it;
  # with its extension, the model's worst case.
  usual = usual_capacity_bits(fp.FP4)
  per_device_bits = 8 * max(c.nbytes for c in always) / N / n_params
  assert usual < per_device_bits < usual + 0.5
  extension_bits = 8 * min(c.nbytes for c in overflow) / N / n_params
  assert abs(usual + extension_bits - default_capacity_bits(fp.FP4)) < 0.01
  assert comm.wire_bits_per_param(found, n_params) < comm.wire_bits_per_param(
      found, n_params, include_conditional=True)


def test_exact_zeros_do_not_drag_the_fit():
  rng = np.random.default_rng(3)
  x = gennorm.sample(rng, 1.0, 1e-3, (20_000,)).astype(np.float32)
  x[: 5_000] = 0.0  # dead units
  opt = co3("fp4")
  _, state = jax.jit(opt.update)({"w": jnp.asarray(x)}, opt.init({"w": jnp.zeros(x.size)}))
  fit = gennorm.fit(x[x != 0])
  assert float(state.scale["w"][0]) == pytest.approx(gennorm.fp4_scale(fit.beta, fit.alpha),
                                                     rel=0.02)


def test_device_threads_decode_their_slots_alike_and_never_their_own():
  import threading
  import types

  from loco_jax.comm import coded_host
  from loco_jax.transforms import co3_exchange
  rng = np.random.default_rng(3)
  rows = rng.integers(0, 16, (8, 5000)).astype(np.uint8)
  coder = co3_exchange.CODER
  streams = [coder.encode(r) for r in rows]
  slots = np.zeros((8, max(map(len, streams))), np.uint8)
  for d, stream in enumerate(streams):
    slots[d, :len(stream)] = np.frombuffer(stream, np.uint8)
  lengths = np.array([len(s) for s in streams], np.int32)
  decodes = []
  counting = types.SimpleNamespace(encode=coder.encode, overhead=coder.overhead,
                                   decode=lambda *a: decodes.append(1) or coder.decode(*a))
  results, start = [None] * 8, threading.Barrier(8)

  def device(i):  # eight devices' callbacks on one host, at the same moment
    start.wait()
    results[i] = coded_host.read_slots(slots, lengths, rows[i], np.int32(i), counting)

  threads = [threading.Thread(target=device, args=(i,)) for i in range(8)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert len(decodes) == 8 * 7  # every peer's slot, never the device's own
  for got, missing in results:
    np.testing.assert_array_equal(got, rows)
    assert not np.any(missing)
