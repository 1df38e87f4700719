"""netbench: real hosts (network namespaces) on a shaped link; bytes on the wire vs the HLO."""

import importlib
import json
import os
import subprocess
import sys

import pytest

from loco_jax.apps import (netbench, netbench_args, netbench_methods, netbench_profile,
                           netbench_report, netns)

TIMEOUT_S = 150


def _namespaces_unavailable() -> str | None:
  """Why namespaces cannot be created here, or None when they can."""
  missing = netns.missing_requirements()
  if missing:
    return "netbench needs " + "; ".join(missing)
  try:
    with netns.Network(2, "20mbit"):
      pass
  except (RuntimeError, OSError) as e:
    return f"cannot create network namespaces here: {e}"
  return None


def _processes_with(text: str) -> list[int]:
  found = []
  for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
      with open(f"/proc/{pid}/cmdline", "rb") as f:
        if text.encode() in f.read():
          found.append(int(pid))
    except OSError:
      pass
  return found


def _netbench_on_the_wire(args: list[str]) -> str:
  """Runs `loco_jax netbench ARGS` (skipped with a printed reason where namespaces cannot be
  made); checks that it exits 0 and leaves no namespace or host process; returns its log."""
  reason = _namespaces_unavailable()
  if reason:
    print(f"SKIP: {reason}")
    pytest.skip(reason)
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "GLIBC_TUNABLES")}
  proc = subprocess.Popen([sys.executable, "-m", "loco_jax", "netbench", *args], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  try:
    log = proc.communicate(timeout=TIMEOUT_S)[0]
  except subprocess.TimeoutExpired:
    proc.terminate()   # netbench removes its hosts on SIGTERM
    log = proc.communicate(timeout=30)[0]
    pytest.fail(f"netbench ran past {TIMEOUT_S} s:\n{log[-3000:]}")
  tag = f"{netns.PREFIX}{proc.pid}-"
  assert not [n for n in netns.our_namespaces() if n.startswith(tag)], "namespaces left behind"
  assert not _processes_with(tag), "host processes left behind"
  assert proc.returncode == 0, log[-3000:]
  return log


@pytest.mark.slow
def test_two_hosts_on_a_slow_link_send_what_the_compiled_program_says(tmp_path):
  out = tmp_path / "net.json"
  _netbench_on_the_wire(
      ["--hosts", "2", "--rate", "20mbit", "--params", str(2**18), "--methods",
       "fp32,loco,loco-quantized", "--steps", "3", "--warmup", "1", "--exchange-only",
       "--timeout", "120", "--json", str(out)])
  records = {r["method"]: r for r in json.loads(out.read_text())}
  assert sorted(records) == ["fp32", "loco", "loco-quantized"]
  for r in records.values():
    assert (r["hosts"], r["rate"], r["n_params"]) == (2, "20mbit", 2**18)
    assert r["step_s"] > 0 and r["host_malloc"] == netbench.HOST_MALLOC
    assert r["host_cpus"] == [sorted(os.sched_getaffinity(0))] * 2  # unpinned: every core
    for bits in r["payload_bits_per_host"]:
      assert abs(bits / r["predicted_bits_per_param"] - 1) <= 0.02, (r["method"], bits, r)
    assert 0.9 * 20e6 <= r["link_tcp_bits_per_s"] <= 20e6   # the shaper's calibration held
  fp32 = records["fp32"]["measured_bits_per_param"]
  # The ring all-reduce's 2 (n-1)/n x 32; LoCo (n-1)/n x (4 + 16) with its bf16 gather (as
  # uint16: XLA:CPU would widen bf16 to 32 bits) and (n-1)/n x (4 + 4) with the quantized one.
  assert 31.5 < fp32 < 33.0
  assert records["loco"]["measured_bits_per_param"] <= 0.32 * fp32
  assert records["loco-quantized"]["measured_bits_per_param"] <= 0.3 * fp32


def test_without_root_or_tools_it_exits_2_naming_what_is_missing(monkeypatch, capsys):
  monkeypatch.setattr(netns, "missing_requirements", lambda: ["root (run as root)", "the `tc`"])
  assert netbench.main(["--exchange-only"]) == 2
  err = capsys.readouterr().err
  assert "root" in err and "`tc`" in err


def _forbid_building(monkeypatch):
  """netns and subprocess made to fail if netbench builds anything or starts a process, and the
  requirements made present, so that only the argument checks can stop the run."""
  def refuse(*args, **kwargs):
    raise AssertionError("netbench built something before checking its arguments")
  monkeypatch.setattr(netns, "missing_requirements", lambda: [])
  for name in ("Network", "remove_stale", "_run"):
    monkeypatch.setattr(netns, name, refuse)
  monkeypatch.setattr(netbench.subprocess, "Popen", refuse)


BAD_ARGUMENTS = [
    (["--exchange-only", "--rate", "fast"], "kbit, mbit or gbit"),
    (["--exchange-only", "--rate", "0mbit"], "positive number"),
    (["--exchange-only", "--methods", "fp32,fp64"], "--methods"),
    (["--exchange-only", "--steps", "0"], "--steps"),
    (["--exchange-only", "--profile", "-1"], "--profile must be >= 0"),
    (["--train-methods", "fp32,adam"], "--train-methods"),
    (["--train-model", "512,1,3072"], "--train-model"),
    (["--train-model", "100,1,64,8"], "n_heads dividing d_model"),
    (["--train-steps", "2"], "--train-steps"),
    (["--train-methods", "diloco", "--train-steps", "30"], "a multiple of --inner-steps 32"),
    (["--train-methods", "diloco", "--train-steps", "32"], "at least 2 of them"),
    (["--train-methods", "diloco-overlap", "--train-steps", "64"], "give it (>= 1) exactly"),
    (["--train-methods", "diloco", "--train-steps", "64", "--overlap", "2"],
     "give it (>= 1) exactly"),
    (["--train-methods", "diloco-overlap", "--train-steps", "64", "--overlap", "32"],
     "--overlap must be in 0..31"),
    (["--train-methods", "diloco-overlap", "--train-steps", "64", "--overlap", "2"],
     "give at least 3 rounds, 96"),
    (["--train-methods", "diloco", "--train-steps", "64", "--fragments", "3"],
     "--fragments 3 must divide --inner-steps 32"),
    (["--exchange-only", "--overlap", "2"], "--overlap is a training option"),
    (["--param-gather", "fp16"], "--param-gather"),
    (["--devices-per-host", "3", "--batch-per-host", "4"], "--batch-per-host"),
    # Issue 30: these ended in a traceback (exit 1) after the argument checks.
    (["--exchange-only", "--hosts", "0"], "hosts must be in 2..64, got 0"),
    (["--exchange-only", "--hosts", "1"], "hosts must be in 2..64, got 1"),
    (["--exchange-only", "--hosts", "100"], "hosts must be in 2..64, got 100"),
    (["--exchange-only", "--delay", "5 ms"], "delay must be a number followed by us, ms or s"),
    (["--exchange-only", "--delay=-5ms"], "delay must be"),
    (["--exchange-only", "--burst", "100"], "burst must be at least 1514"),
    (["--exchange-only", "--params", str(2**50)], "more than this machine's"),
    # Two levels.
    (["--exchange-only", "--hosts", "4", "--nodes", "3", "--inter-rate", "1gbit"],
     "nodes must divide the hosts"),
    (["--exchange-only", "--hosts", "4", "--nodes", "2"], "--inter-rate is the rate between"),
    (["--exchange-only", "--inter-rate", "1gbit"], "--inter-rate is the rate between"),
    (["--exchange-only", "--hosts", "4", "--nodes", "2", "--inter-rate", "1gbyte"],
     "kbit, mbit or gbit"),
    (["--exchange-only", "--methods", "fp32,two-hop"], "need --nodes >= 2"),
    (["--hosts", "4", "--nodes", "2", "--inter-rate", "1gbit"], "pass --exchange-only"),
    # probe and the step model (issue 48).
    (["--exchange-only", "--rate", "100mbit,1gbit", "--probe", "/tmp/cal.json"],
     "--probe writes one calibration: give one --rate"),
    (["--probe", "/tmp/cal.json"], "--probe writes one calibration"),
    (["--exchange-only", "--probe", "/tmp/cal.json", "--probe-args", "--repeats 0"],
     "--repeats and --timeout must be >= 1"),
    (["--exchange-only", "--probe", "/tmp/cal.json", "--probe-args=--fast"],
     "unknown probe options"),
    (["--exchange-only", "--calibration", "/nonexistent.json"], "cannot be read"),
    (["--exchange-only", "--hosts", "4", "--nodes", "2", "--inter-rate", "1gbit",
      "--calibration", "/nonexistent.json"], "cover one level"),
]


@pytest.mark.parametrize("argv, message", BAD_ARGUMENTS)
def test_bad_arguments_exit_2_with_one_line_before_anything_is_built(argv, message, monkeypatch,
                                                                       capsys):
  _forbid_building(monkeypatch)
  assert netbench.main(argv) == 2
  err = capsys.readouterr().err
  assert message in err and err.count("\n") == 1, err


def test_a_calibration_of_other_hosts_or_methods_is_refused(tmp_path, monkeypatch, capsys):
  from loco_jax.apps import calibration as calib
  _forbid_building(monkeypatch)
  path = tmp_path / "cal.json"
  timing = calib.CollectiveTiming("all-reduce", "f32", 4, (4096,), (0.01,))
  calib.write(path, calib.Calibration(4, 4, "cpu", 0.0, (timing,),
                                      (calib.MethodWork("fp32", (4096,), (0.0,)),)))
  assert netbench.main(["--exchange-only", "--calibration", str(path)]) == 2
  assert "is of 4 devices" in capsys.readouterr().err
  assert netbench.main(["--exchange-only", "--hosts", "4", "--methods", "fp32,loco",
                        "--calibration", str(path)]) == 2
  assert "it lacks ['loco']" in capsys.readouterr().err


def test_the_records_carry_the_step_models_prediction():
  from loco_jax.apps import calibration as calib
  timing = calib.CollectiveTiming("all-reduce", "f32", 2, (1e6, 1e7), (0.01, 0.1))
  cal = calib.Calibration(2, 2, "cpu", 0.003, (timing,),
                          (calib.MethodWork("fp32", (1000,), (0.001,)),))
  host = {"kind": "result", "method": "fp32", "step_s": 0.06, "cpu_s": 0.01,
          "collectives_s": 0.05, "collectives_cpu_s": 0.0, "measured_bits_per_param": 64.0,
          "payload_bits_per_param": 64.0, "sent": _counts(64.0, 2000), "malloc": "",
          "cpus": [0], "exchange": "all-reduce", "counts": {}, "gauges": {}, "steps": 5,
          "conditional_steps": 0, "conditional_bits_per_param": 0.0, "extension_steps": 0,
          "extension_bits_per_param": 0.0, "predicted_bits_per_param": 64.0, "finite": True,
          "collectives": ["all-reduce:f32:5000000:data", "all-reduce:f32:9000000:data:cond"]}
  (record,) = netbench_report.summarize([host, dict(host, step_s=0.07)], 2, "1gbit", 2000,
                                        calibration=cal)
  # 5 MB at 10 ms a MB and 3 ms for the first, the conditional one left out, and 1 us a
  # parameter of work.
  assert record["predicted_step_s"] == pytest.approx(0.05 + 0.003 + 0.002)
  assert netbench_report.format_table([record])[2].count("55.0 (+27%)") == 1
  (plain,) = netbench_report.summarize([host, host], 2, "1gbit", 2000)
  assert plain["predicted_step_s"] is None and "| - |" in netbench_report.format_table([plain])[2]


def test_unwritable_outputs_are_refused_before_the_run(tmp_path, monkeypatch, capsys):
  _forbid_building(monkeypatch)
  cases = [(["--json", str(tmp_path / "missing" / "net.json")], "does not exist"),
           (["--png", str(tmp_path / "missing" / "net.png")], "does not exist"),
           (["--json", str(tmp_path)], "must name a file"),
           (["--json", "/proc/netbench.json"], "cannot be written"),
           (["--json", str(tmp_path / "a"), "--png", str(tmp_path / "a")], "the same file")]
  for argv, message in cases:
    assert netbench.main(["--exchange-only", *argv]) == 2, argv
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
  assert sorted(p.name for p in tmp_path.iterdir()) == []   # no probe file left behind


def test_results_are_written_whole_or_printed(tmp_path, monkeypatch, capsys):
  args = netbench_args.parser().parse_args(["--json", str(tmp_path / "net.json")])
  records = [{"method": "fp32", "step_s": 0.1}]
  assert netbench._write_outputs(args, records, [])
  assert json.loads((tmp_path / "net.json").read_text()) == records
  # A write that fails half-way (the disk fills) leaves the old file as it was, and the new
  # records reach the user on stderr rather than being lost.
  def full(fd):
    raise OSError(28, "No space left on device")
  monkeypatch.setattr(os, "fsync", full)
  assert not netbench._write_outputs(args, [{"method": "loco", "step_s": 0.05}], [])
  assert json.loads((tmp_path / "net.json").read_text()) == records
  assert sorted(p.name for p in tmp_path.iterdir()) == ["net.json"]
  err = capsys.readouterr().err
  assert "No space left" in err and '"loco"' in err


def test_hosts_get_the_malloc_settings_unless_told_otherwise(monkeypatch):
  monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  parse = lambda *argv: netbench_args.parser().parse_args(list(argv))
  env = netbench.host_env(parse().host_malloc)
  assert env["GLIBC_TUNABLES"] == netbench.HOST_MALLOC and "XLA_FLAGS" not in env
  assert "GLIBC_TUNABLES" not in netbench.host_env(parse("--default-malloc").host_malloc)
  monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")
  assert netbench.host_env(True)["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2"


@pytest.mark.parametrize("rate, bits", [("20mbit", 2e7), ("1gbit", 1e9), ("1.5GBIT", 1.5e9),
                                        ("500kbit", 5e5)])
def test_rates_as_tc_writes_them(rate, bits):
  assert netns.rate_bits(rate) == bits


@pytest.mark.slow
def test_one_tcp_stream_carries_what_the_shaper_allows():
  reason = _namespaces_unavailable()
  if reason:
    pytest.skip(reason)
  with netns.Network(3, "20mbit") as net:
    assert 0.9 * 20e6 < net.tcp_goodput(0, 2, seconds=1.0) <= 20e6
  with netns.Network(4, "100mbit", nodes=2, inter_rate="10mbit") as net:
    assert 0.9 * 10e6 < net.tcp_goodput(1, 3, seconds=1.0) <= 10e6   # across the nodes


def test_burst_is_milliseconds_of_the_rate_and_fits_a_gso_packet():
  assert netns.burst_bytes("1gbit") == 1_000_000
  assert netns.burst_bytes("20mbit") == netns.MIN_BURST_BYTES >= 65536


def _counts(payload_bits: float, n_params: int = 1000, header_bytes: int = 66, packets=10,
            retransmitted_bytes: int = 0) -> dict:
  """A host's raw counts (sent.Sent) for `payload_bits` a parameter of TCP payload."""
  payload = round(payload_bits * n_params / 8)
  return {"interface_bytes": payload + header_bytes * packets + retransmitted_bytes,
          "packets": packets, "payload_bytes": payload,
          "retransmitted_bytes": retransmitted_bytes}


def _record(method, payload, predicted, step_s=1.0, rate="1mbit", n_params=2**16,
            link_tcp_bits_per_s=None, **counts):
  sent = [_counts(bits, n_params, **counts) for bits in payload]
  link = {} if link_tcp_bits_per_s is None else {"link_tcp_bits_per_s": link_tcp_bits_per_s}
  measured = [8 * s["interface_bytes"] / n_params for s in sent]
  return {"method": method, "hosts": 2, "rate": rate, "n_params": n_params, "step_s": step_s,
          "measured_bits_per_host": measured, "measured_bits_per_param": sum(measured) / 2,
          "payload_bits_per_host": payload, "payload_bits_per_param": sum(payload) / 2,
          "sent_per_host": sent, "predicted_bits_per_param": predicted, "finite": True, **link}


def test_check_flags_payload_off_the_prediction():
  ok = _record("loco", [10.1, 10.05], 10.0)
  off = _record("bf16", [16.0, 16.5], 16.0)
  assert netbench_report.check([ok], 0.9) == []
  failures = netbench_report.check([ok, off], 0.9)
  assert len(failures) == 1 and "bf16" in failures[0] and "3.1%" in failures[0]


def test_calibration_holds_the_shaper_to_what_one_tcp_stream_carries():
  # A shaped 1 Mb/s link carries about 95.7% of its rate as TCP payload; a slow all-reduce is
  # gloo's, not the shaper's, and is no failure.
  healthy = _record("fp32", [32.0, 32.0], 32.0, step_s=100.0, link_tcp_bits_per_s=0.957e6)
  assert netbench_report.rate_fraction(healthy) < 0.1
  assert netbench_report.check([healthy], 0.9) == []
  assert netbench_report.calibrations([healthy, dict(healthy, method="loco")]) == {
      "1mbit": (pytest.approx(0.957), netbench_report.rate_fraction(healthy))}
  slow = dict(healthy, link_tcp_bits_per_s=0.81e6)
  unshaped = dict(healthy, link_tcp_bits_per_s=3.2e6)
  (failure,) = netbench_report.check([slow], 0.9)
  assert "calibration" in failure and "81.0%" in failure
  assert netbench_report.check([slow], 0.75) == []
  assert "320.0%" in netbench_report.check([unshaped], 0.0)[0]


def test_a_payload_too_small_to_check_is_not_held_to_the_prediction():
  # 2 hosts, 4,096 parameters: gloo's own messages were 3.5% over a 16 KiB fp32 all-reduce.
  small = _record("fp32", [33.1, 33.1], 32.0, n_params=4096)
  assert not netbench_report.payload_checked(small)
  assert netbench_report.check([small], 0.9) == []
  large = _record("fp32", [33.1, 33.1], 32.0, n_params=2**15)   # 128 KiB a step
  assert netbench_report.payload_checked(large)
  assert "3.4%" in netbench_report.check([large], 0.9)[0]


def test_headers_and_retransmissions_on_the_interface_are_not_the_programs_bytes():
  # What failed CI once: the interface counted 3.6% over the prediction at 512K parameters
  # (more packets, each with its headers, and resends after drops) while the payload was the
  # program's. The check holds the payload to 2% and the rest to what headers and resends are.
  busy = _record("co3", [4.76, 4.77], 4.75, n_params=2**19, packets=1500,
                 retransmitted_bytes=9000)
  assert min(busy["measured_bits_per_host"]) > 4.75 * 1.036
  assert netbench_report.check([busy], 0.0) == []
  # An interface that sent more than payload, headers and resends can be (a connection the
  # counts missed), or less than the payload (a counter that went back), fails, naming the host.
  for extra in (200 * 1500, -100 * 1500):
    bad = _record("co3", [4.76, 4.77], 4.75, n_params=2**19, packets=1500)
    bad["sent_per_host"][1]["interface_bytes"] += extra
    (failure,) = netbench_report.check([bad], 0.0)
    assert failure.startswith("co3 at 1mbit: host 1: the interface sent"), failure


def test_refuses_to_remove_namespaces_that_are_not_its_own():
  with pytest.raises(ValueError, match="not a netbench namespace"):
    netns.remove_namespace("production")


def _train_row(method, host, step_s, eval_loss=2.0, bits=10.0, predicted=10.0):
  sent = _counts(bits, 1_000_000)
  return {"kind": "train", "method": method, "host": host, "step_s": step_s,
          "final_loss": eval_loss, "eval_loss": eval_loss, "n_params": 1_000_000,
          "tokens_per_step": 512, "collectives_s": 0.01, "sent": sent,
          "measured_bits_per_param": 8 * sent["interface_bytes"] / 1_000_000,
          "payload_bits_per_param": bits, "predicted_bits_per_param": predicted}


def test_training_rows_split_the_step_into_compute_and_exchange():
  rows = [_train_row("compute", 0, 0.05), _train_row("compute", 1, 0.06),
          _train_row("fp32", 0, 0.20, bits=32.1, predicted=32.0),
          _train_row("fp32", 1, 0.25, bits=32.0, predicted=32.0),
          _train_row("loco", 0, 0.10, eval_loss=2.02, bits=10.0, predicted=10.0),
          _train_row("loco", 1, 0.09, eval_loss=2.04, bits=10.1, predicted=10.0),
          {"kind": "result", "method": "fp32"}]
  records = {r["method"]: r for r in netbench_report.summarize_training(rows, 2, "100mbit")}
  fp32, loco = records["fp32"], records["loco"]
  assert fp32["step_s"] == 0.25 and fp32["compute_s"] == 0.06   # the slowest host's
  assert abs(fp32["exchange_s"] - 0.19) < 1e-12
  assert fp32["tokens_per_s"] == 512 / 0.25
  assert abs(loco["eval_loss"] - 2.03) < 1e-12
  # No step predicted by hand-set rates: a cluster's steps are advise's (step_model).
  assert not {"predicted_step_s", "cost_model_step_s"} & set(fp32)
  assert netbench_report.check_training(list(records.values())) == []
  assert "fp32" in netbench_report.format_training_table([fp32])[2]
  bad = netbench_report.summarize_training(rows[:2] + [_train_row("bf16", h, 0.1, bits=17.0,
                                                           predicted=16.0) for h in (0, 1)],
                                    2, "100mbit")
  (failure,) = netbench_report.check_training(bad)
  assert "bf16" in failure and "6.2%" in failure
  with pytest.raises(RuntimeError, match="compute step"):
    netbench_report.summarize_training(rows[2:], 2, "100mbit")


@pytest.mark.slow
def test_the_collectives_replay_runs_the_steps_collectives_as_compiled():
  import jax
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from loco_jax import comm
  from loco_jax.comm import wire
  from loco_jax.train import parallel
  mesh = parallel.data_mesh(8)
  with wire.chunking(1024):   # the pieces of a chunked step, each replayed as it is
    step, state = netbench_methods.exchange_step("loco", 40_000, mesh)
    grads = jax.device_put(np.ones((8, 40_000), np.float32), NamedSharding(mesh, P("data")))
    found = comm.compiled_collectives(step, grads, state)
  replay = netbench_methods.collectives_replay(found, mesh)
  ones = jax.device_put(np.ones(8, np.float32), NamedSharding(mesh, P("data")))
  replayed = comm.compiled_collectives(replay, ones)
  key = lambda c: (c.op, c.dtype, c.nbytes)
  assert len(found) > 3 and sorted(map(key, replayed)) == sorted(map(key, found))
  np.testing.assert_array_equal(np.asarray(replay(ones)), np.ones(8))


@pytest.mark.slow
@pytest.mark.parametrize("method", ["fsdp-loco"])
def test_sharded_training_methods_train_and_report_their_wire(method):
  # In one process on the 8 simulated devices (lo's counters): the zero2 and fsdp rows of
  # netbench's training table come from the same step parallel builds, and evaluate the
  # gathered shards in the model's own shapes.
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import PartitionSpec as P
  from loco_jax.apps import demo
  from loco_jax.train import parallel
  config = demo.DemoConfig(steps=4, devices=8, batch_per_device=1, seq_len=16, d_model=32,
                           n_layers=2, n_heads=2, d_ff=64, warmup=1, eval_batches=2,
                           corpus_bytes=200_000)
  from loco_jax.apps import netbench_worker
  record = netbench_worker._train(method, config, demo.load_corpus(config),
                                  parallel.data_mesh(), "lo", jax, jnp, P)
  assert record["method"] == method and np.isfinite(record["eval_loss"])
  assert abs(record["eval_loss"] - np.log(256)) < 1.0  # near chance after 4 steps, not garbage
  # LoCo's 4-bit reduce-scatter plus the parameter gathers (16 bits each way for fsdp).
  assert 4 < record["predicted_bits_per_param"] < 64
  assert record["overlapped_collectives"] >= 0


@pytest.mark.slow
def test_diloco_training_sends_one_round_of_loco_over_its_inner_steps():
  # The diloco rows: the step time is the mean over whole rounds and the bits the mean of the
  # inner step's (none) and the sync's (loco's, every --inner-steps steps).
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import PartitionSpec as P
  from loco_jax.apps import demo, netbench_worker
  from loco_jax.train import parallel
  config = demo.DemoConfig(steps=6, devices=8, batch_per_device=1, seq_len=16, d_model=32,
                           n_layers=2, n_heads=2, d_ff=64, warmup=1, eval_batches=2,
                           corpus_bytes=200_000)
  corpus, mesh = demo.load_corpus(config), parallel.data_mesh()
  run = lambda method, h: netbench_worker._train(
      method, config, corpus, mesh, "lo", jax, jnp, P,
      outer={"inner_steps": h, "fragments": 1, "overlap": 0})
  every, half = run("diloco-loco", 1), run("diloco-loco", 2)
  ddp = run("loco", 1)
  assert np.isfinite(half["eval_loss"]) and half["overlapped_collectives"] >= 0
  assert every["predicted_bits_per_param"] == pytest.approx(ddp["predicted_bits_per_param"],
                                                            rel=0.01)
  assert half["predicted_bits_per_param"] == pytest.approx(
      every["predicted_bits_per_param"] / 2, rel=0.01)
  assert half["collectives_s"] > 0  # the sync's collectives, replayed in its share of the steps


@pytest.mark.slow
def test_overlapped_diloco_sends_what_the_blocking_one_does_and_times_its_steps_by_kind():
  # On devices 0-3 with the syncs on 4-7: the same bits as the blocking sync (the sync's program
  # on the communication devices, the inner and merge steps none), and the steps by kind.
  import jax
  import jax.numpy as jnp
  from jax.sharding import PartitionSpec as P
  from loco_jax.apps import demo, netbench_worker
  from loco_jax.train import parallel
  config = demo.DemoConfig(steps=12, devices=4, batch_per_device=1, seq_len=16, d_model=32,
                           n_layers=2, n_heads=2, d_ff=64, warmup=1, eval_batches=2,
                           corpus_bytes=200_000)
  corpus, mesh = demo.load_corpus(config), parallel.data_mesh(4)
  run = lambda method, tau: netbench_worker._train(
      method, config, corpus, mesh, "lo", jax, jnp, P,
      outer={"inner_steps": 4, "fragments": 1, "overlap": tau})
  blocking, overlapped = run("diloco-loco", 1), run("diloco-loco-overlap", 1)
  assert blocking["overlap"] == 0 and overlapped["overlap"] == 1
  assert overlapped["predicted_bits_per_param"] == pytest.approx(
      blocking["predicted_bits_per_param"], rel=0.01)
  assert blocking["merge_step_s"] is None and overlapped["merge_step_s"] > 0
  assert all(r[k] > 0 for r in (blocking, overlapped) for k in ("inner_s", "sync_step_s"))


CO3_METHODS = ("co3-fp4", "co3-fp8", "co3-fp4-coded")


def _co3_per_shard(method: str, n: int) -> bool:
  """Whether co3's own accounting (co3_exchange.predicted_bits at the default slots' usual
  size) has `method` take the per-shard exchange on n devices: what netbench must record."""
  settings = importlib.import_module("loco_jax.transforms.co3_settings")
  co3_host = importlib.import_module("loco_jax.transforms.co3_host")
  co3_exchange = importlib.import_module("loco_jax.transforms.co3_exchange")
  fmt = settings.FORMATS[method.split("-")[1]]
  bits = co3_host.usual_capacity_bits(fmt)
  gathered = (co3_host.usual_sum_capacity_bits(n) if method.endswith("-coded") else 16.0)
  return (co3_exchange.predicted_bits(n, bits, gathered, True)
          < co3_exchange.predicted_bits(n, bits, gathered, False))


@pytest.mark.slow
def test_co3_on_three_hosts_sends_its_slots_and_records_its_exchange_and_counts(tmp_path):
  # Three hosts: co3-fp4-coded runs the per-shard all-to-all and the coded gather on the wire,
  # co3-fp4 the all-gather of whole coded gradients (co3's own choice at 3 devices).
  out = tmp_path / "co3.json"
  log = _netbench_on_the_wire(
      ["--hosts", "3", "--rate", "100mbit", "--params", str(2**19), "--methods",
       "co3-fp4,co3-fp4-coded", "--steps", "3", "--warmup", "1", "--exchange-only",
       "--timeout", "120", "--pin-cores", "--json", str(out)])
  assert "overflows (steps)" in log   # the table of what ran and the state's counts
  records = {r["method"]: r for r in json.loads(out.read_text())}
  for method, r in records.items():
    assert ("all-to-all" in r["exchange"]) == _co3_per_shard(method, 3), r["exchange"]
    assert r["counts"] == {"overflows": 0, "extended": 0, "rejected": 0}
    assert r["conditional_steps"] == r["extension_steps"] == 0
    # The slots are sent whole: every host's bytes are the compiled program's prediction.
    for bits in r["payload_bits_per_host"]:
      assert abs(bits / r["predicted_bits_per_param"] - 1) <= 0.02, (method, bits, r)
    coded = r["gauges_per_device"]["coded_bits"]
    assert len(coded) == 3 and all(1.0 < b < 4.0 for b in coded), coded
    cores = sorted(os.sched_getaffinity(0))  # --pin-cores: host i on core i % cores
    assert r["host_cpus"] == [[cores[i % len(cores)]] for i in range(3)], r["host_cpus"]


def _measure_in_process(method: str, n: int, n_params: int = 4096, steps: int = 2,
                        profile: int = 0, warmup: int = 1) -> dict:
  """netbench's record of `method` on n of this process's simulated devices (no wire: only
  what the host reads from the compiled program and the method's state)."""
  import argparse
  import jax
  from jax.sharding import PartitionSpec as P
  from loco_jax.apps import netbench_worker
  from loco_jax.train import parallel
  args = argparse.Namespace(params=n_params, steps=steps, warmup=warmup, hosts=1, nodes=1,
                            devices_per_host=n, interface="lo", profile=profile)
  mesh = parallel.data_mesh(n)
  barrier = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "data"), mesh=mesh,
                                  in_specs=P("data"), out_specs=P()))
  ones = netbench_worker._ones(mesh, jax)
  record = netbench_worker._measure(method, args, mesh, barrier, ones, [])
  return {**record, "host": 0}


