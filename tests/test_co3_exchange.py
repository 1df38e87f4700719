"""co3's per-shard coded exchange on a mesh: the mean, overflow, device counts, NaN, hostile
peers (every device skips together, within seconds) and the bytes in the compiled program."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from tampering import tampering
from timeouts import within

from loco_jax import comm
from loco_jax.core import layout
from loco_jax.codecs import fp, gennorm, huffman_deflate
from loco_jax.comm import coded
from loco_jax.train import parallel
from loco_jax.transforms import co3_exchange
from loco_jax.transforms.co3 import co3

PARAMS = {"w": jnp.zeros((40, 96)), "b": jnp.zeros(3)}  # b: smaller than the device count
N_PARAMS = 40 * 96 + 3
CODER = huffman_deflate


def _grads(seed, n):
  rng = np.random.default_rng(seed)
  return {k: jnp.asarray(gennorm.sample(rng, 1.0, 1e-3, (n, *x.shape)).astype(np.float32))
          for k, x in sorted(PARAMS.items())}


def _step(opt, n):
  mesh = parallel.data_mesh(n)
  state, specs = parallel.init_opt_state(opt, PARAMS, mesh)
  gspecs = jax.tree.map(lambda _: P("data"), PARAMS)
  step = jax.jit(jax.shard_map(lambda g, s: opt.update(jax.tree.map(lambda x: x[0], g), s),
                               mesh=mesh, in_specs=(gspecs, specs),
                               out_specs=(jax.tree.map(lambda _: P(), PARAMS), specs)))
  return step, state


def _sent(grads, n):
  """float64 [n, ...] per leaf: what each device sends at its first step (Q(g) at its scale)."""
  local = co3("fp4", entropy_code=False)
  out = [jax.jit(local.update)(jax.tree.map(lambda g: g[d], grads), local.init(PARAMS))[0]
         for d in range(n)]
  return {k: np.stack([np.asarray(o[k], np.float64) for o in out]) for k in PARAMS}


def _assert_mean(out, sent, rtol):
  for k in PARAMS:
    want = sent[k].mean(axis=0)
    np.testing.assert_allclose(np.asarray(out[k], np.float64), want, rtol=rtol,
                               atol=rtol * np.abs(want).max())


# ----------------------------------------------------------------------------- the wire


def test_coded_all_to_all_delivers_every_row_exactly():
  n, size = 8, 1000
  rows = np.random.default_rng(0).integers(0, 16, (n, n, size)).astype(np.uint8)  # [sender, dest]
  capacity = coded.slot_bytes(size, 8.0, CODER)

  def exchange(rows_1xNxB):
    got = coded.all_to_all(rows_1xNxB[0], jnp.zeros((n, 1)), capacity, CODER, "data")
    return got.rows[None], got.missing[None]

  mesh = parallel.data_mesh(n)
  got, missing = jax.jit(jax.shard_map(exchange, mesh=mesh, in_specs=P("data"),
                                       out_specs=P("data")))(rows)
  np.testing.assert_array_equal(np.asarray(got), rows.transpose(1, 0, 2))  # dest j, from s
  assert not np.any(np.asarray(missing))


# ----------------------------------------------------------------------------- the mean


@pytest.mark.slow
@pytest.mark.parametrize("n", [1, 2, 8])
def test_mean_over_1_2_8_devices_and_a_leaf_smaller_than_the_axis(n):
  grads, sent = _grads(n, n), None
  sent = _sent(grads, n)
  step, state = _step(co3("fp4", axis_name="data",
                          collective="auto" if n == 1 else "all_to_all"), n)
  out, state = step(grads, state)
  # bf16 gather: the float32 mean rounded once to bfloat16 (n = 1: no gather, exact).
  _assert_mean(out, sent, 2.0 ** -8 if n > 1 else 1e-6)
  assert int(state.count) == 1 and int(state.overflows) == 0 and int(state.rejected) == 0
  bits = np.asarray(state.coded_bits)
  assert bits.shape == (n,) and np.all((bits > 1) & (bits < 4))


@pytest.mark.slow
def test_all_gather_and_coded_gather_means():
  grads = _grads(5, 8)
  sent = _sent(grads, 8)
  step, state = _step(co3("fp4", axis_name="data", collective="all_gather"), 8)
  _assert_mean(step(grads, state)[0], sent, 1e-6)  # float32 mean of exact symbols

@pytest.mark.parametrize("n", [3, 8])
def test_coded_gather_returns_the_exact_mean_at_the_agreed_scales(n):
  grads = _grads(5, n)
  if n == 3:  # one device's gradients far smaller (its scale far larger): the bound applies
    grads = jax.tree.map(lambda g: g.at[0].multiply(1e-2), grads)
  step, state = _step(co3("fp4", axis_name="data", gather="coded"), n)
  out, after = step(grads, state)
  own_step, own_state = _step(co3("fp4", axis_name="data", collective="all_to_all"), n)
  own = own_step(grads, own_state)[1].scale  # the bf16 gather: each device at its own scale
  scales = {k: np.asarray(after.scale[k]).reshape(n) for k in PARAMS}
  for k in PARAMS:  # every device converted at the largest of the devices' own scales,
    own_k = np.asarray(own[k]).reshape(n)  # at most AGREED_SCALE_SPAN times the smallest
    assert len(set(own_k.tolist())) > 1, k  # the devices' own scales differ: agreement shows
    agreed = min(own_k.max(), np.float32(co3_exchange.AGREED_SCALE_SPAN) * own_k.min())
    np.testing.assert_array_equal(scales[k], np.full(n, agreed))
    assert agreed < own_k.max() or n != 3, k
  for k in PARAMS:  # what each device sent: its compensated gradient at the agreed scale
    x = np.asarray(grads[k], np.float32).reshape(n, -1)
    q = np.stack([fp.quantize(x[d], fp.FP4, np.float32(scales[k][0])) for d in range(n)])
    want = q.astype(np.float64).mean(axis=0)  # each q: a level times float32's 1 / scale
    np.testing.assert_allclose(np.asarray(out[k], np.float64).reshape(-1), want, rtol=1e-6,
                               atol=1e-6 * np.abs(want).max())
  assert int(after.overflows) == 0 and int(after.rejected) == 0
  # The owner adds its n peers' rows elementwise (quant.sum_rows): XLA:CPU's reduce over the
  # leading axis took 89 of a device's 121 ms a step at n = 4, 4M parameters.
  text = step.lower(grads, state).as_text()
  assert not re.search(rf"reduce\(.*across dimensions = \[0\] : \(tensor<{n}x\d+x", text)


def test_coded_gather_refuses_fp8_and_sums_beyond_a_byte():
  with pytest.raises(ValueError, match="fp4"):
    co3("fp8", axis_name="data", gather="coded")
  with pytest.raises(ValueError, match="21 devices"):
    co3_exchange.check_sum_gather(fp.FP4, 22)
  co3_exchange.check_sum_gather(fp.FP4, 21)


def test_auto_picks_the_all_gather_on_two_devices():
  assert co3_exchange.predicted_bits(2, 3.8, 16.0, True) > co3_exchange.predicted_bits(
      2, 3.8, 16.0, False)
  assert co3_exchange.predicted_bits(8, 3.8, 16.0, True) < co3_exchange.predicted_bits(
      8, 3.8, 16.0, False)
  step, state = _step(co3("fp4", axis_name="data"), 2)
  ops = {c.op for c in comm.lowered_collectives(step, _grads(0, 2), state)}
  assert "all-to-all" not in ops and "all-gather" in ops


# ----------------------------------------------------------------------------- overflow, NaN


@pytest.fixture(scope="module")
def per_shard():
  """One compiled 8-device per-shard step, run under different host hooks."""
  return _step(co3("fp4", axis_name="data", collective="all_to_all"), 8)


@pytest.mark.slow
def test_one_overflowing_slot_sends_the_step_raw_on_every_device(per_shard):
  step, state = per_shard
  grads = _grads(7, 8)
  # Blocked on: the host hooks are global, and jax dispatches asynchronously.
  plain, plain_state = jax.block_until_ready(step(grads, state))

  def pad_one(sender, destination, stream):  # device 3's slot for device 5 does not fit
    return stream + bytes(1 << 16) if (sender, destination) == (3, 5) else stream

  with tampering(pad_one):
    out, after = within(60, lambda: step(grads, state))
  for k in PARAMS:
    np.testing.assert_allclose(np.asarray(out[k]), np.asarray(plain[k]), rtol=1e-6, atol=0)
  assert int(after.overflows) == 1 and int(plain_state.overflows) == 0
  np.testing.assert_allclose(np.asarray(after.error["w"]), np.asarray(plain_state.error["w"]))


def test_nan_on_one_device_skips_the_step_everywhere(per_shard):
  step, state = per_shard
  grads = _grads(8, 8)
  grads["w"] = grads["w"].at[3, 0, 0].set(jnp.nan)
  out, after = step(grads, state)
  assert all(np.all(np.isnan(np.asarray(v))) for v in jax.tree.leaves(out))
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)),
               after, state)


# ----------------------------------------------------------------------------- hostile peers


def _short(stream):  # well-formed, but fewer bytes than the row
  del stream
  return huffman_deflate.encode(np.arange(10, dtype=np.uint8))


def _flip(stream):
  flipped = bytearray(stream)
  flipped[len(stream) // 2] ^= 0x10
  return bytes(flipped)


HOSTILE = {"short": _short, "truncated": lambda s: s[:-7], "bit-flipped": _flip}


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_a_hostile_peer_stream_makes_every_device_skip(per_shard, kind):
  step, state = per_shard
  grads = _grads(9, 8)

  def hostile(sender, destination, stream):
    return HOSTILE[kind](stream) if (sender, destination) == (6, 2) else stream

  with tampering(hostile):
    out, after = within(60, lambda: step(grads, state))
  assert all(np.all(np.isnan(np.asarray(v))) for v in jax.tree.leaves(out))
  assert int(after.rejected) == 1
  kept = after._replace(rejected=state.rejected)
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)),
               kept, state)
  good, _ = step(grads, state)  # and the next step runs as usual
  assert all(np.all(np.isfinite(np.asarray(v))) for v in jax.tree.leaves(good))


def test_a_peer_forging_symbols_that_are_no_levels_makes_every_device_skip():
  """A well-formed stream of bytes that are no fp4 pairs (reserved exponent): the coded
  gather's sums come out NaN on the receiver, which flags the step for every device."""
  step, state = _step(co3("fp4", axis_name="data", gather="coded"), 8)
  row_bytes = sum(layout.shard_len(x.size, 8) for x in jax.tree.leaves(PARAMS)) // 2

  def forge(sender, destination, stream):
    forged = huffman_deflate.encode(np.full(row_bytes, 0x77, np.uint8))
    return forged if (sender, destination) == (1, 6) else stream

  with tampering(forge):
    out, after = within(60, lambda: step(_grads(11, 8), state))
  assert all(np.all(np.isnan(np.asarray(v))) for v in jax.tree.leaves(out))
  assert int(after.rejected) == 1 and int(after.count) == 0


