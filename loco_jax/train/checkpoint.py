"""Atomic orbax checkpoints of a whole TrainState, checked against the run's config on restore.

A checkpoint is the step directory `DIRECTORY/STEP/` that orbax writes: `state/` holds every
array of the state as the sharded global jax.Arrays they are (params or zero2 master shards,
the compressor state with every device's LoCo error and its step counter, the optimizer state,
the step), and `meta/metadata` a small JSON document next to it: the caller's `config` (model,
shape, mode, compressor ...), the device count, and the tree (path -> shape, dtype).

A checkpoint is complete when its commit marker `STEP/loco_jax_commit.json` exists: `save`
writes it last, once orbax has committed the step, and it lists every file of the checkpoint
with its size and sha256. Only complete checkpoints count (`latest_step`, the default step of
`restore`): a directory without the marker (a stray `6/`, a save killed before its marker, a
half-written `STEP.orbax-checkpoint-tmp`) is ignored, so a job killed during a save resumes from
the previous checkpoint. A save killed after orbax's commit but before its marker leaves a
directory that the next save of a step at or above it deletes (it recognizes its own metadata);
any other stray directory at or above the step being saved is an error, never deleted.
Saves are synchronous: `save` returns once the checkpoint is committed.

Checkpoints come from disk and are not trusted: `restore` and `metadata` first check every file
against the marker (reading the checkpoint once more, in every process), and a missing,
truncated, altered or extra file, a marker or metadata unlike what `save` writes, or a step
directory that is a file raises a ValueError naming the path and what is wrong.

Multi-host: every process calls `save` and `restore` with the same arguments (each writes and
reads its own shards; the directory must be shared by all of them); process 0 writes the marker.

A restore only proceeds when the checkpoint matches the run: the same config, the same device
count and the same tree; otherwise it raises a ValueError naming what differs, e.g.
"device count: checkpoint 8, now 4", and touches nothing on disk. A different device count is
refused on purpose, not re-sharded: the per-device LoCo errors are stacked one per device and
the zero2 master shards and optimizer state are cut into N zero-padded shards, so a state saved
on N devices means nothing on M. Re-sharding to another device count is not supported yet.

Example:
  >>> import tempfile
  >>> from loco_jax import checkpoint
  >>> directory = tempfile.mkdtemp()
  >>> state = {"w": jnp.arange(4.0), "count": jnp.zeros((), jnp.int32)}
  >>> checkpoint.save(directory, 100, state, {"model": "mlp"}).name
  '100'
  >>> restored, step = checkpoint.restore(directory, state, {"model": "mlp"})
  >>> step, restored["w"].tolist()
  (100, [0.0, 1.0, 2.0, 3.0])
"""

import contextlib
import itertools
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Iterator

import jax
import numpy as np
import orbax.checkpoint as ocp

from loco_jax.train import files

FORMAT = 2  # 2: the commit marker; format 1 checkpoints (no marker) are not read
COMMIT = "loco_jax_commit.json"
_STATE, _META = "state", "meta"
_META_FILE = f"{_META}/metadata"
_barriers = itertools.count()


def _tree(state: Any) -> dict[str, list]:
  """{path: [shape, dtype]} of every leaf: what the restore checks besides the config."""
  tree = {}
  for path, x in jax.tree_util.tree_leaves_with_path(state):
    key = jax.tree_util.keystr(path)
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
      raise ValueError(f"state leaf {key} is a {type(x).__name__}; a checkpointed state holds "
                       f"arrays only (jax.Array, numpy array or jax.ShapeDtypeStruct)")
    tree[key] = [list(x.shape), str(x.dtype)]
  return tree


def _device_count(state: Any) -> int:
  """Devices the state is laid out on: the largest device set of its leaves' shardings."""
  counts = [len(x.sharding.device_set) for x in jax.tree.leaves(state)
            if getattr(x, "sharding", None) is not None]
  return max(counts, default=jax.device_count())


def _json_config(config: dict) -> dict:
  if not isinstance(config, dict):
    raise ValueError(f"config must be a dict of JSON values, got {type(config).__name__}")
  try:
    return json.loads(json.dumps(config))
  except (TypeError, ValueError) as e:
    raise ValueError(f"config must hold JSON values only (str, int, float, bool, None, lists, "
                     f"dicts with str keys): {e}") from None


def _metadata(step: int, state: Any, config: dict) -> dict:
  return {"format": FORMAT, "step": step, "config": _json_config(config),
          "device count": _device_count(state), "process count": jax.process_count(),
          "tree": _tree(state)}