@pytest.mark.parametrize("method, n", [("co3-fp4-coded", 2), ("co3-fp4-coded", 4),
                                       ("co3-fp4", 4)])
def test_co3_methods_record_which_exchange_ran_and_their_coded_bits(method, n):
  r = _measure_in_process(method, n, profile=1 if n == 4 else 0)
  assert r["finite"] and r["counts"] == {"overflows": 0, "extended": 0, "rejected": 0}
  assert ("all-to-all" in r["exchange"]) == _co3_per_shard(method, n), r["exchange"]
  assert len(r["gauges"]["coded_bits"]) == n and all(0 < b < 4 for b in r["gauges"]["coded_bits"])
  # The raw resend after an overflow is conditional: outside the every-step prediction.
  assert r["conditional_bits_per_param"] > 0
  if method == "co3-fp4-coded":   # the all-gather at 2 devices, the per-shard exchange at 4
    assert _co3_per_shard(method, n) == (n > 2)
  if n == 4:   # the traced step, split: CO3's coder runs in host callbacks
    assert r["profile"]["wall_s"] > 0
    assert all(r["profile"][k] > 0 for k in netbench_profile.KINDS), r["profile"]
    assert r["profile"]["top"][0]["seconds"] > 0
  else:
    assert r["profile"] is None


