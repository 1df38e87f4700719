"""Per-device state merged for another device count: decoded, merged and encoded again.

A checkpoint restored onto a mesh whose data axes have other sizes (`train/reshard.py`) holds
the per-device fields (`specs.py`) of the old devices. One merge a state type turns the n old
devices' states into the m new devices':

- An error owed to the averaged update (loco's, two_hop's intra-node hop's, co3's,
  error_feedback's, ef21's g_i) is decoded to float per leaf and averaged. The next averaged
  update carries (1/n) sum_i e_i; every new device starts from e'_j = (1/n) sum_i e_i, which
  keeps (1/m) sum_j e'_j = (1/n) sum_i e_i: the correction still owed. An int8 error keeps it
  up to its re-quantization (half a step of the new block's scale).
- An error of a shard (loco's gather="quantized" error, two_hop's node hop) covers the shard a
  device averages: the devices' shards make one error of the whole leaf (two_hop's node hop:
  averaged over the nodes first), cut again into the new devices' shards.
- Statistics (co3's scales and coded bits) are averaged; replicated fields (step counters,
  ef21's estimate) are carried over as they are.

Onto a mesh whose model axes have another shape, a type's `Reblock` splits the merge in two:
`merged` gives, for the devices that hold one model block, each param's merged values of that
block (`ByLeaf`); train/model_blocks.py joins each param's blocks and cuts them again; `states`
encodes the new blocks for the new devices. The same mean is kept, param element by element:
(1/m) sum_j e'_j = (1/n) sum_i e_i for each element of each whole param, up to the int8
re-encoding in the new buckets. Statistics are averaged over the old blocks as well.
"""

import math
from typing import Any, Callable, NamedTuple

import jax
import numpy as np

from loco_jax.core import layout
from loco_jax.core.leaves import ByGroup
from loco_jax.core.trees import TreeSignature
from loco_jax.transforms.bucket_errors import (Storage, as_stored, check_buckets,
                                               encoded, group_plan, mean_error,
                                               shard_error, storage_of)
from loco_jax.transforms.baselines import EF21State, ErrorFeedbackState
from loco_jax.transforms.bucket_step import group_shapes
from loco_jax.transforms.co3 import Co3State
from loco_jax.transforms.loco_state import GroupState, LocoState
from loco_jax.transforms.two_hop import TwoHopState


class Devices(NamedTuple):
  """The devices a per-device state is merged over: the data axes in the order its specs split
  them (device d is row-major over them), and their sizes in the checkpoint and now."""
  axes: tuple[str, ...]
  old: tuple[int, ...]
  new: tuple[int, ...]

  def linear(self, where: dict[str, int], new: bool = False) -> int:
    """The device at `where` (a position along each axis)."""
    sizes = self.new if new else self.old
    return int(np.ravel_multi_index([where[a] for a in self.axes], sizes))


Merge = Callable[[list, Any, Devices], list]
Layout = Callable[[Any, Devices], Any]


class ByLeaf(NamedTuple):
  """A state merged over the devices of the data axes that hold one model block, by param leaf:
  what a change of the model axes joins into whole params and cuts again (train/reshard.py)."""
  leaves: dict       # field -> per param leaf: float32 values of this block, flat (None: not held)
  rest: Any          # the state's other per-device fields merged (counters, statistics)


class Reblock(NamedTuple):
  """How a state type goes to a mesh of another shape over the model axes, block by block."""
  merged: Callable[[list, Any, Devices], ByLeaf]   # n old devices' states, one old device's
                                                   # state (shapes) -> by leaf
  states: Callable[[ByLeaf, Any, Devices], list]   # by leaf of one new block, one new device's
                                                   # state (shapes) -> the m new devices'
  old_like: Callable[[Any, list, list], Any]       # one new device's state, each param's block
                                                   # shape and model axes before -> an old one's


