"""`loco-jax advise`: fidelity from the long runs, the recommendation, the CLI and its bad input."""

import json
import re
from pathlib import Path

import pytest

from loco_jax.apps import advise, calibration as calib, fidelity, step_model


def _run(folder: Path, method: str, seed: int, evals: list[tuple[int, float]]) -> None:
  run = folder / f"{method}-s{seed}"
  run.mkdir(parents=True)
  (run / "config.json").write_text(json.dumps({"method": method, "seed": seed}))
  (run / "records.jsonl").write_text("".join(
      json.dumps({"step": s, "eval_loss": e}) + "\n" for s, e in evals)
      + json.dumps({"step": evals[-1][0], "eval_loss": None}) + "\n")


def test_fidelity_is_the_final_eval_gap_to_none_at_the_same_seed_and_step(tmp_path):
  _run(tmp_path, "none", 0, [(0, 5.0), (100, 2.0)])
  _run(tmp_path, "none", 1, [(0, 5.0), (100, 2.5)])
  _run(tmp_path, "loco4", 0, [(0, 5.0), (100, 2.02)])
  _run(tmp_path, "loco4", 1, [(0, 5.0), (100, 2.5)])
  _run(tmp_path, "co3-fp4", 0, [(0, 5.0), (100, 2.1)])
  _run(tmp_path, "bf16", 0, [(0, 5.0), (50, 2.0)])   # stopped early: no `none` at its step
  gaps = fidelity.long_run_gaps(tmp_path)
  assert gaps["loco4"] == (pytest.approx(0.5), 2) and gaps["co3-fp4"][0] == pytest.approx(5.0)
  assert "bf16" not in gaps
  found = fidelity.fidelity(["fp32", "loco-entropy", "co3-fp4", "bf16", "int4"], 1.0, tmp_path)
  assert found["loco-entropy"] == fidelity.Fidelity("loco4", pytest.approx(0.5), 2, True)
  assert found["fp32"].holds and not found["co3-fp4"].holds
  assert found["bf16"].gap_pct is None and not found["bf16"].holds
  assert found["int4"] == fidelity.Fidelity(None, None, 0, False)
  with pytest.raises(ValueError, match="no long-run records"):
    fidelity.long_run_gaps(tmp_path / "nowhere")


def test_the_repositorys_long_runs_give_loco_bf16_and_co3_their_gaps():
  found = fidelity.fidelity(["fp32", "bf16", "loco", "co3-fp4"])
  assert found["fp32"].gap_pct == 0 and found["fp32"].seeds == 2
  assert found["loco"].holds and found["loco"].seeds == 2 and found["loco"].gap_pct < 0
  assert found["bf16"].holds and not found["co3-fp4"].holds   # +0.59% and +1.76%


def _row(method: str, step_s: float, holds: bool = True) -> advise.MethodAdvice:
  return advise.MethodAdvice(method, step_model.StepPrediction(step_s, step_s, 0.0, 0.0),
                             step_s, 4.0, fidelity.Fidelity(method, 0.0, 1, holds))


def test_the_fastest_method_whose_fidelity_holds_is_recommended():
  rows = [_row("fp32", 1.0), _row("bf16", 0.6), _row("loco", 0.4),
          _row("co3-fp4", 0.2, holds=False)]
  assert advise.recommend(rows)[0] == "loco"
  # Where compression pays less than the margin, the plain method is kept.
  assert advise.recommend([_row("fp32", 1.0), _row("loco", 0.98)])[0] == "fp32"
  assert advise.recommend([_row("fp32", 1.0), _row("bf16", 0.6), _row("loco", 0.59)])[0] == "bf16"
  assert advise.recommend([_row("fp32", 1.0), _row("loco", 0.9)])[0] == "loco"
  with pytest.raises(ValueError, match="no method's fidelity holds"):
    advise.recommend([_row("co3-fp4", 0.2, holds=False)])


