"""What a restore onto another mesh may change (train/reshard.py): the data axes' sizes and the
model axes' shape, a model axis coming or going (size 1); not the axes' names or order. Which
axes are data axes: the `checkpoint.train_layout` in the config says."""

from loco_jax.train.checkpoint_record import mesh_text

LAYOUT_KEYS = {"mode", "data axes", "model axes", "params"}  # a train_layout's


def _layout_at(config: dict) -> tuple[str, dict] | None:
  """(its key, or "" for the config itself; the `checkpoint.train_layout` in `config`)."""
  for key, value in (("", config), *config.items()):
    if isinstance(value, dict) and LAYOUT_KEYS <= set(value):
      return key, value
  return None


def train_layout_in(config: dict) -> dict | None:
  """The `checkpoint.train_layout` in `config` (the config itself or one of its values)."""
  found = _layout_at(config)
  return None if found is None else found[1]


def model_keys(config: dict) -> tuple[str, ...]:
  """The keys of `config` (nested ones joined by '.') of its train_layout's model axes and
  params' splits: they differ where the model axes change shape."""
  found = _layout_at(config)
  return () if found is None else tuple(f"{found[0]}.{k}" if found[0] else k
                                        for k in ("model axes", "params"))


def data_axes(saved: list, now: list, config: dict) -> tuple[str, ...]:
  """The data axes of a restore from mesh `saved` onto mesh `now` ([[axis, size], ...], as a
  checkpoint records them): the train_layout's in `config`, else the axes whose sizes differ.
  A ValueError naming both meshes where the axes were renamed or reordered (a model axis may
  come or go: size 1), or a data axis is missing.

  Example:
    >>> data_axes([["data", 8]], [["data", 4]], {})
    ('data',)
  """
  both = f"checkpoint {mesh_text(saved)}, now {mesh_text(now)}"
  old, new = dict(saved or []), dict(now or [])
  only_old, only_new = [a for a in old if a not in new], [a for a in new if a not in old]
  if (not saved or not now or only_old and only_new
          or [a for a in old if a in new] != [a for a in new if a in old]):
    raise ValueError(f"mesh: {both}: a state re-laid for another mesh keeps its axes (names "
                     f"and order); the data axes may change size, the model axes their shape "
                     f"(one may come or go)")
  layout = train_layout_in(config)
  if layout is not None:
    data = tuple(layout["data axes"])
  else:
    data = tuple(a for a in old if a in new and old[a] != new[a])
    if len(data) < len(old) or only_new:
      raise ValueError(f"mesh: {both}: which axes are data axes? Put "
                       f"checkpoint.train_layout(mesh, params, mode=...) in the config")
  if any(a not in old or a not in new for a in data):
    raise ValueError(f"mesh: {both}: the data axes {data} must be on both meshes")
  return data


def model_changed(saved: list, now: list, data: tuple[str, ...]) -> bool:
  """Whether the model axes (all but `data`) have another shape on mesh `now` than on `saved`
  (an axis a mesh lacks: size 1).

  Example:
    >>> model_changed([["data", 4], ["model", 2]], [["data", 8]], ("data",))
    True
  """
  sizes = [{a: n for a, n in mesh if a not in data and n > 1} for mesh in (saved, now)]
  return sizes[0] != sizes[1]