class Registered(NamedTuple):
  """How a state type's per-device fields go to another device count."""
  merge: Merge       # (n old devices' states, one new device's state (shapes), devices) -> m
  how: str           # what the merge does and preserves, for the restore's record
  layout: Layout     # (one new device's state, devices) -> one old device's (shapes)
  reblock: Reblock | None = None   # for another shape over the model axes; None: not re-laid


def mean(arrays: list) -> np.ndarray:
  """The elementwise mean, computed in float64, in the arrays' dtype; the common value itself
  where they are all equal (bit for bit, as a replicated value or a DiLoCo sync leaves them).

  Example:
    >>> mean([np.float32([1, 2]), np.float32([3, 2])]).tolist()
    [2.0, 2.0]
  """
  first = np.asarray(arrays[0])
  if all(np.array_equal(first, a) for a in arrays[1:]):
    return first
  out = np.mean(np.stack([np.asarray(a, np.float64) for a in arrays]), axis=0)
  return (np.round(out) if np.issubdtype(first.dtype, np.integer) else out).astype(first.dtype)


def _tree_mean(trees: list) -> Any:
  return jax.tree.map(lambda *xs: mean(list(xs)), *trees)


# --- LoCo's buckets ------------------------------------------------------------------------------

def _loco_layout(like: LocoState, devices: Devices) -> LocoState:
  """One device's LoCo state over the old devices: its buckets depend on their count."""
  storage, n = storage_of(like.signature, "loco"), math.prod(devices.old)
  quantized = any(g.gather_error is not None for g in like.groups.values())
  return like._replace(groups=ByGroup({key: group_shapes(
      group_plan(like.signature, indices, n, storage), storage.error_scale is None, quantized)
      for key, indices in storage.groups}))


def _loco_merged(states: list, like: LocoState, devices: Devices) -> ByLeaf:
  """The old devices' errors decoded per leaf and averaged; a quantized gather's shard errors
  joined into one error of each whole leaf."""
  storage = storage_of(like.signature, "loco")
  if tuple(storage.axes) != devices.axes:
    raise ValueError(f"loco: its state is split over {devices.axes}, but it averages over "
                     f"{storage.axes}; restore it where its axis_name is the data axes")
  n, count = math.prod(devices.old), len(like.signature.shapes)
  error, gather = [None] * count, [None] * count
  for key, indices in storage.groups:
    plan, old = group_plan(like.signature, indices, n, storage), [s.groups[key] for s in states]
    check_buckets("loco", old[0].error, plan, n, key)
    merged = mean_error([(g.error, g.error_scale) for g in old], plan, n, storage)
    error = [x if i in indices else e for i, (x, e) in enumerate(zip(merged, error))]
    if old[0].gather_error is not None:
      whole = shard_error([(g.gather_error, g.gather_scale) for g in old], plan, storage)
      gather = [x if i in indices else g for i, (x, g) in enumerate(zip(whole, gather))]
  quantized = any(g.gather_error is not None for g in states[0].groups.values())
  return ByLeaf({"error": error, **({"gather": gather} if quantized else {})}, states[0].count)


def _loco_states(merged: ByLeaf, like: LocoState, devices: Devices) -> list:
  """Every new device's error: the merged one encoded in the new buckets (the same on each);
  the whole leaves' gather errors cut again, device j's shard its row j."""
  storage, m = storage_of(like.signature, "loco"), math.prod(devices.new)
  groups = {}
  for key, indices in storage.groups:
    plan = group_plan(like.signature, indices, m, storage)
    pick = lambda values: [x if i in indices else None for i, x in enumerate(values)]
    error, scale = as_stored(*encoded(pick(merged.leaves["error"]), plan, storage))
    groups[key] = [GroupState(error, scale, None, None)] * m
    if "gather" in merged.leaves:
      codes, scales = encoded(pick(merged.leaves["gather"]), plan, storage)
      groups[key] = [g._replace(**dict(zip(("gather_error", "gather_scale"),
                                           as_stored(codes, scales, j))))
                     for j, g in enumerate(groups[key])]
  return [LocoState(merged.rest, ByGroup({k: v[j] for k, v in groups.items()}), like.signature)
          for j in range(m)]