def _differences(saved: dict, now: dict) -> list[str]:
  """'what: checkpoint A, now B' for every config key, the device count and the tree."""
  out = []
  old_config, new_config = saved["config"], now["config"]
  for key in sorted(set(old_config) | set(new_config), key=str):
    old, new = old_config.get(key, "<absent>"), new_config.get(key, "<absent>")
    if old != new:
      out.append(f"{key}: checkpoint {old!r}, now {new!r}")
  if saved["device count"] != now["device count"]:
    out.append(f"device count: checkpoint {saved['device count']}, now {now['device count']}")
  old_tree, new_tree = saved["tree"], now["tree"]
  tree = [f"{k} only in the checkpoint" for k in old_tree if k not in new_tree]
  tree += [f"{k} only now" for k in new_tree if k not in old_tree]
  tree += [f"{k} {what} checkpoint {a}, now {b}" for k in old_tree if k in new_tree
           for what, a, b in zip(("shape", "dtype"), old_tree[k], new_tree[k]) if a != b]
  if tree:
    more = f" (and {len(tree) - 3} more)" if len(tree) > 3 else ""
    out.append("tree: " + ", ".join(tree[:3]) + more)
  return out


@contextlib.contextmanager
def _quiet_absl() -> Iterator[None]:
  """Hides orbax's warnings about read-only managers (restores are read-only on purpose)."""
  logger = logging.getLogger("absl")
  level = logger.level
  logger.setLevel(max(level, logging.ERROR))
  try:
    yield
  finally:
    logger.setLevel(level)


@contextlib.contextmanager
def _manager(path: Path, *, read_only: bool, keep: int | None = None
             ) -> Iterator[ocp.CheckpointManager]:
  with _quiet_absl():
    options = ocp.CheckpointManagerOptions(
        read_only=read_only, create=not read_only, enable_async_checkpointing=False,
        lightweight_initialize=True,
        preservation_policy=None if keep is None else ocp.checkpoint_managers.LatestN(keep))
    manager = ocp.CheckpointManager(path, options=options, item_names=(_STATE, _META))
  try:
    yield manager
  finally:
    manager.close()


def _sync_processes(what: str) -> None:
  """A barrier across the processes of a multi-host job (a no-op in a single process)."""
  if jax.process_count() > 1:
    ocp.multihost.sync_global_processes(f"loco_jax_checkpoint_{what}_{next(_barriers)}")


def _existing_directory(directory: str | os.PathLike) -> Path:
  path = Path(directory).absolute()
  if not path.exists():
    raise ValueError(f"checkpoint directory {path} does not exist")
  if not path.is_dir():
    raise ValueError(f"checkpoint directory {path} is not a directory")
  return path


# --- Which steps are complete ---------------------------------------------------------------------

def _numbered(path: Path) -> dict[int, Path]:
  """{step: entry} of the entries of `path` named by a step number (canonical: `6`, not `06`)."""
  return {int(p.name): p for p in path.iterdir() if p.name.isdigit() and p.name == str(int(p.name))}


def _complete_steps(path: Path) -> list[int]:
  return sorted(step for step, entry in _numbered(path).items() if (entry / COMMIT).is_file())


def _read_json(file: Path, what: str) -> Any:
  try:
    return json.loads(file.read_bytes())
  except FileNotFoundError:
    raise ValueError(f"{file} is missing: the checkpoint has no {what}") from None
  except OSError as e:
    raise ValueError(f"{file}: the {what} cannot be read ({e})") from None
  except ValueError as e:  # bytes that are not UTF-8 JSON
    raise ValueError(f"{file}: the {what} is not JSON ({e})") from None


def _check_files(entry: Path, step: int) -> None:
  """Raises a ValueError naming the path unless `entry` is checkpoint `step` as save wrote it."""
  if not entry.is_dir():
    raise ValueError(f"{entry} is a file, not a checkpoint directory")
  marker = entry / COMMIT
  if not marker.exists():
    raise ValueError(f"{entry} is not a complete checkpoint: no commit marker {marker} (a "
                     f"save killed before it finished, a stray directory, or a checkpoint of "
                     f"format 1, which this version does not read)")
  commit = _read_json(marker, "commit marker")
  listed = commit.get("files") if isinstance(commit, dict) else None
  if not (isinstance(listed, dict) and commit.get("format") == FORMAT
          and commit.get("step") == step and all(
              isinstance(v, list) and len(v) == 2 and isinstance(v[0], int)
              and isinstance(v[1], str) for v in listed.values())):
    raise ValueError(f"{marker} is not a commit marker of step {step} in format {FORMAT}: "
                     f"expected {{'format': {FORMAT}, 'step': {step}, 'files': {{path: [size, "
                     f"sha256]}}}}")
  if _META_FILE not in commit["files"]:
    raise ValueError(f"{marker} lists no {_META_FILE}: not a loco_jax checkpoint")
  files.check_digests(entry, commit["files"], exclude=(COMMIT,))


