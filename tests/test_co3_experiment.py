"""experiments/co3_experiment.py in --quick mode: its files, their keys, and sane values."""

import contextlib
import importlib.util
import io
import json
import math
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "experiments" / "co3_experiment.py"


def _load():
  """The script as a module (registered in sys.modules, which its dataclass needs)."""
  if "co3_experiment" in sys.modules:
    return sys.modules["co3_experiment"]
  spec = importlib.util.spec_from_file_location("co3_experiment", SCRIPT)
  module = importlib.util.module_from_spec(spec)
  sys.modules["co3_experiment"] = module
  spec.loader.exec_module(module)
  return module


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
  """One --quick run (teacher-student, three methods, two workers): (module, status, out)."""
  import jax
  jax.devices()  # start the backend with conftest's 8 devices, so that later tests keep them
  experiment = _load()
  out = tmp_path_factory.mktemp("co3") / "out"
  with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
    status = experiment.main(["--quick", "--workers", "2", "--seeds", "0", "--out", str(out)])
  return experiment, status, out


@pytest.mark.slow
def test_outputs_exist(quick_run):
  _, status, out = quick_run
  assert status == 0
  for name in ("results.json", "table.md", "loss_vs_step.png", "loss_vs_bits.png",
               "beta_per_layer.png", "w2.png"):
    assert (out / name).stat().st_size > 0, name
  for name in ("loss_vs_step.png", "loss_vs_bits.png", "beta_per_layer.png", "w2.png"):
    assert (out / name).read_bytes()[:4] == b"\x89PNG"
  assert not [p.name for p in out.iterdir() if p.name.startswith(".")]  # no temp files left
  table = (out / "table.md").read_text()
  assert all(m in table for m in ("| sgd |", "| co3-fp4 |", "| co3-fp8 |"))


@pytest.mark.slow
def test_results_keys_and_values(quick_run):
  experiment, _, out = quick_run
  results = json.loads((out / "results.json").read_text())
  assert {"command", "config", "runtime_s", "summary", "beta_table", "runs"} <= set(results)
  assert "--quick" in results["command"]
  runs = results["runs"]
  assert [(r["task"], r["method"]) for r in runs] == [("ts", m) for m in experiment.METHODS]
  steps = results["config"]["steps"]
  for r in runs:
    assert set(experiment.RUN_KEYS) <= set(r)
    assert r["workers"] == 2 and len(r["losses"]) == len(r["bits"]) == steps
    assert all(math.isfinite(x) for x in r["losses"])
    assert 0 < r["eval_loss"] < 5 and 0 <= r["eval_accuracy"] <= 1
    assert [rec["step"] for rec in r["records"]] == list(range(0, steps + 1, 10))
    for rec in r["records"]:
      assert set(rec["layers"]) == {"layers/0/kernel", "layers/1/kernel", "layers/2/kernel"}
      for layer in rec["layers"].values():
        fit = layer["nonzero"]
        assert 0.05 <= fit["beta"] <= 20 and fit["alpha"] > 0
        assert all(fit[k] >= 0 for k in ("w2_normal", "w2_laplace", "w2_gennorm"))
        assert 0 <= layer["zero_fraction"] < 1
        if r["method"] != "sgd":
          assert layer["scale"] > 0 and 0 < layer["entropy_empirical"] <= 8
  by_method = {r["method"]: r for r in results["summary"]}
  assert set(by_method) == set(experiment.METHODS)
  for row in by_method.values():
    assert set(experiment.SUMMARY_KEYS) <= set(row)
  assert by_method["sgd"]["bits_per_entry"] == 32.0
  assert by_method["sgd"]["eval_loss_vs_sgd"] == 0.0
  # Huffman-coded small floats: below their raw width, fp4 below fp8, plus a small header.
  fp4, fp8 = by_method["co3-fp4"]["bits_per_entry"], by_method["co3-fp8"]["bits_per_entry"]
  assert 0.5 < fp4 < 4.5 and fp4 < fp8 < 8.5
  assert by_method["co3-fp4"]["compression"] == pytest.approx(32 / fp4)
  # float32 ring all-reduce on 2 workers: 2 (n - 1) / n * 32 = 32 bits, plus the scalar loss.
  assert by_method["sgd"]["wire_bits_per_entry"] == pytest.approx(32.0, abs=0.1)
  for method in ("co3-fp4", "co3-fp8"):
    assert 0 < by_method[method]["wire_bits_per_entry"] < 32
  # Same data, same start: compression costs little in 30 steps of SGD.
  assert abs(by_method["co3-fp8"]["eval_loss_vs_sgd"]) < 5
  assert abs(by_method["co3-fp4"]["eval_loss_vs_sgd"]) < 10


def test_bad_arguments(capsys):
  experiment = _load()
  assert experiment.main(["--quick", "--seeds", "a,b"]) == 2
  assert "--seeds" in capsys.readouterr().err
  assert experiment.main(["--quick", "--steps", "0"]) == 2
