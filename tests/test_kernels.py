"""kernels: the fused compress step and dequantize_mean against loco, numpy, and each other."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loco_jax import kernels, quant
from loco_jax.loco import _reference_step

BLOCK = 2048
F32 = np.float32


def _numpy_step(g, error, error_scale, reset, bits, error_bits, beta):
  """DESIGN.md's step in numpy float32, every operation rounded once; q / s as q * (1 / s)."""
  blocks = error_scale.size
  g, error = g.reshape(blocks, -1), error.reshape(blocks, -1)
  error_scale = error_scale * F32(0) if reset else error_scale

  def reciprocal(s):
    return (F32(1) / np.where(s > 0, s, F32(1))).astype(F32)

  def absmax_scale(x, p):
    absmax = np.abs(x).max(axis=1)
    usable = (absmax > quant.VANISHING) & np.isfinite(absmax)
    qmax = F32(max(2 ** (p - 1) - 1, 1))
    return np.where(usable, qmax / np.where(usable, absmax, F32(1)), F32(0)).astype(F32)

  def compress(x, s, p):
    return np.clip(np.round(x * s[:, None]), -(2 ** (p - 1)), 2 ** (p - 1) - 1).astype(F32)

  def decompress(q, s):
    return np.where((s > 0)[:, None], q * reciprocal(s)[:, None], F32(0)).astype(F32)

  e = decompress(error.astype(F32), error_scale)
  h = (g + e).astype(F32)
  scale = absmax_scale(h, bits)
  q = compress(h, scale, bits)
  d = decompress(q, scale)
  residual = (F32(beta) * e + F32(1.0 - beta) * (h - d).astype(F32)).astype(F32)
  new_scale = absmax_scale(residual, error_bits)
  new_error = compress(residual, new_scale, error_bits).astype(np.int8)
  return q.astype(np.int8), scale, new_error.reshape(-1), new_scale, d.reshape(-1)


def _gradients(seed: int, blocks: int, spread: float = 3.0) -> np.ndarray:
  """Normal values whose blocks differ in magnitude by about e**(2 * spread)."""
  rng = np.random.default_rng(seed)
  magnitude = np.exp(spread * rng.standard_normal((blocks, 1)))
  return (rng.standard_normal((blocks, BLOCK)) * magnitude).astype(F32).reshape(-1)


def _exact_product_gradients(seed: int, blocks: int, bits: int) -> np.ndarray:
  """Blocks whose max |g| is qmax * 2**k: every q / s is then exact, and an FMA cannot change
  any result of the step (the reset keeps the error at zero)."""
  rng = np.random.default_rng(seed)
  qmax = 2 ** (bits - 1) - 1
  top = (qmax * 2.0 ** rng.integers(-12, 12, (blocks, 1))).astype(F32)
  g = np.clip(rng.standard_normal((blocks, BLOCK)) * top / 3, -0.99 * top, 0.99 * top)
  g[:, 0] = top[:, 0] * rng.choice([-1, 1], blocks)
  return g.astype(F32).reshape(-1)


def _jit_step(implementation: str, **options):
  return jax.jit(lambda g, e, s, reset: kernels.compress_step(
      g, e, s, reset=reset, decompressed=True, implementation=implementation, **options))


class _UnfusedLoco:
  """loco's own (unfused) local step with its state: what the kernels are checked against,
  since loco() itself runs the kernel for whole-block leaves."""

  def __init__(self, blocks: int, bits: int = 4):
    self.error = jnp.zeros(blocks * BLOCK, jnp.int8)
    self.error_scale = jnp.zeros(blocks, F32)
    self.step = jax.jit(functools.partial(_reference_step, bits=bits))

  def update(self, g, reset):
    out = self.step(g, self.error, self.error_scale, reset)
    self.error, self.error_scale = out.error, out.error_scale
    return out.decompressed


@pytest.mark.parametrize("blocks,bits", [(1, 4), (40, 4), (6, 8)])
def test_jnp_path_equals_loco_bit_for_bit(blocks, bits):
  state = _UnfusedLoco(blocks, bits)
  step = _jit_step("jnp", bits=bits)
  for k in range(3):  # reset every step: the error is zero at each step
    g = jnp.asarray(_exact_product_gradients(k, blocks, bits))
    out = step(g, state.error, state.error_scale, jnp.bool_(k > 0))
    want = state.update(g, jnp.bool_(k > 0))
    np.testing.assert_array_equal(np.asarray(out.decompressed), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(out.error), np.asarray(state.error))
    np.testing.assert_array_equal(np.asarray(out.error_scale), np.asarray(state.error_scale))
    assert bool(out.finite)


