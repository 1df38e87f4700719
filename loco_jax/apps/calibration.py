"""A cluster's calibration: its collectives' seconds at a few sizes and each method's work.

`loco-jax probe` measures it on the cluster and writes it as JSON; `step_model` and
`loco-jax advise` read it back. A calibration file is untrusted input: `read` and `from_json`
check every field and raise a ValueError naming the first one that is wrong.
"""

import json
import math
import os
from typing import Any, NamedTuple

from loco_jax.train import files

FORMAT = "loco-jax-calibration/2"   # 2: marginal timings and `first_s`
OPS = ("all-reduce", "all-to-all", "all-gather", "reduce-scatter", "collective-permute")
# Only a reduction's speed depends on its element type (gloo sums float32 and int32 in its own
# loops); the others move bytes, whatever the bytes hold.
REDUCING = ("all-reduce", "reduce-scatter")
ANY_DTYPE = "*"


class CollectiveTiming(NamedTuple):
  """Seconds one more collective of an op over `group_size` devices adds to a program that
  already runs one, at increasing buffer sizes: what it costs inside a step's sequence.

  nbytes: the whole buffer, as `comm.Collective.nbytes` counts it (gathered or pre-scatter).
  dtype: the element type of a reduction ("f32"), or "*" for ops that only move bytes.
  """
  op: str
  dtype: str
  group_size: int
  nbytes: tuple[float, ...]
  seconds: tuple[float, ...]


class MethodWork(NamedTuple):
  """Median seconds of one method's exchange step outside its collectives, at a few sizes.

  The step's wall time minus its collectives replayed alone (as compiled) on the same links:
  compress, code, decompress, average and copies, on the cluster's own devices.
  """
  method: str
  n_params: tuple[int, ...]
  seconds: tuple[float, ...]


class Calibration(NamedTuple):
  """What `probe` measured on one cluster: its size, its collectives and its methods' work.

  first_s: what a program's first collective costs beyond the others (the processes meeting,
  the shaper's burst), once a step. chunk_bytes: the most bytes a collective piece sent a peer
  there (`comm.wire.chunk_bytes`; None: whole), which decides the pieces a step compiles to.
  """
  processes: int
  devices: int
  platform: str
  first_s: float
  collectives: tuple[CollectiveTiming, ...]
  work: tuple[MethodWork, ...]
  note: str = ""
  chunk_bytes: int | None = None


def key_dtype(op: str, dtype: str) -> str:
  """The dtype a collective's timing is filed under: its own for a reduction, else "*".

  Example:
    >>> key_dtype("all-gather", "u16"), key_dtype("all-reduce", "f32")
    ('*', 'f32')
  """
  return dtype if op in REDUCING else ANY_DTYPE


def to_json(calibration: Calibration) -> dict[str, Any]:
  """The calibration as a JSON-ready dict (`from_json` reads it back)."""
  return {"format": FORMAT, "processes": calibration.processes,
          "devices": calibration.devices, "platform": calibration.platform,
          "first_s": calibration.first_s, "chunk_bytes": calibration.chunk_bytes,
          "note": calibration.note,
          "collectives": [c._asdict() for c in calibration.collectives],
          "work": [w._asdict() for w in calibration.work]}


def _field(obj: dict, name: str, kind: type | tuple[type, ...], where: str) -> Any:
  if not isinstance(obj, dict) or name not in obj:
    raise ValueError(f"{where}: missing field {name!r}")
  value = obj[name]
  if not isinstance(value, kind) or isinstance(value, bool):
    kinds = kind if isinstance(kind, tuple) else (kind,)
    raise ValueError(f"{where}: {name!r} must be {' or '.join(k.__name__ for k in kinds)}, "
                     f"got {value!r:.80}")
  return value


