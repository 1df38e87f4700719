"""Where one host's step time goes: a jax.profiler trace of a few steps, whose thunks (the
compiled program's top-level instructions as XLA:CPU runs them) are summed by kind: the
collectives (the wire, and the wait for the peers), the host callbacks (CO3's coder) and the
compute (every other instruction: fusions, copies). Control flow (conditionals, loops) is left
out, its instructions are counted where they run. Sums of thunk wall times: on a busy machine
they include time the thread waited for a core. `top_instructions` names the costliest
instructions with the library lines that made them (from the HLO's stack frames).
"""

import collections
import glob
import gzip
import json
import os
import re
import statistics
import time
from typing import Any, Callable

KINDS = ("collectives", "host_callbacks", "compute")
_COLLECTIVES = ("all-to-all", "all-gather", "all-reduce", "reduce-scatter", "collective-permute")
_NOT_THUNKS = ("conditional", "while", "call", "parameter", "constant", "tuple",
               "get-tuple-element", "bitcast")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = .*?\s([a-z][\w\-]*)\((.*)$")
_FRAME = re.compile(r"stack_frame_id=(\d+)")
_TABLE_ROW = re.compile(r"^(\d+) (.*)$")
TOP = 12


def instruction_kinds(hlo_text: str) -> dict[str, str]:
  """{instruction name: its kind in KINDS} for the compiled program's instructions that run as
  thunks (those named in a trace)."""
  kinds = {}
  for line in hlo_text.splitlines():
    m = _INSTRUCTION.match(line)
    if not m:
      continue
    name, op, rest = m.groups()
    base = op.removesuffix("-start").removesuffix("-done")
    if base in _COLLECTIVES:
      kinds[name] = "collectives"
    elif op == "custom-call" and "callback" in rest:
      kinds[name] = "host_callbacks"
    elif op not in _NOT_THUNKS:
      kinds[name] = "compute"
  return kinds


def _seconds_by_instruction(events: list[dict], kinds: dict[str, str]) -> collections.Counter:
  """Seconds of the complete ("X") trace events named after an instruction of `kinds`."""
  total = collections.Counter()
  for e in events:
    if e.get("ph") == "X" and e.get("name") in kinds:
      total[e["name"]] += e.get("dur", 0) * 1e-6
  return total


def thunk_seconds(events: list[dict], kinds: dict[str, str], steps: int) -> dict[str, float]:
  """Seconds a step of each kind: the trace's thunks, summed by their instruction's kind and
  divided by `steps`."""
  total = collections.Counter({k: 0.0 for k in KINDS})
  for name, seconds in _seconds_by_instruction(events, kinds).items():
    total[kinds[name]] += seconds
  return {k: total[k] / steps for k in KINDS}


def _tables(hlo_text: str) -> dict[str, dict[int, str]]:
  """The HLO module's FileNames, FunctionNames, FileLocations and StackFrames: {id: row}."""
  tables, current = {}, None
  for line in hlo_text.splitlines():
    if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
      current = tables.setdefault(line, {})
    elif current is not None and (m := _TABLE_ROW.match(line)):
      current[int(m.group(1))] = m.group(2)
    else:
      current = None
  return tables


def _field(row: str, name: str) -> int:
  return int(re.search(rf"{name}=(\d+)", row).group(1))


def instruction_sources(hlo_text: str) -> dict[str, str]:
  """{instruction name: "path:line < path:line ..."}: the three innermost frames of the
  library (not of its apps) in the instruction's stack, else the innermost frame, where the
  HLO names one."""
  tables = _tables(hlo_text)
  files, locations = tables.get("FileNames", {}), tables.get("FileLocations", {})
  frames = tables.get("StackFrames", {})

  def place(frame: int) -> tuple[bool, str]:
    """(whether the frame is the library's, "path:line" with the library's paths short)."""
    location = locations[_field(frames[frame], "file_location_id")]
    path = files[_field(location, "file_name_id")].strip('"')
    _, inside, short = path.rpartition("/loco_jax/")
    return (bool(inside) and not short.startswith("apps/"),
            f"{short if inside else path}:{_field(location, 'line')}")

  def source(frame: int) -> str:
    stack = []
    while frame in frames:   # a frame's parent_frame_id is its parent's id + 1; 0: none
      stack.append(place(frame))
      frame = _field(frames[frame], "parent_frame_id") - 1
    library = [text for ours, text in dict.fromkeys(stack) if ours]
    return " < ".join(library[:3]) or stack[0][1]

  sources = {}
  for line in hlo_text.splitlines():
    m, frame = _INSTRUCTION.match(line), _FRAME.search(line)
    if m and frame and int(frame.group(1)) in frames:
      sources[m.group(1)] = source(int(frame.group(1)))
  return sources


def top_instructions(events: list[dict], kinds: dict[str, str], sources: dict[str, str],
                     steps: int, count: int = TOP) -> list[dict]:
  """The `count` instructions of `kinds` that took longest: {"name", "kind", "source",
  "seconds"} a step, longest first."""
  total = _seconds_by_instruction(events, kinds)
  return [{"name": name, "kind": kinds[name], "source": sources.get(name, "?"),
           "seconds": seconds / steps} for name, seconds in total.most_common(count)]


def profile(run_step: Callable[[], Any], hlo_text: str, steps: int, folder: str) -> dict:
  """Runs `run_step()` (one step, waited for) `steps` times under jax.profiler.trace into
  `folder`; {"wall_s": the median step, seconds a step of each of KINDS, and "top": the
  costliest instructions (`top_instructions`)}."""
  import jax
  walls = []
  with jax.profiler.trace(folder, create_perfetto_trace=True):
    for _ in range(steps):
      t0 = time.perf_counter()
      run_step()
      walls.append(time.perf_counter() - t0)
  (trace,) = glob.glob(os.path.join(folder, "**", "perfetto_trace.json.gz"), recursive=True)
  with gzip.open(trace, "rt") as f:
    events = json.load(f)
  events = events["traceEvents"] if isinstance(events, dict) else events
  kinds = instruction_kinds(hlo_text)
  return {"wall_s": statistics.median(walls), **thunk_seconds(events, kinds, steps),
          "top": top_instructions(events, kinds, instruction_sources(hlo_text), steps)}
