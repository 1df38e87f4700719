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


class Collective(NamedTuple):
  """One collective of a lowered step: `nbytes` is the full buffer (gathered or pre-scatter).

  `conditional` marks one inside a branch of a conditional (a rare path such as CO3's
  overflow), which a step does not always run. `groups`: its replica groups, each the devices'
  ids (positions in the mesh's flattened device order) in rank order; () for all the devices.
  """
  op: str
  dtype: str
  nbytes: float
  group_size: int
  conditional: bool = False
  groups: tuple[tuple[int, ...], ...] = ()

  @property
  def sent_bytes(self) -> float:
    """Bytes each device sends: ring all-reduce 2(n-1)/n b; the others (n-1)/n b."""
    n = self.group_size
    factor = 2 * (n - 1) / n if self.op == "all-reduce" else (n - 1) / n
    return factor * self.nbytes


_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_BRANCHES = re.compile(r"(?:branch_computations=\{([^}]*)\}|"
                       r"(?:true|false)_computation=%?([\w.\-]+))")


def _shape_bytes(text: str) -> tuple[str, float]:
  dtypes, total = [], 0.0
  for dtype, dims in _SHAPE.findall(text):
    count = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
    total += count * _DTYPE_BYTES.get(dtype, 4)
    dtypes.append(dtype)
  return ",".join(sorted(set(dtypes))), total


def _replica_groups(attrs: str) -> tuple[tuple[int, ...], ...]:
  """`replica_groups={{0,1},{2,3}}` or its iota form `[2,2]<=[4]`, `[2,2]<=[2,2]T(1,0)`."""
  listed = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", attrs)
  if listed:
    return tuple(tuple(int(d) for d in g.split(",") if d)
                 for g in re.findall(r"\{([\d,]*)\}", listed.group(1)) if g)
  iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs)
  if not iota:
    return ()
  dims = [int(d) for d in iota.group(3).split(",")]
  perm = [int(d) for d in iota.group(4).split(",")] if iota.group(4) else range(len(dims))
  ids = np.arange(math.prod(dims)).reshape(dims).transpose(list(perm))
  return tuple(map(tuple, ids.reshape(int(iota.group(1)), int(iota.group(2))).tolist()))


def collectives(hlo_text: str, num_devices: int) -> list[Collective]:
  """Every collective in HLO text (`jax.jit(f).lower(...).as_text(dialect="hlo")`)."""
  lines = hlo_text.splitlines()
  branches = set()
  for line in lines:
    for listed, single in _BRANCHES.findall(line):
      branches.update(name.strip().lstrip("%") for name in (listed or single).split(","))
  found, computation = [], ""
  for line in lines:
    header = _COMPUTATION.match(line)
    if header:
      computation = header.group(1)
      continue
    m = _INSTRUCTION.search(line)
    if not m:
      continue
    op, result = m.group("op"), m.group("result")
    if m.group("start") and result.startswith("("):
      result = result[1:].split("]")[0] + "]"  # async start: (operand, result, ...); same size
    dtype, nbytes = _shape_bytes(result)
    groups = _replica_groups(m.group("attrs"))
    n = len(groups[0]) if groups else num_devices
    # The full buffer: what a gather returns, what a scatter takes (n times what it returns).
    found.append(Collective(op, dtype, nbytes * n if op == "reduce-scatter" else nbytes, n,
                            computation in branches, groups))
  return found


def lowered_collectives(fn, *args, num_devices: int | None = None) -> list[Collective]:
  """Lowers `fn` (jitted or not) on `args` and lists its collectives."""
  jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
  text = jitted.lower(*args).as_text(dialect="hlo")
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


_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
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
        overlapped.setdefault(kind, 0)
        overlapped[kind] += i - at > 1
  return overlapped


def wire_bits_per_param(found: Sequence[Collective], n_params: int,
                        include_conditional: bool = False) -> float:
  """Bits each device sends per parameter per step, summed over every collective that every
  step runs (and over the conditional ones too with `include_conditional`)."""
  return 8.0 * sum(c.sent_bytes for c in found
                   if include_conditional or not c.conditional) / n_params
