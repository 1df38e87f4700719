"""experiments/long_run.py in its short form (a tiny model, 32 steps, a LoCo reset every 8): its
records, a run killed with SIGKILL and resumed to the uninterrupted run's curve, and the report
(experiments/long_run_report.py) on those files."""

import collections
import dataclasses
import json
import math
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from loco_jax import LocoState
from loco_jax.core.leaves import ByGroup
from loco_jax.transforms.loco_state import GroupState

EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments"
sys.path.insert(0, str(EXPERIMENTS))

import long_run  # noqa: E402
import long_run_report  # noqa: E402

STEPS, EVERY, CHECKPOINT, WARMUP, PEAK = 32, 4, 8, 4, 2e-3
TINY_CONFIG = dict(steps=STEPS, d_model=32, n_layers=1, n_heads=2, d_ff=64, seq_len=16,
                   batch_per_device=1, eval_every=EVERY, eval_batches=2, eval_batch=16,
                   checkpoint_every=CHECKPOINT, warmup=WARMUP, peak_lr=PEAK, corpus_bytes=400_000)
TINY = [arg for key, value in TINY_CONFIG.items()
        for arg in ("--" + key.replace("_", "-"), str(value))]
LOCO = "loco4-r8"
KILL = 24  # a checkpoint step: killed after its record, before its checkpoint
# What a record measures (the rest: when and in which process it was measured).
MEASURED = ("step", "eval_loss", "train_loss", "train_losses", "lr", "param_norm", "error")


