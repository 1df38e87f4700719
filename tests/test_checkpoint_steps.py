"""Step directories: retention counts complete checkpoints only, half-written steps go with the
next save, and hostile markers (deep, big, paths leading out, symbolic links) are ValueErrors."""

import hashlib
import json
import os
import re
from pathlib import Path

import jax.numpy as jnp
import pytest

from loco_jax.train import checkpoint

CONFIG = {"model": "tiny"}


def _state(value: float) -> dict:
  return {"w": jnp.full((4,), value), "count": jnp.asarray(int(value), jnp.int32)}


def _save(directory: Path, step: int, keep: int | None = None) -> Path:
  return checkpoint.save(directory, step, _state(step), CONFIG, keep=keep)


def _interrupted(directory: Path, step: int) -> None:
  """A save killed after orbax committed the step, before its marker."""
  (_save(directory, step) / checkpoint.COMMIT).unlink()


def _orbax_unfinished(directory: Path, step: int) -> Path:
  """A save killed while orbax was writing: its temporary directory."""
  tmp = directory / f"{step}.orbax-checkpoint-tmp-1234"
  (tmp / "state").mkdir(parents=True)
  (tmp / "state" / "part").write_bytes(b"\0" * 100)
  return tmp


def _complete(directory: Path) -> list[int]:
  return sorted(int(p.name) for p in directory.iterdir()
                if p.name.isdigit() and (p / checkpoint.COMMIT).is_file())


@pytest.mark.slow
def test_keep_counts_complete_checkpoints_only(tmp_path):
  for step in (1, 2):
    _save(tmp_path, step)
  _interrupted(tmp_path, 4)
  (tmp_path / "3").mkdir()  # a stray below the step saved: neither counted nor deleted
  _save(tmp_path, 5, keep=2)
  assert _complete(tmp_path) == [2, 5]
  assert sorted(p.name for p in tmp_path.iterdir()) == ["2", "3", "5"]
  restored, step = checkpoint.restore(tmp_path, _state(0), CONFIG, step=2)
  assert step == 2 and restored["w"].tolist() == [2.0] * 4
  _save(tmp_path, 6, keep=1)
  assert _complete(tmp_path) == [6] and checkpoint.latest_step(tmp_path) == 6


def test_half_written_steps_go_with_the_next_save(tmp_path):
  _save(tmp_path, 1)
  _interrupted(tmp_path, 4)
  below, above = _orbax_unfinished(tmp_path, 3), _orbax_unfinished(tmp_path, 7)
  assert checkpoint.latest_step(tmp_path) == 1
  _save(tmp_path, 5)
  assert not (tmp_path / "4").exists() and not below.exists()
  assert above.exists()  # orbax's unfinished step 7 waits for a save at or above it
  assert _complete(tmp_path) == [1, 5]
  _interrupted(tmp_path, 9)  # this module's own interrupted save above: in orbax's way, removed
  _save(tmp_path, 8)
  assert not (tmp_path / "9").exists() and not above.exists()
  assert _complete(tmp_path) == [1, 5, 8]


def _both_fail(directory: Path, match: str) -> None:
  with pytest.raises(ValueError, match=match):
    checkpoint.restore(directory, _state(0), CONFIG)
  with pytest.raises(ValueError, match=match):
    checkpoint.metadata(directory)


def test_deep_or_big_markers_are_value_errors(tmp_path):
  directory = tmp_path / "ckpt"
  marker = _save(directory, 3) / checkpoint.COMMIT
  for text, why in (("[" * 100_000, "nests deeper than 64 levels"),
                    ('{"a": ' * 70 + "1" + "}" * 70, "nests deeper than 64 levels"),
                    (json.dumps({"pad": "x" * (5 << 20)}), r"is larger than \d+ bytes")):
    marker.write_text(text)
    _both_fail(directory, re.escape(str(marker)) + ".*" + why)
  deep = {}
  for _ in range(100):
    deep = {"a": deep}
  with pytest.raises(ValueError, match="config must nest at most 62 levels"):
    checkpoint.save(directory, 4, _state(4), {"deep": deep})
  assert not (directory / "4").exists()


def test_marker_paths_stay_inside_the_step_directory(tmp_path):
  """A marker that lists a file outside its step with that file's true size and digest."""
  for i, listed in enumerate(("../../outside.txt", "{outside}", "state/../../../outside.txt",
                              "./meta/metadata")):
    directory = tmp_path / str(i) / "ckpt"
    outside = directory.parent / "outside.txt"
    outside.parent.mkdir()
    outside.write_bytes(b"not part of any checkpoint")
    listed = listed.format(outside=outside)
    marker = _save(directory, 3) / checkpoint.COMMIT
    commit = json.loads(marker.read_text())
    commit["files"][listed] = [outside.stat().st_size,
                               hashlib.sha256(outside.read_bytes()).hexdigest()]
    marker.write_text(json.dumps(commit))
    os.utime(outside, (0, outside.stat().st_mtime))  # a read would move its access time
    _both_fail(directory, re.escape(f"the listed path {listed!r} is not a plain relative path"))
    assert outside.stat().st_atime == 0


def test_symbolic_links_are_refused(tmp_path):
  outside = tmp_path / "outside.txt"
  outside.write_bytes(b"not part of any checkpoint")
  directory = tmp_path / "ckpt"
  step_dir = _save(directory, 3)
  link = step_dir / "state" / "extra"
  link.symlink_to(outside)
  marker = step_dir / checkpoint.COMMIT
  commit = json.loads(marker.read_text())
  commit["files"]["state/extra"] = [outside.stat().st_size,
                                    hashlib.sha256(outside.read_bytes()).hexdigest()]
  marker.write_text(json.dumps(commit))
  _both_fail(directory, re.escape(f"{link} is a symbolic link"))
  link.unlink()
  (step_dir / "state" / "folder").symlink_to(tmp_path, target_is_directory=True)
  _both_fail(directory, re.escape(f"{step_dir / 'state' / 'folder'} is a symbolic link"))

  elsewhere = tmp_path / "elsewhere"
  _save(elsewhere, 4)
  (directory / "4").symlink_to(elsewhere / "4", target_is_directory=True)
  assert checkpoint.latest_step(directory) == 3  # a link is not a checkpoint
  with pytest.raises(ValueError, match=re.escape(f"{directory / '4'} is a symbolic link")):
    checkpoint.restore(directory, _state(0), CONFIG, step=4)
  with pytest.raises(ValueError, match=re.escape(f"{directory / '4'} is in the way")):
    checkpoint.save(directory, 4, _state(4), CONFIG)  # and never deleted
  assert (elsewhere / "4" / checkpoint.COMMIT).is_file()
