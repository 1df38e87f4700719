"""The `loco-jax` command (python -m loco_jax): `demo` trains every method; `bench` and
`netbench` measure; `probe` calibrates a cluster and `advise` picks a method for it."""

import sys

COMMANDS = {"demo": "loco_jax.apps.demo", "bench": "loco_jax.apps.bench",
            "netbench": "loco_jax.apps.netbench", "probe": "loco_jax.apps.probe",
            "advise": "loco_jax.apps.advise"}


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  if not argv or argv[0] not in COMMANDS:
    given = repr(argv[0]) if argv else "nothing"
    print(f"usage: loco-jax {{{','.join(COMMANDS)}}} [options]  (got {given}; "
          f"`loco-jax demo --help` lists the demo's options)", file=sys.stderr)
    return 2
  import importlib  # a command's module sets up jax (device count) before importing it
  return importlib.import_module(COMMANDS[argv[0]]).main(argv[1:])