def _records(folder: Path) -> list[dict]:
  return [json.loads(line) for line in (folder / "records.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def short_runs(tmp_path_factory):
  """Uninterrupted runs of none and loco4-r8, and a loco4-r8 run killed at step 24 (in a
  subprocess) then resumed: (whole out folder, killed out folder, what the kill left)."""
  import jax
  jax.devices()  # the backend with conftest's 8 devices, before the script's setup
  root = tmp_path_factory.mktemp("long")
  whole, killed = root / "whole", root / "killed"
  # Killed and resumed in processes of their own, as a campaign's would be (the second takes
  # the first's compiled step from the persistent cache); the first runs while this process
  # runs the uninterrupted ones (compiling is single-threaded: two cores, two compilers).
  argv = [sys.executable, str(EXPERIMENTS / "long_run.py"), "run", "--method", LOCO, *TINY,
          "--out", str(killed), "--cache-dir", str(root / "xla-cache")]
  process = subprocess.Popen([*argv, "--kill-after-step", str(KILL)], stderr=subprocess.PIPE,
                             text=True)
  for method in ("none", LOCO):
    assert long_run.main(["run", "--method", method, *TINY, "--out", str(whole)]) == 0
  _, err = process.communicate()
  assert process.returncode == -signal.SIGKILL, err[-2000:]
  folder = killed / f"{LOCO}-s0"
  from loco_jax.train import checkpoint
  left = dict(records=_records(folder), checkpoint=checkpoint.latest_step(folder / "checkpoints"))
  resumed = subprocess.run(argv, capture_output=True, text=True)
  assert resumed.returncode == 0, resumed.stderr[-2000:]
  assert f"from step {left['checkpoint']}" in resumed.stderr
  return whole, killed, left


def _schedule(t: int) -> float:
  """optax's warm-up and cosine decay, written out: 0 -> PEAK over WARMUP, then to PEAK / 10."""
  if t < WARMUP:
    return PEAK * t / WARMUP
  end = PEAK / 10
  return end + (PEAK - end) * 0.5 * (1 + math.cos(math.pi * (t - WARMUP) / (STEPS - WARMUP)))


@pytest.mark.slow
def test_records(short_runs):
  whole, _, _ = short_runs
  loco, none = _records(whole / f"{LOCO}-s0"), _records(whole / "none-s0")
  for records in (loco, none):
    assert [r["step"] for r in records] == list(range(0, STEPS + 1, EVERY))
    assert [len(r["train_losses"]) for r in records] == [0] + [EVERY] * (STEPS // EVERY)
    for r in records[1:]:
      assert np.isfinite(r["train_losses"]).all() and np.isfinite(r["eval_loss"])
      assert r["train_loss"] == pytest.approx(np.mean(r["train_losses"]))
      assert r["lr"] == pytest.approx(_schedule(r["step"] - 1), rel=1e-5)
    assert records[-1]["eval_loss"] < records[0]["eval_loss"] - 0.5
    assert np.all(np.diff([r["wall_s"] for r in records]) > 0)
  assert all(r["error"] is None for r in none)
  assert [r["error"]["count"] for r in loco] == [r["step"] for r in loco]
  assert loco[0]["error"]["norm_mean"] == 0.0  # init's zero error
  for r in loco[1:]:
    e = r["error"]
    assert 0 < e["norm_mean"] <= e["norm_max"] and 0 < e["scale_min"] <= e["scale_median"]
  # The same batches for both methods (the data depends on seed and step only): the first
  # step's loss, before any update, is the same.
  assert loco[1]["train_losses"][0] == pytest.approx(none[1]["train_losses"][0], rel=1e-6)


@pytest.mark.slow
def test_killed_run_resumes_to_the_same_curve(short_runs):
  whole, killed, left = short_runs
  assert [r["step"] for r in left["records"]] == list(range(0, KILL + 1, EVERY))
  assert left["checkpoint"] == KILL - CHECKPOINT  # the kill came before checkpoint 24
  expected, resumed = _records(whole / f"{LOCO}-s0"), _records(killed / f"{LOCO}-s0")
  assert len(resumed) == len(expected)
  for a, b in zip(expected, resumed):
    for key in MEASURED:
      want, got = (a[key], b[key]) if isinstance(a[key], dict) else ({key: a[key]}, {key: b[key]})
      assert got.keys() == want.keys()
      for k, value in want.items():
        if value is None or value == []:
          assert got[k] == value, (a["step"], k)
        else:
          np.testing.assert_allclose(got[k], value, rtol=1e-6, err_msg=f"step {a['step']}: {k}")
  # Measured in two processes: up to the checkpoint in the first, then in the second.
  assert [r["segment"] for r in resumed] == [0 if r["step"] <= left["checkpoint"] else 1
                                             for r in resumed]
  assert np.all(np.diff([r["wall_s"] for r in resumed]) > 0)
  assert resumed[:5] == left["records"][:5]  # what was kept is kept as it was


@pytest.mark.slow
def test_complete_run_is_not_run_again(short_runs, capsys):
  whole, _, _ = short_runs
  before = (whole / "none-s0" / "records.jsonl").read_bytes()
  assert long_run.main(["run", "--method", "none", *TINY, "--out", str(whole)]) == 0
  assert "complete" in capsys.readouterr().err
  assert (whole / "none-s0" / "records.jsonl").read_bytes() == before


@pytest.mark.slow
def test_other_settings_do_not_resume_a_run(short_runs, capsys):
  _, killed, _ = short_runs
  folder = killed / f"{LOCO}-s0"
  before = {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}
  argv = ["run", "--method", LOCO, *TINY, "--out", str(killed), "--peak-lr", "0.001"]
  assert long_run.main(argv) == 2
  err = capsys.readouterr().err
  assert "peak_lr: run 0.002, now 0.001" in err and "another --out" in err
  assert {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()} == before


@pytest.mark.slow
def test_a_run_continues_on_another_number_of_devices(short_runs, tmp_path, capsys):
  """The uninterrupted loco run's folder, cut back to its checkpoint of step 24, continues on
  4 devices of 2 windows each: the same global batch, so the same data; LoCo's errors merged."""
  import shutil
  whole, _, _ = short_runs
  folder = tmp_path / f"{LOCO}-s0"
  shutil.copytree(whole / folder.name, folder)
  expected = _records(folder)
  (folder / "records.jsonl").write_text("".join(
      json.dumps(r) + "\n" for r in expected if r["step"] <= KILL))
  four = [*TINY, "--out", str(tmp_path), "--devices", "4", "--batch-per-device", "2"]
  assert long_run.main(["run", "--method", LOCO, *four[:-2], "--batch-per-device", "1"]) == 2
  assert "global batch: run 8 x 1, now 4 x 1" in capsys.readouterr().err
  assert long_run.main(["run", "--method", LOCO, *four]) == 0
  assert "resharded from (data=8) to (data=4)" in capsys.readouterr().err
  resumed = _records(folder)
  assert [r["step"] for r in resumed] == [r["step"] for r in expected]
  assert [r.get("devices", 8) for r in resumed] == [8 if r["step"] <= KILL else 4
                                                    for r in resumed]
  first = next(r for r in resumed if r["step"] > KILL)
  assert "LocoState" in first["resharded"]
  # Step 25 runs on the params of step 24, restored exactly, and the same batch.
  after = [r for r in expected if r["step"] > KILL]
  assert first["train_losses"][0] == pytest.approx(after[0]["train_losses"][0], rel=1e-5)
  mine = np.concatenate([r["train_losses"] for r in resumed if r["step"] > KILL])
  theirs = np.concatenate([r["train_losses"] for r in after])
  noise = np.mean(np.abs(np.diff(np.concatenate([r["train_losses"] for r in expected]))))
  assert np.abs(mine - theirs).max() <= noise


def test_another_number_of_devices_must_keep_the_global_batch(tmp_path):
  path = tmp_path / "config.json"
  config = long_run.LongRunConfig(method="loco4")
  long_run.check_same_config(path, config)
  long_run.check_same_config(path, dataclasses.replace(config, devices=4, batch_per_device=2))
  with pytest.raises(ValueError, match=r"global batch: run 8 x 1, now 2 x 2"):
    long_run.check_same_config(path, dataclasses.replace(config, devices=2, batch_per_device=2))
  with pytest.raises(ValueError, match=r"seed: run 0, now 1"):
    long_run.check_same_config(path, dataclasses.replace(config, devices=4, batch_per_device=2,
                                                         seed=1))


@pytest.mark.parametrize("argv, message", [
    (["--method", "loco5"], "unknown method 'loco5'"),
    (["--method", "ef4-r8"], "ef4 has none"),
    (["--checkpoint-every", "6"], "multiple of --eval-every"),
    (["--steps", "0"], "--steps must be >= 1"),
    (["--eval-batch", "12"], "multiple of the 8 devices"),
])
def test_bad_arguments(argv, message, tmp_path, capsys):
  assert long_run.main(["run", *TINY, *argv, "--out", str(tmp_path)]) == 2
  assert message in capsys.readouterr().err
  assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_campaign_skips_complete_and_busy_runs(short_runs, tmp_path, capsys):
  whole, _, _ = short_runs
  assert len(long_run.CAMPAIGN) >= 10 and {("none", 1), ("loco4", 1)} <= set(long_run.CAMPAIGN)
  configs = [long_run.LongRunConfig(method=m, seed=0) for m in ("none", LOCO)]
  with long_run.exclusive(whole / f"{LOCO}-s0"):  # another worker's
    long_run.campaign([dataclasses.replace(c, **TINY_CONFIG) for c in configs], whole)
  err = capsys.readouterr().err
  assert "none-s0: complete" in err and f"{LOCO}-s0: skipped" in err
  with pytest.raises(long_run.Busy), long_run.exclusive(tmp_path):
    with long_run.exclusive(tmp_path):
      pass
  assert long_run.main(["campaign", "--runs", "none", "--out", str(tmp_path)]) == 2
  assert "expected method:seed" in capsys.readouterr().err


def test_error_stats_dequantize_each_block():
  """e = q / s per block of each device; a zero scale is a zero block."""
  group = GroupState((np.array([[1, -2, 3, 4], [127, 0, 0, -128]], np.int8).reshape(-1),),
                     (np.array([[2.0, 0.5], [0.0, 4.0]], np.float32).reshape(-1),), None, None)
  state = LocoState(np.int32(5), ByGroup({"": group}), None)
  stats = long_run.error_stats(state, devices=2)
  device0 = np.array([1 / 2, -2 / 2, 3 / 0.5, 4 / 0.5])
  device1 = np.array([0.0, 0.0, 0.0, -128 / 4])
  norms = [np.linalg.norm(device0), np.linalg.norm(device1)]
  assert stats["norm_mean"] == pytest.approx(np.mean(norms))
  assert stats["norm_max"] == pytest.approx(max(norms))
  assert (stats["scale_min"], stats["scale_median"], stats["scale_max"]) == (0.5, 2.0, 4.0)
  assert stats["zero_scale_fraction"] == 0.25 and stats["count"] == 5


def test_error_stats_of_a_state_without_a_step_count():
  """EF's state: a float32 error and no count field (a tuple's `count` method is no count)."""
  state = collections.namedtuple("State", "error")({"": np.array([3.0, 4.0, 0.0, 0.0])})
  stats = long_run.error_stats(state, devices=2)
  assert stats == {"norm_mean": pytest.approx(2.5), "norm_max": pytest.approx(5.0)}


@pytest.mark.slow
def test_report_on_the_short_form(short_runs, tmp_path, capsys):
  whole, _, _ = short_runs
  assert long_run_report.main([str(whole), "--window", "4", "--out", str(tmp_path)]) == 0
  text = (tmp_path / "report.md").read_text()
  loco, none = _records(whole / f"{LOCO}-s0"), _records(whole / "none-s0")
  gap = 100 * (loco[-1]["eval_loss"] / none[-1]["eval_loss"] - 1)
  assert f"| {LOCO}-s0 | {STEPS}/{STEPS} | {loco[-1]['eval_loss']:.4f} | " \
         f"{none[-1]['eval_loss']:.4f} | {gap:+.2f} |" in text
  rows = [row.split("|")[2].strip() for row in text.splitlines()
          if row.startswith(f"| {LOCO}-s0 |") and row.count("|") == 5]
  assert rows == ["8", "16", "24", "halfway between resets (none there), 3 places"]
  # The first reset's train effect, from the records: the mean loss of the 4 steps from it
  # against the 4 before, less none's, in % of the loss before.
  steps = lambda records: np.concatenate([r["train_losses"] for r in records])
  mine, base = steps(loco), steps(none)
  change = lambda x: x[8:12].mean() - x[4:8].mean()
  assert f"| {LOCO}-s0 | 8 | {100 * (change(mine) - change(base)) / mine[4:8].mean():+.2f} |" \
      in text
  assert f"| {LOCO} | 1 |" in text
  for name in ("eval_loss.png", "gap.png", "resets.png"):
    assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
  assert long_run_report.main([str(tmp_path / "nothing")]) == 2
  assert "no runs under" in capsys.readouterr().err


def test_timing_table_projects_a_whole_run():
  config = long_run.LongRunConfig(steps=10_000, eval_every=250)
  row = long_run.Timing("loco4", compile_s=20.0, step_s=0.3, step_cpu_s=0.2, eval_s=2.0,
                        eval_cpu_s=1.5)
  table = long_run.timing_table(config, [row])
  wall = (20 + 10_000 * 0.3 + 41 * 2.0) / 3600
  cpu = (10_000 * 0.2 + 41 * 1.5) / 3600
  assert f"| loco4 | 20.0 | 300 | 200 | 2.00 | {wall:.2f} | {cpu:.2f} |" in table