def _calibration(devices: int = 4) -> calib.Calibration:
  timings = tuple(calib.CollectiveTiming(op, dtype, devices, (1e3, 1e7), (1e-3, 1.0))
                  for op, dtype in (("all-reduce", "f32"), ("all-to-all", "*"),
                                    ("all-gather", "*")))
  work = tuple(calib.MethodWork(m, (2**16,), (w,)) for m, w in
               (("fp32", 0.0), ("bf16", 0.002), ("loco", 0.004)))
  return calib.Calibration(devices, devices, "cpu", 0.0, timings, work)


def test_advise_compiles_each_method_and_predicts_from_its_bytes():
  advice = advise.advise(_calibration(), 2**16)
  rows = {r.method: r for r in advice.rows}
  # 4 devices, fp32 ring all-reduce: 2 x 3/4 x 32 bits; loco 4-bit all-to-all + bf16 gather,
  # widened to 32 on CPU (its own uint16 bitcast: 16), with block scales.
  assert rows["fp32"].bits_per_param == pytest.approx(48.0)
  assert rows["bf16"].bits_per_param == pytest.approx(24.0)
  assert 15 < rows["loco"].bits_per_param < 16
  # The collectives' seconds follow their bytes, on the calibration's line: one float32
  # all-reduce of the 2**18-byte gradient.
  assert rows["fp32"].prediction.collectives_s == pytest.approx(
      1e-3 + (2**18 - 1e3) * (1.0 - 1e-3) / (1e7 - 1e3), rel=1e-6)
  assert rows["fp32"].vs_fp32 == 1.0
  assert rows["loco"].prediction.work_s == pytest.approx(0.004)
  assert advice.recommended in rows and rows[advice.recommended].fidelity.holds
  fastest = min((r for r in advice.rows if r.fidelity.holds), key=lambda r: r.prediction.step_s)
  assert advice.recommended in (fastest.method, "fp32", "bf16")
  text = "\n".join(advise.format_advice(advice, 2**16))
  assert "| fp32 |" in text and f"recommended: {advice.recommended}" in text


def test_the_step_is_compiled_with_the_clusters_pieces():
  # Across processes on CPU the library cuts collectives into pieces (comm.wire); the
  # calibration says how, and the compiled step follows it.
  whole = advise.compiled_collectives("bf16", 2**16, 4, None)
  cut = advise.compiled_collectives("bf16", 2**16, 4, 4096)
  assert len(cut) > len(whole) and sum(c.nbytes for c in cut) == sum(c.nbytes for c in whole)


def test_advise_refuses_what_it_cannot_compile_or_predict():
  with pytest.raises(ValueError, match="must include fp32"):
    advise.advise(_calibration(), 1024, ["loco"])
  with pytest.raises(ValueError, match="unknown methods"):
    advise.advise(_calibration(), 1024, ["fp32", "zstd"])
  with pytest.raises(ValueError, match="needs them here"):
    advise.advise(_calibration(devices=64), 1024, ["fp32"])
  with pytest.raises(ValueError, match="no work of method 'loco-quantized'"):
    advise.advise(_calibration(), 1024, ["fp32", "loco-quantized"])


@pytest.mark.parametrize("argv,message", [
    (["--params", "1000"], "give either --calibration FILE or both --hosts H and --rate R"),
    (["--params", "1000", "--hosts", "4"], "give either --calibration FILE or both"),
    (["--params", "1000", "--calibration", "x.json", "--rate", "1gbit"], "exclude each other"),
    (["--params", "0", "--hosts", "4", "--rate", "1gbit"], "--params must be >= 1"),
    (["--params", "1000", "--hosts", "3", "--rate", "7mbit"],
     "no stored calibration for --hosts 3 --rate 7mbit; stored: "),
    (["--params", "1000", "--calibration", "/nonexistent/cal.json"], "cannot be read"),
])
def test_bad_input_exits_2_saying_what_was_wrong(argv, message, capsys):
  assert advise.main(argv) == 2
  assert message in capsys.readouterr().err


def test_a_tampered_calibration_is_refused(tmp_path, capsys):
  path = tmp_path / "cal.json"
  calib.write(path, _calibration())
  obj = json.loads(path.read_text())
  obj["collectives"][0]["seconds"][1] = -1
  path.write_text(json.dumps(obj))
  assert advise.main(["--params", "1000", "--calibration", str(path)]) == 2
  assert "collectives[0]: 'seconds' must hold finite numbers >= 0" in capsys.readouterr().err


