"""The leaf core (`core.leaves`): which leaves are compressed, flat vectors out and back, local
block shapes and specs, keep-or-skip."""

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from jax.sharding import PartitionSpec as P

from loco_jax.core import leaves, local_blocks

DTYPES = (jnp.float32, jnp.float16, jnp.bfloat16, jnp.int32, jnp.bool_)


@st.composite
def _trees(draw):
  shapes = draw(st.lists(st.lists(st.integers(0, 4), max_size=3), min_size=1, max_size=5))
  dtypes = draw(st.lists(st.sampled_from(DTYPES), min_size=len(shapes), max_size=len(shapes)))
  return {f"leaf{i}": jnp.arange(int(np.prod(s)), dtype=jnp.float32).reshape(s).astype(d)
          for i, (s, d) in enumerate(zip(shapes, dtypes))}


@pytest.mark.slow
@pytest.mark.numerics
@settings(max_examples=25, deadline=None)
@given(_trees())
def test_split_chooses_float_leaves_with_elements_and_outputs_restore_them(tree):
  grads = leaves.split(tree)
  expected = [i for i, x in enumerate(jax.tree.leaves(tree))
              if jnp.issubdtype(x.dtype, jnp.floating) and x.size > 0]
  assert grads.sent == expected
  assert grads.groups == ([leaves.Group("", expected, ())] if expected else [])  # one group
  assert grads.agree_axes == ()
  values = [grads.flat(i) if i in grads.sent else None for i in range(len(grads.leaves))]
  assert all(v.dtype == jnp.float32 and v.ndim == 1 for v in values if v is not None)
  out = grads.outputs(values, jnp.float32(0))
  for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(tree)):
    assert a.shape == b.shape and a.dtype == b.dtype
    np.testing.assert_array_equal(np.asarray(a, np.float64), np.asarray(b, np.float64))


@settings(max_examples=25, deadline=None)
@given(st.lists(st.sampled_from([None, "data", "model", ("data", "model")]), min_size=1,
                max_size=3), st.sets(st.sampled_from(["data", "model"])))
def test_kept_axes(entries, kept):
  spec = P(*entries)
  only = local_blocks.keep_axes(spec, set(kept))
  assert sorted(local_blocks.spec_axes(only)) == sorted(
      a for a in local_blocks.spec_axes(spec) if a in kept)


def test_a_flag_of_nan_skips_the_state_and_poisons_every_output():
  tree = {"w": jnp.ones((2, 3)), "n": jnp.arange(3)}
  grads = leaves.split(tree)
  new, old = [jnp.zeros(6)], [jnp.ones(6)]
  flags = leaves.flag(jnp.bool_(False)) + leaves.flag(jnp.bool_(True))
  np.testing.assert_array_equal(leaves.keep_if(jnp.isfinite(flags), new, old)[0], old[0])
  out = grads.outputs([None, grads.flat(1)], flags)
  assert np.all(np.isnan(out["w"])) and np.array_equal(out["n"], tree["n"])


def test_vary_like_types_a_replicated_value_as_this_devices_own():
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))

  def body(x):
    y = leaves.vary_like(jnp.zeros((1,)), x)
    return jax.lax.cond(x[0] > 0, lambda: y, lambda: x[:1])  # the branches' types must agree

  out = jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data"))(
      jnp.arange(8.0))
  assert out.shape == (8,)


def test_specs_without_a_mesh_are_refused():
  with pytest.raises(ValueError, match="needs a mesh"):
    local_blocks.find_blocks({"w": jnp.ones(4)}, None, {"w": P("model")}, "loco")
