"""The HLO reader's device groups: every replica-group form XLA 0.10.2 prints, read from real
compiled lines and from programs compiled here on meshes of 8 CPU devices, and a ValueError
(never a guess) for a form it does not know."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from loco_jax import comm
from loco_jax.comm import hlo

N = 8
# Groups by mesh axis, device (d, m) of a (data, model) mesh being number d * model + m.
DATA_OF_4x2, MODEL_OF_4x2 = ((0, 2, 4, 6), (1, 3, 5, 7)), ((0, 1), (2, 3), (4, 5), (6, 7))

# Lines of programs compiled on 8 CPU devices by jax 0.10.2 (shard_map collectives, and the
# ones XLA's partitioner inserts for reshards and reductions; metadata cut), with their groups
# worked out from the mesh: (line, groups).
REAL_LINES = {
    "explicit lists, shard_map psum over 'data' of (4, 2)": (
        "%psum.7 = f32[16]{0} all-reduce(%param.1), channel_id=1, replica_groups="
        "{{0,2,4,6},{1,3,5,7}}, use_global_device_ids=true, to_apply=%region_0.0",
        DATA_OF_4x2),
    "iota transposed: a (4, 2) matmul's gather over 'data'": (
        "%all-gather = f32[16,16]{1,0} all-gather(%param), channel_id=1, replica_groups="
        "[2,4]<=[4,2]T(1,0), dimensions={0}, use_global_device_ids=true",
        DATA_OF_4x2),
    "iota: P('model', 'data') -> P(None, 'data') on (4, 2), over 'model'": (
        "%all-gather = f32[16,8]{1,0} all-gather(%param), channel_id=1, replica_groups="
        "[4,2]<=[8], dimensions={0}, use_global_device_ids=true",
        MODEL_OF_4x2),
    # arange(8).reshape(2, 2, 2).transpose(2, 1, 0) flattened: 0 4 2 6 1 5 3 7.
    "iota of three dimensions, P('model', 'data') -> P(None, 'model') on (4, 2)": (
        "%all-gather.1 = f32[16,16]{1,0} all-gather(%wrapped_copy.1), channel_id=3, "
        "replica_groups=[4,2]<=[2,2,2]T(2,1,0), dimensions={0}, use_global_device_ids=true",
        ((0, 4), (2, 6), (1, 5), (3, 7))),
    "mesh axes: a (4, 2) sum over 'model'": (
        "ROOT %all-reduce = f32[16,8]{1,0} all-reduce(%ynn_fusion), channel_id=2, replica_groups="
        "mesh['axis_0'=4,'axis_1'=2] {'axis_1'}, use_global_device_ids=true, to_apply=%add.clone",
        MODEL_OF_4x2),
    # Issue 29: read as all 8 devices; the mesh is (4, 2) seen as (2, 4) (devices
    # [[0, 2, 4, 6], [1, 3, 5, 7]]), and 'axis_0' is 'model'.
    "mesh with device_ids, P('model', 'data') -> P() on (4, 2), over 'model'": (
        "%all-gather.1 = f32[16,32]{1,0} all-gather(%wrapped_copy.1), channel_id=2, "
        "replica_groups=mesh['axis_0'=2,'axis_1'=4], device_ids=([4,2]T(1,0)) {'axis_0'}, "
        "dimensions={0}, use_global_device_ids=true",
        MODEL_OF_4x2),
    # Devices [[0, 2, 1, 3], [4, 6, 5, 7]]; 'axis_1':(2)2 is the middle of 'axis_1' split
    # [1, 2, 2]: within each row, the pairs 2 apart. (Its collective-permute below then moves
    # each pair's halves to their targets: 1 -> 4, 3 -> 6, 4 -> 1, 6 -> 3.)
    "mesh with a sub-axis, P('data', 'model') -> P('model', 'data') on (4, 2)": (
        "%all-to-all.1 = (f32[4,1,8]{2,1,0}, f32[4,1,8]{2,1,0}) all-to-all("
        "%bitcast_slice_fusion.1, %bitcast_slice_fusion), channel_id=1, replica_groups="
        "mesh['axis_0'=2,'axis_1'=4], device_ids=([2,2,2]T(0,2,1)) {'axis_1':(2)2}",
        ((0, 2), (1, 3), (4, 6), (5, 7))),
    "mesh of three axes, P('data', 'model') -> P(None, 'data') on (4, 2), over 'data'": (
        "%all-to-all.1 = (f32[1,4,8]{2,1,0}, f32[1,4,8]{2,1,0}, f32[1,4,8]{2,1,0}, "
        "f32[1,4,8]{2,1,0}) all-to-all(%slice_bitcast_fusion, %bitcast_slice_fusion.2, "
        "%bitcast_slice_fusion.1, %bitcast_slice_fusion), channel_id=2, replica_groups="
        "mesh['axis_0'=4,'axis_1'=1,'axis_2'=2] {'axis_0'}",
        DATA_OF_4x2),
    # Devices [[0, 4], [1, 5], [2, 6], [3, 7]] as [1, 4, 2]: 'axis_1' is 'model' of (2, 4).
    "mesh of three axes with device_ids, P('model', 'data') -> P(None, 'model') on (2, 4)": (
        "%all-to-all.1 = (f32[4,1,8]{2,1,0}, f32[4,1,8]{2,1,0}, f32[4,1,8]{2,1,0}, "
        "f32[4,1,8]{2,1,0}) all-to-all(%bitcast_slice_fusion.3, %bitcast_slice_fusion.2, "
        "%bitcast_slice_fusion.1, %bitcast_slice_fusion), channel_id=2, replica_groups="
        "mesh['axis_0'=1,'axis_1'=4,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_1'}",
        ((0, 1, 2, 3), (4, 5, 6, 7))),
    "one mesh axis with device_ids, P(('model', 'data')) -> P() on (4, 2)": (
        "%all-gather = f32[64]{0} all-gather(%param), channel_id=1, replica_groups="
        "mesh['axis_0'=8], device_ids=([4,2]T(1,0)) {'axis_0'}, dimensions={0}, "
        "use_global_device_ids=true",
        ((0, 2, 4, 6, 1, 3, 5, 7),)),
    "source-target pairs: a ring over 'data' of (4, 2)": (
        "%ppermute.3 = f32[16]{0} collective-permute(%param.1), channel_id=1, "
        "source_target_pairs={{0,2},{2,4},{4,6},{6,0},{1,3},{3,5},{5,7},{7,1}}",
        DATA_OF_4x2),
    "source-target pairs, some to themselves: the reshard above": (
        "ROOT %collective-permute = f32[8,8]{1,0} collective-permute(%copy_bitcast_fusion), "
        "channel_id=2, source_target_pairs={{0,0},{2,2},{1,4},{3,6},{4,1},{6,3},{5,5},{7,7}}",
        ((0,), (1, 4), (2,), (3, 6), (5,), (7,))),
}


@pytest.mark.parametrize("name", list(REAL_LINES))
def test_every_form_xla_prints_gives_its_groups(name):
  line, groups = REAL_LINES[name]
  (found,) = comm.collectives(line, N)
  assert found.groups == groups
  assert found.group_size == max(map(len, groups))


def test_an_empty_list_is_every_device_in_one_group():
  """`replica_groups={}` (XLA's default; jax 0.10.2 printed explicit lists instead in every
  program tried here, so the line is a real one with its list emptied)."""
  line = REAL_LINES["explicit lists, shard_map psum over 'data' of (4, 2)"][0]
  (found,) = comm.collectives(line.replace("{{0,2,4,6},{1,3,5,7}}", "{}"), N)
  assert found.groups == (tuple(range(N)),) and found.group_size == N


def test_sent_bytes_follow_the_group():
  """Issue 29's gather over 'model' (2 devices) sends half its buffer, not 7/8 of it; a
  collective-permute sends its buffer once from each device that sends to another."""
  (over_model,) = comm.collectives(REAL_LINES[
      "mesh with device_ids, P('model', 'data') -> P() on (4, 2), over 'model'"][0], N)
  assert over_model.nbytes == 16 * 32 * 4 and over_model.sent_bytes == over_model.nbytes / 2
  (ring,) = comm.collectives(REAL_LINES["source-target pairs: a ring over 'data' of (4, 2)"][0], N)
  assert ring.pairs[0] == (0, 2) and ring.sent_bytes == ring.nbytes == 64
  stay = "%cp = f32[16]{0} collective-permute(%p), source_target_pairs={{0,0},{1,1}}"
  assert comm.collectives(stay, N)[0].sent_bytes == 0.0


@pytest.mark.parametrize("groups", [
    "mesh['axis_0'=4,'axis_1'=2] {'model'}",                   # an axis the mesh lacks
    "mesh['axis_0'=8], device_ids=(0,2,4,6,1,3,5,7) {'axis_0'}",  # ids this reader cannot read
    "mesh['axis_0'=8] {'axis_0':(3)2}",                          # a sub-axis that does not fit
    "[3,4]<=[8]",                                                # 12 places for 8 devices
    "maximal_mesh[device_id=3]",
    "{{0,1},{2,x}}",
])
def test_a_form_it_cannot_read_is_an_error_naming_the_line(groups):
  line = (f"%all-gather = f32[16]{{0}} all-gather(%p), channel_id=1, replica_groups={groups}, "
          "dimensions={0}")
  with pytest.raises(ValueError, match="all-gather.*replica_groups"):
    comm.collectives(line, N)


def test_a_collective_without_groups_is_an_error():
  with pytest.raises(ValueError, match="no replica_groups"):
    comm.collectives("%ar = f32[16]{0} all-reduce(%p), channel_id=1, to_apply=%add", N)
  with pytest.raises(ValueError, match="collective-permute"):
    comm.collectives("%cp = f32[16]{0} collective-permute(%p), channel_id=1", N)


# --- Programs compiled here: each collective's groups against the mesh it runs on ----------------

MESHES = [((8,), ("data",)), ((4, 2), ("data", "model")), ((2, 4), ("data", "model"))]


def _axis_groups(mesh, axes) -> list:
  """The device groups of a collective over `axes`: devices that differ only there."""
  ids = np.arange(mesh.size).reshape(mesh.devices.shape)
  over = [i for i, name in enumerate(mesh.axis_names) if name in axes]
  rest = [i for i in range(ids.ndim) if i not in over]
  size = math.prod(ids.shape[i] for i in over)
  return sorted(tuple(sorted(g)) for g in ids.transpose(rest + over).reshape(-1, size).tolist())


def _sorted_groups(c: hlo.Collective) -> list:
  return sorted(tuple(sorted(g)) for g in c.groups)


def _axis_sets(names) -> list:
  return [(n,) for n in names] + ([tuple(names)] if len(names) > 1 else [])


def _each_collective(x, axis_sets):
  """psum, all_gather, psum_scatter, all_to_all and a ring ppermute over each set of axes, on
  a slice of a size unique to the set (the slice's size tells the collectives apart)."""
  total = []
  for k, axes in enumerate(axis_sets):
    n = math.prod(jax.lax.axis_size(a) for a in axes)
    v = x[: k + 1]
    ring = [(i, (i + 1) % n) for i in range(n)]
    total += [jax.lax.psum(v, axes), jax.lax.all_gather(v, axes, tiled=True),
              jax.lax.psum_scatter(jnp.tile(v, n), axes, tiled=True),
              jax.lax.all_to_all(jnp.tile(v, n), axes, 0, 0, tiled=True),
              jax.lax.ppermute(v, axes, ring)]
  return sum(t.sum() for t in total)[None]


@pytest.mark.parametrize("kind", [AxisType.Auto, AxisType.Explicit])
@pytest.mark.parametrize("shape, names", MESHES)
def test_shard_map_collectives_get_the_groups_of_their_axes(shape, names, kind):
  mesh = jax.make_mesh(shape, names, (kind,) * len(names))
  axis_sets = _axis_sets(names)
  spec = P(tuple(names))  # 4 values a device
  x = jax.device_put(jnp.ones(N * 4), NamedSharding(mesh, spec))
  step = jax.jit(jax.shard_map(functools.partial(_each_collective, axis_sets=axis_sets),
                               mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))
  found = comm.compiled_collectives(step, x, num_devices=N)
  assert len(found) == 5 * len(axis_sets)
  for c in found:
    per_device = c.nbytes / 4 / (1 if c.op in ("all-reduce", "collective-permute") else
                                 c.group_size)
    k = round(per_device) - 1
    assert _sorted_groups(c) == _axis_groups(mesh, axis_sets[k]), (c.op, axis_sets[k])


@pytest.mark.parametrize("kind", [AxisType.Auto, AxisType.Explicit])
@pytest.mark.parametrize("shape", [(4, 2), (2, 4)])
def test_partitioner_collectives_get_the_groups_of_their_axes(shape, kind):
  """What XLA's partitioner inserts (the mesh forms, with device_ids where the sharding's
  device order is transposed): a gather to replicated runs over 'model', then 'data' (or the
  other way); a sum over one dimension over the axis sharding it; a swap of the two axes
  (sub-axes) moves every device's data in groups that cover the mesh."""
  mesh = jax.make_mesh(shape, ("data", "model"), (kind,) * 2)
  to = ((lambda spec: lambda a: jax.sharding.reshard(a, spec)) if kind == AxisType.Explicit else
        (lambda spec: lambda a: jax.lax.with_sharding_constraint(a, NamedSharding(mesh, spec))))
  with jax.set_mesh(mesh):
    model_data = jax.device_put(jnp.ones((16, 32)), NamedSharding(mesh, P("model", "data")))
    data_model = jax.device_put(jnp.ones((16, 32)), NamedSharding(mesh, P("data", "model")))
    gathers = comm.compiled_collectives(to(P()), model_data, num_devices=N)
    sums = comm.compiled_collectives(lambda a: jnp.sum(a, axis=1), data_model, num_devices=N)
    swap = comm.compiled_collectives(to(P("model", "data")), data_model, num_devices=N)
  assert sorted(_sorted_groups(c) for c in gathers) == sorted(
      _axis_groups(mesh, (a,)) for a in ("data", "model"))
  assert [c.op for c in sums] == ["all-reduce"]
  assert _sorted_groups(sums[0]) == _axis_groups(mesh, ("model",))
  assert swap
  for c in swap:  # every device in exactly one group
    assert sorted(d for g in c.groups for d in g) == list(range(N)), c