def _merge_loco(states: list, like: LocoState, devices: Devices) -> list:
  return _loco_states(_loco_merged(states, like, devices), like, devices)


def _old_like(like: Any, shapes: list, axes: list) -> Any:
  """One device's LoCo or two_hop state (shapes) on a mesh where the params' blocks had `shapes` and were
  split over the model `axes`: the groups and buckets of that mesh."""
  signature, groups = like.signature, {}
  for i, (shape, floats) in enumerate(zip(shapes, signature.floats)):
    if floats and math.prod(shape):
      groups.setdefault(",".join(sorted(axes[i])), []).append(i)
  layout = tuple((k, tuple((key, tuple(v)) for key, v in groups.items()) if k == "groups"
                  else v) for k, v in signature.layout)
  return like._replace(signature=TreeSignature(signature.treedef, tuple(map(tuple, shapes)),
                                               signature.floats, layout))


# --- two_hop: an intra-node hop over the local axis, a node hop over node shards --------------

def _hops(like: TwoHopState, devices: Devices) -> tuple[Storage, str, str, list, list]:
  """(storage, node axis, local axis, [(nodes, local devices) before, now], per group key
  [its hop-1 plans before and now, its hop-2 plans before and now])."""
  storage = storage_of(like.signature, "two_hop")
  node, local = storage.axes
  if set(devices.axes) != {node, local}:
    raise ValueError(f"two_hop: its state is split over {devices.axes}, but its hops run over "
                     f"{storage.axes}; restore it where those are the data axes")
  grids = [dict(zip(devices.axes, s)) for s in (devices.old, devices.new)]
  sizes = [(g[node], g[local]) for g in grids]
  shard = lambda rows: lambda size: layout.shard_len(size, rows)
  plans = {key: ([group_plan(like.signature, indices, locs, storage) for _, locs in sizes],
                 [group_plan(like.signature, indices, nodes, storage, shard(locs))
                  for nodes, locs in sizes]) for key, indices in storage.groups}
  return storage, node, local, sizes, plans


def _two_hop_layout(like: TwoHopState, devices: Devices) -> TwoHopState:
  """One device's two_hop state over the old devices: both hops' buckets depend on them."""
  storage, _, _, _, plans = _hops(like, devices)
  fields = TwoHopState._fields[1:7]
  per_field = {f: {} for f in fields}
  for key, (hop1, hop2) in plans.items():
    shapes = (group_shapes(hop1[0], storage.error_scale is None, False)[:2]
              + tuple(group_shapes(hop2[0], storage.error_scale is None,
                                   like.gather_error is not None)))
    for f, value in zip(fields, shapes):
      per_field[f][key] = value
  return like._replace(**{f: None if getattr(like, f) is None else ByGroup(per_field[f])
                          for f in fields})


