"""`loco-jax bench`: a quick run end to end, the JSON records, bad arguments."""

import json
import mmap
import os

import jax
import pytest

from loco_jax.apps import bench

REQUIRED_KEYS = {"name", "value", "unit", "backend", "n_params"}


@pytest.mark.slow
def test_quick_run_writes_every_part_atomically(tmp_path, monkeypatch, capsys):
  path = tmp_path / "out" / "bench.json"
  replaced = []
  real_replace = os.replace

  def spy_replace(src, dst):
    replaced.append((str(src), str(dst)))
    return real_replace(src, dst)

  monkeypatch.setattr(bench.os, "replace", spy_replace)
  assert bench.main(["--quick", "--json", str(path)]) == 0
  # Written once, from a temporary file in the same directory, which is gone afterwards.
  assert len(replaced) == 1 and replaced[0][1] == str(path)
  assert os.path.dirname(replaced[0][0]) == str(path.parent)
  assert sorted(os.listdir(path.parent)) == ["bench.json"]
  records = json.loads(path.read_text())
  assert records and all(set(r) == REQUIRED_KEYS for r in records)
  by_name = {r["name"]: r for r in records}
  ratio = by_name["loco_over_adamw"]
  assert ratio["unit"] == "x" and ratio["value"] > 0 and ratio["n_params"] == 2**16
  assert ratio["backend"] == "cpu"
  for name in ("step_ms/adamw", "step_ms/loco_update", "step_ms/copy",
               "step_ms/compress_step_jnp", "compress_step_over_adamw",
               "loco_bandwidth_fraction_of_copy", "hlo_fusions/compress_step_jnp",
               "wire_bits_per_param/loco_bf16_gather",
               "wire_bits_per_param/loco_quantized_gather",
               "loco_over_adamw_tree",
               "loco_over_adamw_tree/min", "loco_over_adamw_tree/max",
               "compile_s/loco_update_tree", "compile_s/adamw_tree", "compile_over_adamw_tree",
               "compile_s/loco_mesh_step_tree", "compile_s/pmean_mesh_step_tree",
               "wire_bits_per_param_tree/loco_bf16_gather"):
    assert name in by_name, name
  # Each timed step's page faults a call, and the temporaries of the compiled steps.
  for name in ("adamw", "loco_update", "adamw_tree", "loco_update_tree", "copy", "copy_fresh"):
    faults = by_name[f"page_faults/{name}"]
    assert faults["unit"] == "count" and faults["value"] >= 0, faults
  for name in ("adamw", "loco_update", "adamw_tree", "loco_update_tree", "compress_step_jnp"):
    temp = by_name[f"temp_MiB/{name}"]
    assert temp["unit"] == "MiB" and 0 <= temp["value"] < 64, temp
  assert by_name["temp_MiB/loco_update_tree"]["value"] > 0  # the gradients' buckets
  spread = [by_name[f"loco_over_adamw_tree/{end}"]["value"] for end in ("min", "max")]
  assert 0 < spread[0] <= spread[1]
  # The quick tree (d_model 64, 2 layers): its own parameter count, wire bits still ~4 + 16.
  assert by_name["loco_over_adamw_tree"]["n_params"] == 2 * 49_984 + 256 * 64 + 128 * 64 + 128
  assert by_name["wire_bits_per_param_tree/loco_bf16_gather"]["value"] < 20 * 7 / 8 * 1.03
  # The wire bits come from the HLO: 4-bit all-to-all plus bf16 all-gather, 7/8 of each sent.
  assert 17.4 < by_name["wire_bits_per_param/loco_bf16_gather"]["value"] < 17.6
  assert by_name["wire_bits_per_param/loco_quantized_gather"]["value"] < 7.1
  assert any(name.startswith("codec/") for name in by_name)
  out = capsys.readouterr().out
  assert "| loco_over_adamw |" in out


@pytest.mark.slow
def test_every_timed_step_keeps_its_donated_state_in_place():
  # jax gives a donated buffer to the first output of its shape and dtype: a step that returned
  # its update first would hand adamw's mu to the update and time a copy (2x adamw's step).
  cands, _, _ = bench._step_candidates(2**12, "cpu", False, {"d_model": 16, "layers": 1})
  stateful = [c for c in cands if c.name in ("adamw", "loco_update", "adamw_tree",
                                             "loco_update_tree", "compress_step_jnp")]
  assert len(stateful) == 5
  for c in stateful:
    pointers = lambda: sorted(x.unsafe_buffer_pointer() for x in jax.tree.leaves(c.state)
                              if x.size > 1)
    before = pointers()
    c.run()
    assert pointers() == before, c.name


def test_minor_faults_counts_first_touches():
  # A fresh anonymous mapping of 32 MiB, one byte written a page: one fault a page, or one a
  # 2 MiB huge page where transparent huge pages are on for every mapping.
  size = 32 * 2**20
  with mmap.mmap(-1, size) as memory:
    before = bench.minor_faults()
    for at in range(0, size, 4096):
      memory[at] = 1
    assert bench.minor_faults() - before >= size // 2**21


@pytest.mark.parametrize("argv,message", [
    (["--n-params", "0"], "--n-params must be a positive integer"),
    (["--n-params", "-3"], "--n-params must be a positive integer"),
    (["--repeats", "0"], "--repeats must be a positive integer"),
    (["--psi", "7e9"], "unrecognized arguments"),   # the Table I model left for advise
    (["--skip", "gpu"], "--skip takes"),
    (["--frobnicate"], "unrecognized arguments"),
])
def test_bad_arguments_exit_2_with_a_message(argv, message, capsys):
  assert bench.main(argv) == 2
  assert message in capsys.readouterr().err


def test_cli_dispatches_bench(capsys):
  from loco_jax.apps import cli
  assert cli.main(["bench", "--n-params", "0"]) == 2
  assert "--n-params" in capsys.readouterr().err


@pytest.mark.slow
def test_wire_bits_run_in_a_subprocess_where_this_process_has_fewer_devices(monkeypatch):
  """A process with fewer than 8 devices (a GPU machine) gets the wire bits from a CPU
  subprocess: the same records as in process."""
  tree = dict(d_model=64, layers=1)
  bits = lambda records: {r.name: r.value for r in records if r.name.startswith("wire_bits")}
  here = bits(bench.wire_bits_in_process(tree))
  monkeypatch.setattr(bench.jax, "device_count", lambda: 1)
  there = bits(bench.wire_bits(tree))
  assert "wire_bits_per_param/loco_bf16_gather" in here and there == here
