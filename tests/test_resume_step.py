"""The first step after an elastic resume (issue 47): a state restored onto another data size or
model shape takes one step of the real train step (parallel.make_train_step), which must equal
an independent computation from the merged state.

- An error e added to the gradient (LoCo, error_feedback): every new device holds the merged
  error e'. The reference is the same step from the restored state with that error zeroed and
  the loss plus <e', params>, e' decoded here (tests/decoded.py): its gradient on every device
  is g_j + e', which the restored step computes as g_j plus its stored error. Equal to float32
  rounding.
- co3 and DiLoCo's workers: the reference state is built here from the checkpointed one with
  numpy (every new device the old devices' float64 mean) and must be the restored state bit for
  bit, and so must the step from it.

two_hop is left to tests/test_merge.py (its merge against numpy) and tests/test_reshard.py (the
resumed run's loss, and its node hop's error through two model shapes): a reference state would
re-encode its two hops' buckets here.
"""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import decoded
import train_worker
from loco_jax import co3, loco
from loco_jax.core.leaves import ByGroup
from loco_jax.train import fsdp
from loco_jax.transforms import baselines
from loco_jax.transforms.loco_state import LocoState
from model_runs import SHAPES, SPECS, batch, loco_rows, mesh_of, restored, run_on, sizes, trained

COMPRESSORS = {
    "loco4": lambda scatter: loco(axis_name="data", scatter=scatter),
    "loco4-quantized": lambda scatter: loco(axis_name="data", gather="quantized"),
    "error_feedback": lambda scatter: baselines.error_feedback(block_size=64, axis_name="data"),
    "co3": lambda scatter: co3("fp4", axis_name="data", refit_interval=2),
}


def _copy(state: Any) -> Any:
  return jax.tree.map(jnp.copy, state)  # the steps donate their state


def _zeroed(compressor_state: Any) -> Any:
  """The compressor's state with its error zero (LoCo: its codes and their scales)."""
  zero = lambda tree: jax.tree.map(lambda x: x * 0, tree)
  if isinstance(compressor_state, fsdp.Layered):  # fsdp.whole_model: all in the head
    return compressor_state._replace(head=_zeroed(compressor_state.head))
  if isinstance(compressor_state, LocoState):
    return compressor_state._replace(groups=ByGroup({
        k: g._replace(error=zero(g.error), error_scale=zero(g.error_scale))
        for k, g in compressor_state.groups.items()}))
  return compressor_state._replace(error=zero(compressor_state.error))


def _compressor(state: Any) -> Any:
  """The compressor's state (fsdp.whole_model's: the head's)."""
  compressor = state.compressor_state
  return compressor.head if isinstance(compressor, fsdp.Layered) else compressor


def _rows(state: Any, mesh, field: str = "error") -> list:
  """Each data row's error `field` decoded into whole params."""
  compressor = _compressor(state)
  if isinstance(compressor, LocoState):
    return loco_rows(compressor, mesh, field)
  return decoded.float_errors(getattr(compressor, field), SHAPES, SPECS, *sizes(mesh))


def _merged(saved: Any, old_mesh, state: Any, mesh) -> dict:
  """What the merge preserves, checked: every new device holds e' = (1/n) sum_i e_i, so that
  (1/m) sum_j e'_j = (1/n) sum_i e_i: a float error exactly numpy's float64 mean, LoCo's int8
  within half a step of its block (1/254 of the param's largest |value|); a quantized gather's
  error of each whole param kept likewise. Returns e'."""
  before, after = _rows(saved, old_mesh), _rows(state, mesh)
  int8 = isinstance(_compressor(state), LocoState)
  for k in SHAPES:
    stack = np.stack([r[k] for r in before]).astype(np.float64)
    assert np.abs(stack - stack[0]).max() > 0, k   # the devices' errors differ
    for row in after[1:]:
      np.testing.assert_array_equal(row[k], after[0][k])
    if int8:
      bound = np.abs(stack.mean(0)).max() / 254 * (1 + 1e-6)
      assert np.abs(after[0][k] - stack.mean(0)).max() <= bound, k
    else:
      np.testing.assert_array_equal(after[0][k], stack.mean(0).astype(np.float32))
  if int8 and any(g.gather_error is not None for g in _compressor(state).groups.values()):
    kept, whole = _rows(state, mesh, "gather_error")[0], _rows(saved, old_mesh, "gather_error")[0]
    for k in SHAPES:
      assert np.abs(kept[k] - whole[k]).max() <= np.abs(whole[k]).max() / 254 * (1 + 1e-6), k
  return after[0]