def _two_hop_merged(states: list, like: TwoHopState, devices: Devices) -> ByLeaf:
  """The old devices' intra-node errors decoded per leaf and averaged; the node hop's errors
  averaged over the nodes and joined over the local axis into one error of each whole leaf (and
  a quantized gather's rows joined likewise)."""
  storage, node, local, sizes, plans = _hops(like, devices)
  nodes, locs = sizes[0]
  count = len(like.signature.shapes)
  at = lambda i, l: devices.linear({node: i, local: l})
  scales = lambda s, f, key: None if getattr(s, f) is None else getattr(s, f)[key]
  out = {f: [None] * count for f in ("error", "node", "gather")}

  def whole(per_local: list[list]) -> list:
    return [None if per_local[0][i] is None else np.concatenate(
        [shards[i] for shards in per_local])[:math.prod(like.signature.shapes[i])]
        for i in range(count)]

  def keep(field: str, values: list) -> None:
    out[field] = [x if x is not None else o for x, o in zip(values, out[field])]

  for key, (hop1, hop2) in plans.items():
    if states[0].error is not None:  # intra="loco": every device's error of its whole leaves
      keep("error", mean_error([(s.error[key], scales(s, "error_scale", key)) for s in states],
                               hop1[0], locs, storage))
    check_buckets("two_hop", states[0].node_error[key], hop2[0], nodes, key)
    keep("node", whole([mean_error([(states[at(i, l)].node_error[key],
                                     scales(states[at(i, l)], "node_error_scale", key))
                                    for i in range(nodes)], hop2[0], nodes, storage)
                        for l in range(locs)]))
    if states[0].gather_error is not None:  # gather="quantized": device (i, l) has row i
      keep("gather", whole([shard_error([(states[at(i, l)].gather_error[key],
                                          scales(states[at(i, l)], "gather_error_scale", key))
                                         for i in range(nodes)], hop2[0], storage)
                            for l in range(locs)]))
  kept = {f: v for f, v in out.items() if any(x is not None for x in v)}
  return ByLeaf(kept, states[0].count)


def _two_hop_states(merged: ByLeaf, like: TwoHopState, devices: Devices) -> list:
  """Every new device's state: the intra-node error encoded in the new buckets (the same on
  each); the node hop's whole leaves cut into the new local axis's shards, local position l's
  on every node (a quantized gather's: node i's row of it)."""
  storage, node, local, sizes, plans = _hops(like, devices)
  new_nodes, new_locs = sizes[1]
  m = math.prod(devices.new)
  fields = {f: [dict() for _ in range(m)] for f in TwoHopState._fields[1:7]}
  for key, (hop1, hop2) in plans.items():
    indices = dict(storage.groups)[key]
    pick = lambda values: [x if i in indices else None for i, x in enumerate(values)]
    new_len = [leaf.size if leaf else 0 for leaf in hop2[1].leaves]
    cut = lambda values: [
        [None if x is None else np.pad(x, (0, max(new_locs * new_len[i] - x.size, 0)))
         [l * new_len[i]:(l + 1) * new_len[i]] for i, x in enumerate(pick(values))]
        for l in range(new_locs)]
    new = {f: [None] * m for f in fields}
    if "error" in merged.leaves:
      new["error"], new["error_scale"] = zip(
          *[as_stored(*encoded(pick(merged.leaves["error"]), hop1[1], storage))] * m)
    for field, source in (("node_error", "node"), ("gather_error", "gather")):
      if source not in merged.leaves:
        continue
      for l, shards in enumerate(cut(merged.leaves[source])):
        codes, scales = encoded(shards, hop2[1], storage)
        for i in range(new_nodes):
          j = devices.linear({node: i, local: l}, new=True)
          new[field][j], new[field + "_scale"][j] = as_stored(
              codes, scales, i if field == "gather_error" else None)
    for f, per_device in new.items():
      for j, value in enumerate(per_device):
        fields[f][j][key] = value
  field = lambda f, j: (None if getattr(like, f) is None else ByGroup(fields[f][j]))
  return [TwoHopState(merged.rest, *[field(f, j) for f in TwoHopState._fields[1:7]],
                      like.signature) for j in range(m)]


def _merge_two_hop(states: list, like: TwoHopState, devices: Devices) -> list:
  return _two_hop_states(_two_hop_merged(states, like, devices), like, devices)


# --- Per-leaf float states ------------------------------------------------------------------------

def _merge_co3(states: list, like: Co3State, devices: Devices) -> list:
  first = states[0]
  merged = first._replace(error=_tree_mean([s.error for s in states]),
                          scale=_tree_mean([s.scale for s in states]),
                          coded_bits=mean([s.coded_bits for s in states]))
  return [merged] * math.prod(devices.new)


