"""Two-hop LoCo on a (node=2, local=4) CPU mesh: the mean, and wire bytes per hop from the HLO."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from loco_jax import comm
from loco_jax.train import parallel
from loco_jax.transforms.two_hop import two_hop

NODES, LOCAL = 2, 4
AXES = ("node", "local")
PARAMS = {"w": jnp.zeros((128, 96)), "b": jnp.zeros(96), "odd": jnp.zeros((5, 3))}
N_PARAMS = sum(x.size for x in jax.tree.leaves(PARAMS))


def _grads(seed):
  keys = jax.random.split(jax.random.key(seed), len(PARAMS))
  return {k: jax.random.normal(key, (NODES, LOCAL, *x.shape))
          for key, (k, x) in zip(keys, sorted(PARAMS.items()))}


@pytest.fixture
def step_of(shard_mapped_update):
  """(the jitted update of a two_hop on the (node, local) mesh, its state)."""
  return lambda opt: shard_mapped_update(opt, parallel.node_mesh(NODES, LOCAL), PARAMS, AXES)


@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.parametrize("intra,gather", [("reduce_scatter", "bf16"), ("loco", "bf16"),
                                          ("reduce_scatter", "quantized")])
def test_two_hops_track_the_mean(intra, gather, step_of):
  step, state = step_of(two_hop(intra=intra, gather=gather))
  total_in, total_out = 0, 0
  for seed in range(6):
    grads = _grads(seed)
    out, state = step(grads, state)
    total_in += np.asarray(grads["w"]).mean((0, 1))
    total_out += np.asarray(out["w"])
    assert out["odd"].shape == (5, 3)
  assert np.abs(total_out - total_in).mean() < 0.2 * np.abs(total_in).mean()
  assert int(state.count) == 6


@pytest.mark.slow
def test_wire_bytes_per_hop(step_of):
  report = {}
  for intra in ("reduce_scatter", "loco"):
    step, state = step_of(two_hop(intra=intra))
    hops = {}
    for c in comm.lowered_collectives(step, _grads(0), state):
      key = (c.op, "intra" if c.group_size == LOCAL else "inter")
      hops[key] = hops.get(key, 0) + comm.wire_bits_per_param([c], N_PARAMS)
    report[intra] = hops
  inter = report["reduce_scatter"]
  # Across nodes only packed 4-bit codes travel (each device's node shard: 1/LOCAL of the leaf).
  assert inter[("all-to-all", "inter")] < 4.2 / LOCAL
  assert inter[("reduce-scatter", "intra")] > 20  # float32, by design, inside the node
  assert report["loco"][("all-to-all", "intra")] < 4.2
  assert ("reduce-scatter", "intra") not in report["loco"]


@pytest.mark.slow
def test_a_quantized_gather_carries_bits_across_nodes_not_16(step_of):
  across = {}
  for gather in ("bf16", "quantized"):
    step, state = step_of(two_hop(gather=gather))
    found = [c for c in comm.lowered_collectives(step, _grads(0), state)
             if c.op == "all-gather" and c.group_size == NODES]
    assert len(found) == 1
    across[gather] = comm.wire_bits_per_param(found, N_PARAMS)
  # 4-bit codes and a float32 scale a block where bfloat16 carried 16 bits.
  assert 4.0 / 16 <= across["quantized"] / across["bf16"] < 4.2 / 16, across
  assert int(state.count) == 0 and state.gather_error is not None


def test_bad_arguments():
  with pytest.raises(ValueError, match="intra"):
    two_hop(intra="ring")
  with pytest.raises(ValueError, match="differ"):
    two_hop("x", "x")
  with pytest.raises(ValueError, match="gather must be one of"):
    two_hop(gather="fp32")


@pytest.mark.slow
@pytest.mark.parametrize("intra,gather", [("reduce_scatter", "bf16"), ("loco", "bf16"),
                                          ("loco", "quantized")])
def test_non_finite_gradient_on_one_device_outputs_nan_and_keeps_state(intra, gather, step_of):
  # block_size 1024: "w" is whole blocks on every local device, so hop 1 takes the fused step.
  step, state = step_of(two_hop(intra=intra, gather=gather, block_size=1024))
  _, state = step(_grads(0), state)
  bad = _grads(1)
  bad["w"] = bad["w"].at[1, 2, 5, 7].set(jnp.inf)
  out, after = step(bad, state)
  assert all(np.all(np.isnan(np.asarray(x))) for x in jax.tree.leaves(out))
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)),
               after, state)


@pytest.mark.slow
def test_a_gradient_tree_that_does_not_match_the_state_names_the_leaf(step_of):
  step, state = step_of(two_hop(intra="loco"))
  grads = _grads(0)
  grads["odd"] = jnp.zeros((NODES, LOCAL, 4, 3))
  with pytest.raises(ValueError, match=r"two_hop: gradient leaf \['odd'\] has shape \(4, 3\), "
                                       r"but the params the state was initialised with have \(5, 3\)"):
    step(grads, state)
