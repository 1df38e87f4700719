"""The `loco-jax demo` command on a tiny config: results.json, bits from the HLO, bad input."""

import collections
import contextlib
import dataclasses
import errno
import io
import json
import math
import os
import re
import shutil
import signal
import subprocess
import time

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loco_jax.apps import cli, demo, demo_output
from loco_jax.train import files

TINY = ["--steps", "4", "--d-model", "64", "--layers", "1", "--heads", "4", "--batch", "1",
        "--seq-len", "16", "--eval-batches", "2"]
TEXT = b"the quick brown fox jumps over the lazy dog; " * 400  # 18 KB, letters and "; "


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
  """One demo run (none and loco4) on a text file: (exit status, out folder, stderr)."""
  root = tmp_path_factory.mktemp("demo")
  text = root / "corpus.txt"
  text.write_bytes(TEXT)
  out = root / "out"
  err = io.StringIO()
  with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()) as table:
    status = cli.main(["demo", *TINY, "--methods", "none,loco4", "--data", str(text),
                       "--out", str(out)])
  return status, out, err.getvalue(), table.getvalue()


@pytest.mark.slow
def test_results_json(tiny_run):
  status, out, _, table = tiny_run
  assert status == 0
  results = json.loads((out / "results.json").read_text())
  assert [r["method"] for r in results] == ["none", "loco4"]
  for r in results:
    assert tuple(r) == demo_output.RESULT_KEYS
    assert math.isfinite(r["final_loss"]) and math.isfinite(r["eval_loss"])
    assert 0 < r["step_time_s"] < 60
  none, loco4 = results
  assert none["gradient_bits_per_param"] == pytest.approx(32.0)
  # 4 bits plus the block scales. The bucket layout (few block lengths, so few kernels to
  # compile) pads this tiny model's small leaves a little more than per-leaf blocks did: 4.125
  # bits against 4.058 (the per-leaf layout); on the GPT-2-shaped tree the two are level.
  assert 4.0 <= loco4["gradient_bits_per_param"] <= 4.13
  # Wire bits from the HLO: a float32 ring all-reduce sends 2 * 7/8 * 32 bits; LoCo 7/8 of its
  # 4-bit all-to-all plus 7/8 of a bfloat16 all-gather.
  assert none["wire_bits_per_param"] == pytest.approx(56.0, abs=0.05)
  assert 7 / 8 * (4.0 + 16.0) <= loco4["wire_bits_per_param"] <= 7 / 8 * (4.13 + 16.5)
  assert "loco4" in table and "grad bits" in table
  assert (out / "loss_curves.csv").read_text().startswith("step,none,loco4\n")
  assert (out / "loss_curves.png").read_bytes()[:4] == b"\x89PNG"
  assert not [p.name for p in out.iterdir() if p.name.startswith(".")]  # no temp files left


@pytest.mark.slow
def test_progress_goes_to_stderr(tiny_run):
  _, _, err, table = tiny_run
  assert "[1/2] none" in err and "[2/2] loco4" in err and "4/4" in err
  assert "[1/2]" not in table


@pytest.mark.slow
def test_diloco_methods_send_one_sync_every_inner_steps(tmp_path):
  # The bits are the run's mean over the inner steps (nothing) and the syncs (every 4th step).
  text = tmp_path / "corpus.txt"
  text.write_bytes(TEXT)
  with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
    status = cli.main(["demo", *TINY, "--steps", "8", "--inner-steps", "4", "--methods",
                       "loco4,diloco,diloco-loco4,diloco-loco4-quantized", "--data", str(text),
                       "--out", str(tmp_path / "out")])
  assert status == 0
  results = {r["method"]: r for r in json.loads((tmp_path / "out/results.json").read_text())}
  assert results["diloco"]["wire_bits_per_param"] == pytest.approx(56.0 / 4, abs=0.02)
  assert results["diloco-loco4"]["wire_bits_per_param"] == pytest.approx(
      results["loco4"]["wire_bits_per_param"] / 4, rel=0.01)
  # The quantized gather: 4 bits back instead of 16.
  assert (results["diloco-loco4-quantized"]["wire_bits_per_param"]
          < 0.5 * results["diloco-loco4"]["wire_bits_per_param"])
  assert all(math.isfinite(r["eval_loss"]) for r in results.values())


