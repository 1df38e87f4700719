"""Damaged, partial and stray checkpoints: every one gives a ValueError naming the path."""

import gc
import json
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from loco_jax.train import checkpoint, files, parallel

CONFIG = {"model": "tiny", "mode": "ddp"}
STEP = 3


def _state(offset: float = 0.0) -> dict:
  """A tiny state laid out like a TrainState's: sharded, replicated, int and float leaves."""
  mesh = parallel.data_mesh(8)
  sharded = NamedSharding(mesh, P("data"))
  return {"params": {"w": jax.device_put(jnp.arange(16.0) + offset, sharded),
                     "b": jax.device_put(jnp.full((3,), 0.5 + offset), NamedSharding(mesh, P()))},
          "error": jax.device_put(jnp.arange(16, dtype=jnp.int8), sharded),
          "count": jnp.asarray(7, jnp.int32)}


def _assert_equal(a, b) -> None:
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert x.dtype == y.dtype
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
  """A checkpoint directory holding step 3 of `_state()`, never modified by the tests."""
  directory = tmp_path_factory.mktemp("pristine") / "ckpt"
  checkpoint.save(directory, STEP, _state(), CONFIG)
  return directory


def _copy(pristine: Path, into: Path) -> Path:
  shutil.copytree(pristine, into / "ckpt")
  return into / "ckpt"


def _entries(step_dir: Path) -> list[Path]:
  """Every file and folder of a checkpoint, deepest first."""
  return sorted(step_dir.rglob("*"), key=lambda p: (-len(p.parts), str(p)))


def _delete(p: Path) -> None:
  shutil.rmtree(p) if p.is_dir() else p.unlink()


def _empty(p: Path) -> None:
  p.write_bytes(b"")