def test_the_cli_dispatches_probe_and_advise(capsys):
  from loco_jax.apps import cli
  assert cli.main(["advise", "--params", "0", "--hosts", "2", "--rate", "1gbit"]) == 2
  assert "--params" in capsys.readouterr().err
  assert cli.main(["probe", "--out", "/tmp/x.json", "--methods", "zstd"]) == 2
  assert "--methods must be distinct names" in capsys.readouterr().err


@pytest.mark.slow
def test_a_stored_netbench_calibration_recommends_loco_at_100mbit(capsys):
  # Probe's calibration of 2 netbench hosts at 100 Mb/s: LoCo's step is about a third of
  # fp32's there (docs/results/advise.md), and its fidelity holds.
  assert advise.main(["--params", str(2**22), "--hosts", "2", "--rate", "100mbit"]) == 0
  out = capsys.readouterr().out
  assert "recommended: loco (" in out and "| fp32 |" in out and "1.00x" in out


def test_the_check_finds_a_step_off_its_prediction(tmp_path, capsys):
  import importlib.util
  root = Path(__file__).resolve().parents[1]
  spec = importlib.util.spec_from_file_location("advise_check",
                                                root / "experiments" / "advise_check.py")
  check = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(check)
  stored = root / "docs" / "records" / "advise_4hosts_100mbit_4m.json"
  records = json.loads(stored.read_text())
  assert check.main([str(stored)]) == 0
  assert "| 4 | 100mbit | 4194304 | 1 | 9 of 9 |" in capsys.readouterr().out
  loco = next(r for r in records if r["method"] == "loco")
  step_s = loco["step_s"]
  loco["step_s"] = step_s * 1.3
  (tmp_path / "off.json").write_text(json.dumps(records))
  assert check.main([str(tmp_path / "off.json")]) == 1
  assert "MISSED: 4 hosts, 100mbit, 4194304 params: loco measured" in capsys.readouterr().out
  loco["step_s"] = records[0]["step_s"] * 1.2   # the advised method, now slower than fp32
  (tmp_path / "slow.json").write_text(json.dumps(records))
  assert records[0]["method"] == "fp32" and check.main([str(tmp_path / "slow.json")]) == 1
  assert re.search(r"advised loco took \+\d+\.\d% against the fastest, [\w-]+, and \+20\.0% "
                   r"against fp32", capsys.readouterr().out)
  # Three runs of the setting: the median of loco's runs holds where one run of three is off...
  again = [dict(r, step_s=r["step_s"] * 1.01) for r in records if r is not loco]
  rerun = dict(loco, step_s=step_s)
  (tmp_path / "again.json").write_text(json.dumps(again + [rerun]))
  (tmp_path / "third.json").write_text(json.dumps([dict(rerun, step_s=step_s * 0.99)]))
  runs = [str(tmp_path / name) for name in ("off.json", "again.json", "third.json")]
  assert check.main(runs) == 0
  assert "| 4 | 100mbit | 4194304 | 3 | 9 of 9 |" in capsys.readouterr().out
  # ...and misses where two of three are, naming every run.
  (tmp_path / "third.json").write_text(json.dumps([dict(rerun, step_s=step_s * 1.3)]))
  assert check.main(runs) == 1
  assert f"(the median of runs of {step_s * 1.3e3:.1f}, {step_s * 1e3:.1f}, " \
         f"{step_s * 1.3e3:.1f} ms)" in capsys.readouterr().out
  other = dict(rerun, collectives=["all-gather:u8:8:data"])
  (tmp_path / "other.json").write_text(json.dumps([other]))
  with pytest.raises(SystemExit, match="differ in collectives"):
    check.main([str(tmp_path / "off.json"), str(tmp_path / "other.json")])
  pinned = dict(rerun, host_cpus=[[i] for i in range(rerun["hosts"])])
  (tmp_path / "pinned.json").write_text(json.dumps([pinned]))
  with pytest.raises(SystemExit, match="differ in host_cpus"):
    check.main([str(tmp_path / "off.json"), str(tmp_path / "pinned.json")])