def test_short_steps_are_timed_until_they_fill_a_second():
  from loco_jax.apps import netbench_worker
  assert netbench_worker.timed_steps(5, 0.3) == 5 and netbench_worker.timed_steps(5, 0.05) == 20
  # One warm-up step compiles: its time does not count, and --steps is taken as given.
  assert _measure_in_process("fp32", 2, warmup=1)["steps"] == 2
  # Two: the second, milliseconds at 4,096 parameters, asks for many more.
  r = _measure_in_process("fp32", 2, warmup=2)
  assert 2 < r["steps"] <= netbench_worker.MAX_TIMED_STEPS, r["steps"]


def test_host_work_is_the_busiest_hosts_cpu_outside_its_collectives():
  r = _measure_in_process("loco", 2)
  assert r["cpu_s"] > 0 and r["collectives_cpu_s"] > 0
  hosts = [{**r, "cpu_s": 0.5, "collectives_cpu_s": 0.2},
           {**r, "host": 1, "cpu_s": 0.4, "collectives_cpu_s": 0.0}]
  (record,) = netbench_report.summarize(hosts, 2, "1gbit", 4096)
  assert record["host_work_s"] == pytest.approx(0.4)
  row = netbench_report.format_table([record])[2].split(" | ")
  assert row[6] == f"{0.4e9 / 4096:.1f}"   # ns a parameter a step