def _truncate(p: Path) -> None:
  p.write_bytes(p.read_bytes()[:p.stat().st_size // 2])


def _garbage(p: Path) -> None:
  p.write_bytes(b"\x00not what save wrote\xff" * 3)


def _flip_last_byte(p: Path) -> None:
  data = bytearray(p.read_bytes())
  data[-1] ^= 0x01
  p.write_bytes(bytes(data))


def _into_folder(p: Path) -> None:
  p.unlink()
  p.mkdir()


DAMAGE = {"delete": _delete, "empty": _empty, "truncate": _truncate, "garbage": _garbage,
          "flip": _flip_last_byte, "folder": _into_folder}


def _restore_fails(directory: Path, named: Path, step: int | None = None) -> str:
  """restore raises a ValueError (no other exception, no state) whose message names `named`."""
  try:
    checkpoint.restore(directory, _state(1.0), CONFIG, step=step)
  except ValueError as e:
    assert str(named) in str(e), (str(named), str(e))
    return str(e)
  pytest.fail(f"restore read a damaged checkpoint ({named})")


@pytest.mark.parametrize("damage", DAMAGE)
def test_every_damaged_file_is_named(pristine, tmp_path, damage):
  """Each file (and each folder, for delete) of a real checkpoint in turn: damaged, restore
  raises a ValueError naming it; the undamaged copy restores exactly."""
  step_dir = pristine / str(STEP)
  targets = [p for p in _entries(step_dir) if p.is_file() or damage == "delete"]
  assert len(targets) >= 10 and step_dir / checkpoint.COMMIT in targets
  for i, target in enumerate(targets):
    copy = _copy(pristine, tmp_path / str(i))
    damaged = copy / target.relative_to(pristine)
    DAMAGE[damage](damaged)
    _restore_fails(copy, damaged, step=STEP)
    if damaged.name != checkpoint.COMMIT or damaged.is_file():  # the newest step: the same
      _restore_fails(copy, damaged)
    else:  # without its marker the step does not count: there is no checkpoint
      assert checkpoint.latest_step(copy) is None
      _restore_fails(copy, damaged.parent)
    with pytest.raises(ValueError, match=re.escape(str(copy / str(STEP)))):
      checkpoint.metadata(copy)
  restored, step = checkpoint.restore(pristine, _state(1.0), CONFIG)
  assert step == STEP
  _assert_equal(restored, _state())


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_changed_byte_is_caught(pristine, data):
  """A random byte of a random file set to another value: a ValueError naming that file."""
  step_dir = pristine / str(STEP)
  names = [p.relative_to(pristine) for p in _entries(step_dir) if p.is_file()]
  name = data.draw(st.sampled_from(names))
  size = (pristine / name).stat().st_size
  at = data.draw(st.integers(0, size - 1))
  delta = data.draw(st.integers(1, 255))
  with tempfile.TemporaryDirectory() as tmp:
    copy = _copy(pristine, Path(tmp))
    file = copy / name
    content = bytearray(file.read_bytes())
    content[at] = (content[at] + delta) % 256
    file.write_bytes(bytes(content))
    _restore_fails(copy, file if name.name != checkpoint.COMMIT else file.parent)


def _reseal(step_dir: Path) -> None:
  """Rewrites the marker to match the files as they are now, as save writes it (a damage the
  digests miss)."""
  marker = step_dir / checkpoint.COMMIT
  commit = json.loads(marker.read_text())
  commit["files"] = files.digests(step_dir, exclude=(checkpoint.COMMIT,))
  marker.write_text(json.dumps(commit, indent=2) + "\n")


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["empty", "truncate", "garbage"])
def test_damage_behind_a_matching_marker_is_still_an_error(pristine, tmp_path, damage,
                                                           monkeypatch):
  """Past the digests (marker rewritten to match), orbax's reading is the check: a damaged
  file gives a ValueError naming the step's state or metadata, or, where orbax does not need
  the file, the exact saved state; never another exception or a wrong state. And restore
  raises only once every read it started has ended: none ends later into a closed event loop,
  as an unraisable exception in whatever code runs next."""
  unraisable = []
  monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
  step_dir = pristine / str(STEP)
  errors = 0
  for i, target in enumerate(p for p in _entries(step_dir)
                             if p.is_file() and p.name != checkpoint.COMMIT):
    copy = _copy(pristine, tmp_path / str(i))
    DAMAGE[damage](copy / target.relative_to(pristine))
    _reseal(copy / str(STEP))
    try:
      restored, _ = checkpoint.restore(copy, _state(1.0), CONFIG)
    except ValueError as e:
      assert str(copy / str(STEP)) in str(e), str(e)
      errors += 1
    else:
      _assert_equal(restored, _state())
  assert errors >= 2  # at least the metadata and the array data
  time.sleep(0.2)  # what was still reading has ended by now
  gc.collect()
  assert not unraisable, [f"{u.exc_value!r} in {u.object!r}" for u in unraisable]


def test_malformed_markers_and_metadata(pristine, tmp_path):
  copy = _copy(pristine, tmp_path)
  marker = copy / str(STEP) / checkpoint.COMMIT
  good = marker.read_text()
  for text in ("[]", "{}", json.dumps({**json.loads(good), "step": 4}),
               json.dumps({**json.loads(good), "files": {"x": [1]}}),
               json.dumps({**json.loads(good), "format": 1}), "\xff{"):
    marker.write_text(text)
    _restore_fails(copy, marker)
  marker.write_text(good)
  meta = copy / str(STEP) / "meta" / "metadata"
  good_meta = json.loads(meta.read_text())
  for bad in ({**good_meta, "tree": []}, {**good_meta, "step": 9}, {**good_meta, "format": 1},
              {k: v for k, v in good_meta.items() if k != "config"}, [1, 2]):
    meta.write_text(json.dumps(bad))
    _reseal(copy / str(STEP))
    _restore_fails(copy, meta)


def test_copied_step_directory_is_refused(pristine, tmp_path):
  """`cp -r 3 5`: the marker says step 3, the directory 5: refused, naming the marker."""
  copy = _copy(pristine, tmp_path)
  shutil.copytree(copy / str(STEP), copy / "5")
  assert checkpoint.latest_step(copy) == 5
  _restore_fails(copy, copy / "5" / checkpoint.COMMIT)
  _restore_fails(copy, copy / "5" / checkpoint.COMMIT, step=5)
  checkpoint.restore(copy, _state(1.0), CONFIG, step=STEP)  # the original still reads


def test_strays_do_not_count(pristine, tmp_path):
  copy = _copy(pristine, tmp_path)
  (copy / "6").mkdir()
  (copy / "7").write_text("a file")
  (copy / "8.orbax-checkpoint-tmp-123").mkdir()
  (copy / "09").mkdir()
  assert checkpoint.latest_step(copy) == STEP
  restored, step = checkpoint.restore(copy, _state(1.0), CONFIG)
  assert step == STEP
  _assert_equal(restored, _state())
  assert re.search(r"not a complete checkpoint.*no commit marker",
                   _restore_fails(copy, copy / "6", step=6))
  assert "is a file" in _restore_fails(copy, copy / "7", step=7)
  # A stray at or above the step being saved is in the way (orbax would refuse), not deleted.
  with pytest.raises(ValueError, match=re.escape(f"{copy / '6'} is in the way of saving step 5")):
    checkpoint.save(copy, 5, _state(2.0), CONFIG)
  with pytest.raises(ValueError, match=re.escape(f"{copy / '7'} is in the way")):
    checkpoint.save(copy, 7, _state(2.0), CONFIG)
  assert (copy / "6").is_dir() and (copy / "7").is_file()
  checkpoint.save(copy, 10, _state(2.0), CONFIG)  # above every stray: saved
  assert checkpoint.latest_step(copy) == 10
  empty = tmp_path / "only_strays"
  (empty / "6").mkdir(parents=True)
  with pytest.raises(ValueError, match=re.escape(f"not complete: {empty / '6'}")):
    checkpoint.restore(empty, _state(), CONFIG)


def test_save_killed_before_its_marker_is_redone(pristine, tmp_path):
  """Orbax committed step 4 but the marker was never written: ignored, then replaced."""
  copy = _copy(pristine, tmp_path)
  checkpoint.save(copy, 4, _state(4.0), CONFIG)
  (copy / "4" / checkpoint.COMMIT).unlink()
  assert checkpoint.latest_step(copy) == STEP
  _assert_equal(checkpoint.restore(copy, _state(1.0), CONFIG)[0], _state())
  checkpoint.save(copy, 4, _state(5.0), CONFIG)
  restored, step = checkpoint.restore(copy, _state(1.0), CONFIG)
  assert step == 4
  _assert_equal(restored, _state(5.0))