def test_a_peer_forging_sums_beyond_any_of_n_levels_makes_every_device_skip():
  """A well-formed gathered stream whose bytes (255) exceed every sum of 8 devices' levels."""
  step, state = _step(co3("fp4", axis_name="data", gather="coded"), 8)
  row_bytes = sum(layout.shard_len(x.size, 8) for x in jax.tree.leaves(PARAMS))

  def forge(sender, destination, stream):
    forged = huffman_deflate.encode(np.full(row_bytes, 255, np.uint8))
    return forged if (sender, destination) == (2, -1) else stream

  with tampering(forge):
    out, after = within(60, lambda: step(_grads(12, 8), state))
  assert all(np.all(np.isnan(np.asarray(v))) for v in jax.tree.leaves(out))
  assert int(after.rejected) == 1 and int(after.count) == 0


@pytest.mark.slow
@pytest.mark.parametrize("exchange_kw", [dict(gather="coded"), dict(collective="all_gather")])
def test_a_corrupt_gathered_stream_makes_every_device_skip(exchange_kw):
  step, state = _step(co3("fp4", axis_name="data", **exchange_kw), 8)

  def flip_gathered(sender, destination, stream):
    return _flip(stream) if destination == -1 and sender == 4 else stream

  with tampering(flip_gathered):
    out, after = within(60, lambda: step(_grads(10, 8), state))
  assert all(np.all(np.isnan(np.asarray(v))) for v in jax.tree.leaves(out))
  assert int(after.rejected) == 1 and int(after.count) == 0


