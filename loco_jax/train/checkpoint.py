"""Atomic orbax checkpoints of a whole TrainState, checked against the run's config on restore.

`DIRECTORY/STEP/` holds orbax's `state/` (every array of the state, sharded as it is) and
`meta/metadata`, a JSON record of the caller's `config`, the device count, the mesh and the tree
(checkpoint_record.py). A step is complete once `save` has written its commit marker
`STEP/loco_jax_commit.json` last, listing every file with its size and sha256
(checkpoint_steps.py). Only complete steps count, so a job killed during a save resumes from the
previous one; a save removes its own and orbax's half-written steps, and refuses any other stray
directory at or above its step.

Checkpoints from disk are not trusted: `restore` and `metadata` check every file against the
marker and raise a ValueError naming the path and what is wrong. A restore also needs the same
config, device count, mesh and tree, else a ValueError names each difference, e.g. "mesh:
checkpoint (data=4, model=2), now (data=8)". With `reshard=True` a mesh whose data axes have
other sizes, or whose model axes have another shape, is accepted: the state is re-laid for it
(train/reshard.py: master shards re-cut, per-device errors merged) and the result says how.
Put `train_layout(mesh, params, mode=...)` in the config to check what the arrays cannot show;
a change of the model axes needs it. Format 2 checkpoints (no mesh record)
restore on one device only. Multi-host: every process calls `save` and `restore` alike, on a
shared directory; process 0 writes the marker.
"""

import asyncio
import contextlib
import itertools
import logging
import os
from pathlib import Path
from typing import Any, Iterator

import jax
import numpy as np
import orbax.checkpoint as ocp

from loco_jax.train import checkpoint_record, checkpoint_steps, mesh_change
from loco_jax.train import reshard as reshard_lib
from loco_jax.train.checkpoint_record import train_layout
from loco_jax.train.model_blocks import ModelBlocks, model_blocks
from loco_jax.train.reshard import Restored
from loco_jax.train.checkpoint_steps import COMMIT, FORMAT, META_FILE

__all__ = ["COMMIT", "FORMAT", "Restored", "latest_step", "metadata", "restore", "save",
           "train_layout"]

_STATE, _META = "state", "meta"
_FINISH_S = 60.0
_barriers = itertools.count()


class _FinishingLoop(asyncio.SelectorEventLoop):
  """An event loop whose running tasks finish (at most `_FINISH_S` s) before it closes.

  When one of orbax's shard reads fails it closes its loop with the others still reading; they
  would end later in the closed loop as unraisable errors.
  """

  def close(self) -> None:
    running = [task for task in asyncio.all_tasks(self) if not task.done()]
    if running and not self.is_running() and not self.is_closed():
      finished = asyncio.gather(*running, return_exceptions=True)
      with contextlib.suppress(asyncio.TimeoutError):
        self.run_until_complete(asyncio.wait_for(finished, _FINISH_S))
    super().close()


class _FinishingPolicy(asyncio.DefaultEventLoopPolicy):
  def new_event_loop(self) -> asyncio.AbstractEventLoop:
    return _FinishingLoop()


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
def _manager(path: Path, *, read_only: bool) -> Iterator[ocp.CheckpointManager]:
  """Orbax's manager of `path`, no retention of its own; its event loops finish their reads."""
  with _quiet_absl():
    options = ocp.CheckpointManagerOptions(
        read_only=read_only, create=not read_only, enable_async_checkpointing=False,
        lightweight_initialize=True)
    manager = ocp.CheckpointManager(path, options=options, item_names=(_STATE, _META))
  policy = asyncio.get_event_loop_policy()
  asyncio.set_event_loop_policy(_FinishingPolicy())
  try:
    yield manager
  finally:
    asyncio.set_event_loop_policy(policy)
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


def latest_step(directory: str | os.PathLike) -> int | None:
  """The newest complete step in `directory`; None if it has none or does not exist.

  Complete: the step directory holds the commit marker that `save` writes last. Half-written
  saves and stray directories do not count; a complete step's files are checked on restore.

  Example:
    >>> import tempfile
    >>> from loco_jax.train import checkpoint
    >>> directory = Path(tempfile.mkdtemp())
    >>> _ = checkpoint.save(directory, 5, {"w": jnp.ones(2)}, {})
    >>> (directory / "6").mkdir()  # a stray directory: not a checkpoint
    >>> checkpoint.latest_step(directory)
    5
  """
  path = Path(directory).absolute()
  if not path.is_dir():
    return None
  steps = checkpoint_steps.complete_steps(path)
  return steps[-1] if steps else None


