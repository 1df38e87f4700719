"""`loco-jax probe`: two processes on 127.0.0.1 write a calibration advise reads; bad options."""

import os
import sys

import pytest

import processes
from loco_jax.apps import advise, calibration as calib, probe

TIMEOUT_S = 240


@pytest.mark.slow
def test_two_processes_probe_their_collectives_and_methods(tmp_path):
  out = tmp_path / "cal.json"
  port = processes.free_port()
  processes.run_all([
      [sys.executable, "-m", "loco_jax", "probe", "--out", str(out), "--processes", "2",
       "--process-id", str(i), "--coordinator", f"127.0.0.1:{port}", "--cpu-devices", "2",
       "--methods", "fp32,loco", "--work-params", "4096,16384", "--sizes", "4096,65536",
       "--repeats", "2", "--timeout", str(TIMEOUT_S)] for i in range(2)], TIMEOUT_S, "probe")
  assert sorted(os.listdir(tmp_path)) == ["cal.json"]   # written once, no temp file left
  found = calib.read(out)
  assert (found.processes, found.devices, found.platform) == (2, 4, "cpu")
  # fp32 runs a float32 all-reduce, loco an all-to-all and an all-gather: each timed over the
  # 4 devices at both sizes, and at the sizes the steps run it at (whole elements in 4 equal
  # pieces): loco's all-to-all is 2,080 bytes at 4,096 parameters, 8,240 at 16,384 (a piece: 4
  # bits a parameter, a float32 scale a block of up to 2,048, a 4-byte flag word).
  assert {(t.op, t.dtype) for t in found.collectives} >= {
      ("all-reduce", "f32"), ("all-to-all", "*"), ("all-gather", "*")}
  for t in found.collectives:
    assert t.group_size == 4 and {4096, 65536} <= set(t.nbytes) and all(s > 0 for s in t.seconds)
    assert list(t.nbytes) == sorted(set(t.nbytes)) and all(b % 16 == 0 for b in t.nbytes)
  assert {2080, 8240} <= set(next(t for t in found.collectives if t.op == "all-to-all").nbytes)
  assert [w.method for w in found.work] == ["fp32", "loco"]
  assert all(w.n_params == (4096, 16384) for w in found.work)
  advice = advise.advise(found, 2**20)
  assert {r.method for r in advice.rows} == {"fp32", "loco"}


@pytest.mark.parametrize("argv,message", [
    (["--methods", "fp32,fp32"], "--methods must be distinct names"),
    (["--methods", "two-hop"], "--methods must be distinct names"),
    (["--work-params", "4096,1024"], "--work-params must be positive and increasing"),
    (["--sizes", "a,b"], "--sizes must be comma-separated integers"),
    (["--processes", "2"], "--coordinator ADDRESS:PORT is needed"),
    (["--processes", "2", "--process-id", "2", "--coordinator", "h:1"], "--process-id must be"),
    (["--repeats", "0"], "--repeats and --timeout must be >= 1"),
    (["--max-step-s", "0"], "--max-call-s and --max-step-s > 0"),
    (["--cpu-devices", "0"], "--cpu-devices must be >= 1"),
])
def test_bad_options_exit_2_before_jax_starts(tmp_path, argv, message, capsys):
  assert probe.main(["--out", str(tmp_path / "cal.json"), *argv]) == 2
  assert message in capsys.readouterr().err
  assert not (tmp_path / "cal.json").exists()


def test_an_unwritable_out_is_refused(tmp_path, capsys):
  assert probe.main(["--out", str(tmp_path / "no" / "cal.json")]) == 2
  assert "does not exist" in capsys.readouterr().err
  with pytest.raises(ValueError, match="unknown probe options"):
    probe.parse_args(["--out", "x.json", "--frobnicate"])