# ----------------------------------------------------------------------------- the HLO


def test_capacity_and_bits_in_the_compiled_program(per_shard):
  step, state = per_shard
  found = comm.compiled_collectives(step, _grads(0, 8), state)
  always = [c for c in found if not c.conditional]
  # The slots, the gather, and the 4-byte agreement on whether the slots' extension goes.
  assert sorted(c.op for c in always) == ["all-gather", "all-reduce", "all-to-all"]
  a2a = next(c for c in always if c.op == "all-to-all")
  rows = sum(layout.shard_len(x.size, 8) for x in jax.tree.leaves(PARAMS)) // 2  # fp4 pairs
  usual = coded.slot_bytes(rows, 2 * co3_exchange.co3_host.usual_capacity_bits(fp.FP4), CODER)
  assert a2a.dtype == "u8" and a2a.nbytes == 8 * (usual + 4 + 4 * 3)  # + length, scales, flag
  bits = comm.wire_bits_per_param(found, N_PARAMS)
  predicted = co3_exchange.predicted_bits(8, 8 * (usual + 16) / (2 * rows), 16.0, True)
  assert bits == pytest.approx(predicted, rel=0.03)
  # On the steps that need them: the extension (up to the model's worst case), then the raw
  # resend of fp4, two symbols a byte.
  extension, *raw = [c for c in found if c.conditional]
  reach = coded.slot_bytes(rows, 2 * co3_exchange.co3_host.default_capacity_bits(fp.FP4), CODER)
  assert extension.op == "all-to-all" and extension.nbytes == 8 * (reach - usual)
  assert sorted(c.op for c in raw) == ["all-gather", "all-to-all"]
  assert comm.wire_bits_per_param(found, N_PARAMS, include_conditional=True) > bits