def test_jnp_path_tracks_loco_on_general_data():
  """With a live error, loco's XLA program contracts some multiply-adds into FMAs and the
  kernel does not (see kernels._sealed): at most a last-bit difference, rarely a code by one."""
  blocks = 64
  state = _UnfusedLoco(blocks)
  step = _jit_step("jnp")
  for k in range(4):
    g = jnp.asarray(_gradients(k, blocks))
    out = step(g, state.error, state.error_scale, jnp.bool_(k == 3))
    want = state.update(g, jnp.bool_(k == 3))
    np.testing.assert_array_equal(np.asarray(out.decompressed), np.asarray(want))
    codes = np.asarray(out.error).astype(int) - np.asarray(state.error)
    assert np.abs(codes).max() <= 1 and np.mean(codes != 0) < 1e-4
    np.testing.assert_allclose(np.asarray(out.error_scale), np.asarray(state.error_scale),
                               rtol=2e-6)


@pytest.mark.parametrize("blocks,bits,error_bits,beta,cpu_tile", [
    (64, 4, 8, 0.8, 16),    # 4 tiles of 16 blocks: the tiled CPU path
    (12, 4, 8, 0.8, None), (16, 8, 8, 0.9, None), (16, 2, 6, 0.5, None), (8, 3, 8, 0.8, 4),
    (4, 1, 8, 0.0, None)])
def test_jnp_path_equals_numpy_reference_bit_for_bit(blocks, bits, error_bits, beta, cpu_tile,
                                                      monkeypatch):
  if cpu_tile:
    monkeypatch.setattr(kernels, "CPU_TILE_BLOCKS", cpu_tile)
  step = _jit_step("jnp", bits=bits, error_bits=error_bits, beta=beta)
  error, error_scale = np.zeros(blocks * BLOCK, np.int8), np.zeros(blocks, F32)
  for k in range(4):
    g, reset = _gradients(k, blocks), k == 2
    out = step(g, error, error_scale, jnp.bool_(reset))
    q, scale, error, error_scale, d = _numpy_step(g, error, error_scale, reset, bits,
                                                   error_bits, beta)
    np.testing.assert_array_equal(np.asarray(out.packed), np.asarray(quant.pack(q, bits)))
    np.testing.assert_array_equal(np.asarray(out.scales), scale)
    np.testing.assert_array_equal(np.asarray(out.error), error)
    np.testing.assert_array_equal(np.asarray(out.error_scale), error_scale)
    np.testing.assert_array_equal(np.asarray(out.decompressed), d)


@pytest.mark.parametrize("blocks,bits,error_bits,beta,tile_blocks", [
    (20, 4, 8, 0.8, None), (8, 2, 8, 0.5, 4), (6, 8, 6, 0.9, 2)])
def test_pallas_interpret_equals_jnp_bit_for_bit(blocks, bits, error_bits, beta, tile_blocks):
  if kernels.pl is None:
    pytest.skip("jax.experimental.pallas does not import on this jax")
  options = dict(bits=bits, error_bits=error_bits, beta=beta)
  pallas = _jit_step("pallas", interpret=True, tile_blocks=tile_blocks, **options)
  reference = _jit_step("jnp", **options)
  error, error_scale = jnp.zeros(blocks * BLOCK, jnp.int8), jnp.zeros(blocks, jnp.float32)
  for k in range(3):
    g, reset = jnp.asarray(_gradients(k, blocks)), jnp.bool_(k == 2)
    got, want = pallas(g, error, error_scale, reset), reference(g, error, error_scale, reset)
    for a, b in zip(got, want):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    error, error_scale = want.error, want.error_scale


def test_auto_is_jnp_on_cpu_and_the_probe_passes_in_interpret_mode():
  assert kernels.chosen_implementation() == "jnp"
  if kernels.pl is not None:
    assert kernels.pallas_matches_jnp("cpu", interpret=True)


