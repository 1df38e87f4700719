"""The step directories of a checkpoint directory: the commit marker that makes one complete,
its files checked against the marker, and what a save removes.

`DIRECTORY/STEP/` is complete once its marker `loco_jax_commit.json`, written last, lists every
file of the step with its size and sha256. A numbered directory without it is an interrupted
save of this module (orbax committed it, the marker was never written) or a stray; orbax's own
unfinished steps are `STEP.orbax-checkpoint-tmp-*`. Markers and metadata are not trusted:
bounded reads, and every listed path stays inside its step directory.
"""

import json
import re
import shutil
from pathlib import Path
from typing import Any

from loco_jax.train import files

FORMAT = 3  #: 3: the mesh record; 2: the commit marker; format 1 (no marker) is not read
READABLE_FORMATS = (2, 3)
COMMIT = "loco_jax_commit.json"
META_FILE = "meta/metadata"  #: orbax's JSON item "meta"
MAX_MARKER_BYTES = 4 << 20
MAX_METADATA_BYTES = 16 << 20
_ORBAX_UNFINISHED = re.compile(r"(\d+)\.orbax-checkpoint-tmp")


def numbered(path: Path) -> dict[int, Path]:
  """{step: entry} of the entries of `path` named by a step number (canonical: `6`, not `06`)."""
  return {int(p.name): p for p in path.iterdir() if p.name.isdigit() and p.name == str(int(p.name))}


def complete_steps(path: Path) -> list[int]:
  """The steps in `path` whose directory (a real one, not a symbolic link) holds a commit
  marker, oldest first."""
  return sorted(step for step, entry in numbered(path).items()
                if not entry.is_symlink() and (entry / COMMIT).is_file())


def _is_listing(listed: Any) -> bool:
  """{path: [size, sha256]}, as `write_marker` writes it (the paths are checked on use)."""
  return isinstance(listed, dict) and all(
      isinstance(v, list) and len(v) == 2 and type(v[0]) is int and v[0] >= 0
      and isinstance(v[1], str) for v in listed.values())


def verify(entry: Path, step: int) -> None:
  """Raises a ValueError naming the path unless `entry` is checkpoint `step` as save wrote it:
  a real directory whose marker (of a readable format, of this step, listing the metadata)
  lists exactly its files, with their sizes and digests."""
  if entry.is_symlink():
    raise ValueError(f"{entry} is a symbolic link, not a checkpoint directory: nothing read "
                     f"from a checkpoint may lead outside it")
  if not entry.is_dir():
    raise ValueError(f"{entry} is a file, not a checkpoint directory")
  marker = entry / COMMIT
  if not (marker.exists() or marker.is_symlink()):
    raise ValueError(f"{entry} is not a complete checkpoint: no commit marker {marker} (a "
                     f"save killed before it finished, a stray directory, or a checkpoint of "
                     f"format 1, which this version does not read)")
  commit = files.read_json(marker, "commit marker", MAX_MARKER_BYTES)
  if not (isinstance(commit, dict) and commit.get("format") in READABLE_FORMATS
          and type(commit.get("step")) is int and commit["step"] == step
          and _is_listing(commit.get("files"))):
    raise ValueError(f"{marker} is not a commit marker of step {step} in format {FORMAT}: "
                     f"expected {{'format': {FORMAT}, 'step': {step}, 'files': {{path: [size, "
                     f"sha256]}}}}")
  if META_FILE not in commit["files"]:
    raise ValueError(f"{marker} lists no {META_FILE}: not a loco_jax checkpoint")
  files.check_digests(entry, commit["files"], exclude=(COMMIT,))
  # What this version's save writes, byte for byte: a marker altered where JSON does not care
  # (white space) has been altered all the same.
  if (commit["format"] == FORMAT
      and marker.read_bytes() != (json.dumps(commit, indent=2) + "\n").encode()):
    raise ValueError(f"{marker} is not the commit marker save writes: it has been altered")


def write_marker(entry: Path, step: int) -> None:
  """Makes step directory `entry` complete: its marker, listing every file, written atomically."""
  text = json.dumps({"format": FORMAT, "step": step,
                     "files": files.digests(entry, exclude=(COMMIT,))}, indent=2) + "\n"
  if len(text.encode()) > MAX_MARKER_BYTES:
    raise ValueError(f"{entry} holds too many files for a commit marker of at most "
                     f"{MAX_MARKER_BYTES} bytes; the step stays incomplete")
  files.write_atomic(entry / COMMIT, text)


def read_metadata(entry: Path) -> Any:
  """The JSON document `entry/meta/metadata` (bounded; a ValueError naming it otherwise)."""
  return files.read_json(entry / META_FILE, "checkpoint metadata", MAX_METADATA_BYTES)


def _is_interrupted_save(entry: Path, step: int) -> bool:
  """A real directory without a marker whose metadata is this module's, of step `step`."""
  if entry.is_symlink() or not entry.is_dir() or (entry / COMMIT).exists():
    return False
  try:
    meta = read_metadata(entry)
  except ValueError:  # no metadata, or not ours
    return False
  return (isinstance(meta, dict) and meta.get("format") in READABLE_FORMATS
          and meta.get("step") == step)


def in_the_way(path: Path, step: int) -> list[Path]:
  """What a save of `step` into `path` removes first: this module's interrupted saves, of any
  step (orbax refuses to save below one), and orbax's unfinished steps up to `step`.

  Any other entry named by a step number at or above `step` (a stray directory or file) is a
  ValueError, and is never deleted; strays below `step` are left where they are.
  """
  doomed, complete = [], set(complete_steps(path))
  for number, entry in sorted(numbered(path).items()):
    if number in complete:
      continue
    if _is_interrupted_save(entry, number):
      doomed.append(entry)
    elif number >= step:
      raise ValueError(f"{entry} is in the way of saving step {step}: it is not a complete "
                       f"checkpoint (no {COMMIT}) nor an interrupted save of this module; move "
                       f"or delete it, or save to another directory")
  for entry in sorted(path.iterdir()):
    unfinished = _ORBAX_UNFINISHED.match(entry.name)
    if unfinished and int(unfinished[1]) <= step and entry.is_dir() and not entry.is_symlink():
      doomed.append(entry)
  return doomed


def remove(entry: Path) -> None:
  """Deletes step directory `entry`, its marker first and its metadata last: a removal cut
  short leaves an interrupted save, which the next save removes, never a step that looks
  complete."""
  (entry / COMMIT).unlink(missing_ok=True)
  for child in sorted(entry.iterdir(), key=lambda p: p.name == "meta"):
    if child.is_dir() and not child.is_symlink():
      shutil.rmtree(child)
    else:
      child.unlink()
  entry.rmdir()


def prune(path: Path, keep: int) -> list[int]:
  """Removes all complete steps in `path` but the newest `keep`; returns the steps removed.
  Incomplete steps are not counted."""
  old = complete_steps(path)[:-keep]
  for step in old:
    remove(path / str(step))
  return old