def test_data_file_is_what_it_trains_on(tmp_path):
  path = tmp_path / "corpus.txt"
  path.write_bytes(TEXT)
  config = demo.DemoConfig(steps=3, seq_len=16, batch_per_device=1, eval_batches=2)
  corpus = demo.load_corpus(config, path)
  assert corpus.train_SxBxL.shape == (3, 8, 17)
  assert set(np.unique(corpus.train_SxBxL)) <= set(TEXT)
  assert set(np.unique(corpus.eval_KxBxL)) <= set(TEXT)
  folder = tmp_path / "folder"
  folder.mkdir()
  (folder / "a.txt").write_bytes(TEXT)
  assert demo.load_corpus(config, folder).train_SxBxL.shape == (3, 8, 17)
  default = demo.load_corpus(config)  # the stdlib sources
  assert "standard library" in default.source and default.train_SxBxL.shape == (3, 8, 17)


def _fails(capsys, argv, *phrases):
  assert demo.main(argv) == 2
  err = capsys.readouterr().err
  for phrase in phrases:
    assert phrase in err, err
  return err


def test_bad_input_exits_2(tmp_path, capsys):
  _fails(capsys, ["--methods", "none,loco5"], "unknown method", "'loco5'", "loco4")
  _fails(capsys, ["--steps", "0"], "--steps", "positive")
  _fails(capsys, ["--steps", "-3"], "--steps")
  _fails(capsys, ["--steps", "ten"], "--steps")
  _fails(capsys, ["--data", str(tmp_path / "missing.txt")], "missing.txt", "no such")
  (tmp_path / "empty.txt").write_bytes(b"")
  _fails(capsys, ["--data", str(tmp_path / "empty.txt"), *TINY], "empty.txt", "empty")
  (tmp_path / "short.txt").write_bytes(b"tiny")
  _fails(capsys, ["--data", str(tmp_path / "short.txt"), *TINY], "short.txt", "bytes")
  (tmp_path / "no_text").mkdir()
  _fails(capsys, ["--data", str(tmp_path / "no_text"), *TINY], "no text files")
  assert cli.main(["demo", "--methods", "bogus"]) == 2
  # The overlap options, refused where no method takes them or past their bounds.
  _fails(capsys, ["--methods", "diloco-loco4", "--overlap", "2"], "--overlap applies to the "
         "-overlap DiLoCo methods")
  _fails(capsys, ["--methods", "loco4", "--alpha", "0.5"], "--alpha applies to the DiLoCo")
  _fails(capsys, ["--methods", "diloco-overlap", "--alpha", "1.5"], "--alpha", "[0, 1]")
  _fails(capsys, ["--methods", "diloco-overlap", "--inner-steps", "4", "--overlap", "4"],
         "--overlap 4 must be below --inner-steps 4")


def test_interrupted_demo_writes_nothing(tmp_path, monkeypatch, capsys):
  def interrupt(*args, **kwargs):
    raise KeyboardInterrupt
  monkeypatch.setattr(demo, "run_method", interrupt)
  out = tmp_path / "out"
  assert demo.main([*TINY, "--methods", "none", "--out", str(out)]) == 130
  assert "interrupted" in capsys.readouterr().err
  assert not list(out.iterdir())


def test_json_write_is_atomic(tmp_path):
  path = tmp_path / "results.json"
  files.write_json_atomic(path, [{"method": "none"}])
  with pytest.raises(TypeError):  # fails halfway through serializing
    files.write_json_atomic(path, [{"method": "loco4"}, {"bad": object()}])
  assert json.loads(path.read_text()) == [{"method": "none"}]
  assert [p.name for p in tmp_path.iterdir()] == ["results.json"]


def test_methods_and_co3_hook():
  assert set(demo.available_methods()) <= set(demo.METHODS)
  assert demo.METHODS[:6] == ("none", "bf16", "int4-noef", "ef4", "loco4", "loco4-fixed")
  if demo.co3_status() is None:
    assert "co3-fp4" in demo.available_methods()
  else:
    assert "co3-fp4" not in demo.available_methods()
  with pytest.raises(ValueError, match="unknown method"):
    demo.make_compressor("loco5")