def test_profile_sums_thunks_by_the_kind_of_their_instruction():
  hlo = """ENTRY %main {
  %p = f32[8]{0} parameter(0)
  %add_fusion.1 = f32[8]{0} fusion(%p), kind=kLoop, calls=%fused
  %all-to-all.3 = (u8[1,4]{1,0}, u8[1,4]{1,0}) all-to-all(%a, %b), channel_id=1
  %psum_invariant.7 = f32[] all-reduce(%x), channel_id=2, to_apply=%sum
  %buffer_callback.2 = (u8[4,9]{1,0}, s32[4]{0}) custom-call(%y), custom_call_target="xla_buffer_python_cpu_callback"
  %conditional.4 = (f32[1]{0}) conditional(%c, %t, %f), branch_computations={%r1, %r2}
}"""
  kinds = netbench_profile.instruction_kinds(hlo)
  assert kinds == {"add_fusion.1": "compute", "all-to-all.3": "collectives",
                   "psum_invariant.7": "collectives", "buffer_callback.2": "host_callbacks"}
  events = [{"ph": "X", "name": "add_fusion.1", "dur": 3000},
            {"ph": "X", "name": "all-to-all.3", "dur": 5000},
            {"ph": "X", "name": "psum_invariant.7", "dur": 1000},
            {"ph": "X", "name": "buffer_callback.2", "dur": 7000},
            {"ph": "X", "name": "conditional.4", "dur": 99000},   # its thunks are counted
            {"ph": "X", "name": "Rendezvous", "dur": 99000},      # inside a collective
            {"ph": "i", "name": "add_fusion.1", "dur": 99000}]
  assert netbench_profile.thunk_seconds(events, kinds, steps=2) == pytest.approx(
      {"collectives": 0.003, "host_callbacks": 0.0035, "compute": 0.0015})
  top = netbench_profile.top_instructions(events, kinds, {"add_fusion.1": "fp.py:12"}, steps=2,
                                          count=2)
  assert top == [{"name": "buffer_callback.2", "kind": "host_callbacks", "source": "?",
                  "seconds": pytest.approx(0.0035)},
                 {"name": "all-to-all.3", "kind": "collectives", "source": "?",
                  "seconds": pytest.approx(0.0025)}]


