"""FSDP (ZeRO-3) on an 8-device CPU mesh: same training as zero2, memory, wire bits, checkpoints."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import processes
import train_worker
from loco_jax import comm, loco
from loco_jax.train import checkpoint, fsdp, parallel
from loco_jax.apps.models import gpt

N = 8
SMALL = gpt.GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_layers=2, n_heads=2, d_ff=32)


def _layered(config=SMALL) -> fsdp.Layered:
  return gpt.layered_params(gpt.split_model(gpt.GPT(config))[1])


def _batches(steps, config=SMALL, size=16):
  rng = np.random.default_rng(0)
  for _ in range(steps):
    # A learnable sequence: each token is the previous one plus a per-row stride, mod vocab.
    start = rng.integers(0, config.vocab_size, (size, 1))
    stride = rng.integers(1, 3, (size, 1))
    yield jnp.asarray((start + stride * np.arange(config.seq_len + 1)) % config.vocab_size,
                      jnp.int32)


def _setup(mode, compressor, config=SMALL, optimizer=None, **kwargs):
  mesh = parallel.data_mesh(N)
  optimizer = optimizer or optax.adam(1e-2)
  model = gpt.layered_model(config)
  params, loss_fn = _layered(config), model
  if mode == "zero2":
    params, loss_fn = fsdp.unstacked(params, model)
  state, specs = parallel.init_train_state(params, optimizer, mesh, compressor=compressor,
                                           mode=mode)
  step = parallel.make_train_step(loss_fn, optimizer, mesh, params, compressor=compressor,
                                  mode=mode, **kwargs)
  return state, step


def _train(mode, compressor, steps, **kwargs):
  state, step = _setup(mode, compressor, **kwargs)
  losses = []
  for batch in _batches(steps):
    state, loss = step(state, batch)
    losses.append(float(loss))
  return np.array(losses), state


def _fsdp_params_as_zero2(state) -> dict:
  """fsdp's master shards (global arrays) rearranged as zero2's (per layer leaves)."""
  blocks = state.params.blocks
  layers = fsdp.num_layers(blocks)
  return {"embed": state.params.embed, "head": state.params.head,
          "blocks": [jax.tree.map(lambda x: x[i], blocks) for i in range(layers)]}


@pytest.mark.slow
def test_uncompressed_fsdp_matches_zero2():
  fsdp_losses, fsdp_state = _train("fsdp", parallel.reduce_scatter("data"), 10)
  zero2_losses, zero2_state = _train("zero2", parallel.reduce_scatter("data"), 10)
  np.testing.assert_allclose(fsdp_losses, zero2_losses, rtol=1e-5)
  assert fsdp_losses[-1] < 0.9 * fsdp_losses[0]
  # adam divides by sqrt(v): where a gradient is near 0, its rounding moves the step by a
  # fraction of lr (1e-2); elsewhere the params agree to float32 rounding.
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4,
                                                       atol=1e-4),
               _fsdp_params_as_zero2(fsdp_state), zero2_state.params)


@pytest.mark.slow  # about 30 s: compiles two 12-layer steps with LoCo
def test_memory_of_a_12_layer_step_is_at_most_035_of_zero2s():
  config = gpt.GPTConfig(vocab_size=64, seq_len=32, d_model=32, n_layers=12, n_heads=4,
                         d_ff=64)
  batch = next(_batches(1, config))
  peak = {}
  for mode in ("fsdp", "zero2"):
    state, step = _setup(mode, loco(axis_name="data", scatter=True), config)
    m = step.jitted.lower(state, batch).compile().memory_analysis()
    # Per device (the SPMD program): the arguments (the state, the batch) live throughout; the
    # outputs are the new state, donated into the arguments' buffers (alias), so they add only
    # out - alias; temp is the peak of XLA's scratch buffers (gathered params, gradients,
    # activations).
    peak[mode] = (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
                  + m.temp_size_in_bytes)
  assert peak["fsdp"] <= 0.35 * peak["zero2"], peak


@pytest.mark.slow
@pytest.mark.parametrize("param_gather,steps", [("compute", 50), ("int8", 5)])
def test_loco_fsdp_matches_loco_zero2_in_training_and_wire_bytes(param_gather, steps):
  batches = list(_batches(steps))
  found, losses = {}, {}
  for mode in ("fsdp", "zero2"):
    # Blocks of 8 values: every row of every leaf is whole blocks, so LoCo lays out each layer's
    # leaves the same whether it compresses one layer (fsdp) or the whole tree (zero2); longer
    # blocks leave remainders whose block lengths LoCo chooses per tree.
    state, step = _setup(mode, loco(axis_name="data", scatter=True, block_size=8),
                         compute_dtype=jnp.bfloat16, param_gather=param_gather)
    found[mode] = comm.collectives_per_step(
        step.jitted.lower(state, batches[0]).compile().as_text(), N)
    losses[mode] = []
    for b in batches:
      state, loss = step(state, b)
      losses[mode].append(float(loss))
  fsdp_losses, zero2_losses = np.array(losses["fsdp"]), np.array(losses["zero2"])
  assert fsdp_losses[-1] < (0.4 if steps >= 50 else 0.95) * fsdp_losses[0]
  # The same LoCo math on the same blocks (and the same int8 parameter blocks): the
  # first steps agree to float rounding. Programs compiled differently round differently; once
  # a rounding difference flips a 4-bit code (one step of its block's scale), the runs part
  # like two seeds of one training: within 0.3% here over 50 steps, where this LoCo differs
  # from uncompressed training by up to 3%.
  np.testing.assert_allclose(fsdp_losses[:3], zero2_losses[:3], rtol=1e-4)
  np.testing.assert_allclose(fsdp_losses, zero2_losses, rtol=1e-2)

  total = lambda mode, op: sum(c.nbytes for c in found[mode] if c.op == op)
  exchanges = [c for c in found["fsdp"] if c.op == "all-to-all"]
  assert len(exchanges) == SMALL.n_layers + 2, exchanges  # each layer's, the head's, the embed's
  # The same codes and scales as zero2's one exchange of every leaf; each exchange also
  # carries LoCo's 4-byte finiteness flag per device.
  extra = total("fsdp", "all-to-all") - total("zero2", "all-to-all")
  assert 0 <= extra <= 4 * N * (len(exchanges) - 1), extra
  # Every layer's params are gathered twice (forward, backward); head's once (its gradient is
  # taken right after its forward).
  ratio = total("fsdp", "all-gather") / total("zero2", "all-gather")
  assert 1.5 < ratio <= 2.0, ratio
  assert not any(c.op == "reduce-scatter" or c.op == "all-reduce" and c.nbytes > 16
                 for c in found["fsdp"]), found["fsdp"]


def test_collectives_per_step_counts_every_loop_iteration():
  mesh = parallel.data_mesh(N)

  def scanned(x):
    return jax.lax.scan(lambda c, _: (c + jax.lax.psum(c, "data"), None), x, None, length=5)[0]

  def unknown_trips(x):
    return jax.lax.while_loop(lambda c: c.sum() < 100.0, lambda c: c + jax.lax.psum(c, "data"), x)

  for fn, count in ((scanned, 5), (unknown_trips, None)):
    jitted = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("data"), out_specs=P("data")))
    text = jitted.lower(jnp.ones(N)).compile().as_text()
    if count is None:
      with pytest.raises(ValueError, match="trip count"):
        comm.collectives_per_step(text, N)
    else:
      found = comm.collectives_per_step(text, N)
      assert [c.op for c in found] == ["all-reduce"] * count, found


@pytest.mark.slow
def test_checkpoint_round_trip_is_exact(tmp_path):
  mesh = parallel.data_mesh(N)
  state, step, config = train_worker.build("fsdp", 32, mesh)
  batches = [train_worker.batch(i, mesh) for i in range(3)]
  for b in batches[:2]:
    state, _ = step(state, b)
  errors = [g.error for g in state.compressor_state.blocks.groups.values()]
  assert all(np.asarray(e).any() and e.shape[0] == train_worker.LAYERS
             for e in jax.tree.leaves(errors))
  like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                      state)
  checkpoint.save(tmp_path, 2, state, config)
  restored, at = checkpoint.restore(tmp_path, like, config)
  assert at == 2 and isinstance(restored.params, fsdp.Layered)
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, restored),
               jax.tree.map(np.asarray, state))
  # The same program on the same state: the next step is the same, bit for bit.
  after, loss = step(state, batches[2])
  after_restored, loss_restored = step(restored, batches[2])
  assert float(loss) == float(loss_restored)
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, after_restored),
               jax.tree.map(np.asarray, after))


def _mlp_params():
  k1, k2 = jax.random.split(jax.random.key(0))
  return {"w1": jax.random.normal(k1, (16, 64)) * 0.3, "b1": jnp.zeros(64),
          "w2": jax.random.normal(k2, (64, 4)) * 0.3, "b2": jnp.zeros(4)}


def _mlp_loss(params, batch):
  h = jnp.tanh(batch[:, :16] @ params["w1"] + params["b1"])
  return jnp.mean((h @ params["w2"] + params["b2"] - batch[:, 16:]) ** 2)


@pytest.mark.slow
def test_whole_model_fallback_matches_zero2():
  mesh, optimizer = parallel.data_mesh(N), optax.adam(1e-2)
  rng = np.random.default_rng(0)
  batches = [jnp.asarray(rng.standard_normal((64, 20)), jnp.float32) for _ in range(5)]
  losses = {}
  for mode, params, loss_fn in (("fsdp", fsdp.Layered({}, {}, _mlp_params()),
                                 fsdp.whole_model(_mlp_loss)),
                                ("zero2", _mlp_params(), _mlp_loss)):
    compressor = parallel.reduce_scatter("data")
    state, specs = parallel.init_train_state(params, optimizer, mesh, compressor=compressor,
                                             mode=mode)
    step = parallel.make_train_step(loss_fn, optimizer, mesh, params,
                                    compressor=compressor, mode=mode)
    losses[mode] = []
    for b in batches:
      state, loss = step(state, b)
      losses[mode].append(float(loss))
  np.testing.assert_allclose(losses["fsdp"], losses["zero2"], rtol=1e-5)
  assert losses["fsdp"][-1] < losses["fsdp"][0]


@pytest.mark.slow
@settings(max_examples=15, deadline=None)
@given(devices=st.sampled_from([1, 2, 3, 8]), layers=st.integers(1, 3),
       shape=st.lists(st.integers(1, 9), min_size=0, max_size=2))
def test_shard_params_round_trip(devices, layers, shape):
  rng = np.random.default_rng(len(shape) * 100 + layers * 10 + devices)
  params = fsdp.Layered({"e": rng.standard_normal((5, 3)).astype(np.float32)},
                        {"w": rng.standard_normal((layers, *shape)).astype(np.float32)},
                        {"h": rng.standard_normal(shape).astype(np.float32)})
  mesh = parallel.data_mesh(devices)
  shards = fsdp.shard_params(params, mesh)
  expected = fsdp.local_shard_shapes(params, devices)
  assert shards.blocks["w"].shape == (layers, devices * expected.blocks["w"].shape[1])
  # Device j's shard of layer l is elements [j * S, (j + 1) * S) of that layer, zero-padded.
  s = expected.blocks["w"].shape[1]
  padded = np.zeros((layers, devices * s), np.float32)
  padded[:, : int(np.prod(shape))] = params.blocks["w"].reshape(layers, -1)
  np.testing.assert_array_equal(np.asarray(shards.blocks["w"]), padded)
  back = fsdp.unshard_params(shards, params)
  jax.tree.map(np.testing.assert_array_equal, back, params)


@pytest.mark.slow
def test_bad_inputs_raise():
  mesh = parallel.data_mesh(N)
  compressor = parallel.reduce_scatter("data")
  optimizer = optax.adam(1e-2)
  with pytest.raises(ValueError, match="takes params as fsdp.Layered"):
    parallel.init_train_state(_mlp_params(), optimizer, mesh, compressor=compressor,
                              mode="fsdp")
  with pytest.raises(ValueError, match="needs a compressor with reduce-scatter"):
    parallel.init_train_state(_layered(), optimizer, mesh, mode="fsdp")
  ragged = _layered()._replace(blocks={"a": jnp.zeros((2, 3)), "b": jnp.zeros((3, 3))})
  with pytest.raises(ValueError, match=r"leading axes are \[2, 3\]"):
    parallel.init_train_state(ragged, optimizer, mesh, compressor=compressor, mode="fsdp")
  state, specs = parallel.init_train_state(_layered(), optimizer, mesh, compressor=compressor,
                                           mode="fsdp")
  with pytest.raises(ValueError, match="takes the model as fsdp.LayeredModel"):
    parallel.make_train_step(_mlp_loss, optimizer, mesh, _layered(),
                             compressor=compressor, mode="fsdp")
  with pytest.raises(ValueError, match="block_size .* param_gather='int8'"):
    parallel.make_train_step(gpt.layered_model(SMALL), optimizer, mesh, _layered(),
                             compressor=compressor, mode="fsdp", block_size=256)
  # A compressor with all-reduce semantics returns whole gradients, not this device's shard.
  from loco_jax.transforms import baselines
  mean = baselines.uncompressed(axis_name="data")
  state, specs = parallel.init_train_state(_layered(), optimizer, mesh, compressor=mean,
                                           mode="fsdp")
  step = parallel.make_train_step(gpt.layered_model(SMALL), optimizer, mesh, _layered(),
                                  compressor=mean, mode="fsdp")
  with pytest.raises(ValueError, match="reduce-scatter semantics"):
    step(state, next(_batches(1)))


def _run_workers(tmp_path, name: str, count: int, steps: int = 6) -> dict[int, float]:
  """train_worker --mode fsdp as `count` processes of 8 / count devices; {step: loss}."""
  port = str(processes.free_port())
  losses = tmp_path / f"{name}.txt"
  processes.run_all([
      [sys.executable, str(Path(train_worker.__file__)), "--mode", "fsdp", "--hidden", "32",
       "--steps", str(steps), "--losses", str(losses), "--ckpt-dir", str(tmp_path / name),
       "--ckpt-every", str(steps), "--num-processes", str(count), "--process-id", str(i),
       "--port", port, "--devices-per-process", str(N // count)] for i in range(count)],
      300, name)
  return {int(k): float(v) for k, v in (line.split() for line in losses.read_text().splitlines())}


@pytest.mark.slow  # two multi-process runs: about a minute
def test_two_processes_train_like_one(tmp_path):
  one = _run_workers(tmp_path, "one", 1)
  two = _run_workers(tmp_path, "two", 2)
  assert sorted(one) == sorted(two) == list(range(1, 7))
  # The logged loss is a pmean: gloo may sum the 8 devices' losses in another order.
  np.testing.assert_allclose([two[k] for k in one], [one[k] for k in one], rtol=1e-6)
  mesh = parallel.data_mesh(N)
  like, _, config = train_worker.build("fsdp", 32, mesh)
  final_one, _ = checkpoint.restore(tmp_path / "one", like, config)
  final_two, _ = checkpoint.restore(tmp_path / "two", like, config)
  assert any(np.asarray(e).any() for e in jax.tree.leaves(
      [g.error for g in final_one.compressor_state.blocks.groups.values()]))
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, final_two),
               jax.tree.map(np.asarray, final_one))


@pytest.mark.slow
def test_nnx_example_layers_compute_the_modules_loss():
  sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
  import fsdp_nnx_example as example
  from flax import nnx
  model = example.ResidualMLP(16, 3, nnx.Rngs(0))
  functions, params = example.layered(model)
  assert fsdp.num_layers(params.blocks) == 3
  batch = example.batches(1, size=8)[0]
  expected = example.mse(model(batch[:, :example.IN]), batch)
  np.testing.assert_allclose(fsdp.layered_loss(functions)(params, batch), expected, rtol=1e-5)


@pytest.mark.slow
def test_a_non_finite_gradient_leaves_every_layers_compressor_state_unchanged():
  mesh = parallel.data_mesh(N)
  optimizer = optax.adam(1e-2)
  compressor = loco(axis_name="data", scatter=True)
  params = train_worker.layered_params(32)
  state, specs = parallel.init_train_state(params, optimizer, mesh, compressor=compressor,
                                           mode="fsdp")
  model = train_worker.layered_model()
  head = model.head
  # The head passes no gradient down: a NaN target makes the head's gradient NaN while every
  # block's and the embed's stay finite (zero, plus their LoCo errors).
  model = model._replace(head=lambda p, h, batch: head(p, jax.lax.stop_gradient(h), batch))
  step = parallel.make_train_step(model, optimizer, mesh, params, compressor=compressor,
                                  mode="fsdp")
  batch = train_worker.batch(0, mesh)
  state, _ = step(state, batch)
  before = jax.tree.map(np.asarray, state.compressor_state)
  poisoned = jnp.asarray(np.asarray(batch)).at[5, 18].set(jnp.nan)
  state, loss = step(state, poisoned)
  assert np.isnan(float(loss))
  assert np.isnan(np.asarray(state.params.head["w2"])).all()
  assert np.isfinite(np.asarray(state.params.blocks["w"])).all()
  jax.tree.map(np.testing.assert_array_equal, before,
               jax.tree.map(np.asarray, state.compressor_state))


def test_async_collectives_counts_pairs_with_work_between():
  # XLA:CPU runs collectives synchronously (no start/done pairs); GPU programs look like this.
  text = """HloModule m

ENTRY %main (p: bf16[8]) -> bf16[64] {
  %p = bf16[8]{0} parameter(0)
  %all-gather-start = (bf16[8]{0}, bf16[64]{0}) all-gather-start(%p), dimensions={0}
  %m = bf16[8]{0} multiply(%p, %p)
  %all-gather-done = bf16[64]{0} all-gather-done(%all-gather-start)
  %all-gather-start.1 = (bf16[8]{0}, bf16[64]{0}) all-gather-start(%m), dimensions={0}
  %all-gather-done.1 = bf16[64]{0} all-gather-done(%all-gather-start.1)
  ROOT %a = bf16[64]{0} add(%all-gather-done, %all-gather-done.1)
}
"""
  assert comm.async_collectives(text) == {"all-gather": 1}
  assert comm.async_collectives(text.replace("  %m = bf16[8]{0} multiply(%p, %p)\n", "")) == {
      "all-gather": 0}
