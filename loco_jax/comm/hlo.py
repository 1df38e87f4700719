"""Collectives and their bytes read from a compiled (or lowered) program's HLO text."""

import math
import re
from typing import NamedTuple, Sequence

import jax
import numpy as np

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
                "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "s4": 0.5, "u4": 0.5}
_COLLECTIVES = ("all-to-all", "all-gather", "all-reduce", "reduce-scatter", "collective-permute")
_INSTRUCTION = re.compile(
    r"=\s*(?P<result>\(.*?\)|\w+\[[\d,]*\](?:\{[^}]*\})?)\s+"
    r"(?P<op>" + "|".join(_COLLECTIVES) + r")(?P<start>-start)?\((?P<attrs>.*)$")
_SHAPE = re.compile(r"(\w+)\[([\d,]*)\]")

Groups = tuple[tuple[int, ...], ...]


class Collective(NamedTuple):
  """One collective of a lowered step: `nbytes` is the full buffer (gathered or pre-scatter).

  `groups`: its device groups (positions in the mesh's flattened device array), `group_size`
  the largest's size; a collective-permute's `pairs` (source, target) and the sets they connect.
  `conditional`: inside a conditional's branch, not run every step. `op_name`: its metadata's.
  """
  op: str
  dtype: str
  nbytes: float
  group_size: int
  conditional: bool = False
  groups: Groups = ()
  pairs: tuple[tuple[int, int], ...] = ()
  op_name: str = ""

  @property
  def sent_bytes(self) -> float:
    """Bytes each device sends: ring all-reduce 2(n-1)/n b; the others (n-1)/n b (n: the
    group size); a collective-permute b, from each device whose target is another (0 if every
    pair keeps its data on one device)."""
    if self.op == "collective-permute":
      return float(self.nbytes) if any(s != t for s, t in self.pairs) else 0.0
    n = self.group_size
    factor = 2 * (n - 1) / n if self.op == "all-reduce" else (n - 1) / n
    return factor * self.nbytes


_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")  # a computation's first line
_BRANCHES = re.compile(r"(?:branch_computations=\{([^}]*)\}|"
                       r"(?:true|false)_computation=%?([\w.\-]+))")


def _shape_bytes(text: str) -> tuple[str, float]:
  dtypes, total = [], 0.0
  for dtype, dims in _SHAPE.findall(text):
    count = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
    total += count * _DTYPE_BYTES.get(dtype, 4)
    dtypes.append(dtype)
  return ",".join(sorted(set(dtypes))), total


# The replica-group forms XLA prints (xla/hlo/ir/replica_group.cc): explicit lists, `{}` (every
# device in one group), iota lists `[groups,size]<=[dims]T(perm)`, and mesh axes
# `mesh['a'=2,'b'=4], device_ids=([4,2]T(1,0)) {'a','b':(2)2}`.
_INTS = r"\d+(?:,\d+)*"
_LISTS = re.compile(r"replica_groups=\{((?:\{(?:" + _INTS + r")?\},?)*)\}")
_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=\[(" + _INTS + r")\]"
                   r"(?:T\((" + _INTS + r")\))?")
_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\]"
                   r"(?:, device_ids=\(\[(" + _INTS + r")\](?:T\((" + _INTS + r")\))?\))?"
                   r" \{([^}]*)\}")
_NAME = r"'([^']*)'|([\w.\-]+)"
_MESH_AXIS = re.compile(r"(?:" + _NAME + r")=(\d+)$")
_AXIS_REF = re.compile(r"(?:" + _NAME + r")(?::\((\d+)\)(\d+))?$")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")
_OP_NAME = re.compile(r'metadata=\{[^}]*op_name="([^"]*)"')


def _ints(text: str | None) -> list[int]:
  return [int(x) for x in text.split(",")] if text else []


def _rows(devices: np.ndarray, size: int) -> Groups:
  return tuple(map(tuple, devices.reshape(-1, size).tolist()))


def _iota(dims: list[int], perm: list[int]) -> np.ndarray:
  """XLA's iota tile assignment [dims]T(perm): arange reshaped to dims, then transposed."""
  return np.arange(math.prod(dims)).reshape(dims).transpose(perm or range(len(dims)))