def _check_metadata(meta: Any, file: Path, step: int) -> dict:
  if not isinstance(meta, dict) or meta.get("format") != FORMAT:
    raise ValueError(f"{file}: unknown checkpoint metadata format "
                     f"{meta.get('format') if isinstance(meta, dict) else meta!r}; "
                     f"this version reads format {FORMAT}")
  kinds = {"step": int, "config": dict, "device count": int, "tree": dict}
  wrong = [k for k, kind in kinds.items() if not isinstance(meta.get(k), kind)]
  if wrong or meta["step"] != step or not all(
      isinstance(v, list) and len(v) == 2 for v in meta["tree"].values()):
    raise ValueError(f"{file}: the metadata of step {step} is malformed "
                     f"({', '.join(wrong) or 'step or tree'}); expected the JSON that save "
                     f"writes: {', '.join(kinds)}")
  return meta


def latest_step(directory: str | os.PathLike) -> int | None:
  """The newest complete step in `directory`; None if it has none or does not exist.

  Complete: the step directory holds the commit marker that `save` writes last. Half-written
  saves and stray directories do not count; a complete step's files are checked on restore.
  Example:
    >>> import tempfile
    >>> from loco_jax import checkpoint
    >>> directory = Path(tempfile.mkdtemp())
    >>> _ = checkpoint.save(directory, 5, {"w": jnp.ones(2)}, {})
    >>> (directory / "6").mkdir()  # a stray directory: not a checkpoint
    >>> checkpoint.latest_step(directory)
    5
  """
  path = Path(directory).absolute()
  if not path.is_dir():
    return None
  steps = _complete_steps(path)
  return steps[-1] if steps else None


def _in_the_way(path: Path, step: int) -> list[Path]:
  """This module's own interrupted saves at or above `step` (orbax would refuse to save below
  them, and they are garbage); a ValueError for anything else there."""
  doomed = []
  for number, entry in sorted(_numbered(path).items()):
    if number < step:
      continue
    try:
      meta = json.loads((entry / _META_FILE).read_bytes())
      ours = (meta.get("format"), meta.get("step")) == (FORMAT, number)
    except (OSError, ValueError, AttributeError):  # not a folder, no metadata, not ours
      ours = False
    if not ours:
      raise ValueError(f"{entry} is in the way of saving step {step}: it is not a complete "
                       f"checkpoint (no {COMMIT}) nor an interrupted save of this module; move "
                       f"or delete it, or save to another directory")
    doomed.append(entry)
  return doomed


def save(directory: str | os.PathLike, step: int, state: Any, config: dict, *,
         keep: int | None = None) -> Path:
  """Writes `state` (a TrainState, or any pytree of arrays) as `directory/step`; returns it.

  `config` (JSON values) describes the run: whatever must match for a restore to make sense
  (model name and shape, mode, compressor settings). `keep`: delete all but the newest `keep`
  checkpoints after this one is committed (None keeps all). Steps only go up: saving a step at
  or below the newest complete one raises a ValueError instead of overwriting it. Every process
  of a multi-host job must call it.
  Example:
    >>> import tempfile
    >>> from loco_jax import checkpoint
    >>> directory = tempfile.mkdtemp()
    >>> path = checkpoint.save(directory, 1, {"w": jnp.ones(3)}, {"model": "mlp"})
    >>> path.name, (path / checkpoint.COMMIT).is_file()
    ('1', True)
  """
  if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
    raise ValueError(f"step must be an int >= 0, got {step!r}")
  if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
    raise ValueError(f"keep must be None (keep all) or an int >= 1, got {keep!r}")
  step = int(step)
  metadata = _metadata(step, state, config)
  path = Path(directory).absolute()
  if path.exists() and not path.is_dir():
    raise ValueError(f"checkpoint directory {path} is not a directory")
  newest = latest_step(path)
  if newest is not None and step <= newest:
    raise ValueError(f"step {step} is not after the newest checkpoint {newest} in {path}; "
                     f"checkpoints are never overwritten: save a later step or use another "
                     f"directory")
  doomed = _in_the_way(path, step) if path.is_dir() else []
  _sync_processes("inspect")  # every process has looked before process 0 deletes anything
  if doomed and jax.process_index() == 0:
    for entry in doomed:
      shutil.rmtree(entry)
  _sync_processes("clear")
  with _manager(path, read_only=False, keep=keep) as manager:
    saved = manager.save(step, args=ocp.args.Composite(
        **{_STATE: ocp.args.StandardSave(state), _META: ocp.args.JsonSave(metadata)}))
    manager.wait_until_finished()
  if not saved:
    raise ValueError(f"orbax declined to save step {step} in {path}")
  entry = path / str(step)
  if jax.process_index() == 0:  # last: the marker makes the step complete
    files.write_json_atomic(entry / COMMIT, {"format": FORMAT, "step": step,
                                             "files": files.digests(entry, exclude=(COMMIT,))})
  _sync_processes("commit")
  return entry


