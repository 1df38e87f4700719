"""The `loco-jax demo` command on a tiny config: results.json, bits from the HLO, bad input."""

import contextlib
import io
import json
import math

import numpy as np
import pytest

from loco_jax import cli, demo, files

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


def test_results_json(tiny_run):
  status, out, _, table = tiny_run
  assert status == 0
  results = json.loads((out / "results.json").read_text())
  assert [r["method"] for r in results] == ["none", "loco4"]
  for r in results:
    assert tuple(r) == demo.RESULT_KEYS
    assert math.isfinite(r["final_loss"]) and math.isfinite(r["eval_loss"])
    assert 0 < r["step_time_s"] < 60
  none, loco4 = results
  assert none["gradient_bits_per_param"] == pytest.approx(32.0)
  assert 4.0 <= loco4["gradient_bits_per_param"] <= 4.1
  # Wire bits from the HLO: a float32 ring all-reduce sends 2 * 7/8 * 32 bits; LoCo 7/8 of its
  # 4-bit all-to-all plus 7/8 of a bfloat16 all-gather.
  assert none["wire_bits_per_param"] == pytest.approx(56.0, abs=0.05)
  assert 7 / 8 * (4.0 + 16.0) <= loco4["wire_bits_per_param"] <= 7 / 8 * (4.1 + 16.5)
  assert "loco4" in table and "grad bits" in table
  assert (out / "loss_curves.csv").read_text().startswith("step,none,loco4\n")
  assert (out / "loss_curves.png").read_bytes()[:4] == b"\x89PNG"
  assert not [p.name for p in out.iterdir() if p.name.startswith(".")]  # no temp files left


def test_progress_goes_to_stderr(tiny_run):
  _, _, err, table = tiny_run
  assert "[1/2] none" in err and "[2/2] loco4" in err and "4/4" in err
  assert "[1/2]" not in table


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
    demo.make_compressor("loco3")