def _series(obj: dict, x_name: str, where: str, integer: bool = False) -> tuple[tuple, tuple]:
  """(x, seconds) of a measured series: as long as each other, at least one point, x strictly
  increasing and positive, seconds finite and >= 0."""
  xs = _field(obj, x_name, list, where)
  seconds = _field(obj, "seconds", list, where)
  if not xs or len(xs) != len(seconds):
    raise ValueError(f"{where}: {x_name!r} and 'seconds' must be non-empty lists of one "
                     f"length, got {len(xs)} and {len(seconds)}")
  for name, values, kinds in ((x_name, xs, int if integer else (int, float)),
                              ("seconds", seconds, (int, float))):
    if not all(isinstance(v, kinds) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
               for v in values):
      what = "integers" if kinds is int else "numbers"
      raise ValueError(f"{where}: {name!r} must hold finite {what} >= 0, got {values!r:.120}")
  if any(b <= a for a, b in zip(xs, xs[1:])) or xs[0] <= 0:
    raise ValueError(f"{where}: {x_name!r} must be positive and strictly increasing, got "
                     f"{xs!r:.120}")
  return tuple(xs), tuple(float(s) for s in seconds)


def from_json(obj: Any, source: str = "calibration") -> Calibration:
  """A Calibration from parsed JSON, every field checked (a ValueError naming the bad one)."""
  if not isinstance(obj, dict):
    raise ValueError(f"{source}: must be a JSON object, got {type(obj).__name__}")
  if obj.get("format") != FORMAT:
    raise ValueError(f"{source}: 'format' must be {FORMAT!r}, got {obj.get('format')!r:.80}")
  processes = _field(obj, "processes", int, source)
  devices = _field(obj, "devices", int, source)
  if processes < 1 or devices < processes:
    raise ValueError(f"{source}: need processes >= 1 and devices >= processes, got "
                     f"{processes} and {devices}")
  collectives, seen = [], set()
  for i, c in enumerate(_field(obj, "collectives", list, source)):
    where = f"{source}: collectives[{i}]"
    op, dtype = _field(c, "op", str, where), _field(c, "dtype", str, where)
    if op not in OPS:
      raise ValueError(f"{where}: 'op' must be one of {OPS}, got {op!r:.40}")
    if not dtype or dtype != key_dtype(op, dtype) or (op in REDUCING and dtype == ANY_DTYPE):
      raise ValueError(f"{where}: 'dtype' of a {op} must be "
                       f"{'its element type' if op in REDUCING else repr(ANY_DTYPE)}, got "
                       f"{dtype!r:.40}")
    group = _field(c, "group_size", int, where)
    if not 2 <= group <= devices:
      raise ValueError(f"{where}: 'group_size' must be in 2..{devices}, got {group}")
    if (op, dtype, group) in seen:
      raise ValueError(f"{where}: a second timing of {op} {dtype} over {group} devices")
    seen.add((op, dtype, group))
    collectives.append(CollectiveTiming(op, dtype, group, *_series(c, "nbytes", where)))
  work, methods = [], set()
  for i, w in enumerate(_field(obj, "work", list, source)):
    where = f"{source}: work[{i}]"
    method = _field(w, "method", str, where)
    if not method or method in methods:
      raise ValueError(f"{where}: 'method' must be a new non-empty name, got {method!r:.40}")
    methods.add(method)
    work.append(MethodWork(method, *_series(w, "n_params", where, integer=True)))
  first_s = _field(obj, "first_s", (int, float), source)
  if not math.isfinite(first_s) or first_s < 0:
    raise ValueError(f"{source}: 'first_s' must be a finite number >= 0, got {first_s}")
  note = _field(obj, "note", str, source) if "note" in obj else ""
  if "chunk_bytes" not in obj:
    raise ValueError(f"{source}: missing field 'chunk_bytes'")
  chunk = obj["chunk_bytes"]
  if chunk is not None and (not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1):
    raise ValueError(f"{source}: 'chunk_bytes' must be a positive int or null, got {chunk!r:.40}")
  return Calibration(processes, devices, _field(obj, "platform", str, source), float(first_s),
                     tuple(collectives), tuple(work), note, chunk)


def read(path: str | os.PathLike) -> Calibration:
  """Reads and checks a calibration file (a ValueError saying what is wrong with it)."""
  try:
    text = open(path, encoding="utf-8").read()
  except OSError as e:
    raise ValueError(f"calibration {str(path)!r} cannot be read: {e.strerror or e}") from None
  try:
    obj = json.loads(text)
  except json.JSONDecodeError as e:
    raise ValueError(f"calibration {str(path)!r} is not JSON: {e}") from None
  return from_json(obj, f"calibration {str(path)!r}")


def write(path: str | os.PathLike, calibration: Calibration) -> None:
  """Writes the calibration whole or not at all (files.write_json_atomic)."""
  files.write_json_atomic(path, to_json(calibration), indent=1)