def test_instruction_sources_name_the_library_lines_that_made_each_instruction():
  # The tables of a compiled module's text (jax 0.10): frame 3 (fp.py:141) was called from
  # frame 2 (co3.py:201), called from frame 1 (an application's line); parent ids are + 1.
  hlo = """HloModule jit_step

FileNames
1 "/x/loco_jax/apps/netbench_worker.py"
2 "/x/loco_jax/transforms/co3.py"
3 "/x/loco_jax/codecs/fp.py"
FunctionNames
1 "run"
FileLocations
1 {file_name_id=1 function_name_id=1 line=12 end_line=12 column=2 end_column=2}
2 {file_name_id=2 function_name_id=1 line=201 end_line=201 column=2 end_column=2}
3 {file_name_id=3 function_name_id=1 line=141 end_line=141 column=2 end_column=2}
StackFrames
1 {file_location_id=1 parent_frame_id=1}
2 {file_location_id=2 parent_frame_id=2}
3 {file_location_id=3 parent_frame_id=3}

ENTRY %main {
  %fusion.3 = u8[8]{0} fusion(%p), kind=kLoop, calls=%f, metadata={op_name="jit(step)/round" stack_frame_id=3}
  %fusion.4 = u8[8]{0} fusion(%p), kind=kLoop, calls=%f, metadata={op_name="jit(step)/x" stack_frame_id=1}
  %copy.1 = f32[8]{0} copy(%q)
}"""
  assert netbench_profile.instruction_sources(hlo) == {
      "fusion.3": "codecs/fp.py:141 < transforms/co3.py:201",
      "fusion.4": "apps/netbench_worker.py:12"}   # no library frame: the innermost one