@pytest.mark.slow
def test_a_stream_longer_than_usual_takes_the_extension_on_every_device(per_shard):
  step, state = per_shard
  grads = _grads(7, 8)
  plain, plain_state = jax.block_until_ready(step(grads, state))
  rows = sum(layout.shard_len(x.size, 8) for x in jax.tree.leaves(PARAMS)) // 2
  usual = coded.slot_bytes(rows, 2 * co3_exchange.co3_host.usual_capacity_bits(fp.FP4), CODER)

  def lengthen_one(sender, destination, stream):  # device 3's stream for device 5: one byte
    # more than the usual slot (bytes after a deflate stream's last block are not read)
    return stream + bytes(usual + 1 - len(stream)) if (sender, destination) == (3, 5) else stream

  with tampering(lengthen_one):
    out, after = within(60, lambda: step(grads, state))
  for k in PARAMS:
    np.testing.assert_array_equal(np.asarray(out[k]), np.asarray(plain[k]))
  assert (int(after.extended), int(after.overflows)) == (1, 0)
  assert (int(plain_state.extended), int(plain_state.overflows)) == (0, 0)
  np.testing.assert_array_equal(np.asarray(after.error["w"]), np.asarray(plain_state.error["w"]))


@pytest.mark.parametrize("senders_of_long_rows", [(), (2,), tuple(range(4))])
def test_slot_extensions_go_only_where_a_stream_needs_them(senders_of_long_rows):
  n, size = 4, 4096
  rng = np.random.default_rng(0)
  rows = rng.integers(0, 4, (n, n, size), dtype=np.uint8)  # 2 bits a byte: fit 3
  for s in senders_of_long_rows:
    rows[s] = rng.integers(0, 256, (n, size), dtype=np.uint8)  # 8 bits a byte: need more
  capacity = coded.slot_bytes(size, 3.0, CODER)
  extension = coded.slot_bytes(size, 8.5, CODER) - capacity

  def exchange(rows_1xNxB):
    side = jnp.zeros((n, 1), jnp.float32)
    a2a = coded.all_to_all(rows_1xNxB[0], side, capacity, CODER, "data", extension)
    gathered = coded.all_gather(rows_1xNxB[0, 0], side[0], capacity, CODER, "data", extension)
    return jax.tree.map(lambda x: jnp.asarray(x)[None], (a2a, gathered))

  step = jax.jit(jax.shard_map(exchange, mesh=parallel.data_mesh(n), in_specs=P("data"),
                               out_specs=P("data")))
  a2a, gathered = step(jnp.asarray(rows))
  long = int(bool(senders_of_long_rows))
  for got, sent in ((a2a, rows.transpose(1, 0, 2)), (gathered, rows[None, :, 0].repeat(n, 0))):
    np.testing.assert_array_equal(np.asarray(got.rows), sent)  # got[j, s]: s's row for j
    np.testing.assert_array_equal(np.asarray(got.missing), 0)
    np.testing.assert_array_equal(np.asarray(got.extended), [long] * n)  # every device alike
  always, sometimes = [], []
  for c in comm.compiled_collectives(step, jnp.asarray(rows)):
    (sometimes if c.conditional else always).append((c.op, c.nbytes))
  assert sorted(sometimes) == [("all-gather", n * extension), ("all-to-all", n * extension)]
  assert ("all-reduce", 4) in always  # the all-to-all's agreement; the gather's is its lengths