def save(directory: str | os.PathLike, step: int, state: Any, config: dict, *,
         keep: int | None = None) -> Path:
  """Writes `state` (a TrainState, or any pytree of arrays) as `directory/step`; returns it.

  `config` (JSON values) is what must match for a restore (`train_layout`). `keep`: once this
  step is committed, delete all but the newest `keep` complete checkpoints (None keeps all).
  Steps only go up: a step at or below the newest complete one is a ValueError.

  Example:
    >>> import tempfile
    >>> from loco_jax.train import checkpoint
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
  meta = checkpoint_record.record(step, state, config)
  path = Path(directory).absolute()
  if path.exists() and not path.is_dir():
    raise ValueError(f"checkpoint directory {path} is not a directory")
  newest = latest_step(path)
  if newest is not None and step <= newest:
    raise ValueError(f"step {step} is not after the newest checkpoint {newest} in {path}; "
                     f"checkpoints are never overwritten: save a later step or use another "
                     f"directory")
  doomed = checkpoint_steps.in_the_way(path, step) if path.is_dir() else []
  _sync_processes("inspect")  # every process has looked before process 0 deletes anything
  if jax.process_index() == 0:
    for entry in doomed:
      checkpoint_steps.remove(entry)
  _sync_processes("clear")
  with _manager(path, read_only=False) as manager:
    saved = manager.save(step, args=ocp.args.Composite(
        **{_STATE: ocp.args.StandardSave(state), _META: ocp.args.JsonSave(meta)}))
    manager.wait_until_finished()
  if not saved:
    raise ValueError(f"orbax declined to save step {step} in {path}")
  entry = path / str(step)
  if jax.process_index() == 0:  # last: the marker makes the step complete
    checkpoint_steps.write_marker(entry, step)
    if keep is not None:
      checkpoint_steps.prune(path, keep)
  _sync_processes("commit")
  return entry


def _resolve(path: Path, step: int | None) -> tuple[int, Path]:
  """(step, its verified directory): the newest complete step by default."""
  if step is None:
    steps = checkpoint_steps.complete_steps(path)
    if not steps:
      others = [str(entry) for _, entry in sorted(checkpoint_steps.numbered(path).items())]
      raise ValueError(f"no checkpoint in {path}: no complete step directory (named by its "
                       f"step number, with a {COMMIT})" +
                       (f"; not complete: {', '.join(others)}" if others else ""))
    step = steps[-1]
  entry = path / str(step)
  if not (entry.exists() or entry.is_symlink()):
    raise ValueError(f"no checkpoint of step {step} in {path}; complete steps present: "
                     f"{checkpoint_steps.complete_steps(path)}")
  checkpoint_steps.verify(entry, step)
  return step, entry


def _read_metadata(entry: Path, step: int) -> dict:
  return checkpoint_record.check(checkpoint_steps.read_metadata(entry), entry / META_FILE, step)


def metadata(directory: str | os.PathLike, step: int | None = None) -> dict:
  """The JSON stored next to checkpoint `step` (the newest by default): config, devices, mesh,
  tree.

  Example:
    >>> import tempfile
    >>> from loco_jax.train import checkpoint
    >>> directory = tempfile.mkdtemp()
    >>> _ = checkpoint.save(directory, 3, {"w": jnp.ones(2)}, {"model": "mlp"})
    >>> meta = checkpoint.metadata(directory)
    >>> meta["step"], meta["config"], meta["mesh"], meta["tree"]
    (3, {'model': 'mlp'}, None, {"['w']": [[2], 'float32', None]})
  """
  step, entry = _resolve(_existing_directory(directory), step)
  return _read_metadata(entry, step)


def _read(path: Path, entry: Path, step: int, abstract: Any) -> Any:
  """Orbax's read of the state into `abstract` (its tree, shapes, dtypes and shardings)."""
  with _manager(path, read_only=True) as manager:
    try:
      return manager.restore(step, args=ocp.args.Composite(
          **{_STATE: ocp.args.StandardRestore(abstract)}))[_STATE]
    except Exception as e:  # whatever orbax makes of files that passed the digests
      raise ValueError(f"{entry / _STATE}: orbax cannot read the state "
                       f"({type(e).__name__}: {e})") from e


def _blocks(saved: dict, now: dict, state_like: Any, entry: Path) -> ModelBlocks:
  """The params' model blocks in the checkpoint and now (train/model_blocks.py)."""
  if not hasattr(state_like, "params"):
    raise ValueError(f"checkpoint {entry} cannot be re-laid for other model axes: the state to "
                     f"restore into is a {type(state_like).__name__}, not a train state with "
                     f"params (parallel.init_train_state's)")
  try:
    return model_blocks(saved["config"], now["config"], saved["mesh"], now["mesh"],
                        state_like.params)
  except ValueError as e:
    raise ValueError(f"checkpoint {entry} cannot be re-laid for this mesh: {e}") from None