def _shifted(loss_fn, shift: dict):
  """loss + <shift, params>: its gradient is the loss's plus `shift`."""
  return lambda params, b: loss_fn(params, b) + sum(jnp.sum(shift[k] * params[k]) for k in shift)


def _leaves_close(a: Any, b: Any) -> None:
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    x, y = np.asarray(x), np.asarray(y)
    np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-6 * max(np.abs(y).max(), 1e-30))


ERROR_CASES = [  # (mode, compressor, old (data, model), new (data, model)); model 0: no axis
    ("ddp", "loco4", (4, 2), (2, 4)),
    ("ddp", "loco4-quantized", (4, 2), (8, 0)),
    ("ddp", "error_feedback", (4, 2), (2, 4)),
    ("zero2", "loco4", (4, 2), (8, 1)),   # the data size changes too in each of these
    ("fsdp", "loco4", (8, 0), (4, 0)),
]


def _runs(mode: str, name: str, old: tuple, new: tuple, loss_fn=None) -> tuple:
  """(the old run, the new run, the new run's step on `loss_fn`): fsdp as one head
  (fsdp.whole_model) so that the loss takes a term on every param."""
  loss_fn = loss_fn or train_worker.loss_fn
  factory = lambda: COMPRESSORS[name](mode in ("zero2", "fsdp"))
  if mode == "fsdp":
    params = fsdp.Layered({}, {}, train_worker.init_params(32))
    make = lambda mesh, loss: run_on(mesh, mode, factory(), fsdp.whole_model(loss), params)
  else:
    make = lambda mesh, loss: run_on(mesh, mode, factory(), loss)
  return make(mesh_of(*old), train_worker.loss_fn), make(mesh_of(*new), train_worker.loss_fn), \
      lambda shift: make(mesh_of(*new), _shifted(loss_fn, shift)).step


@pytest.mark.slow
@pytest.mark.parametrize("mode, name, old, new", ERROR_CASES)
def test_the_first_step_adds_the_merged_error_to_the_gradient(tmp_path, mode, name, old, new):
  before, after, shifted_step = _runs(mode, name, old, new)
  saved = trained(before, 3)
  state = restored(tmp_path, saved, before, after).state
  shift = _merged(saved, before.mesh, state, after.mesh)
  reference = state._replace(compressor_state=_zeroed(state.compressor_state))
  mine, _ = after.step(_copy(state), batch(after.mesh, 3))
  theirs, _ = shifted_step(shift)(_copy(reference), batch(after.mesh, 3))
  _leaves_close(mine.params, theirs.params)
  _leaves_close(mine.opt_state, theirs.opt_state)
  moved = [np.abs(np.asarray(a) - np.asarray(b)).max()
           for a, b in zip(jax.tree.leaves(mine.params), jax.tree.leaves(state.params))]
  assert max(moved) > 0


def _tiled(x, old: int, new: int) -> np.ndarray:
  """Every new device's row: the old devices' rows' float64 mean (rows split on dim 0)."""
  rows = np.asarray(x).reshape(old, -1)
  mean = rows.astype(np.float64).mean(0).astype(rows.dtype)
  return np.tile(mean, new).reshape((new * np.asarray(x).shape[0] // old, *np.shape(x)[1:]))


def _built(saved: Any, like: Any) -> Any:
  """The checkpointed state on 8 devices laid out for 4, as `like`'s shardings say: a leaf of
  another shape (a per-device one, DiLoCo's workers) the old rows' mean on every device, every
  other leaf as saved."""
  return jax.tree.map(lambda x, l: jax.device_put(
      np.asarray(x) if x.shape == l.shape else _tiled(x, 8, 4), l.sharding), saved, like)


@pytest.mark.slow
@pytest.mark.parametrize("mode, name", [("ddp", "co3"), ("diloco", "error_feedback")])
def test_the_first_step_is_the_one_from_the_state_built_from_the_mean(tmp_path, mode, name):
  extra = {"inner_steps": 2} if mode == "diloco" else {}
  before, after = (run_on(mesh_of(n), mode, COMPRESSORS[name](False), **extra) for n in (8, 4))
  saved = trained(before, 3)
  state = restored(tmp_path, saved, before, after).state
  built = _built(saved, state)
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(built)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  mine, _ = after.step(_copy(state), batch(after.mesh, 3))
  theirs, _ = after.step(_copy(built), batch(after.mesh, 3))
  for a, b in zip(jax.tree.leaves(mine), jax.tree.leaves(theirs)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
