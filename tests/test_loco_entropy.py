"""`loco(..., entropy_code=True)`: the all-to-all's packed codes Huffman-coded into fixed slots.
Lossless, so the step equals plain LoCo's exactly; an overflowing slot sends the step raw on
every device; a hostile peer's stream makes every device skip; the slots in the compiled HLO."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from tampering import tampering
from timeouts import within

from loco_jax import comm, kernels
from loco_jax.codecs import huffman_deflate
from loco_jax.comm import coded
from loco_jax.core import buckets
from loco_jax.transforms.loco import loco

N = 8
PARAMS = {"w": jnp.zeros((64, 96)), "b": jnp.zeros(5)}  # b: smaller than the device count
N_PARAMS = 64 * 96 + 5


def _grads(seed):
  rng = np.random.default_rng(seed)
  # Heavy-tailed, as real gradients are: the 4-bit codes crowd near 0 and code to ~2-3 bits.
  return {k: jnp.asarray(rng.laplace(0, 1e-3, (N, *x.shape)).astype(np.float32))
          for k, x in sorted(PARAMS.items())}


def _equal(a, b):
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


def _same_step(a, b):
  """Equal but for float32 rounding: the coded and the plain step are different compiled
  programs (the same arithmetic, fused differently), so a float may differ in its last bit."""
  def check(x, y):
    x, y = np.asarray(x), np.asarray(y)
    if np.issubdtype(x.dtype, np.floating):
      np.testing.assert_allclose(x, y, rtol=2e-7, atol=0)
    else:
      np.testing.assert_array_equal(x, y)
  jax.tree.map(check, a, b)


@pytest.fixture(scope="module")
def steps(mesh, shard_mapped_update):
  return {name: shard_mapped_update(opt, mesh, PARAMS) for name, opt in {
      "plain": loco(axis_name="data"),
      "coded": loco(axis_name="data", entropy_code=True),
      "tight": loco(axis_name="data", entropy_code=True, capacity_bits=0.25)}.items()}


def test_the_coded_step_is_plain_locos_step_exactly(steps):
  (plain, state), (coded_step, coded_state) = steps["plain"], steps["coded"]
  for seed in range(3):  # three steps: the error carried through the coded exchange too
    grads = _grads(seed)
    out, state = plain(grads, state)
    got, coded_state = coded_step(grads, coded_state)
    _same_step((got, coded_state), (out, state))


def test_slots_too_small_send_every_step_raw_with_the_same_result(steps):
  (plain, state), (tight, tight_state) = steps["plain"], steps["tight"]
  grads = _grads(4)
  _same_step(within(60, lambda: tight(grads, tight_state)), plain(grads, state))


def test_one_overflowing_slot_sends_the_step_raw_on_every_device(steps):
  (plain, state), (coded_step, coded_state) = steps["plain"], steps["coded"]
  grads = _grads(5)
  expected = jax.block_until_ready(plain(grads, state))

  def pad_one(sender, destination, stream):  # device 3's slot for device 5 does not fit
    return stream + bytes(1 << 16) if (sender, destination) == (3, 5) else stream

  with tampering(pad_one):
    got = within(60, lambda: coded_step(grads, coded_state))
  _same_step(got, expected)


def _flip(stream):
  flipped = bytearray(stream)
  flipped[len(stream) // 2] ^= 0x10
  return bytes(flipped)


@pytest.mark.parametrize("hostile", [lambda s: s[:-7], _flip, lambda s: s[: len(s) // 3]],
                         ids=["truncated", "bit-flipped", "short"])
def test_a_hostile_peer_stream_makes_every_device_skip(steps, hostile):
  coded_step, state = steps["coded"]

  def tamper(sender, destination, stream):
    return hostile(stream) if (sender, destination) == (6, 2) else stream

  with tampering(tamper):
    out, after = within(60, lambda: coded_step(_grads(6), state))
  assert all(np.all(np.isnan(np.asarray(v))) for v in jax.tree.leaves(out))
  _equal(after, state)
  good, _ = coded_step(_grads(6), state)  # and the next step runs as usual
  assert all(np.all(np.isfinite(np.asarray(v))) for v in jax.tree.leaves(good))


def test_nan_on_one_device_skips_the_step_everywhere(steps):
  coded_step, state = steps["coded"]
  grads = _grads(7)
  grads["w"] = grads["w"].at[3, 0, 0].set(jnp.nan)
  out, after = coded_step(grads, state)
  assert all(np.all(np.isnan(np.asarray(v))) for v in jax.tree.leaves(out))
  _equal(after, state)


def test_scatter_returns_plain_locos_shards(mesh, shard_mapped_update):
  kw = dict(axis_name="data", scatter=True)
  plain, state = shard_mapped_update(loco(**kw), mesh, PARAMS, out_spec=P("data"))
  coded_step, coded_state = shard_mapped_update(loco(entropy_code=True, **kw), mesh, PARAMS,
                                                out_spec=P("data"))
  _same_step(coded_step(_grads(8), coded_state), plain(_grads(8), state))


def test_the_all_to_all_sends_slots_of_the_capacity(steps):
  coded_step, state = steps["coded"]
  found = comm.compiled_collectives(coded_step, _grads(0), state)
  always = [c for c in found if not c.conditional]
  assert sorted(c.op for c in always) == ["all-gather", "all-reduce", "all-to-all"]
  a2a = next(c for c in always if c.op == "all-to-all")
  plan = buckets.plan(tuple(x.size for x in jax.tree.leaves(PARAMS)), N, 2048)
  code_bytes = sum(b * n for b, n in zip(plan.blocks, plan.block_lens)) // 2  # 4-bit codes
  slot = coded.slot_bytes(code_bytes, 3.5 * 2, huffman_deflate)
  # Each row: the slot, its stream's length, one float32 scale a block and the flag.
  assert a2a.dtype == "u8" and a2a.nbytes == N * (slot + 4 + 4 * sum(plan.blocks) + 4)
  assert next(c for c in always if c.op == "all-reduce").nbytes == 8  # the slots' verdict
  raw = [c for c in found if c.conditional]  # the overflow path: the packed codes as they are
  assert [c.op for c in raw] == ["all-to-all"]
  assert raw[0].nbytes == N * (code_bytes + 4 * sum(plan.blocks) + 4)


def test_the_coder_sends_fewer_bits_than_the_packed_codes_on_heavy_tailed_gradients():
  """What a slot's capacity is measured against: the coded rate of LoCo's codes."""
  g = _grads(9)["w"][0].reshape(-1)
  out = kernels.compress_step(g, jnp.zeros(g.size, jnp.int8), jnp.zeros(g.size // 2048),
                              bits=4, error_bits=8, beta=0.8, reset=False, block_size=2048)
  packed = np.asarray(out.packed).reshape(-1)
  coded_bits = 8 * len(huffman_deflate.encode(packed)) / g.size
  assert coded_bits < 3.5  # the default slot (4 - 0.5 bits a code) holds it


@pytest.mark.parametrize("kw,message", [
    (dict(entropy_code=True), "needs an axis_name"),
    (dict(axis_name="data", capacity_bits=2.0), "pass entropy_code=True"),
    (dict(axis_name="data", entropy_code=True, capacity_bits=4.5), "capacity_bits"),
    (dict(axis_name="data", entropy_code=True, capacity_bits=0.0), "capacity_bits"),
])
def test_bad_arguments_raise(kw, message):
  with pytest.raises(ValueError, match=message):
    loco(**kw)