def _merge_error_feedback(states: list, like: ErrorFeedbackState, devices: Devices) -> list:
  return [ErrorFeedbackState(_tree_mean([s.error for s in states]))] * math.prod(devices.new)


def _merge_ef21(states: list, like: EF21State, devices: Devices) -> list:
  merged = EF21State(_tree_mean([s.local for s in states]), states[0].estimate)
  return [merged] * math.prod(devices.new)


def _by_leaf(fields: tuple[str, ...]) -> Reblock:
  """A state whose `fields` hold each leaf's float values (flat, its block's elements): merged
  as its type's merge does, those fields by leaf and the rest as they are."""
  def merged(states: list, like: Any, devices: Devices) -> ByLeaf:
    one = _MERGES[type(like)].merge(states, like, devices)[0]
    return ByLeaf({f: jax.tree.leaves(getattr(one, f)) for f in fields},
                  one._replace(**{f: None for f in fields}))

  def states(merged: ByLeaf, like: Any, devices: Devices) -> list:
    trees = {f: jax.tree.structure(getattr(like, f)).unflatten(merged.leaves[f]) for f in fields}
    return [merged.rest._replace(**trees)] * math.prod(devices.new)
  return Reblock(merged, states, lambda like, shapes, axes: like)


_ERROR_MEAN = ("the devices' errors decoded and averaged, every new device starting from the "
               "mean: the correction owed to the averaged update is kept")
_SAME = lambda like, devices: like  # per-leaf state: laid out alike on any device count
_MERGES: dict[type, Registered] = {
    LocoState: Registered(_merge_loco, _ERROR_MEAN + " (int8: re-encoded in the new buckets); "
                          "a quantized gather's shard errors joined and cut again",
                          _loco_layout, Reblock(_loco_merged, _loco_states, _old_like)),
    TwoHopState: Registered(_merge_two_hop, _ERROR_MEAN + " (the node hop's per node shard); "
                            "the node shards joined and cut again for the new local axis",
                            _two_hop_layout, Reblock(_two_hop_merged, _two_hop_states,
                                                     _old_like)),
    Co3State: Registered(_merge_co3, _ERROR_MEAN + "; scales and coded bits averaged", _SAME,
                         _by_leaf(("error",))),
    ErrorFeedbackState: Registered(_merge_error_feedback, _ERROR_MEAN, _SAME,
                                   _by_leaf(("error",))),
    EF21State: Registered(_merge_ef21, "g_i averaged (the estimate g, their mean, carried "
                          "over): mean_j g'_j = g still", _SAME, _by_leaf(("local", "estimate"))),
}


def register_merge(state_type: type, merge: Merge, how: str, layout: Layout | None = None,
                   reblock: Reblock | None = None) -> None:
  """Declares how the per-device fields of a state class of your own (`register_per_device`)
  are merged for another device count: `merge(states, like, devices)` takes the n old devices'
  states (numpy) and one new device's state (ShapeDtypeStructs) and returns the m new ones';
  `how` says what it preserves, for the restore's record; `layout(like, devices)` gives one
  old device's state (shapes) where it differs from a new one's (default: the same);
  `reblock`: how it goes to a mesh of another shape over the model axes (default: refused).

  Example:
    >>> from typing import Any, NamedTuple
    >>> class MyState(NamedTuple):
    ...   error: Any
    >>> register_merge(MyState, lambda states, like, devices: [
    ...     MyState(mean([s.error for s in states]))] * math.prod(devices.new), "the mean")
  """
  if not callable(merge) or not isinstance(how, str):
    raise ValueError(f"register_merge: merge must be callable and how a str, got "
                     f"{type(merge).__name__} and {type(how).__name__}")
  _MERGES[state_type] = Registered(merge, how, layout or _SAME, reblock)


def merge_of(state: Any) -> Registered | None:
  """The merge of `state`'s type (`Registered`); None for a type no one registered."""
  return _MERGES.get(type(state))
