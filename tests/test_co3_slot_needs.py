"""experiments/co3_slot_needs.py: what netbench's co3 streams need, against the slots netbench
fits to them (`netbench_methods.CO3_FITTED_SLOT_BITS`)."""

import contextlib
import importlib.util
import io
import json
from pathlib import Path

import pytest

from loco_jax.apps import netbench_methods

SCRIPT = Path(__file__).resolve().parents[1] / "experiments" / "co3_slot_needs.py"


def _run(*argv: str) -> dict:
  spec = importlib.util.spec_from_file_location("co3_slot_needs", SCRIPT)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    module.main(list(argv))
  return json.loads(out.getvalue())


@pytest.mark.slow
@pytest.mark.parametrize("devices, kinds", [(4, {"all_to_all": "capacity_bits",
                                                  "gather": "gather_capacity_bits"}),
                                             (2, {"all_gather": "capacity_bits"})])
def test_netbench_fitted_slots_hold_its_streams(devices, kinds):
  record = _run("--devices", str(devices), "--params", str(1 << 17), "--steps", "2")
  assert record["overflows"] == 0
  slots = netbench_methods.CO3_FITTED_SLOT_BITS
  for kind, slot in kinds.items():
    low, high = record[f"{kind}_worst_need"]
    # What the streams need, up to the fitted slot's margin: a slot far above would be no fit.
    assert 0.85 * slots[slot] < low <= high < slots[slot], (kind, record)
