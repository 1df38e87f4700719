"""Where one host's step time goes: a jax.profiler trace of a few steps, whose thunks (the
compiled program's top-level instructions as XLA:CPU runs them) are summed by kind: the
collectives (the wire, and the wait for the peers), the host callbacks (CO3's coder) and the
compute (every other instruction: fusions, copies). Control flow (conditionals, loops) is left
out, its instructions are counted where they run. Sums of thunk wall times: on a busy machine
they include time the thread waited for a core.
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


def thunk_seconds(events: list[dict], kinds: dict[str, str], steps: int) -> dict[str, float]:
  """Seconds a step of each kind: the complete ("X") trace events named after an instruction
  of `kinds`, summed and divided by `steps`."""
  total = collections.Counter({k: 0.0 for k in KINDS})
  for e in events:
    if e.get("ph") == "X" and e.get("name") in kinds:
      total[kinds[e["name"]]] += e.get("dur", 0) * 1e-6
  return {k: total[k] / steps for k in KINDS}


def profile(run_step: Callable[[], Any], hlo_text: str, steps: int, folder: str) -> dict:
  """Runs `run_step()` (one step, waited for) `steps` times under jax.profiler.trace into
  `folder`; {"wall_s": the median step, and seconds a step of each of KINDS}."""
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
  return {"wall_s": statistics.median(walls),
          **thunk_seconds(events, instruction_kinds(hlo_text), steps)}
