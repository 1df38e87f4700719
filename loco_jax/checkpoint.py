"""Atomic orbax checkpoints of a whole TrainState, checked against the run's config on restore.

A checkpoint is the step directory `DIRECTORY/STEP/` that orbax writes: `state/` holds every
array of the state as the sharded global jax.Arrays they are (params or zero2 master shards,
the compressor state with every device's LoCo error and its step counter, the optimizer state,
the step), and `meta/metadata` a small JSON document next to it: the caller's `config` (model,
shape, mode, compressor ...), the device count, and the tree (path -> shape, dtype).

Saves are atomic: orbax writes into `STEP.orbax-checkpoint-tmp` and renames it to `STEP` once
every process has finished, so a job killed during a save leaves the previous checkpoint whole;
the half-written temporary directory is ignored (and replaced by the next save of that step).
Saves are synchronous: `save` returns once the checkpoint is committed.

Multi-host: every process calls `save` and `restore` with the same arguments (each writes and
reads its own shards; the directory must be shared by all of them).

A restore only proceeds when the checkpoint matches the run: the same config, the same device
count and the same tree; otherwise it raises a ValueError naming what differs, e.g.
"device count: checkpoint 8, now 4", and touches nothing on disk. A different device count is
refused on purpose, not re-sharded: the per-device LoCo errors are stacked one per device and
the zero2 master shards and optimizer state are cut into N zero-padded shards, so a state saved
on N devices means nothing on M. Re-sharding to another device count is not supported yet.

Example:
  >>> checkpoint.save("/ckpt", 100, state, {"model": "gpt-small", "mode": "zero2"})
  >>> state, step = checkpoint.restore("/ckpt", fresh_state, {"model": "gpt-small", ...})
"""

import contextlib
import json
import logging
import os
from pathlib import Path
from typing import Any, Iterator

import jax
import numpy as np
import orbax.checkpoint as ocp

FORMAT = 1
_STATE, _META = "state", "meta"


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
  old_config, new_config = saved.get("config", {}), now["config"]
  for key in sorted(set(old_config) | set(new_config), key=str):
    old, new = old_config.get(key, "<absent>"), new_config.get(key, "<absent>")
    if old != new:
      out.append(f"{key}: checkpoint {old!r}, now {new!r}")
  if saved.get("device count") != now["device count"]:
    out.append(f"device count: checkpoint {saved.get('device count')}, now {now['device count']}")
  old_tree, new_tree = saved.get("tree", {}), now["tree"]
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


def _existing_directory(directory: str | os.PathLike) -> Path:
  path = Path(directory).absolute()
  if not path.exists():
    raise ValueError(f"checkpoint directory {path} does not exist")
  if not path.is_dir():
    raise ValueError(f"checkpoint directory {path} is not a directory")
  return path


def latest_step(directory: str | os.PathLike) -> int | None:
  """The newest committed step in `directory`; None if it has none or does not exist.

  Half-written saves (`STEP.orbax-checkpoint-tmp` directories) do not count.
  Example:
    >>> start = checkpoint.latest_step("/ckpt") or 0
  """
  path = Path(directory).absolute()
  if not path.is_dir():
    return None
  with _manager(path, read_only=True) as manager:
    return manager.latest_step()


def save(directory: str | os.PathLike, step: int, state: Any, config: dict, *,
         keep: int | None = None) -> Path:
  """Writes `state` (a TrainState, or any pytree of arrays) as `directory/step`; returns it.

  `config` (JSON values) describes the run: whatever must match for a restore to make sense
  (model name and shape, mode, compressor settings). `keep`: delete all but the newest `keep`
  checkpoints after this one is committed (None keeps all). Steps only go up: saving a step at
  or below the newest one raises a ValueError instead of overwriting it. Every process of a
  multi-host job must call it.
  Example:
    >>> checkpoint.save("/ckpt", int(state.step), state, {"model": "mlp", "mode": "zero2"})
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
  with _manager(path, read_only=False, keep=keep) as manager:
    newest = manager.latest_step()
    if newest is not None and step <= newest:
      raise ValueError(f"step {step} is not after the newest checkpoint {newest} in {path}; "
                       f"checkpoints are never overwritten: save a later step or use another "
                       f"directory")
    saved = manager.save(step, args=ocp.args.Composite(
        **{_STATE: ocp.args.StandardSave(state), _META: ocp.args.JsonSave(metadata)}))
    manager.wait_until_finished()
  if not saved:
    raise ValueError(f"orbax declined to save step {step} in {path}")
  return path / str(step)


def metadata(directory: str | os.PathLike, step: int | None = None) -> dict:
  """The JSON stored next to checkpoint `step` (the newest by default): config, devices, tree."""
  path = _existing_directory(directory)
  with _manager(path, read_only=True) as manager:
    return _read_metadata(manager, path, step)[1]


def _read_metadata(manager: ocp.CheckpointManager, path: Path, step: int | None
                   ) -> tuple[int, dict]:
  steps = sorted(manager.all_steps())
  if not steps:
    raise ValueError(f"no checkpoint in {path}: no committed step directory (named by its "
                     f"step number) was found")
  if step is None:
    step = steps[-1]
  elif step not in steps:
    raise ValueError(f"no checkpoint of step {step} in {path}; steps present: {steps}")
  try:
    meta = manager.restore(step, args=ocp.args.Composite(
        **{_META: ocp.args.JsonRestore()}))[_META]
  except (FileNotFoundError, KeyError, ValueError) as e:
    raise ValueError(f"{path / str(step)} is not a loco_jax checkpoint (no readable "
                     f"'{_META}' item: {e})") from None
  if not isinstance(meta, dict) or meta.get("format") != FORMAT:
    raise ValueError(f"{path / str(step)}: unknown checkpoint metadata format "
                     f"{meta.get('format') if isinstance(meta, dict) else meta!r}; "
                     f"this version reads format {FORMAT}")
  return step, meta


def restore(directory: str | os.PathLike, state_like: Any, config: dict,
            step: int | None = None) -> tuple[Any, int]:
  """Reads checkpoint `step` (the newest by default) into the layout of `state_like`.

  `state_like` is a state of the same run (e.g. the fresh one from `init_train_state`, or its
  `jax.ShapeDtypeStruct`s with shardings): the result has its tree, dtypes and shardings.
  The checkpoint must have been saved with an equal `config`, the same device count and the same
  tree; otherwise a ValueError lists every difference and nothing is read or changed. Every
  process of a multi-host job must call it. Returns (state, step).
  Example:
    >>> state, specs = parallel.init_train_state(params, opt, mesh, compressor=c, mode="zero2")
    >>> if checkpoint.latest_step("/ckpt") is not None:
    ...   state, start = checkpoint.restore("/ckpt", state, config)
  """
  path = _existing_directory(directory)
  now = _metadata(0, state_like, config)
  with _manager(path, read_only=True) as manager:
    step, saved = _read_metadata(manager, path, step)
    differences = _differences(saved, now)
    if differences:
      raise ValueError(f"checkpoint {path / str(step)} does not match this run: "
                       + "; ".join(differences)
                       + ". Restore with the config, device count and state it was saved with "
                       "(re-sharding to another device count is not supported), or start a "
                       "new directory.")
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state_like)
    state = manager.restore(step, args=ocp.args.Composite(
        **{_STATE: ocp.args.StandardRestore(abstract)}))[_STATE]
  return state, step