def _resolve(path: Path, step: int | None) -> tuple[int, Path]:
  """(step, its verified directory): the newest complete step by default."""
  if step is None:
    steps = _complete_steps(path)
    if not steps:
      others = [str(entry) for _, entry in sorted(_numbered(path).items())]
      raise ValueError(f"no checkpoint in {path}: no complete step directory (named by its "
                       f"step number, with a {COMMIT})" +
                       (f"; not complete: {', '.join(others)}" if others else ""))
    step = steps[-1]
  entry = path / str(step)
  if not entry.exists():
    raise ValueError(f"no checkpoint of step {step} in {path}; complete steps present: "
                     f"{_complete_steps(path)}")
  _check_files(entry, step)
  return step, entry


def _read_metadata(manager: ocp.CheckpointManager, entry: Path, step: int) -> dict:
  try:
    meta = manager.restore(step, args=ocp.args.Composite(
        **{_META: ocp.args.JsonRestore()}))[_META]
  except Exception as e:  # whatever orbax makes of files that passed the digests
    raise ValueError(f"{entry / _META_FILE}: orbax cannot read the metadata "
                     f"({type(e).__name__}: {e})") from e
  return _check_metadata(meta, entry / _META_FILE, step)


def metadata(directory: str | os.PathLike, step: int | None = None) -> dict:
  """The JSON stored next to checkpoint `step` (the newest by default): config, devices, tree.

  Example:
    >>> import tempfile
    >>> from loco_jax import checkpoint
    >>> directory = tempfile.mkdtemp()
    >>> _ = checkpoint.save(directory, 3, {"w": jnp.ones(2)}, {"model": "mlp"})
    >>> meta = checkpoint.metadata(directory)
    >>> meta["step"], meta["config"], meta["tree"]
    (3, {'model': 'mlp'}, {"['w']": [[2], 'float32']})
  """
  path = _existing_directory(directory)
  step, entry = _resolve(path, step)
  with _manager(path, read_only=True) as manager:
    return _read_metadata(manager, entry, step)


def restore(directory: str | os.PathLike, state_like: Any, config: dict,
            step: int | None = None) -> tuple[Any, int]:
  """Reads checkpoint `step` (the newest complete one by default) into the layout of
  `state_like`.

  `state_like` is a state of the same run (e.g. the fresh one from `init_train_state`, or its
  `jax.ShapeDtypeStruct`s with shardings): the result has its tree, dtypes and shardings.
  The checkpoint's files must be those `save` wrote (else a ValueError names the first that is
  not), and it must have been saved with an equal `config`, the same device count and the same
  tree; otherwise a ValueError lists every difference and nothing is read or changed. Every
  process of a multi-host job must call it. Returns (state, step).
  Example:
    >>> import tempfile
    >>> from loco_jax import checkpoint
    >>> directory, config = tempfile.mkdtemp(), {"model": "mlp"}
    >>> _ = checkpoint.save(directory, 7, {"w": jnp.ones(2)}, config)
    >>> fresh = {"w": jnp.zeros(2)}
    >>> state, start = checkpoint.restore(directory, fresh, config)
    >>> start, state["w"].tolist()
    (7, [1.0, 1.0])
    >>> checkpoint.restore(directory, fresh, {"model": "gpt"})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: checkpoint .../7 does not match this run: model: checkpoint 'mlp', now 'gpt'...
  """
  path = _existing_directory(directory)
  now = _metadata(0, state_like, config)
  step, entry = _resolve(path, step)
  with _manager(path, read_only=True) as manager:
    saved = _read_metadata(manager, entry, step)
    differences = _differences(saved, now)
    if differences:
      raise ValueError(f"checkpoint {entry} does not match this run: "
                       + "; ".join(differences)
                       + ". Restore with the config, device count and state it was saved with "
                       "(re-sharding to another device count is not supported), or start a "
                       "new directory.")
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state_like)
    try:
      state = manager.restore(step, args=ocp.args.Composite(
          **{_STATE: ocp.args.StandardRestore(abstract)}))[_STATE]
    except Exception as e:  # whatever orbax makes of files that passed the digests
      raise ValueError(f"{entry / _STATE}: orbax cannot read the state "
                       f"({type(e).__name__}: {e})") from e
  return state, step