def test_gradient_collectives_are_of_the_largest_kind_not_the_first():
  """co3's coded gather agrees on its scales (a small pmin) before its all-to-all."""
  from loco_jax.comm import hlo
  scales = hlo.Collective("all-reduce", "f32", 80, 8)
  slots = hlo.Collective("all-to-all", "u8", 66_000, 8)
  flag = hlo.Collective("all-reduce", "f32", 4, 8)
  sums = hlo.Collective("all-gather", "u8", 110_000, 8)
  assert demo.gradient_collectives([scales, flag, slots, sums]) == [slots]
  assert demo.gradient_bits([scales, flag, slots, sums], 137_216) == pytest.approx(
      8 * 66_000 / 137_216)


def test_co3_wire_bits_add_the_conditional_collectives_on_the_steps_that_ran_them():
  from loco_jax.comm import coded, hlo
  n_params = 1000
  always = [hlo.Collective("all-to-all", "u8", 4 * 400, 4),
            hlo.Collective("all-gather", "u8", 4 * 500, 4)]
  extension = hlo.Collective("all-to-all", "u8", 4 * 100, 4, True,
                             op_name=f"shard_map/{coded.EXTENSION_SCOPE}/cond/all_to_all")
  resend = hlo.Collective("all-to-all", "u8", 4 * 500, 4, True, op_name="cond/all_to_all")
  state = collections.namedtuple("State", "coded_bits overflows extended rejected")
  # 10 steps: 3 took the slots' extension, 1 of them then overflowed it and resent raw.
  states = [state(np.full(4, 2.5), 0, 0, 0)] * 9 + [state(np.full(4, 2.5), 1, 3, 0)]
  record = demo.co3_record(states, always + [extension, resend], n_params, 4, "coded")
  bits = lambda nbytes: 8 * 0.75 * nbytes / n_params   # (n-1)/n of a device's 4 rows
  assert record["extension_wire_bits"] == pytest.approx(bits(400))
  assert record["resend_wire_bits"] == pytest.approx(bits(2000))
  assert record["mean_wire_bits"] == pytest.approx(
      bits(1600 + 2000) + (3 * bits(400) + bits(2000)) / 10, abs=1e-4)


# --- Flags and --out are checked before jax starts; outputs are replaced as one set -------------

def _no_device_setup(monkeypatch):
  def setup(*args, **kwargs):
    pytest.fail("the demo set up jax devices before rejecting its input")
  monkeypatch.setattr(demo, "setup_devices", setup)


def _cli_fails(capsys, argv, *phrases) -> str:
  assert cli.main(["demo", *argv]) == 2
  err = capsys.readouterr().err
  for phrase in phrases:
    assert phrase in err, (phrase, err)
  assert "Traceback" not in err
  return err


def test_flags_rejected_before_jax_starts(tmp_path, monkeypatch, capsys):
  _no_device_setup(monkeypatch)
  out = tmp_path / "out"
  _cli_fails(capsys, ["--devices", "1000", "--out", str(out)], "--devices",
             f"1..{demo.MAX_DEVICES}", "1000")
  _cli_fails(capsys, ["--devices", "0"], "--devices", f"1..{demo.MAX_DEVICES}")
  _cli_fails(capsys, ["--seed", "-1"], "--seed", "0..2**63-1", "-1")
  _cli_fails(capsys, ["--seed", str(2**63)], "--seed", "0..2**63-1")
  _cli_fails(capsys, ["--seq-len", "100000", "--out", str(out)], "--seq-len 100000",
             "half of this machine's", "at most")
  _cli_fails(capsys, ["--steps", str(10**12), "--out", str(out)], "--steps", "at most")
  assert not out.exists()  # rejected before the output folder was made


def test_out_checked_before_training(tmp_path, monkeypatch, capsys):
  _no_device_setup(monkeypatch)
  (tmp_path / "file").write_text("x")
  _cli_fails(capsys, ["--out", str(tmp_path / "file")], "--out", "exists and is a file")
  _cli_fails(capsys, ["--out", str(tmp_path / "file" / "a" / "b")], "--out",
             f"is under {tmp_path / 'file'}, which is a file")
  (tmp_path / "mine").mkdir()
  (tmp_path / "mine" / "notes.txt").write_text("keep me")
  _cli_fails(capsys, ["--out", str(tmp_path / "mine")], "--out", "notes.txt",
             "does not write")
  assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"

  def denied(target):
    raise PermissionError(13, "Permission denied", str(target.parent))
  monkeypatch.setattr(files, "staging_folder", denied)
  _cli_fails(capsys, ["--out", str(tmp_path / "new")], "--out", "not writable",
             "Permission denied")


