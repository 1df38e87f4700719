"""optax's own test files with a compressor chained in front of its optimizers (issue 29).

  python experiments/optax_suite.py                       # every compressor, the default files
  python experiments/optax_suite.py --compressors loco4,co3 --files _src/float64_test.py

For each compressor, pytest runs the installed optax's test files in a subprocess in which
`optax.sgd`, `optax.adam` and `optax.adamw` (and their `optax._src.alias` originals) return
`optax.chain(compressor, optimizer)` (`optax_suite_plugin.py`, loaded with `-p`). Every test
that builds one of them then runs through the compressor: inits, updates under jit, tree
utilities, sharding, float64, conditionality, accumulation. Prints one JSON record per
compressor (passed, failed, the failed test ids) and a summary table; --json writes them.

A failure is either a compressor's expected loss of precision (a test that asserts an
optimizer reaches a tolerance that lossy gradients do not: read the assertion) or a defect.
"""

import argparse
import json
import os
from pathlib import Path
import re
import subprocess
import sys

import optax

from optax_suite_plugin import COMPRESSORS

HERE = Path(__file__).resolve().parent
OPTAX = Path(optax.__file__).resolve().parent
FILES = ("_src/alias_test.py", "_src/float64_test.py", "_src/sharding_test.py",
         "transforms/_conditionality_test.py", "transforms/_accumulation_test.py",
         "contrib/_common_test.py")


def run(compressor: str, files: list[str], timeout: float) -> dict:
  """pytest over `files` with `compressor` chained in; the counts and the failed ids."""
  env = dict(os.environ, LOCO_JAX_OPTAX_COMPRESSOR=compressor,
             PYTHONPATH=os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])))
  cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
         "optax_suite_plugin", "-rfE", *[str(OPTAX / f) for f in files]]
  done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout,
                        cwd=HERE.parent)
  out = done.stdout + done.stderr
  counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|error|skipped)", out)}
  # pytest's summary lines: "FAILED id", "ERROR id", and for a subtest "SUBFAILED[msg] id".
  failed = sorted(set(re.findall(r"^(?:SUB)?(?:FAILED|ERROR)(?:\[[^\]]*\])? (\S+)", out, re.M)))
  return {"compressor": compressor, "exit": done.returncode, "passed": counts.get("passed", 0),
          "failed": counts.get("failed", 0) + counts.get("error", 0),
          "failed_ids": [f.split("site-packages/")[-1] for f in failed]}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--compressors", default=",".join(COMPRESSORS))
  parser.add_argument("--files", default=",".join(FILES),
                      help="test files, relative to the installed optax package")
  parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per compressor")
  parser.add_argument("--json", type=Path, help="write the records here (JSON lines)")
  args = parser.parse_args(argv)
  names = args.compressors.split(",")
  unknown = sorted(set(names) - set(COMPRESSORS))
  if unknown:
    parser.error(f"unknown compressors {unknown}; known: {', '.join(COMPRESSORS)}")
  if args.json and not args.json.parent.is_dir():
    parser.error(f"--json: no folder {args.json.parent}")
  records = []
  for name in names:
    record = run(name, args.files.split(","), args.timeout)
    records.append(record)
    print(json.dumps(record), flush=True)
  print(f"\n{'compressor':16}{'passed':>8}{'failed':>8}")
  for r in records:
    print(f"{r['compressor']:16}{r['passed']:>8}{r['failed']:>8}")
  if args.json:
    tmp = args.json.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    tmp.replace(args.json)
  return 0


if __name__ == "__main__":
  sys.exit(main())
