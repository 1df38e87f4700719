"""The exchange step model and its calibration file: predictions on synthetic calibrations, and
every way a calibration file can be wrong."""

import json
import math

import pytest

from loco_jax import comm
from loco_jax.apps import calibration as calib
from loco_jax.apps import step_model

GATHER = calib.CollectiveTiming("all-gather", "*", 4, (1e3, 1e6, 4e6), (0.001, 0.020, 0.080))
SUM = calib.CollectiveTiming("all-reduce", "f32", 4, (4e3, 4e6), (0.002, 0.100))
LOCO = calib.MethodWork("loco", (2**20, 2**22), (0.010, 0.034))
CAL = calib.Calibration(4, 4, "cpu", 0.005, (GATHER, SUM),
                        (LOCO, calib.MethodWork("fp32", (2**20,), (0.001,))))


def test_collectives_interpolate_between_sizes_and_keep_the_last_rate_beyond():
  assert step_model.collective_seconds(GATHER, 1e6) == pytest.approx(0.020)
  assert step_model.collective_seconds(GATHER, 2.5e6) == pytest.approx(0.050)
  # Beyond 4 MB: 20 ms a MB, the last segment's rate; below 1 KB: the latency.
  assert step_model.collective_seconds(GATHER, 1e7) == pytest.approx(0.200)
  assert step_model.collective_seconds(GATHER, 1) == pytest.approx(0.001)


def test_work_runs_through_the_probed_sizes_never_below_zero():
  assert step_model.work_seconds(LOCO, 2**22) == pytest.approx(0.034)
  assert step_model.work_seconds(LOCO, 2**21) == pytest.approx(0.018)
  # Beyond the probed sizes, the nearest segment's slope.
  assert step_model.work_seconds(LOCO, 2**24) == pytest.approx(0.010 + 0.024 / 3 * 15)
  assert step_model.work_seconds(LOCO, 2**18) == pytest.approx(0.010 - 0.024 / 3 * 0.75)
  # A segment that falls (noise) stops at zero; one size is proportional.
  falling = calib.MethodWork("x", (2**20, 2**22), (0.004, 0.002))
  assert step_model.work_seconds(falling, 2**24) == 0.0
  one = calib.MethodWork("x", (2**20,), (0.004,))
  assert step_model.work_seconds(one, 2**22) == pytest.approx(0.016)
  # Bent: measured at 16M, the work there is what was measured, not the line's.
  bent = calib.MethodWork("x", (2**20, 2**22, 2**24), (0.003, 0.010, 0.086))
  assert step_model.work_seconds(bent, 2**24) == pytest.approx(0.086)


def test_a_step_is_its_collectives_plus_the_methods_work():
  found = [comm.Collective("all-gather", "u16", 2e6, 4),
           comm.Collective("all-gather", "u8", 2e6, 4),
           comm.Collective("all-reduce", "f32", 4e6, 4),
           comm.Collective("all-gather", "u8", 4e6, 4, conditional=True),   # not every step
           comm.Collective("all-reduce", "s32", 4, 1)]                      # one device: free
  p = step_model.predict(CAL, "loco", found, 2**21)
  # Each collective at its calibrated cost in a sequence, and the first's extra once.
  assert p.collectives_s == pytest.approx(2 * 0.0400 + 0.100 + 0.005)
  assert p.work_s == pytest.approx(0.018)
  assert p.step_s == pytest.approx(p.collectives_s + p.work_s) and p.hidden_s == 0
  # Overlapped collectives hide behind the work, up to all of it.
  hidden = step_model.predict(CAL, "loco", found, 2**21, [True, False, False, False, False])
  assert hidden.hidden_s == pytest.approx(0.018)
  assert hidden.step_s == pytest.approx(p.step_s - 0.018)


def test_a_step_without_collectives_is_its_work_alone():
  p = step_model.predict(CAL, "fp32", [comm.Collective("all-reduce", "f32", 4, 1)], 2**20)
  assert p == step_model.StepPrediction(0.001, 0.0, 0.001, 0.0)