def _mesh_groups(axes_text: str, ids: str | None, perm: str | None, refs_text: str) -> Groups:
  """Groups of a `mesh[...] {axes}` list: the device array reshaped so that every listed
  (sub-)axis is a dimension, those dimensions moved last (in the order listed), and cut into
  rows (MeshAxesReplicaGroupList::flattened_replica_groups)."""
  names, sizes = [], []
  for entry in axes_text.split(","):
    m = _MESH_AXIS.match(entry.strip())
    if not m:
      raise ValueError(f"mesh axis {entry!r}")
    names.append(m.group(1) if m.group(1) is not None else m.group(2))
    sizes.append(int(m.group(3)))
  devices = (_iota(_ints(ids), _ints(perm)) if ids else np.arange(math.prod(sizes)))
  refs = []  # (mesh axis, pre-size, size) of each listed axis, in the order listed
  for entry in filter(None, (e.strip() for e in refs_text.split(","))):
    m = _AXIS_REF.match(entry)
    name = m and (m.group(1) if m.group(1) is not None else m.group(2))
    if name not in names:
      raise ValueError(f"axis {entry!r}")
    axis = names.index(name)
    refs.append((axis, int(m.group(3)), int(m.group(4))) if m.group(3) else (axis, 1, sizes[axis]))
  dims, grouped = [], {}
  for axis, full in enumerate(sizes):
    covered = 1  # the product of this axis's dimensions so far, major to minor
    for ref in sorted((r for r in refs if r[0] == axis), key=lambda r: r[1]):
      _, pre, size = ref
      if pre % covered or full % (pre * size):
        raise ValueError(f"sub-axis {ref} of an axis of {full}")
      if pre != covered:
        dims.append(pre // covered)
      grouped[ref] = len(dims)
      dims.append(size)
      covered = pre * size
    if covered != full:
      dims.append(full // covered)
  last = [grouped[r] for r in refs]
  order = [d for d in range(len(dims)) if d not in last] + last
  group_size = math.prod(dims[d] for d in last)
  return _rows(devices.reshape(dims).transpose(order), group_size)


def _components(pairs: list[tuple[int, int]]) -> Groups:
  """The sets of devices that a collective-permute's pairs connect, each sorted."""
  parent: dict[int, int] = {}

  def root(x: int) -> int:
    while parent.setdefault(x, x) != x:
      x = parent[x]
    return x

  for s, t in pairs:
    parent[root(s)] = root(t)
  members: dict[int, list[int]] = {}
  for x in sorted(parent):
    members.setdefault(root(x), []).append(x)
  return tuple(sorted(tuple(m) for m in members.values()))


def replica_groups(line: str, num_devices: int) -> tuple[Groups, tuple[tuple[int, int], ...]]:
  """(groups, source-target pairs) of one collective's HLO line, in every form XLA prints;
  `{}` is every one of `num_devices` devices in one group. A ValueError naming the line for a
  form it does not know (never a guess).

  Example:
    >>> replica_groups("replica_groups=[2,4]<=[4,2]T(1,0), dimensions={0}", 8)[0]
    ((0, 2, 4, 6), (1, 3, 5, 7))
  """
  try:
    if m := _MESH.search(line):
      return _mesh_groups(*m.groups()), ()
    if m := _IOTA.search(line):
      count, size, dims, perm = int(m.group(1)), int(m.group(2)), _ints(m.group(3)), m.group(4)
      if count * size != math.prod(dims):
        raise ValueError(f"{count} groups of {size} from {math.prod(dims)} devices")
      return _rows(_iota(dims, _ints(perm)), size), ()
    if m := _LISTS.search(line):
      groups = tuple(tuple(_ints(g)) for g in re.findall(r"\{([\d,]*)\}", m.group(1)))
      return groups or (tuple(range(num_devices)),), ()
    if m := _PAIRS.search(line):
      pairs = tuple((int(s), int(t)) for s, t in re.findall(r"\{(\d+),(\d+)\}", m.group(1)))
      return _components(list(pairs)), pairs
    problem = "no replica_groups or source_target_pairs in a form this reader knows"
  except ValueError as e:  # a malformed mesh, axis or reshape
    problem = f"malformed replica groups ({e})"
  raise ValueError(f"loco_jax.comm: {problem}: {line.strip()[:400]}")


def collectives(hlo_text: str, num_devices: int) -> list[Collective]:
  """Every collective in HLO text (`jax.jit(f).lower(...).as_text(dialect="hlo",
  debug_info=True)`; without debug_info there is no `op_name`), with its device groups
  (`replica_groups`: a ValueError for a line whose groups it cannot read)."""
  lines = hlo_text.splitlines()
  branches = set()
  for line in lines:
    for listed, single in _BRANCHES.findall(line):
      branches.update(name.strip().lstrip("%") for name in (listed or single).split(","))
  found, computation = [], ""
  for line in lines:
    header = _HEADER.match(line)
    if header:
      computation = header.group(2)
      continue
    m = _INSTRUCTION.search(line)
    if not m:
      continue
    op, result = m.group("op"), m.group("result")
    if m.group("start") and result.startswith("("):
      result = result[1:].split("]")[0] + "]"  # async start: (operand, result, ...); same size
    dtype, nbytes = _shape_bytes(result)
    groups, pairs = replica_groups(line, num_devices)
    n = max(len(g) for g in groups)
    # The full buffer: what a gather returns, what a scatter takes (n times what it returns).
    op_name = _OP_NAME.search(line)
    found.append(Collective(op, dtype, nbytes * n if op == "reduce-scatter" else nbytes, n,
                            computation in branches, groups, pairs,
                            op_name.group(1) if op_name else ""))
  return found


def lowered_collectives(fn, *args, num_devices: int | None = None) -> list[Collective]:
  """Lowers `fn` (jitted or not) on `args` and lists its collectives."""
  jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
  text = jitted.lower(*args).as_text(dialect="hlo", debug_info=True)  # with op_name
  return collectives(text, num_devices or jax.device_count())


def compiled_collectives(fn, *args, num_devices: int | None = None) -> list[Collective]:
  """Compiles `fn` on `args` for this backend and lists the collectives one call runs
  (`collectives_per_step`: one in a scan's body once per iteration).

  What crosses the wire: the backend's compiler may rewrite collectives after lowering (XLA:CPU
  widens 16-bit float ones to float32), so where the lowered and compiled HLO differ, this one
  is right.
  """
  jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
  text = jitted.lower(*args).compile().as_text()
  return collectives_per_step(text, num_devices or jax.device_count())


_CALLEE = re.compile(r"(calls|to_apply|body|condition|true_computation|false_computation)="
                     r"%?([\w.\-]+)|branch_computations=\{([^}]*)\}")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"')


def _computations(hlo_text: str) -> tuple[dict[str, list[str]], str]:
  """{name: its lines} of every computation, and the entry's name."""
  found, name, entry = {}, None, None
  for line in hlo_text.splitlines():
    header = _HEADER.match(line)
    if header:
      name = header.group(2)
      found[name] = [line]
      entry = name if header.group(1) else entry
    elif name is not None:
      found[name].append(line)
  if entry is None:
    raise ValueError("no ENTRY computation in the HLO text: pass compiled.as_text()")
  return found, entry


def collectives_per_step(hlo_text: str, num_devices: int) -> list[Collective]:
  """Every collective a step runs, from compiled HLO text: one in a while loop's body (a scan
  over layers) is listed once per iteration (XLA's known_trip_count; nested loops multiply),
  one in a conditional's branch is marked `conditional`. Feed it to `wire_bits_per_param`.

  A ValueError if a loop whose trip count XLA does not know holds a collective.
  """
  comps, entry = _computations(hlo_text)

  def visit(name: str, conditional: bool) -> list[Collective]:
    lines = comps[name]
    found = [c._replace(conditional=c.conditional or conditional) for c in collectives(
        "\n".join(lines), num_devices)]
    for line in lines[1:]:
      trips = _TRIPS.search(line)
      for kind, callee, branches in _CALLEE.findall(line):
        for child in ([callee] if callee else [b.strip().lstrip("%") for b in branches.split(",")]):
          inner = visit(child, conditional or bool(branches) or kind.endswith("computation"))
          if kind == "body" and inner:
            if not trips:
              raise ValueError(f"the while loop with body {child} holds collectives but XLA "
                               f"does not know its trip count: cannot count them per step")
            inner = inner * int(trips.group(1))
          found += inner
    return found

  return visit(entry, False)


def async_collectives(hlo_text: str) -> dict[str, int]:
  """Per collective kind, how many async start/done pairs of the compiled program have other
  instructions scheduled between them (work that can overlap the transfer)."""
  overlapped: dict[str, int] = {}
  for lines in _computations(hlo_text)[0].values():
    open_starts: dict[str, tuple[str, int]] = {}
    for i, line in enumerate(lines):
      start = re.search(r"%([\w.\-]+) = .*?\s([\w\-]+)-start\(", line)
      if start:
        open_starts[start.group(1)] = (start.group(2), i)
        continue
      done = re.search(r"[\w\-]+-done\(.*?%([\w.\-]+)\)", line)
      if done and done.group(1) in open_starts:
        kind, at = open_starts.pop(done.group(1))
        overlapped[kind] = overlapped.get(kind, 0) + (i - at > 1)
  return overlapped


def wire_bits_per_param(found: Sequence[Collective], n_params: int,
                        include_conditional: bool = False) -> float:
  """Bits each device sends per parameter per step, summed over every collective that every
  step runs (and over the conditional ones too with `include_conditional`)."""
  return 8.0 * sum(c.sent_bytes for c in found
                   if include_conditional or not c.conditional) / n_params