def _peer_payloads(peers: int, blocks: int, bits: int = 4):
  """Random packed shards (every code equally likely) and scales spread over e**(+-9)."""
  rng = np.random.default_rng(peers)
  received = rng.integers(0, 256, (peers, blocks * BLOCK * bits // 8), dtype=np.uint8)
  scales = np.exp(3 * rng.standard_normal((peers, blocks))).astype(F32)
  scales[0, blocks // 2] = 0.0  # a vanishing block decompresses to 0
  return received, scales


def _numpy_dequantize(received, scales, bits):
  peers, blocks = scales.shape
  codes = np.asarray(quant.unpack(jnp.asarray(received.reshape(peers, blocks, -1)), bits))
  step = (F32(1) / np.where(scales > 0, scales, F32(1))).astype(F32)
  return np.where((scales > 0)[..., None], codes.astype(F32) * step[..., None],
                  F32(0)).astype(F32)


@pytest.mark.parametrize("implementation", ["jnp", "pallas"])
def test_dequantize_mean_equals_numpy_mean(implementation):
  if implementation == "pallas" and kernels.pl is None:
    pytest.skip("jax.experimental.pallas does not import on this jax")
  options = dict(implementation=implementation, interpret=True if implementation == "pallas"
                 else None)
  mean = jax.jit(lambda r, s: kernels.dequantize_mean(r, s, **options))
  received, scales = _peer_payloads(8, 6)
  want = _numpy_dequantize(received, scales, 4).mean(axis=0).reshape(-1)
  np.testing.assert_array_equal(np.asarray(mean(received, scales)), want)  # 1/8 is exact
  # Any peer count: the sum in peer order times 1/N (how XLA divides a mean by N).
  received, scales = received[:3], scales[:3]
  values = _numpy_dequantize(received, scales, 4)
  total = values[0] + values[1] + values[2]
  np.testing.assert_array_equal(np.asarray(mean(received, scales)),
                                (total * (F32(1) / F32(3))).reshape(-1))
  np.testing.assert_allclose(np.asarray(mean(received, scales)), values.mean(0).reshape(-1),
                             rtol=2.5e-7)


def test_dequantize_mean_of_bit_plane_widths_and_many_peers():
  received, scales = _peer_payloads(kernels.UNROLLED_PEERS + 2, 1, bits=3)
  got = jax.jit(lambda r, s: kernels.dequantize_mean(r, s, bits=3))(received, scales)
  values = _numpy_dequantize(received, scales, 3)
  np.testing.assert_allclose(np.asarray(got), values.mean(0).reshape(-1), rtol=1e-5,
                             atol=1e-6 * np.abs(values).max())


def test_non_finite_gradient_is_reported():
  g = jnp.asarray(_gradients(0, 2)).at[5].set(jnp.nan)
  for implementation in ("jnp", "pallas") if kernels.pl is not None else ("jnp",):
    out = kernels.compress_step(g, jnp.zeros(g.size, jnp.int8), jnp.zeros(2),
                                implementation=implementation, interpret=True
                                if implementation == "pallas" else None)
    assert not bool(out.finite)


def test_bad_arguments_name_what_was_expected():
  g = jnp.zeros(3 * BLOCK)
  error, error_scale = jnp.zeros(3 * BLOCK, jnp.int8), jnp.zeros(3)
  with pytest.raises(ValueError, match="multiple of block_size"):
    kernels.compress_step(jnp.zeros(BLOCK + 8), jnp.zeros(BLOCK + 8, jnp.int8), error_scale)
  with pytest.raises(ValueError, match="error must be int8"):
    kernels.compress_step(g, error.astype(jnp.int32), error_scale)
  with pytest.raises(ValueError, match="error_scale must be"):
    kernels.compress_step(g, error, jnp.zeros(4))
  with pytest.raises(ValueError, match="implementation must be one of"):
    kernels.compress_step(g, error, error_scale, implementation="cuda")
  with pytest.raises(ValueError, match="bits"):
    kernels.compress_step(g, error, error_scale, bits=9)
  with pytest.raises(ValueError, match="cannot run here"):
    kernels.compress_step(g, error, error_scale, bits=3, implementation="pallas")
  with pytest.raises(ValueError, match=r"\[N, bytes\]"):
    kernels.dequantize_mean(jnp.zeros(8, jnp.uint8), jnp.zeros((1, 1)))


def test_pallas_calls_trace_under_shard_map_with_varying_outputs():
  # Under shard_map (check_vma) a pallas_call needs inputs of one kind and outputs that say how
  # they vary; loco's mesh step on GPU runs the kernel there. (The CPU interpreter itself cannot
  # run under shard_map, so this checks the traced program.)
  mesh = jax.make_mesh((8,), ("data",))
  from jax.sharding import PartitionSpec as P

  def step(g):  # the error and its scales are not varying here: they get cast
    out = kernels.compress_step(g[0], jnp.zeros(g.shape[1], jnp.int8),
                                jnp.zeros(g.shape[1] // 2048), implementation="pallas",
                                interpret=True)
    mean = kernels.dequantize_mean(out.packed.reshape(1, -1), out.scales[None],
                                   implementation="pallas", interpret=True)
    return out.packed[None], mean[None]

  grads = jax.ShapeDtypeStruct((8, 4096), jnp.float32,
                               sharding=jax.sharding.NamedSharding(mesh, P("data")))
  traced = jax.make_jaxpr(jax.shard_map(step, mesh=mesh, in_specs=P("data"),
                                        out_specs=(P("data"), P("data"))))(grads)
  inner = traced.jaxpr.eqns[0].params["jaxpr"]
  calls = [e for e in inner.eqns if e.primitive.name == "pallas_call"]
  assert len(calls) == 2
  for call in calls:
    for var in call.invars + call.outvars:
      assert var.aval.manual_axis_type.varying == {"data"}, (call, var)