def test_what_the_calibration_lacks_is_named_not_guessed():
  with pytest.raises(ValueError, match=r"no timing of all-reduce \(s32\) over 4 devices.*"
                                       r"all-gather:\*:4, all-reduce:f32:4"):
    step_model.predict(CAL, "loco", [comm.Collective("all-reduce", "s32", 8, 4)], 10)
  with pytest.raises(ValueError, match=r"over 8 devices"):
    step_model.predict(CAL, "loco", [comm.Collective("all-gather", "u8", 8, 8)], 10)
  with pytest.raises(ValueError, match="no work of method 'bf16'; it holds loco, fp32"):
    step_model.predict(CAL, "bf16", [], 10)


def test_a_calibration_file_round_trips(tmp_path):
  path = tmp_path / "cal.json"
  calib.write(path, CAL)
  assert calib.read(path) == CAL
  assert [p.name for p in tmp_path.iterdir()] == ["cal.json"]


_DELETE = object()


def _good() -> dict:
  return calib.to_json(CAL)


def _set(obj, path, value):
  *parents, last = path
  for key in parents:
    obj = obj[key]
  if value is _DELETE:
    del obj[last]
  else:
    obj[last] = value


@pytest.mark.parametrize("path,value,message", [
    (("format",), "loco-jax-calibration/1", "'format' must be 'loco-jax-calibration/2'"),
    (("first_s",), -0.1, "'first_s' must be a finite number >= 0"),
    (("first_s",), _DELETE, "missing field 'first_s'"),
    (("devices",), 2, "devices >= processes"),
    (("processes",), True, "'processes' must be int"),
    (("collectives", 0, "op"), "broadcast", "'op' must be one of"),
    (("collectives", 0, "dtype"), "u8", r"'dtype' of a all-gather must be '\*'"),
    (("collectives", 1, "dtype"), "*", "'dtype' of a all-reduce must be its element type"),
    (("collectives", 0, "group_size"), 1, r"'group_size' must be in 2\.\.4"),
    (("collectives", 0, "nbytes"), [1e3, 1e3, 4e6], "strictly increasing"),
    (("collectives", 0, "seconds"), [0.1, -0.1, 0.2], "finite numbers >= 0"),
    (("collectives", 0, "seconds"), [0.1, math.nan, 0.2], "finite numbers >= 0"),
    (("collectives", 0, "seconds"), [0.1], "non-empty lists of one length"),
    (("collectives", 1), dict(_good()["collectives"][0]), r"collectives\[1\].*a second timing"),
    (("collectives", 0, "seconds"), _DELETE, r"collectives\[0\]: missing field 'seconds'"),
    (("work", 0, "n_params"), [1.5, 3], "finite integers >= 0"),
    (("work", 1, "method"), "loco", "must be a new non-empty name"),
    (("work",), "none", "'work' must be list"),
    (("note",), 3, "'note' must be str"),
    (("chunk_bytes",), 0, "'chunk_bytes' must be a positive int or null"),
    (("chunk_bytes",), _DELETE, "missing field 'chunk_bytes'"),
])
def test_a_bad_calibration_file_is_a_value_error_naming_the_field(tmp_path, path, value, message):
  obj = _good()
  _set(obj, path, value)
  (tmp_path / "cal.json").write_text(json.dumps(obj))
  with pytest.raises(ValueError, match=message):
    calib.read(tmp_path / "cal.json")


def test_unreadable_or_non_json_files_are_value_errors(tmp_path):
  with pytest.raises(ValueError, match="cannot be read"):
    calib.read(tmp_path / "missing.json")
  (tmp_path / "cal.json").write_text("{not json")
  with pytest.raises(ValueError, match="is not JSON"):
    calib.read(tmp_path / "cal.json")
  (tmp_path / "cal.json").write_text("[1, 2]")
  with pytest.raises(ValueError, match="must be a JSON object"):
    calib.read(tmp_path / "cal.json")
