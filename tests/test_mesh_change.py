"""train/mesh_change.py: which meshes a checkpoint may be re-laid onto, and its data axes."""

import re

import pytest

from loco_jax.train import mesh_change
from loco_jax.train.checkpoint_record import mesh_text


def test_data_axes_are_the_layouts_or_those_that_changed():
  assert mesh_change.data_axes([["data", 8]], [["data", 4]], {}) == ("data",)
  layout = {"mode": "ddp", "data axes": ["data"], "model axes": ["model"], "params": {}}
  assert mesh_change.data_axes([["data", 4], ["model", 2]], [["data", 2], ["model", 2]],
                           {"layout": layout}) == ("data",)
  for now in ([["data", 2], ["model", 4]], [["data", 8]], [["data", 8], ["model", 1]]):
    assert mesh_change.data_axes([["data", 4], ["model", 2]], now, {"layout": layout}) == ("data",)
    assert mesh_change.model_changed([["data", 4], ["model", 2]], now, ("data",))
  assert not mesh_change.model_changed([["data", 8], ["model", 1]], [["data", 4]], ("data",))
  for old, now in (([["data", 4], ["model", 2]], [["data", 2], ["model", 2]]),
                   ([["data", 8]], [["data", 4], ["model", 2]])):
    with pytest.raises(ValueError, match="which axes are data axes"):
      mesh_change.data_axes(old, now, {})
  for old, now in (([["data", 8]], [["node", 2], ["local", 4]]),
                   ([["data", 4], ["model", 2]], [["data", 4], ["tensor", 2]]),
                   ([["data", 4], ["model", 2]], [["model", 2], ["data", 4]])):
    with pytest.raises(ValueError, match=re.escape(
        f"mesh: checkpoint {mesh_text(old)}, now {mesh_text(now)}: a state re-laid for "
        f"another mesh keeps its axes (names and order)")):
      mesh_change.data_axes(old, now, {})
  with pytest.raises(ValueError, match=re.escape("the data axes ('data',) must be on both")):
    mesh_change.data_axes([["data", 4], ["model", 2]], [["model", 8]], {"layout": layout})


def test_the_model_keys_are_the_train_layouts():
  layout = {"mode": "ddp", "data axes": ["data"], "model axes": [], "params": {}}
  assert mesh_change.model_keys({"layout": layout, "devices": 8}) == (
      "layout.model axes", "layout.params")
  assert mesh_change.model_keys(layout) == ("model axes", "params")
  assert mesh_change.model_keys({"devices": 8}) == ()
