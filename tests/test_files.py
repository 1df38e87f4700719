"""files: atomic single files, a folder of outputs replaced as one, digests of a folder."""

import os
import signal
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loco_jax.train import files


def _fill(folder: Path, contents: dict[str, bytes]) -> Path:
  for name, data in contents.items():
    (folder / name).parent.mkdir(parents=True, exist_ok=True)
    (folder / name).write_bytes(data)
  return folder


def _read(folder: Path) -> dict[str, bytes]:
  return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*")
          if p.is_file()}


OLD = {"results.json": b"[1]", "loss_curves.csv": b"step\n1", "loss_curves.png": b"png1"}
NEW = {"results.json": b"[2]", "loss_curves.csv": b"step\n2"}


@pytest.mark.parametrize("before", ["missing", "empty", "full"])
def test_replace_folder(tmp_path, before):
  target = tmp_path / "out"
  if before != "missing":
    target.mkdir()
  if before == "full":
    _fill(target, OLD)
  staging = _fill(files.staging_folder(target), NEW)
  assert staging.parent == tmp_path and staging.name.startswith(".out.new-")
  files.replace_folder(staging, target)
  assert _read(target) == NEW  # the whole new set, no file of the old one (loss_curves.png)
  assert [p.name for p in tmp_path.iterdir()] == ["out"]


@pytest.mark.parametrize("failing", ["aside", "into place"])
def test_replace_folder_interrupted_keeps_the_old_set(tmp_path, monkeypatch, failing):
  target = _fill(tmp_path / "out", OLD)
  staging = _fill(files.staging_folder(target), NEW)
  real_replace, real_rename = os.replace, os.rename

  def replace(src, dst):
    if failing == "aside" and Path(src) == target:
      raise KeyboardInterrupt
    return real_replace(src, dst)

  def rename(src, dst):
    if failing == "into place" and Path(src) == staging:
      raise OSError(28, "No space left on device")
    return real_rename(src, dst)

  monkeypatch.setattr(os, "replace", replace)
  monkeypatch.setattr(os, "rename", rename)
  with pytest.raises((KeyboardInterrupt, OSError)):
    files.replace_folder(staging, target)
  assert _read(target) == OLD
  assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["out", staging.name])


def test_replace_folder_needs_one_parent(tmp_path):
  (tmp_path / "a").mkdir()
  with pytest.raises(ValueError, match="same folder"):
    files.replace_folder(tmp_path / "a", tmp_path / "b" / "out")


def test_sigint_waits_for_the_renames(sigint_raises):
  reached = []
  with pytest.raises(KeyboardInterrupt):
    with files._sigint_deferred():
      os.kill(os.getpid(), signal.SIGINT)
      reached.append("after the signal")
  assert reached == ["after the signal"]


TREE = {"state/_METADATA": b'{"a": 1}', "state/d/0a1b": bytes(range(40)), "meta/metadata": b"{}",
        "top": b"x"}


def test_digests_round_trip(tmp_path):
  folder = _fill(tmp_path / "ckpt", TREE)
  listed = files.digests(folder)
  assert list(listed) == sorted(TREE) and listed["top"][0] == 1
  files.check_digests(folder, listed)
  (folder / "marker").write_text("{}")
  files.check_digests(folder, files.digests(folder, exclude=("marker",)), exclude=("marker",))


@settings(max_examples=30, deadline=None)
@given(name=st.sampled_from(sorted(TREE)),
       change=st.sampled_from(["delete", "empty", "append", "flip", "folder", "extra"]),
       at=st.integers(0, 39))
def test_any_change_is_named(tmp_path_factory, name, change, at):
  folder = _fill(tmp_path_factory.mktemp("ckpt"), TREE)
  listed = files.digests(folder)
  path = folder / name
  data = bytearray(path.read_bytes())
  if change == "delete":
    path.unlink()
  elif change == "empty":
    path.write_bytes(b"")
  elif change == "append":
    path.write_bytes(bytes(data) + b"\0")
  elif change == "flip":
    data[at % len(data)] ^= 0x80
    path.write_bytes(bytes(data))
  elif change == "folder":
    path.unlink()
    path.mkdir()
  else:
    path = path.with_name(path.name + ".extra")
    path.write_bytes(b"")
  with pytest.raises(ValueError, match=str(path).replace(".", r"\.")):
    files.check_digests(folder, listed)


def test_sigint_during_the_renames_comes_after_them(tmp_path, monkeypatch, sigint_raises):
  """Ctrl-C between the renames: the new set is put in place whole, then it interrupts."""
  target = _fill(tmp_path / "out", OLD)
  staging = _fill(files.staging_folder(target), NEW)
  real_rename = os.rename

  def rename(src, dst):
    os.kill(os.getpid(), signal.SIGINT)
    return real_rename(src, dst)

  monkeypatch.setattr(os, "rename", rename)
  with pytest.raises(KeyboardInterrupt):
    files.replace_folder(staging, target)
  assert _read(target) == NEW
  assert [p.name for p in tmp_path.iterdir()] == ["out"]