def _relaid(path: Path, entry: Path, step: int, saved: dict, data: tuple[str, ...],
            state_like: Any, blocks: ModelBlocks | None) -> Restored:
  """The checkpoint read with its own shapes onto one device of this process, re-laid for the
  mesh of `state_like` over the `data` axes and, with `blocks`, the model axes
  (train/reshard.py)."""
  try:
    paths = reshard_lib.saved_paths(state_like, saved["mesh"], data, blocks)
  except ValueError as e:
    raise ValueError(f"checkpoint {entry} cannot be re-laid for this mesh: {e}") from None
  tree, listed = saved["tree"], jax.tree.leaves(paths)
  extra = [f"{k} only in the checkpoint" for k in tree if k not in set(listed)]
  missing = [f"{k} only now" for k in listed if k not in tree]
  if extra or missing:
    raise ValueError(f"checkpoint {entry} does not match this run on its mesh "
                     f"{checkpoint_record.mesh_text(saved['mesh'])}: tree: "
                     + ", ".join((extra + missing)[:3]) + ". Restore with the model, mode and "
                     "transformations it was saved with.")
  single = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  try:  # the record is not trusted: shapes of ints >= 0, a dtype jax knows
    if not all(isinstance(tree[k][0], list) and all(type(n) is int and n >= 0
                                                    for n in tree[k][0]) for k in tree):
      raise ValueError("a shape is not a list of ints >= 0")
    abstract = jax.tree.map(lambda k: jax.ShapeDtypeStruct(
        tuple(tree[k][0]), jax.numpy.dtype(tree[k][1]), sharding=single), paths)
  except (TypeError, ValueError) as e:
    raise ValueError(f"{entry / META_FILE}: the tree's shapes and dtypes are malformed "
                     f"({e})") from None
  specs = jax.tree.map(lambda k: checkpoint_record.spec_of(tree[k][2]), paths)
  old = jax.device_get(_read(path, entry, step, abstract))
  try:
    state, resharded = reshard_lib.relay(old, state_like, saved["mesh"], data, specs, blocks)
  except ValueError as e:
    raise ValueError(f"checkpoint {entry} cannot be re-laid for this mesh: {e}") from None
  return Restored(state, step, resharded)


def restore(directory: str | os.PathLike, state_like: Any, config: dict,
            step: int | None = None, *, reshard: bool = False,
            mesh_keys: tuple[str, ...] = ()) -> tuple[Any, int] | Restored:
  """Reads checkpoint `step` (the newest complete one by default) into the layout of
  `state_like`.

  `state_like` is a state of the same run (a fresh one, or `jax.ShapeDtypeStruct` leaves with
  shardings): the result has its tree, dtypes and shardings. A ValueError lists every
  difference of files, config, devices, mesh or tree, and nothing is read. Returns (state, step).

  `reshard=True` also accepts a mesh whose data axes have other sizes or whose model axes have
  another shape (a model axis may come or go), the model, mode and transformations the same
  (train/reshard.py says how each leaf is re-laid; LoCo's errors are averaged over the old
  devices). A change of the model axes needs `train_layout` in both configs; its model axes
  and param splits may then differ. `mesh_keys`: the config keys that describe the mesh and
  may then differ (e.g. "devices"). Returns `Restored(state, step, resharded)`, where `resharded`
  says how, or is None on the same mesh (restored as saved, bit for bit).

  Example:
    >>> import tempfile
    >>> from loco_jax.train import checkpoint
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
  if mesh_keys and not reshard:
    raise ValueError(f"mesh_keys={mesh_keys!r} name config keys that may differ on another "
                     f"mesh: pass reshard=True with them")
  path = _existing_directory(directory)
  now = checkpoint_record.record(0, state_like, config)
  step, entry = _resolve(path, step)
  saved = _read_metadata(entry, step)
  if saved["format"] == 2 and saved["device count"] > 1:
    raise ValueError(f"{entry}: a checkpoint of format 2, from before checkpoints recorded "
                     f"their mesh, of a state on {saved['device count']} devices: the mesh its "
                     f"arrays were laid out on is unknown, and on another mesh they would come "
                     f"back scrambled, so this version does not restore it; start a new "
                     f"checkpoint directory")
  relaid = reshard and saved["format"] > 2 and saved["mesh"] != now["mesh"]
  data, model, differences = (), False, []
  if relaid:
    try:
      data = mesh_change.data_axes(saved["mesh"], now["mesh"], now["config"])
      model = mesh_change.model_changed(saved["mesh"], now["mesh"], data)
    except ValueError as e:
      differences.append(str(e))
  keys = tuple(mesh_keys) + (mesh_change.model_keys(now["config"]) if model else ())
  differences = checkpoint_record.differences(
      saved, now, keys if relaid else None, data, model) + differences
  if differences:
    hint = ("" if reshard else " (or, where only the data axes' sizes or the model axes' "
            "shape differ, reshard=True)")
    raise ValueError(f"checkpoint {entry} does not match this run: " + "; ".join(differences)
                     + f". Restore with the config, mesh and state it was saved with{hint}, or "
                     "start a new directory.")
  if relaid:
    return _relaid(path, entry, step, saved, data, state_like,
                   _blocks(saved, now, state_like, entry) if model else None)
  state = _read(path, entry, step, jax.tree.map(ocp.utils.to_shape_dtype_struct, state_like))
  return Restored(state, step, None) if reshard else (state, step)