def test_needed_bits_invert_the_slot_size():
  size = 10_000
  for bits in (1.0, 2.75, 6.0):
    slot = coded.slot_bytes(size, bits, CODER)
    assert bits <= coded.needed_bits_per_byte(slot, size, CODER) < bits + 8 / size
    assert coded.needed_bits_per_byte(slot + 1, size, CODER) > bits  # one byte more: too long
  np.testing.assert_allclose(coded.needed_bits_per_byte(np.array([slot, slot]), size, CODER),
                             coded.needed_bits_per_byte(slot, size, CODER))


def test_slot_capacities_set_the_compiled_slots():
  n = 4
  opt = co3("fp4", axis_name="data", gather="coded", capacity_bits=3.0, gather_capacity_bits=4.5)
  step, state = _step(opt, n)
  found = [c for c in comm.compiled_collectives(step, _grads(0, n), state) if not c.conditional]
  row = sum(layout.shard_len(x.size, n) for x in jax.tree.leaves(PARAMS))  # symbols a row
  a2a, gather = (next(c for c in found if c.op == op) for op in ("all-to-all", "all-gather"))
  assert a2a.nbytes == n * (coded.slot_bytes(row // 2, 2 * 3.0, CODER) + 4 + 4 * 3)
  assert gather.nbytes == n * (coded.slot_bytes(row, 4.5, CODER) + 4 + 4 * 2)  # + status
  out, after = step(_grads(0, n), state)  # the default slots' exact mean, in the smaller slots
  default_step, default_state = _step(co3("fp4", axis_name="data", gather="coded"), n)
  for k in PARAMS:
    np.testing.assert_array_equal(np.asarray(out[k]),
                                  np.asarray(default_step(_grads(0, n), default_state)[0][k]))
  assert int(after.overflows) == 0
  for kwargs in (dict(gather_capacity_bits=4.5), dict(gather="coded", entropy_code=False,
                                                      gather_capacity_bits=4.5),
                 dict(gather="coded", gather_capacity_bits=9.0)):
    with pytest.raises(ValueError, match="gather_capacity_bits"):
      co3("fp4", axis_name="data", **kwargs)