@contextlib.contextmanager
def _read_only(folder):
  """`folder` without write permission; for root, who writes there anyway, a read-only bind
  mount of it (skips where mounting is not allowed either)."""
  folder.chmod(0o555)
  mounted = False
  try:
    if os.access(folder, os.W_OK):
      bind = ["mount", "--bind", str(folder), str(folder)]
      if shutil.which("mount") is None or subprocess.run(bind, capture_output=True).returncode:
        pytest.skip("this user writes in read-only folders and may not mount one read-only")
      mounted = True
      remount = ["mount", "-o", "remount,bind,ro", str(folder)]
      subprocess.run(remount, capture_output=True, check=True)
    yield folder
  finally:
    if mounted:
      subprocess.run(["umount", str(folder)], capture_output=True, check=True)
    folder.chmod(0o755)


def test_out_in_a_read_only_folder(tmp_path, monkeypatch, capsys):
  _no_device_setup(monkeypatch)
  (tmp_path / "locked").mkdir()
  with _read_only(tmp_path / "locked") as locked:
    _cli_fails(capsys, ["--out", str(locked / "out")], "--out", "not writable")
    assert not (locked / "out").exists()


@settings(max_examples=40, deadline=None)
@given(devices=st.integers(1, demo.MAX_DEVICES), batch=st.integers(1, 64),
       heads=st.integers(1, 16), layers=st.integers(1, 24),
       memory_gib=st.integers(1, 2048))
def test_seq_len_bound_is_the_one_stated(devices, batch, heads, layers, memory_gib):
  """The largest --seq-len the message states is accepted; one more is refused."""
  config = demo.DemoConfig(steps=1, devices=devices, batch_per_device=batch, n_heads=heads,
                           d_model=heads, n_layers=layers, seq_len=10**7)
  memory = memory_gib * 2**30
  with pytest.raises(demo.DemoError, match=r"--seq-len 10000000: .* at most (\d+) ") as e:
    demo._check_config(config, memory)
  bound = int(re.search(r"at most (\d+) ", str(e.value)).group(1))
  demo._check_config(dataclasses.replace(config, seq_len=bound), memory)
  with pytest.raises(demo.DemoError, match=f"--seq-len {bound + 1}: "):
    demo._check_config(dataclasses.replace(config, seq_len=bound + 1), memory)


def _fake_run(loss: float):
  """run_method without training: `loss` at every step, so that two runs' outputs differ."""
  def run(name, compressor, config, corpus, progress=None, **kwargs):
    return demo_output.MethodResult(name, loss, loss + 0.1, 4.0, 20.0, 0.01,
                             [loss + i / 10 for i in range(config.steps)][::-1], 0.0, 0, [])
  return run


def _snapshot(folder) -> dict[str, bytes]:
  return {p.name: p.read_bytes() for p in folder.iterdir()}


def test_interrupted_write_keeps_the_previous_outputs(tmp_path, monkeypatch, capsys,
                                                     sigint_raises):
  text = tmp_path / "corpus.txt"
  text.write_bytes(TEXT)
  out = tmp_path / "runs" / "out"
  argv = [*TINY, "--methods", "none,loco4", "--data", str(text), "--out", str(out)]
  monkeypatch.setattr(demo, "run_method", _fake_run(2.0))
  assert demo.main(argv) == 0
  previous = _snapshot(out)
  assert sorted(previous) == sorted(demo_output.OUTPUTS)
  plot = demo_output.plot_curves

  def sigint_while_plotting(path, *args):
    assert (path.parent / "results.json").exists()  # the new results.json is written by now
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(10)  # the KeyboardInterrupt comes here
    pytest.fail("SIGINT did not interrupt the demo")

  def disk_full(path, *args):
    raise OSError(errno.ENOSPC, "No space left on device", str(path))

  monkeypatch.setattr(demo, "run_method", _fake_run(3.0))
  for writer, status, said in ((sigint_while_plotting, 130, "interrupted while writing"),
                               (disk_full, 1, "No space left")):
    monkeypatch.setattr(demo_output, "plot_curves", writer)
    assert demo.main(argv) == status
    err = capsys.readouterr().err
    assert said in err and f"{out} is as it was" in err
    assert _snapshot(out) == previous  # all the previous outputs, none of the new ones
    assert [p.name for p in out.parent.iterdir()] == ["out"]  # no staging folder left

  monkeypatch.setattr(demo_output, "plot_curves", plot)
  assert demo.main(argv) == 0
  now = _snapshot(out)
  assert sorted(now) == sorted(previous)
  assert all(now[name] != previous[name] for name in now)  # a whole new set
  assert json.loads(now["results.json"])[0]["final_loss"] == 3.0
  assert [p.name for p in out.parent.iterdir()] == ["out"]