def _sent_alone(record: dict, field: str, scale: float = 1.0, n_params: int = 2**20) -> dict:
  """`record` of one host measured in process (nothing on a wire) as if it had sent its
  `field` bits a parameter x `scale` a step, headers and all, for `n_params` parameters (enough
  for the payload to be checked)."""
  bits = record[field] * scale
  counts = _counts(bits * record["steps"], n_params)
  return {**record, "n_params": n_params, "payload_bits_per_host": [bits],
          "sent_per_host": [counts]}


def test_overflow_steps_add_the_raw_resend_to_the_prediction(monkeypatch):
  # Slots of 1 bit a symbol: every step's streams overflow and the exchange runs again raw.
  from loco_jax.transforms import co3
  tight = netbench_methods.METHODS["co3-fp4-coded"]._replace(
      make=lambda: co3("fp4", gamma=0.7, axis_name="data", gather="coded",
                           capacity_bits=1.0))
  monkeypatch.setitem(netbench_methods.METHODS, "co3-tight", tight)
  r = _measure_in_process("co3-tight", 4, steps=3)
  assert r["counts"] == {"overflows": 3, "extended": 0, "rejected": 0}
  assert r["conditional_steps"] == 3
  assert r["finite"]
  (record,) = netbench_report.summarize([r], 1, "1gbit", 4096)
  assert record["expected_bits_per_param"] == pytest.approx(
      record["predicted_bits_per_param"] + record["conditional_bits_per_param"])
  # A payload that matches the every-step prediction alone fails, and the failure says why.
  (failure,) = netbench_report.check([_sent_alone(record, "predicted_bits_per_param")], 0.0)
  assert "co3-tight" in failure and "conditional collectives, run on 3 of 3" in failure
  assert netbench_report.check([_sent_alone(record, "expected_bits_per_param", 1.005)], 0.0) == []
  assert "3 of 3" in netbench_report.format_state_table([record])[2]