# --- --reset-interval: LoCo's error reset, visible in a short run -------------------------------

def test_reset_interval_in_help(capsys):
  assert cli.main(["demo", "--help"]) == 0
  text = " ".join(capsys.readouterr().out.split())  # argparse wraps the help
  assert "--reset-interval N" in text and "0: never" in text and "default 1024" in text


def test_reset_interval_flag_checked_before_jax_starts(monkeypatch, capsys):
  _no_device_setup(monkeypatch)
  _cli_fails(capsys, ["--reset-interval", "-1"], "--reset-interval", "an integer >= 0", "-1")
  _cli_fails(capsys, ["--reset-interval", "ten"], "--reset-interval", "'ten'")
  _cli_fails(capsys, ["--reset-interval", "8", "--methods", "none,ef4"], "--reset-interval",
             "applies to the LoCo methods", "none, ef4")


def test_reset_interval_reaches_the_runs(tmp_path, monkeypatch, capsys):
  seen = []

  def run(name, compressor, config, corpus, progress=None, **kwargs):
    seen.append((name, config.reset_interval))
    return _fake_run(2.0)(name, compressor, config, corpus, progress)
  monkeypatch.setattr(demo, "run_method", run)
  text = tmp_path / "corpus.txt"
  text.write_bytes(TEXT)
  argv = [*TINY, "--methods", "none,loco4", "--data", str(text), "--out", str(tmp_path / "out")]
  assert demo.main([*argv, "--reset-interval", "2"]) == 0
  assert seen == [("none", 2), ("loco4", 2)]
  assert "LoCo's error reset every 2 steps" in capsys.readouterr().err
  assert demo.main([*argv, "--reset-interval", "0"]) == 0
  assert "LoCo's error never reset" in capsys.readouterr().err
  assert demo.main(argv) == 0
  assert seen[-1] == ("loco4", 1024)


# loco4-entropy runs only on an axis; its error is loco4's (the coding is lossless:
# tests/test_loco_entropy.py).
@pytest.mark.slow
@pytest.mark.parametrize("method", [m for m in demo.LOCO_METHODS if m != "loco4-entropy"])
def test_reset_interval_resets_each_loco_method(method):
  """With reset_interval 3 the fourth step (k = 3) starts from a zero error: its output is a
  fresh state's first output for the same gradient; with the default it is not."""
  rng = np.random.default_rng(1)
  # 2e-5: gradients on the scale of loco4-fixed's s = 2**17 (the others' scales follow them).
  grads = [{"w": 2e-5 * rng.standard_normal((8, 256)).astype(np.float32)} for _ in range(4)]

  def outputs(reset_interval):
    """The fourth step's output, and the output of a fresh state's first step on its gradient."""
    opt = demo.make_compressor(method, demo.DemoConfig(reset_interval=reset_interval), None)
    update = jax.jit(opt.update)
    state = opt.init(grads[0])
    for g in grads:
      out, state = update(g, state)
    return np.asarray(out["w"]), np.asarray(update(grads[3], opt.init(grads[3]))[0]["w"])

  reset, fresh = outputs(3)
  np.testing.assert_allclose(reset, fresh, rtol=1e-6, atol=1e-7)
  kept, fresh = outputs(1024)
  assert np.abs(kept - fresh).max() > 1e-3 * np.abs(fresh).max()


def test_the_old_step_programs_call_names_its_replacement():
  with pytest.raises(TypeError, match=r"demo.lowered_programs\(step, mode, state, batch\)"):
    demo.step_programs(None, "ddp", {})