def test_extended_steps_add_the_slots_extensions_alone_to_the_prediction(monkeypatch):
  # Default slots whose usual size is 1 bit a symbol: every step's streams take the extension
  # to the model's worst case (3.76 bits), and none overflows it.
  monkeypatch.setattr(importlib.import_module("loco_jax.transforms.co3_settings"), "usual_capacity_bits",
                      lambda fmt: 1.0)
  r = _measure_in_process("co3-fp4-coded", 4, steps=3)
  assert r["counts"] == {"overflows": 0, "extended": 3, "rejected": 0}
  assert (r["conditional_steps"], r["extension_steps"]) == (0, 3) and r["finite"]
  (record,) = netbench_report.summarize([r], 1, "1gbit", 4096)
  assert 0 < record["extension_bits_per_param"] < record["conditional_bits_per_param"]
  assert record["expected_bits_per_param"] == pytest.approx(
      record["predicted_bits_per_param"] + record["extension_bits_per_param"])
  assert "conditional collectives, run on 3 of 3" in netbench_report.check(
      [_sent_alone(record, "predicted_bits_per_param")], 0.0)[0]


def test_profile_table_lists_each_profiled_methods_costliest_instructions():
  top = [{"name": "fusion.3", "kind": "compute", "source": "codecs/fp.py:141", "seconds": 0.015}]
  record = {"method": "co3-fp4", "hosts": 2, "rate": "1gbit", "step_s": 0.13,
            "profile": {"wall_s": 0.133, "collectives": 0.027, "host_callbacks": 0.048,
                        "compute": 0.071},
            "profile_per_host": [{"top": top}, {"top": []}]}
  lines = netbench_report.format_profile_table([record, {**record, "profile": None}])
  assert sum(line.startswith("| co3-fp4 | 2 |") for line in lines) == 1
  assert "| fusion.3 | compute | codecs/fp.py:141 | 15.00 |" in lines
